"""A newcomer's script that starts a runtime at import time, without the spawn guard.
test_lifecycle.py runs it and expects the error to say what is missing."""
import numpy as np

from simpledbi import ModelConfig, Run, SharedModel
from tests.models import affine


def worker(rank):
    return SharedModel("m", max_shape=(1, 2)).forward(np.ones((1, 2), np.float32)).shape


Run(target=worker, worker_num=1,
    models=[ModelConfig(name="m", factory=affine, device="cpu", num_threads=1)])
