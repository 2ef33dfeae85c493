"""What a new user hits first: a runtime started from a notebook, stdin or ``python -c``."""
from __future__ import annotations

import ast
import builtins
import functools
import itertools
import os
import re
import subprocess
import sys

import pytest

from simpledbi import sources

from . import models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The README's Runtime snippet, with the model class and its factory defined right there, in
# __main__: a notebook cell, `python -c`, `python - < snippet.py`. Spawned model processes
# cannot import either by name.
SNIPPET = """
import numpy as np
import torch
from simpledbi import ModelConfig, Runtime, SharedModel

class Net(torch.nn.Module):
    def forward(self, x):
        return x * 2 + 1

def build():
    return Net()

with Runtime([ModelConfig(name="net", factory=build, device="cpu", num_threads=1)]) as rt:
    with SharedModel("net", (1, 3), namespace=rt.namespace) as model:
        print("ANSWER", model.forward(np.ones((1, 3), np.float32)).tolist(), flush=True)
"""
HIDE_CLOUDPICKLE = "import sys; sys.modules['cloudpickle'] = None  # as if not installed\n"


def _python(*args: str, stdin: str = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, input=stdin, capture_output=True,
                          text=True, timeout=100)


def _no_tracebacks_from_children(err: str) -> bool:
    return "FileNotFoundError" not in err and "Traceback" not in err


# ---------------------------------------------------------------- item 3: factories in __main__
@pytest.mark.timeout(120)
def test_a_factory_defined_on_stdin_is_sent_by_value():
    # `python - < snippet.py`: each model process printed FileNotFoundError: '<stdin>' (spawn
    # re-runs __main__'s "file"), and the parent raised ModelProcessDied while loading.
    pytest.importorskip("cloudpickle")
    p = _python("-", stdin=SNIPPET)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "ANSWER [[3.0, 3.0, 3.0]]" in p.stdout
    assert _no_tracebacks_from_children(p.stderr), p.stderr[-3000:]


@pytest.mark.timeout(120)
def test_a_factory_defined_in_python_c_is_sent_by_value():
    pytest.importorskip("cloudpickle")
    p = _python("-c", SNIPPET)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "ANSWER [[3.0, 3.0, 3.0]]" in p.stdout
    assert _no_tracebacks_from_children(p.stderr), p.stderr[-3000:]


@pytest.mark.timeout(120)
def test_without_cloudpickle_such_a_factory_is_refused_before_start_up_saying_what_to_do():
    p = _python("-c", HIDE_CLOUDPICKLE + SNIPPET)
    assert p.returncode == 1
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("TypeError: model 'net': factory __main__.build cannot reach the model "
                           "processes: it is defined in __main__, which here is python -c"), last
    assert "pip install 'simpledbi[notebook]'" in last and "move it into a module" in last
    assert "ModelProcessDied" not in p.stderr   # refused before any model process started


@pytest.mark.timeout(180)
def test_a_factory_defined_in_a_jupyter_notebook_is_sent_by_value():
    pytest.importorskip("cloudpickle")
    manager = pytest.importorskip("jupyter_client.manager")
    pytest.importorskip("ipykernel")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, *sys.path[1:]]))
    km, kc = manager.start_new_kernel(kernel_name="python3", startup_timeout=90, cwd=ROOT, env=env)
    out, errors = [], []

    def collect(msg):
        content = msg["content"]
        if msg["msg_type"] == "stream":
            out.append(content["text"])
        elif msg["msg_type"] == "error":
            errors.append("\n".join(content["traceback"]))

    try:
        reply = kc.execute_interactive(SNIPPET, timeout=120, output_hook=collect)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    assert reply["content"]["status"] == "ok", errors
    assert "ANSWER [[3.0, 3.0, 3.0]]" in "".join(out), (out, errors)


# A whole Run from a notebook cell or stdin: its target, like a factory, lives in __main__.
RUN_SNIPPET = """
import numpy as np
from simpledbi import ModelConfig, Run, SharedModel
from tests.models import affine

def worker(rank):
    return SharedModel("net", (1, 3)).forward(np.full((1, 3), rank, np.float32)).tolist()

print("ANSWER", Run(target=worker, worker_num=2, models=[
    ModelConfig(name="net", factory=affine, device="cpu", num_threads=1)]), flush=True)
"""


@pytest.mark.timeout(120)
def test_a_run_target_defined_on_stdin_is_sent_by_value():
    # each worker printed "AttributeError: Can't get attribute 'worker' on <module '__main__'>",
    # and Run raised a WorkerError that did not say why
    pytest.importorskip("cloudpickle")
    p = _python("-", stdin=RUN_SNIPPET)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "ANSWER [[[1.0, 1.0, 1.0]], [[3.0, 3.0, 3.0]]]" in p.stdout, p.stdout
    assert _no_tracebacks_from_children(p.stderr), p.stderr[-3000:]


@pytest.mark.timeout(120)
def test_without_cloudpickle_such_a_run_target_is_refused_before_start_up():
    for args, stdin, where in ((("-c", HIDE_CLOUDPICKLE + RUN_SNIPPET), None, "python -c"),
                               (("-",), HIDE_CLOUDPICKLE + RUN_SNIPPET, "standard input (python -)")):
        p = _python(*args, stdin=stdin)
        assert p.returncode == 1
        last = p.stderr.strip().splitlines()[-1]
        assert last.startswith("TypeError: Run: target __main__.worker cannot reach the worker processes: "
                               f"it is defined in __main__, which here is {where}"), last


def _undefined(code: str) -> set:
    """Names a snippet reads but never binds (import, assignment, def, argument) and that are no
    builtins (scopes are not told apart: enough for a README snippet)."""
    bound, used = set(dir(builtins)), set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Name):
            (used if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.ExceptHandler)):
            bound.add(node.name)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return used - bound


def test_every_readme_python_snippet_runs_as_pasted_or_says_it_is_a_fragment_and_what_it_lacks():
    with open(os.path.join(ROOT, "README.md")) as f:
        blocks = re.findall(r"^```python\n(.*?)^```", f.read(), re.S | re.M)
    assert len(blocks) >= 5
    for code in blocks:
        note = " ".join(itertools.takewhile(lambda line: line.startswith("#"), code.splitlines()))
        missing = _undefined(code)
        unsaid = [n for n in missing if not re.search(rf"\b{n}\b", note)]
        assert not missing or "fragment" in note and not unsaid, (sorted(missing), code)


def test_which_factories_travel_by_value():
    assert sources.why_not_importable(models.affine) is None
    assert sources.why_not_importable(functools.partial(models.gated, "g")) is None
    assert "lambda" in sources.why_not_importable(lambda: None)

    def nested():
        return models.Affine()
    assert "nested" in sources.why_not_importable(functools.partial(nested))
    assert sources.ship("m", models.affine, "spawn") is models.affine
    assert sources.ship("m", nested, "fork") is nested       # a forked child has it already


def test_a_lambda_factory_is_sent_by_value_or_refused_without_cloudpickle(monkeypatch):
    pytest.importorskip("cloudpickle")
    shipped = sources.ship("m", lambda: models.Affine(), "spawn")
    assert isinstance(shipped, sources.ByValue) and "<lambda>" in repr(shipped)
    import pickle
    assert isinstance(pickle.loads(pickle.dumps(shipped))(), models.Affine)
    monkeypatch.setitem(sys.modules, "cloudpickle", None)
    with pytest.raises(TypeError, match=r"<lambda> is a lambda or a nested function.*"
                                        r"pip install 'simpledbi\[notebook\]'"):
        sources.ship("m", lambda: None, "spawn")


@pytest.mark.timeout(120)
def test_a_partial_carrying_something_of_main_is_sent_by_value():
    # the factory itself is importable; what the partial carries (a class of __main__) is not
    pytest.importorskip("cloudpickle")
    code = SNIPPET.replace("def build():\n    return Net()",
                           "import functools, operator\nbuild = functools.partial(operator.call, Net)")
    assert "operator.call" in code
    p = _python("-c", code)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "ANSWER [[3.0, 3.0, 3.0]]" in p.stdout


# ---------------------------------------------------------------- item 13: Ctrl-C while a child starts
@pytest.mark.timeout(60)
def test_a_ctrl_c_while_a_child_is_started_is_raised_after_the_block_not_inside_it():
    # With another thread in the process, the kernel gave the SIGINT blocked in the main thread to
    # that thread, and Python raised KeyboardInterrupt inside the block -- inside Process.start(),
    # between spawning a child and writing its bootstrap data, or before the runtime recorded it.
    code = """
import os, signal, threading
from simpledbi.interrupts import children_deaf_to_ctrl_c
other = threading.Event()
threading.Thread(target=other.wait, daemon=True).start()   # a thread that does not block SIGINT
try:
    with children_deaf_to_ctrl_c():
        os.kill(os.getpid(), signal.SIGINT)   # Ctrl-C while a child is being started
        for _ in range(200000):               # bytecodes at which Python runs a pending handler
            pass
        print("THE BLOCK RAN TO ITS END", flush=True)
except KeyboardInterrupt:
    print("KEYBOARDINTERRUPT", flush=True)
assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
"""
    p = _python("-c", code)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["THE", "BLOCK", "RAN", "TO", "ITS", "END", "KEYBOARDINTERRUPT"], p.stdout
