"""Bad input, model failures and timeouts: a clear exception in the caller, the runtime unharmed."""
from __future__ import annotations

import functools
import threading
import warnings

import numpy as np
import pytest
import torch

from simpledbi import ModelConfig, ModelError, Runtime, RuntimeStopped, SharedModel
from simpledbi.errors import RemoteTraceback

from . import models
from .conftest import FAST, cpu_model, wait_queued


@pytest.fixture
def affine(start_runtime):
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=4, wait_time=0.001))
    model = SharedModel("affine", max_shape=(2, 3, 4), namespace=rt.namespace)
    yield model
    model.close()


def _healthy(model):
    x = np.ones((2, 3, 4), np.float32)
    np.testing.assert_array_equal(model.forward(x), x * 2 + 1)


def _nested():
    with warnings.catch_warnings():   # (torch: "the PyTorch API of nested tensors is in prototype stage")
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([torch.zeros(3, 4)])


@pytest.mark.parametrize("bad,exc,words", [
    (np.zeros((3, 3, 4), np.float32), ValueError, ["1..2 rows", "got 3"]),
    (np.zeros((0, 3, 4), np.float32), ValueError, ["1..2 rows", "got 0"]),
    (np.zeros((1, 3, 5), np.float32), ValueError, ["dimension 2 is 5", "1..4"]),
    (np.zeros((1, 3), np.float32), ValueError, ["expected 3 dimensions", "(1, 3)"]),
    (np.zeros((1, 3, 4), np.float64), TypeError, ["expected float32", "got float64"]),
    (torch.zeros((1, 3, 4), dtype=torch.int32), TypeError, ["expected float32", "got int32"]),
    ([[0.0] * 4] * 3, TypeError, ["numpy array or a torch tensor", "got list"]),
    (torch.zeros((1, 3, 4)).to_sparse(), TypeError, ["expected a dense tensor", "torch.sparse_coo", ".to_dense()"]),
    (_nested(), TypeError, ["expected a dense tensor", "nested",
                                                                  ".to_padded_tensor(0)"]),
])
def test_bad_input_is_refused_before_anything_is_sent(affine, bad, exc, words):
    before = affine.stats()["requests"]
    with pytest.raises(exc) as info:
        affine.forward(bad)
    for w in words:
        assert w in str(info.value)
    assert affine.stats()["requests"] == before
    _healthy(affine)


def test_a_negated_or_conjugated_view_is_sent_as_torch_reads_it(affine):
    """numpy() refuses tensors with their lazy negation bit set: torch's own RuntimeError reached the
    caller (helper-51). Their values are what torch would compute with."""
    x = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    view = torch._neg_view(x)
    assert view.is_neg()
    torch.testing.assert_close(affine.forward(view), -x * 2 + 1)
    _healthy(affine)


def test_wrong_number_of_inputs(affine):
    x = np.zeros((1, 3, 4), np.float32)
    with pytest.raises(TypeError, match=r"expected 1 input\(s\).*got 2"):
        affine.forward(x, x)
    with pytest.raises(TypeError, match=r"got 0"):
        affine.forward()
    _healthy(affine)


def test_unknown_model_name_lists_the_available_ones(affine):
    with pytest.raises(LookupError, match=r"no model named 'nope'.*\['affine'\]"):
        SharedModel("nope", max_shape=(1, 3), namespace=affine.namespace)


def test_a_name_no_model_can_have_is_a_lookup_error_not_an_os_error(affine):
    # "m" * 300 made an OSError (file name too long) when the runtime's files were looked up
    for name in ("m" * 300, "a/b", ""):
        with pytest.raises(LookupError, match="model names are 1-48 letters"):
            SharedModel(name, max_shape=(1, 3), namespace=affine.namespace)


def test_a_namespace_that_no_runtime_can_have_or_two_ways_to_attach_say_so(affine):
    # both: runtime= won, namespace= went unseen, and the call waited 30 s for a runtime "x"
    with pytest.raises(TypeError, match="pass runtime= .* or namespace= .*, not both"):
        SharedModel("affine", (2, 3, 4), runtime="x", namespace=affine.namespace)
    for ns in ("../../etc", "", "sdbi_u0"):   # ("no model named 'affine' in runtime ../../etc; available: []")
        with pytest.raises(LookupError, match=r"no simpledbi runtime .* is running here \(a namespace is "):
            SharedModel("affine", (2, 3, 4), namespace=ns)


def test_no_runtime_at_all(monkeypatch):
    monkeypatch.delenv("SIMPLEDBI_NAMESPACE", raising=False)
    with pytest.raises(LookupError, match="no simpledbi runtime"):
        SharedModel("affine", max_shape=(1, 3))


def test_max_batch_size_smaller_than_the_clients_rows(affine):
    with pytest.raises(ValueError, match=r"5 rows.*max_batch_size=4"):
        SharedModel("affine", max_shape=(5, 3, 4), namespace=affine.namespace)


@pytest.mark.parametrize("shape,exc", [("abc", TypeError), ((1, 0, 3), ValueError), ((), TypeError),
                                       ([(1, 2), (2, 2)], ValueError)])
def test_bad_max_shape(affine, shape, exc):
    with pytest.raises(exc, match="max_shape"):
        SharedModel("affine", max_shape=shape, namespace=affine.namespace)


def test_bad_timeout_value(affine):
    with pytest.raises(ValueError, match="timeout"):
        affine.forward(np.zeros((1, 3, 4), np.float32), timeout=-1)


def test_model_exception_reaches_the_caller_with_its_traceback(start_runtime):
    rt = start_runtime(cpu_model("faulty", models.faulty, max_batch_size=4))
    with SharedModel("faulty", max_shape=(2, 3), namespace=rt.namespace) as model:
        x = np.full((1, 3), models.RAISE, np.float32)
        with pytest.raises(ModelError) as info:
            model.forward(x)
        err = info.value
        assert err.remote_type == "ValueError"
        assert "poisoned input" in str(err)
        assert isinstance(err.__cause__, RemoteTraceback)
        assert 'raise ValueError("poisoned input")' in err.remote_traceback
        y = np.ones((2, 3), np.float32)
        np.testing.assert_array_equal(model.forward(y), y * 2 + 1)  # the runtime is still up
        with pytest.raises(ModelError, match=r"expected 2 rows.*got 1"):
            model.forward(np.full((2, 3), models.WRONG_ROWS, np.float32))
        with pytest.raises(ModelError, match=r"expected a tensor, or a tuple/list/dict/namedtuple .*got str"):
            model.forward(np.full((1, 3), models.NOT_A_TENSOR, np.float32))
        np.testing.assert_array_equal(model.forward(y), y * 2 + 1)
        assert model.stats()["errors"] == 3


@pytest.mark.parametrize("isolate", [False, True])
def test_a_poisoned_batch_fails_only_the_culprit_when_isolating(start_runtime, gate, isolate):
    rt = start_runtime(cpu_model("faulty", functools.partial(models.faulty, gate.name),
                                 max_batch_size=4, wait_time=1.0, isolate_errors=isolate))
    model = SharedModel("faulty", max_shape=(1, 3), namespace=rt.namespace)
    outcomes = {}

    def call(i, value):
        try:
            outcomes[i] = model.forward(np.full((1, 3), value, np.float32), timeout=60)
        except ModelError as e:
            outcomes[i] = e

    blocker = threading.Thread(target=call, args=("blocker", models.GATE))
    blocker.start()
    gate.wait_entered()  # the only model process is busy: the next four requests queue up
    threads = [threading.Thread(target=call, args=(i, models.RAISE if i == 0 else float(i)))
               for i in range(4)]
    for t in threads:
        t.start()
    wait_queued(model, n=4)   # the four, queued behind the gated blocker
    batches = model.stats()["batches"]
    gate.open()
    for t in threads + [blocker]:
        t.join(60)
    # The four queued requests fill one batch (max_batch_size=4), poisoned by request 0.
    assert len(outcomes) == 5 and not isinstance(outcomes.pop("blocker"), Exception)
    # counted before their callers are woken: the gated batch, then the poisoned one
    assert model.stats()["batches"] == batches + 2
    assert isinstance(outcomes[0], ModelError) and "poisoned input" in str(outcomes[0])
    if isolate:  # bisection finds the culprit: the three innocent callers get their answers
        for i in (1, 2, 3):
            np.testing.assert_array_equal(outcomes[i], np.full((1, 3), i * 2 + 1, np.float32))
        assert model.stats()["isolated_batches"] == 1 and model.stats()["errors"] == 1
    else:
        assert all(isinstance(v, ModelError) for v in outcomes.values()), outcomes
    model.close()


@pytest.mark.timeout(120)
def test_stats_count_an_isolated_batch_before_any_of_its_callers_returns(start_runtime, gate):
    # Isolating answered (and woke) each part of a poisoned batch as it went, and counted the batch's
    # requests and batches only once the bisection was over: a caller answered early read stats()
    # without its own call (batches 0, or 4 requests of 8) for as long as the retries still ran.
    # Each retry here takes 50 ms, so a caller answered early reads stats() while they run.
    # A batch of five: a client process keeps at most ~6 requests in the model's queue
    # (client._SEND_BUFFER), and the test queues them all while the model process is held.
    n = 5
    rt = start_runtime(cpu_model("faulty", functools.partial(models.faulty, gate.name, 0.05),
                                 max_batch_size=n, wait_time=1.0))
    model = SharedModel("faulty", max_shape=(1, 3), namespace=rt.namespace)
    before = model.stats()
    seen, outcomes = {}, {}

    def call(i, value):
        try:
            outcomes[i] = model.forward(np.full((1, 3), value, np.float32), timeout=60)
        except ModelError as e:
            outcomes[i] = e
        seen[i] = model.stats()   # at once, as the call returns

    blocker = threading.Thread(target=call, args=("blocker", models.GATE))
    blocker.start()
    gate.wait_entered()  # the only model process is busy: the next n requests queue up
    culprit = n - 1
    threads = [threading.Thread(target=call, args=(i, models.RAISE if i == culprit else float(i)))
               for i in range(n)]
    for t in threads:
        t.start()
    wait_queued(model, n=n)   # one batch of n (max_batch_size), poisoned by its last request
    gate.open()
    for t in threads + [blocker]:
        t.join(60)
    assert len(seen) == n + 1 and isinstance(outcomes[culprit], ModelError), outcomes
    assert all(not isinstance(outcomes[i], Exception) for i in range(culprit)), outcomes

    def grew(stats, key):
        return stats[key] - before[key]

    for i in range(n):   # the gated batch and the poisoned one, counted before any caller woke
        assert (grew(seen[i], "requests"), grew(seen[i], "batches"), grew(seen[i], "rows")) == (n + 1, 2, n + 1), \
            (i, seen[i])
        assert seen[i]["isolated_batches"] == 1, (i, seen[i])
    assert grew(seen[culprit], "errors") == 1, seen[culprit]   # the culprit's own error too
    after = model.stats()
    assert (grew(after, "requests"), grew(after, "batches"), grew(after, "errors")) == (n + 1, 2, 1), after
    assert after["mean_batch_size"] == (before["rows"] + n + 1) / (before["batches"] + 2)
    model.close()


def test_timeout_before_any_model_process_took_the_request(start_runtime, gate):
    rt = start_runtime(cpu_model("gated", functools.partial(models.gated, gate.name), max_batch_size=1))
    blocker = SharedModel("gated", max_shape=(1, 2), namespace=rt.namespace)
    late = SharedModel("gated", max_shape=(1, 2), namespace=rt.namespace)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault(
        "y", blocker.forward(np.full((1, 2), models.GATE, np.float32), timeout=60)))
    t.start()
    gate.wait_entered()  # the only model process is now held: this request cannot be taken
    with pytest.raises(TimeoutError, match=r"within the timeout \(0.2 s: the request was withdrawn"):
        late.forward(np.ones((1, 2), np.float32), timeout=0.2)
    gate.open()
    t.join(60)
    np.testing.assert_array_equal(result["y"], np.full((1, 2), models.GATE * 2 + 1, np.float32))
    x = np.full((1, 2), 3.0, np.float32)
    np.testing.assert_array_equal(late.forward(x), x * 2 + 1)
    blocker.close()
    late.close()


def test_late_result_is_never_returned_to_a_later_call(start_runtime, gate):
    rt = start_runtime(cpu_model("gated", functools.partial(models.gated, gate.name), max_batch_size=1))
    with SharedModel("gated", max_shape=(1, 2), namespace=rt.namespace) as model:
        with pytest.raises(TimeoutError, match=r"within the timeout \(0.3 s\); .* being computed"):
            model.forward(np.full((1, 2), models.GATE, np.float32), timeout=0.3)
        gate.open()  # the late result arrives now, and must be dropped
        x = np.full((1, 2), 5.0, np.float32)
        np.testing.assert_array_equal(model.forward(x, timeout=30), x * 2 + 1)
        np.testing.assert_array_equal(model.forward(x + 1), x * 2 + 3)


def test_model_that_fails_to_load_is_reported(start_runtime, tmp_path):
    broken = tmp_path / "broken.pt"
    broken.write_bytes(b"not a TorchScript archive")
    rt = Runtime([ModelConfig(name="m", path=str(broken), device="cpu")], FAST)
    with pytest.raises(ModelError, match=r"process 0 failed to load: RuntimeError"):
        rt.start()
    # Started again (a notebook cell re-run), it did nothing and returned: every client then
    # found no runtime. A shut-down one is the same.
    with pytest.raises(RuntimeError, match="cannot start again: create a new Runtime"):
        rt.start()
    ok = start_runtime(ModelConfig(name="m", factory=models.affine, device="cpu"))
    ok.shutdown()
    with pytest.raises(RuntimeError, match="was shut down .* cannot start again"):
        ok.start()


def test_a_warm_up_that_fails_on_the_declared_input_shapes_says_so(start_runtime):
    """(It read as the factory's failure: "failed to load: RuntimeError: mat1 and mat2 shapes ...")."""
    rt = Runtime([ModelConfig(name="m", factory=models.multi_io, device="cpu", max_batch_size=4,
                              input_shapes=[(3,)])], FAST)
    with pytest.raises(ModelError, match=r"failed to load: RuntimeError: the model loaded, but its warm-up on "
                                         r"zeros of the declared input_shapes \[\(3,\)\] \(float32; batches "
                                         r"of 4 and 1 rows\) failed: TypeError"):
        rt.start()


def test_what_a_model_process_could_not_load_is_refused_before_starting_one(tmp_path, monkeypatch):
    # A missing file or a factory that cannot be pickled failed seconds later, in a model
    # process, with a raw PicklingError for the lambda. (With cloudpickle, a lambda is sent by
    # value: tests/test_newcomer.py.)
    missing = str(tmp_path / "missing.pt")
    with pytest.raises(FileNotFoundError, match="model 'm': no model file at .*missing.pt"):
        Runtime([ModelConfig(name="m", path=missing, device="cpu")]).start()
    monkeypatch.setitem(__import__("sys").modules, "cloudpickle", None)
    with pytest.raises(TypeError, match="a lambda or a nested function.*simpledbi\\[notebook\\]"):
        Runtime([ModelConfig(name="m", factory=lambda: None, device="cpu")]).start()


def test_a_call_after_close_says_closed_however_the_handle_attached():
    # A handle attached by name raised TypeError ('NoneType' object is not subscriptable).
    import os
    name = f"closed{os.getpid()}"
    with Runtime([cpu_model("affine", models.affine, max_batch_size=2)], name=name) as rt:
        for m in (SharedModel("affine", max_shape=(1, 2), runtime=name),
                  SharedModel("affine", max_shape=(1, 2), namespace=rt.namespace)):
            m.close()
            with pytest.raises(RuntimeStopped, match="is closed"):
                m.forward(np.ones((1, 2), np.float32))


def test_a_model_error_names_item_shapes_other_than_the_declared_ones(start_runtime):
    """Requests may be smaller than the declared input_shapes, so a (1, 15) input reaches a model
    declared (16,); one that needs exactly that fails with its own words ("mat1 and mat2 shapes cannot
    be multiplied"), which said nothing of the declaration (helper-52). The error now names both."""
    rt = start_runtime(cpu_model("lin", models.linear16, input_shapes=[(16,)]))
    m = SharedModel("lin", namespace=rt.namespace)
    with pytest.raises(ModelError, match=r"shapes cannot be multiplied .*\(input 'input' has item shape "
                                         r"\(15,\), the model declares \(16,\) in input_shapes\)"):
        m.forward(np.ones((1, 15), np.float32))
    assert m.forward(np.ones((2, 16), np.float32)).shape == (2, 4)
    m.close()
