"""Model processes' log records, handled by the parent's logging configuration.

A spawned model process starts with an unconfigured ``logging``, so its lines (ours, and the model's
libraries') would vanish or bypass the handlers the user set up in the main process. Each model process gets
the write end of a pipe of its own: a handler on its root logger sends every record there, tagged
``<model|instance>``, and a relay thread hands them to the parent's logger of the same name, which filters and
formats them as configured. One pipe per process, not a ``multiprocessing.Queue`` (``QueueHandler``): a
Queue's writers share one lock, and a model process killed while holding it would silence every other one."""
from __future__ import annotations

import logging
import os
import pickle
import threading
from multiprocessing.connection import Connection, wait
from typing import List, Optional

logger = logging.getLogger(__name__)
_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class _PipeHandler(logging.Handler):
    """In a model process: send each record, made picklable and tagged, to the parent."""

    def __init__(self, conn: Connection, tag: str):
        super().__init__()
        self.conn, self.tag = conn, tag

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
            if not msg.startswith(self.tag):
                msg = f"{self.tag} {msg}"
            if record.exc_info:
                msg += "\n" + logging.Formatter().formatException(record.exc_info)
            if record.stack_info:
                msg += "\n" + record.stack_info
            fields = dict(record.__dict__, msg=msg, args=None, exc_info=None, exc_text=None, stack_info=None)
            try:
                data = pickle.dumps(logging.makeLogRecord(fields))
            except Exception:  # noqa: BLE001 - an unpicklable ``extra``: send the standard fields
                data = pickle.dumps(logging.makeLogRecord(
                    {k: v for k, v in fields.items() if k in _STANDARD}))
            self.conn.send_bytes(data)
        except (OSError, EOFError, ValueError):
            pass  # the parent is gone: nobody to tell
        except Exception:  # noqa: BLE001 - logging must never break serving
            self.handleError(record)


def install_child_handler(conn: Optional[Connection], tag: str, level: int) -> None:
    """Route this (model) process's logging to the parent. Called first thing in the child."""
    if conn is None:
        return
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(_PipeHandler(conn, tag))
    root.setLevel(level)


class LogRelay:
    """In the parent: a thread that reads the model processes' pipes and re-emits their records."""

    def __init__(self):
        self._conns: List[Connection] = []
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="simpledbi-logs", daemon=True)
        self._thread.start()

    def add(self, conn: Connection) -> None:
        with self._lock:
            self._conns.append(conn)
        os.write(self._wake_w, b"+")

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    conns = list(self._conns)
                # Once stopping, nothing may come to wake us: look every 0.5 s whether the pipes are
                # drained (close() waits for that, a bounded time).
                for obj in wait(conns + [self._wake_r], timeout=0.5 if self._stop else None):
                    if obj == self._wake_r:
                        os.read(self._wake_r, 64)
                        continue
                    try:
                        record = pickle.loads(obj.recv_bytes())
                    except (EOFError, OSError):  # the process exited: its pipe is drained
                        with self._lock:
                            if obj in self._conns:   # (close() may have cleared them)
                                self._conns.remove(obj)
                        obj.close()
                        continue
                    except Exception:  # noqa: BLE001 - one bad record must not stop the relay
                        logger.debug("dropped an unreadable log record", exc_info=True)
                        continue
                    if isinstance(record, logging.LogRecord):
                        target = logging.getLogger(record.name)
                        if target.isEnabledFor(record.levelno):
                            target.handle(record)
                if self._stop:
                    with self._lock:  # at stop, drain what is buffered, then leave
                        if not any(c.poll() for c in self._conns if not c.closed):
                            break
        except (OSError, ValueError):  # closed under us at shutdown
            pass

    def close(self, timeout: float = 2.0) -> None:
        """Relay what the (now stopped) processes left in their pipes, then stop the thread. That is at
        most a pipe's buffer a process, milliseconds to relay; ``timeout`` bounds a shutdown against a
        user's log handler that blocks."""
        self._stop = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout)
        with self._lock:
            for c in self._conns:
                c.close()
            self._conns.clear()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
