"""The exceptions a caller of simpledbi can see, all :class:`SimpleDBIError` (an application can
catch the whole family). An error in another process (a model's forward pass) is re-raised in the
caller as a fresh exception whose ``__cause__`` carries the remote traceback text, the way
CPython's ``concurrent.futures.process`` does it."""
from __future__ import annotations

__all__ = ["SimpleDBIError", "ModelError", "ModelProcessDied", "RuntimeStopped", "RuntimeUnavailable",
           "WorkerError", "SlotsExhausted", "Overloaded", "RemoteTraceback"]


class SimpleDBIError(Exception):
    """Base class of every simpledbi error."""


class RemoteTraceback(Exception):
    """Holds (as its message) the formatted traceback of an exception raised in another process."""


class ModelError(SimpleDBIError):
    """The model's own forward pass raised (or returned something unusable) for this request's batch:
    ``remote_type`` is the original exception's type name, ``remote_traceback`` its traceback text.
    The runtime stays up and serves the next batch."""

    def __init__(self, message: str, remote_type: str = "", remote_traceback: str = ""):
        super().__init__(message)
        self.remote_type, self.remote_traceback = remote_type, remote_traceback
        if remote_traceback:
            self.__cause__ = RemoteTraceback(remote_traceback)


class ModelProcessDied(SimpleDBIError):
    """A model process died (or the runtime was declared broken) while this request depended on it."""

    def __init__(self, message: str, exitcode: int | None = None):
        super().__init__(message)
        self.exitcode = exitcode


class RuntimeStopped(SimpleDBIError):
    """The runtime is shutting down (or gone) and accepts no more requests."""


class RuntimeUnavailable(RuntimeStopped, TimeoutError):
    """A call's ``timeout`` (or a handle's ``connect_timeout``) ran out while its runtime, attached by name,
    was down, restarting or not started yet: a :class:`RuntimeStopped` and a ``TimeoutError`` alike."""


class WorkerError(SimpleDBIError):
    """A worker process of :func:`simpledbi.Run` failed: it raised, or exited with a non-zero code."""

    def __init__(self, message: str, rank: int, exitcode: int | None = None,
                 remote_type: str = "", remote_traceback: str = ""):
        super().__init__(message)
        self.rank, self.exitcode = rank, exitcode
        self.remote_type, self.remote_traceback = remote_type, remote_traceback
        if remote_traceback:
            self.__cause__ = RemoteTraceback(remote_traceback)


class SlotsExhausted(SimpleDBIError, RuntimeError):
    """Every client slot of the model is taken (``ModelConfig.max_clients``)."""


class Overloaded(SimpleDBIError, TimeoutError):
    """The model refused this request at once rather than answer it late or queue it without
    bound (NOTE [overload]): ``reason`` is ``"deadline"`` (it could not be answered within its
    timeout given the queue ahead) or ``"queue"`` (``max_queue`` requests were waiting);
    ``expected_wait`` the wait it would have had (seconds, 0 when unknown). Retrying after about
    ``retry_after`` seconds is reasonable. The request never ran. A ``TimeoutError`` too: code
    that catches ``TimeoutError`` keeps working (the refusal only comes before the timeout)."""

    def __init__(self, message: str, reason: str = "queue", expected_wait: float = 0.0,
                 timeout: float | None = None):
        super().__init__(message)
        self.reason, self.expected_wait, self.timeout = reason, expected_wait, timeout

    @property
    def retry_after(self) -> float:
        """Seconds a caller could reasonably wait before trying again: for a deadline, until the
        queue ahead would fit in its timeout; for a full queue, its expected wait. At least 1 ms, at
        most a minute (an unbounded expected wait -- higher priorities take all of the capacity --
        still gives a number an HTTP ``Retry-After`` can carry)."""
        late = (self.timeout or 0.0) if self.reason == "deadline" else 0.0
        return min(max(self.expected_wait - late, 0.001), 60.0)
