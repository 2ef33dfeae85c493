"""What runs in a worker process started by ``Run``: the user's target, with its result or
exception sent back to the parent and its SharedModel slots detached on the way out."""
from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import traceback

from .client import ENV_NAMESPACE, close_all_clients
from .interrupts import child_signals


def worker_main(rank: int, target, args, kwargs, namespace: str, conn) -> None:
    child_signals()  # Ctrl-C is the parent's to handle (NOTE [Ctrl-C and children])
    faulthandler.enable()
    os.environ[ENV_NAMESPACE] = namespace
    code = 0
    try:
        try:
            result = target(rank, *args, **kwargs)
        except SystemExit as e:
            if e.code not in (None, 0):
                raise
            result = None
        try:
            conn.send(("ok", result))
        except Exception as e:  # noqa: BLE001 - an unpicklable result
            conn.send(("error", type(e).__name__,
                       f"the worker's return value could not be sent back: {e}", ""))
            code = 1
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises WorkerError
        code = 1
        with contextlib.suppress(Exception):
            conn.send(("error", type(e).__name__, str(e), traceback.format_exc()))
    finally:
        close_all_clients()
        conn.close()
    if code:
        sys.exit(code)
