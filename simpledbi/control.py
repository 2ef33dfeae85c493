"""Commands to a running ``simpledbi serve`` (``simpledbi reload``): a Unix socket in the
runtime's private namespace directory (mode 0700: only its user can connect), one JSON line each
way. The serve process answers once the command is done (a reload: new processes serve, old ones
finished), so the command's exit status says whether it worked."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading

from .shm import ns_path
from .sources import import_path

logger = logging.getLogger(__name__)

_MAX_LINE = 1 << 16
_READ_TIMEOUT = 10.0   # seconds a connection has to send its command


def socket_path(namespace: str) -> str:
    return ns_path(namespace, "control.sock")


class ControlServer:
    """Accepts commands for ``runtime`` on threads of its own (one per connection)."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.path = socket_path(runtime.namespace)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen(8)
        self.thread = threading.Thread(target=self._serve, name="simpledbi-control", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            # One thread per connection: a client that connects and never sends (or a long
            # reload) holds up no one else.
            threading.Thread(target=self._serve_one, args=(conn,), name="simpledbi-control-conn",
                             daemon=True).start()

    def _serve_one(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(_READ_TIMEOUT)
                line = _read_line(conn)
                conn.settimeout(None)      # the answer comes when the command is done
                reply = self._handle(line)
            except socket.timeout:
                reply = {"ok": False, "error": f"no command within {_READ_TIMEOUT:g} s"}
            except Exception as e:  # noqa: BLE001 - every failure is an answer
                logger.exception("control command failed")
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps(reply).encode() + b"\n")

    def _handle(self, line: bytes) -> dict:
        try:
            msg = json.loads(line)
        except ValueError:
            return {"ok": False, "error": "expected one JSON object per line"}
        op = msg.get("op") if isinstance(msg, dict) else None
        if op == "reload":
            model, path, timeout = msg.get("model"), msg.get("path"), msg.get("timeout", 60.0)
            if not isinstance(model, str) or (path is not None and not isinstance(path, str)):
                return {"ok": False, "error": "reload: expected a model name and an optional path"}
            logger.info("reload of %r requested%s", model, f" from {path}" if path else "")
            try:
                cfg = self.runtime.reload(model, path, timeout)
            except Exception as e:  # noqa: BLE001 - the answer says why; so does the log, where an
                # operator looks (the command's output is gone with the shell that ran it)
                logger.error("reload of %r failed: %s: %s", model, type(e).__name__, e)
                return {"ok": False, "error": f"{type(e).__name__}: {e}"}
            if path:
                return {"ok": True, "message": f"model {model!r} reloaded from {path}"}
            source = f"model file {cfg.path}" if cfg.path else f"factory {import_path(cfg.factory)}"
            return {"ok": True, "message": f"model {model!r} reloaded: its {source} loaded again"}
        return {"ok": False, "error": f"unknown op {op!r}; expected 'reload'"}

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n") and len(data) < _MAX_LINE:
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def send(namespace: str, message: dict) -> dict:
    """Send one command to the serve process of ``namespace``; its answer, once it is done."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(socket_path(namespace))
        except (FileNotFoundError, ConnectionRefusedError):
            raise LookupError("this runtime takes no commands (only `simpledbi serve` does)") from None
        s.sendall(json.dumps(message).encode() + b"\n")
        line = _read_line(s)
    try:
        return json.loads(line)
    except ValueError:
        raise RuntimeError(f"unreadable answer from the runtime: {line[:200]!r}") from None
