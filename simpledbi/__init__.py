"""simpledbi: dynamic batching of many processes' small requests through shared memory.

    from simpledbi import Run, ModelConfig, SharedModel

    def worker(rank):
        model = SharedModel("resnet50", max_shape=(1, 3, 224, 224))
        y = model.forward(x)

    if __name__ == "__main__":
        Run(target=worker, worker_num=8,
            models=[ModelConfig(name="resnet50", path="resnet50.pt", max_batch_size=32, model_num=2)])
"""

from .client import SharedModel
from .config import ModelConfig, RuntimeOptions
from .errors import (ModelError, ModelProcessDied, RuntimeStopped, RuntimeUnavailable, SimpleDBIError,
                     Overloaded, SlotsExhausted, WorkerError)
from .runtime import Run, Runtime
from .status import inspect

__all__ = ["Run", "Runtime", "ModelConfig", "RuntimeOptions", "SharedModel", "SimpleDBIError", "ModelError",
           "ModelProcessDied", "RuntimeStopped", "RuntimeUnavailable", "SlotsExhausted", "Overloaded",
           "WorkerError", "inspect"]
__version__ = "0.2.0"

