"""The ``simpledbi`` command (also ``python -m simpledbi``): ``serve``, ``status``, ``reload`` (README: "Any
model, any web framework"; ``--help`` lists the flags). ``serve --config`` reads a TOML file holding what the
flags hold (the flags win): ``[options]`` (RuntimeOptions fields), ``[[models]]`` (ModelConfig fields;
``factory = "module:function"`` instead of ``path``), as in ``examples/fastapi_app/serve.toml``. A relative
``path`` there is relative to the file's directory; a factory's module is imported from the working directory
and $PYTHONPATH, as ``--model``'s is."""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.util
import json
import logging
import os
import signal
import sys
import threading
import time
import tomllib
from typing import Any, Dict, List, Optional, Sequence

from . import naming, sources
from .config import ModelConfig, RuntimeOptions
from .control import ControlServer
from .errors import SimpleDBIError

logger = logging.getLogger("simpledbi.serve")

_MODEL_FLAGS = ("max_batch_size", "model_num", "wait_time", "latency_target", "device",
                "batching", "precision", "max_clients", "max_queue", "default_timeout")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:   # (parse_args named them under the top-level usage, which lists no flag of the command)
        (args.parser if args.command else parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if not args.command:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except BrokenPipeError:  # `simpledbi status --json | head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:  # Ctrl-C before a command handles it (serve: importing the models' modules)
        print(f"simpledbi {args.command}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, TypeError, LookupError, OSError, RuntimeError, SimpleDBIError, ImportError,
            tomllib.TOMLDecodeError) as e:
        where = getattr(e, "remote_traceback", "")   # a model process's (a factory that raised)
        if where:
            print(where.rstrip() + "\n", file=sys.stderr)
        print(f"simpledbi {args.command}: {e}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="simpledbi", description="Dynamic batching of many processes' "
                                "requests to shared PyTorch models, through shared memory.")
    sub = p.add_subparsers(dest="command")

    s = sub.add_parser("serve", help="run a standalone, named runtime until SIGTERM / Ctrl-C",
                       description="Run a standalone, named runtime until SIGTERM / Ctrl-C. A flag given "
                       "overrides the same setting of the --config file; the model flags apply to every "
                       "model.")
    s.add_argument("--name", help="the runtime's name, used by clients to attach (required here "
                   "or in the config)")
    s.add_argument("--config", help="a TOML file: name, metrics_port, metrics_addr, drain_timeout, "
                   "[options], "
                   "[[models]] (a relative model path in it is relative to the file's directory); a flag "
                   "given overrides the file's setting")
    s.add_argument("--model", action="append", default=[], metavar="NAME=PATH|MODULE:FACTORY",
                   help="a model to serve: a TorchScript / .pt2 file, or a function that builds "
                   "it (repeatable; the flags below apply to each)")
    s.add_argument("--max-batch-size", type=int, help=f"most rows in one batch {_default('max_batch_size')}")
    s.add_argument("--model-num", type=int, help=f"model processes per model {_default('model_num')}")
    s.add_argument("--wait-time", type=float, help="upper bound (s) on a request's wait for others "
                   + _default("wait_time"))
    s.add_argument("--latency-target", type=float, help="seconds of p99 latency to keep under "
                   "(default: none)")
    s.add_argument("--device", help="cpu, cuda, cuda:N or auto (a comma-separated list spreads instances) "
                   + _default("device"))
    s.add_argument("--batching", choices=("adaptive", "fixed"), help="adaptive: a batch waits only as long "
                   "as the learned costs say it pays; fixed: up to --wait-time " + _default("batching"))
    s.add_argument("--precision", choices=("float32", "float16", "bfloat16"), help="cast parameters and "
                   "floating inputs to this precision on the device " + _default("precision"))
    s.add_argument("--max-clients", type=int, help="client slots one model process maps at once: a slot per "
                   "call in flight; idle ones are unmapped to make room " + _default("max_clients"))
    s.add_argument("--max-queue", type=int, help="refuse new requests (Overloaded) beyond this many "
                   "waiting (README, Overload) (default: no bound)")
    s.add_argument("--default-timeout", type=float, help="seconds: the deadline of calls that give "
                   "none; a call that cannot finish in time is refused (README, Overload) (default: none)")
    s.add_argument("--input-shape", action="append", metavar="D1,D2,...",
                   help="item shape of an input (no batch dimension), repeatable in input order; the model "
                   "warms up with it and clients need no max_shape (default: none)")
    s.add_argument("--input-dtype", action="append", metavar="DTYPE", help="numpy dtype of an input, "
                   "repeatable in input order, one per --input-shape; requests of another dtype are refused "
                   "(default: none: requests of any dtype are taken; clients and the warm-up use float32)")
    s.add_argument("--mps", choices=("auto", "on", "off"), help="CUDA MPS: auto (a private daemon when "
                   "two or more model processes share a GPU), on (an error if it cannot start), off "
                   + _default("mps", RuntimeOptions))
    s.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port "
                   "(needs the metrics extra: pip install 'simpledbi[metrics]') (default: none)")
    s.add_argument("--metrics-addr", help="address for /metrics (default: 0.0.0.0)")
    s.add_argument("--drain-timeout", type=float,
                   help="seconds to finish accepted requests at SIGTERM (default: 30)")
    s.add_argument("--log-level", default="INFO", type=str.upper,
                   choices=("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL"),
                   help="which log records to print (default: INFO)")
    s.set_defaults(func=_serve, parser=s)

    st = sub.add_parser("status", help="what a running runtime is doing")
    st.add_argument("name", nargs="?", help="runtime name (default: $SIMPLEDBI_RUNTIME, or the "
                    "only one running)")
    st.add_argument("--check", action="store_true", help="print one line; exit 1 unless every "
                    "model is ready (a health check)")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.set_defaults(func=_status, parser=st)

    r = sub.add_parser("reload", help="replace a model's processes without failing a request")
    r.add_argument("model", help="the model to reload")
    r.add_argument("--runtime", help="runtime name (default: $SIMPLEDBI_RUNTIME, or the only one)")
    r.add_argument("--path", metavar="PATH|MODULE:FACTORY", help="a new TorchScript / .pt2 file, "
                   "or a function that builds the model, imported by the serve process (default: "
                   "load the same again)")
    r.add_argument("--timeout", type=float, default=60.0, help="seconds the old processes get to "
                   "answer what they took (default 60); what they still hold then fails")
    r.set_defaults(func=_reload, parser=r)
    return p


def _default(field: str, of=ModelConfig) -> str:
    """"(default: X)" read from the dataclass: serve's flags default to None (the config file, then
    the dataclass, decide), so argparse's own default would say "None"."""
    return f"(default: {next(f.default for f in dataclasses.fields(of) if f.name == field)})"


# ---------------------------------------------------------------- serve
@dataclasses.dataclass
class ServeConfig:
    name: str
    models: List[ModelConfig]
    options: RuntimeOptions
    metrics_port: Optional[int] = None
    metrics_addr: str = "0.0.0.0"
    drain_timeout: float = 30.0


def load_serve_config(args: argparse.Namespace) -> ServeConfig:
    """Merge the TOML file (if any) and the flags (which win) into validated configs."""
    doc: Dict[str, Any] = {}
    if args.config:
        with open(args.config, "rb") as f:
            doc = tomllib.load(f)
        top = ("name", "metrics_port", "metrics_addr", "drain_timeout", "options", "models")
        if unknown := set(doc) - set(top):
            raise _unknown(args.config, unknown, top, "name, metrics_port, metrics_addr, drain_timeout, "
                           "[options], [[models]]")
    name = args.name or doc.get("name")
    if not name:
        raise ValueError("a runtime name is needed: --name NAME (clients attach with "
                         "SharedModel(model, runtime=NAME))")
    flags = {k: getattr(args, k) for k in _MODEL_FLAGS if getattr(args, k) is not None}
    if "device" in flags and "," in flags["device"]:
        flags["device"] = flags["device"].split(",")
    if args.input_shape:
        try:
            flags["input_shapes"] = [tuple(int(d) for d in s.split(",")) for s in args.input_shape]
        except ValueError:
            raise ValueError(f"--input-shape: expected item dimensions as integers D1,D2,..., got "
                             f"{args.input_shape}") from None
    if args.input_dtype:
        flags["input_dtypes"] = list(args.input_dtype)
    entries = doc.get("models", [])
    if not isinstance(entries, list) or not all(isinstance(m, dict) for m in entries):
        raise ValueError(f"{args.config}: models: expected [[models]] tables (name = ..., path = ... or "
                         f"factory = ...), got {entries!r}")
    if args.config:   # as most tools read a config file: not against wherever serve was started
        here = os.path.dirname(os.path.abspath(args.config))
        entries = [{**e, "path": os.path.normpath(os.path.join(here, e["path"]))}
                   if isinstance(e.get("path"), str) and not os.path.isabs(e["path"]) else e for e in entries]
    for spec in args.model:
        model_name, sep, where = spec.partition("=")
        if not sep or not where:
            raise ValueError(f"--model: expected NAME=PATH or NAME=MODULE:FACTORY, got {spec!r}")
        try:
            kind, source = sources.resolve(where)
        except (OSError, ValueError) as e:
            raise ValueError(f"model {model_name!r}: {e}") from None
        entries.append({"name": model_name, kind: source})
    if not entries:
        raise ValueError("no model to serve: give --model NAME=PATH (or [[models]] in --config)")
    models = [_model_config({**e, **flags}) for e in entries]
    options = doc.get("options", {})
    if not isinstance(options, dict):
        raise ValueError(f"{args.config}: options: expected an [options] table, got {options!r}")
    if args.mps:
        options = {**options, "mps": args.mps}
    fields = [f.name for f in dataclasses.fields(RuntimeOptions)]
    # (as [[models]] says it: the TypeError named RuntimeOptions.__init__)
    if unknown := set(options) - set(fields):
        raise _unknown("[options]", unknown, fields)
    try:
        runtime_options = RuntimeOptions(**options)
    except TypeError as e:
        raise ValueError(f"[options]: {e}") from None
    port = args.metrics_port if args.metrics_port is not None else doc.get("metrics_port")
    if port is not None and (type(port) is not int or not 0 <= port <= 65535):   # (before any model loads)
        raise ValueError(f"metrics_port: expected a port number 0-65535, got {port!r}")
    drain = args.drain_timeout if args.drain_timeout is not None else doc.get("drain_timeout", 30.0)
    if isinstance(drain, bool) or not isinstance(drain, (int, float)) or not 0 <= drain < float("inf"):
        raise ValueError(f"drain_timeout: expected seconds >= 0, got {drain!r}")
    return ServeConfig(name, models, runtime_options, port,
                       args.metrics_addr or doc.get("metrics_addr", "0.0.0.0"), float(drain))


def _model_config(entry: Dict[str, Any]) -> ModelConfig:   # entry: a fresh dict, changed here
    fields = [f.name for f in dataclasses.fields(ModelConfig)]
    if unknown := set(entry) - set(fields):   # (first: before a factory's module is imported)
        raise _unknown(f"model {entry.get('name')!r} ([[models]])", unknown, fields)
    if isinstance(entry.get("path"), str) and not os.path.isfile(entry["path"]):
        raise ValueError(f"model {entry.get('name')!r}: no model file at {entry['path']!r}")
    if isinstance(entry.get("factory"), str):
        entry["factory"] = sources.import_factory(entry["factory"])
    return ModelConfig(**entry)


def _unknown(where: str, unknown, valid: Sequence[str], listed: str = "") -> ValueError:
    """"<where>: unknown setting 'max_batch_sise' (did you mean 'max_batch_size'?); expected some of
    <the valid ones>" (``listed``: how to list them, if not by their names)."""
    named = []
    for key in sorted(map(str, unknown)):
        close = difflib.get_close_matches(key, valid, n=1)
        named.append(repr(key) + (f" (did you mean {close[0]!r}?)" if close else ""))
    return ValueError(f"{where}: unknown setting{'s' if len(named) > 1 else ''} {', '.join(named)}; "
                      f"expected some of {listed or ', '.join(valid)}")


def _serve(args: argparse.Namespace) -> int:
    from .runtime import Runtime
    logging.basicConfig(level=getattr(logging, args.log_level),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_serve_config(args)
    naming.refuse_if_live(naming.resolve(cfg.name), cfg.name)   # before "starting" (register() too)
    if cfg.metrics_port is not None and importlib.util.find_spec("prometheus_client") is None:
        # before loading any model: a missing extra fails fast
        raise ImportError("--metrics-port needs prometheus_client: pip install 'simpledbi[metrics]'")
    metrics_at = _serve_metrics(cfg) if cfg.metrics_port is not None else ""
    stop, started, draining, signals = threading.Event(), threading.Event(), threading.Event(), []

    def on_signal(signum, frame):
        signals.append(signum)
        # still starting: Runtime.start cleans up and re-raises; draining: a second Ctrl-C stops at once
        # (it did nothing: a drain waits up to --drain-timeout, helper-52). Not a second SIGTERM:
        # `timeout` sends one to the process and then one to its group, and that skipped the drain
        # (helper-55); SIGKILL stops at once.
        if not started.is_set() or draining.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    t0 = time.monotonic()
    runtime = Runtime(cfg.models, cfg.options, name=cfg.name)
    control = None
    try:
        logger.info("starting runtime %r: %s", cfg.name, ", ".join(
            f"{m.name} ({m.model_num} x {'/'.join(m.device)})" for m in cfg.models))
        try:
            runtime.start()
        except KeyboardInterrupt:
            logger.info("interrupted while starting; stopped")
            return 128 + (signals[0] if signals else signal.SIGINT)   # 130 for Ctrl-C, 143 for SIGTERM
        started.set()
        control = ControlServer(runtime)   # `simpledbi reload`
        logger.info("runtime %r ready in %.1f s (MPS: %s): attach with SharedModel(%r, "
                    "runtime=%r) or SIMPLEDBI_RUNTIME=%s%s", cfg.name, time.monotonic() - t0,
                    runtime.mps.state, cfg.models[0].name, cfg.name, cfg.name, metrics_at)
        stop.wait()
        control.close()
        try:
            draining.set()
            logger.info("stopping: the requests accepted are answered first (Ctrl-C again to stop now)")
            runtime.drain(cfg.drain_timeout)
        except KeyboardInterrupt:
            # (unanswered() counts a model's socket queue as one: helper-53)
            logger.warning("interrupted again: stopping now; requests still unanswered (at least %d) end: "
                           "clients attached by name wait for a successor up to their connect_timeout, "
                           "others get RuntimeStopped", runtime.unanswered())
            return 128 + signals[-1]
        finally:
            draining.clear()
        return 0
    finally:
        if control is not None:
            control.close()
        runtime.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if signals:   # stopped by a signal, the process exits: a further Ctrl-C meanwhile raised inside
            signal.signal(signal.SIGINT, signal.SIG_IGN)   # torch's atexit hooks, with a traceback (helper-53)
        if started.is_set():
            logger.info("runtime %r stopped", cfg.name)


def _serve_metrics(cfg: ServeConfig) -> str:
    """Serve /metrics before any model loads, so that a port in use fails in a moment rather than
    after the models loaded (scrapes meanwhile show them loading); the ready line's words about it."""
    from .metrics import start_metrics_server
    try:
        served = start_metrics_server(cfg.metrics_port, cfg.name, addr=cfg.metrics_addr)
    except OSError as e:   # (errno's "[Errno 98]" prefix said nothing more)
        raise OSError(f"--metrics-port {cfg.metrics_port} on {cfg.metrics_addr}: {e.strerror or e}") from None
    # the port the system chose for --metrics-port 0 (prometheus_client < 0.17 returns nothing)
    port = served[0].server_address[1] if served else cfg.metrics_port
    return f"; Prometheus metrics on {cfg.metrics_addr}:{port}/metrics"


# ---------------------------------------------------------------- reload
def _reload(args: argparse.Namespace) -> int:
    from . import control
    from .status import inspect
    path = args.path   # MODULE:FACTORY is imported by the serve process (on its sys.path)
    if path is not None and (os.path.isfile(path) or not sources.is_import_path(path)):
        sources.resolve(path)          # raises for a Python file or no file, saying what to write
        path = os.path.abspath(path)   # a file: the serve process has a working directory of its own
    info = inspect(args.runtime)
    reply = control.send(info.namespace, {"op": "reload", "model": args.model, "path": path,
                                          "timeout": args.timeout})
    if reply.get("ok"):
        print(reply.get("message", "reloaded"))
        return 0
    print(f"simpledbi reload: {reply.get('error')}", file=sys.stderr)
    return 1


# ---------------------------------------------------------------- status
def _status(args: argparse.Namespace) -> int:
    from .status import format_status, inspect
    try:
        info = inspect(args.name)
    except LookupError as e:
        if args.check:   # a health check: "not ready", in the form asked for
            print(json.dumps({"name": args.name, "ready": False, "error": str(e)}) if args.json
                  else f"NOT READY: {e}")
            return 1
        raise
    if args.json and args.check:   # a health check's answer, on one line (not every histogram bound)
        print(json.dumps(_health(info)))
    elif args.json:   # ("ready" is a property: asdict leaves it out)
        print(json.dumps({**dataclasses.asdict(info), "ready": info.ready}, indent=1, default=str))
    elif args.check:
        bad = [f"{m.name} {m.state}" + ("" if m.state != "running" else ", no instance ready: " +
                                         ", ".join(i.state if i.alive else "dead" for i in m.instances))
               for m in info.models if not m.ready]
        print(f"{'READY' if info.ready else 'NOT READY'}: runtime {info.name}"
              + (f" ({', '.join(bad)})" if bad else ""))
    else:
        print(format_status(info))
    return 0 if info.ready or not args.check else 1


def _health(info) -> Dict[str, Any]:
    """`status --check --json`: whether the runtime and each model serve, and how many model
    processes of each are ready (of how many)."""
    return {"name": info.name, "ready": info.ready, "pid": info.pid, "alive": info.alive,
            "models": [{"name": m.name, "state": m.state, "ready": m.ready,
                        "ready_instances": sum(i.alive and i.state == "ready" for i in m.instances),
                        "instances": len(m.instances)} for m in info.models]}
