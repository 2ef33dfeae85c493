"""Model I/O as real models have it: inputs by keyword or dict, dict / namedtuple outputs, and
the declared inputs (names, shapes, dtypes) a client gets from the runtime instead of repeating."""
from __future__ import annotations

import functools
import multiprocessing as mp
import os
import threading

import numpy as np
import pytest
import torch

from simpledbi import ModelError, SharedModel

from . import models
from .conftest import cpu_model, wait_queued

pytestmark = pytest.mark.timeout(120)

I64 = ("int64", "int64", "int64")


def _hf(name="hf", gate=None, **kw):
    kw.setdefault("max_batch_size", 8)
    kw.setdefault("input_shapes", [(4,), (4,), (4,)])
    kw.setdefault("input_dtypes", I64)
    factory = functools.partial(models.hf_like, gate.name) if gate is not None else models.hf_like
    return cpu_model(name, factory, **kw)


def _ids(rows=2, start=1):
    return np.arange(start, start + rows * 4, dtype=np.int64).reshape(rows, 4)


def _expect(ids, mask=None, types=None):
    """What HFLike returns, as a dict of numpy arrays."""
    m = np.ones_like(ids) if mask is None else mask
    out = {"logits": (ids * 2 * m).astype(np.float32), "hidden": ids + 1}
    if mask is not None:
        out["mask_used"] = mask.sum(1, keepdims=True)
    if types is not None:
        out["types"] = types * 3
    return out


def _assert_dict_equal(got, want):
    assert isinstance(got, dict) and list(got) == list(want), (list(got), list(want))
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
        assert got[k].dtype == want[k].dtype, (k, got[k].dtype, want[k].dtype)


def _pids(rt, name):
    return [int(p) for p in rt.ctls[name].instances["pid"]]


def test_keyword_inputs_and_dict_outputs(start_runtime):
    rt = start_runtime(_hf())
    ids, mask = _ids(), np.array([[1, 1, 0, 0], [1, 1, 1, 0]], np.int64)
    with SharedModel("hf", namespace=rt.namespace) as m:   # max_shape and dtype as declared
        assert m.input_names == ("input_ids", "attention_mask", "token_type_ids")
        _assert_dict_equal(m.forward(input_ids=ids, attention_mask=mask), _expect(ids, mask))
        _assert_dict_equal(m(input_ids=ids), _expect(ids))                  # a subset of names
        _assert_dict_equal(m(attention_mask=mask, input_ids=ids), _expect(ids, mask))  # any order
        _assert_dict_equal(m(ids, token_type_ids=mask), _expect(ids, types=mask))      # mixed
        _assert_dict_equal(m({"input_ids": ids, "attention_mask": mask}), _expect(ids, mask))
        # torch in -> torch leaves out, in the same dict
        out = m(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))
        assert list(out) == ["logits", "hidden", "mask_used"]
        assert all(isinstance(v, torch.Tensor) for v in out.values())
        np.testing.assert_array_equal(out["logits"].numpy(), _expect(ids, mask)["logits"])
        # positional calls are unchanged: all three inputs, in order
        _assert_dict_equal(m(ids, mask, mask), _expect(ids, mask, mask))


def test_namedtuple_outputs_come_back_as_namedtuples(start_runtime):
    rt = start_runtime(cpu_model("nt", models.named_out, max_batch_size=4))
    ids, mask = _ids(3), np.ones((3, 4), np.int64)
    mask[0, 0] = 0
    with SharedModel("nt", max_shape=[(3, 4), (3, 4)], dtype="int64", namespace=rt.namespace) as m:
        for out in (m(input_ids=ids, attention_mask=mask), m(ids, mask)):
            assert type(out).__name__ == "Pair" and out._fields == ("logits", "pooled")
            assert isinstance(out, tuple)
            np.testing.assert_array_equal(out.logits, (ids * mask).astype(np.float32))
            np.testing.assert_array_equal(out.pooled, ids.sum(1, keepdims=True))
        assert type(m(ids, mask)) is type(out)  # the type is made once and cached
        # it pickles (a DataLoader worker or a Pool task returning it hung or failed, helper-48), to
        # the same namedtuple, in another process too
        import pickle
        back = pickle.loads(pickle.dumps(out))
        assert type(back) is type(out)
        np.testing.assert_array_equal(back.logits, out.logits)
        ctx = mp.get_context("spawn")
        with ctx.Pool(1) as pool:
            assert pool.apply(pickle.loads, (pickle.dumps(out),))._asdict().keys() == out._asdict().keys()
    import torch   # a torch dtype names the same dtype as numpy's ("expected one of float32, ..." before)
    with SharedModel("nt", max_shape=[(3, 4), (3, 4)], dtype=torch.int64, namespace=rt.namespace) as m:
        assert m.dtypes == [np.dtype(np.int64)] * 2 and type(m(ids, mask)).__name__ == "Pair"


def test_torchscript_model_names_come_from_its_schema(start_runtime, tmp_path):
    path = str(tmp_path / "scripted.pt")
    torch.jit.script(models.Scriptable()).save(path)
    rt = start_runtime(cpu_model("ts", None, path=path, max_batch_size=4, input_shapes=[(4,), (4,)],
                                 input_dtypes=("int64", "int64")))
    ids, mask = _ids(), np.array([[1, 0, 1, 0], [0, 1, 0, 1]], np.int64)
    with SharedModel("ts", namespace=rt.namespace) as m:
        assert m.input_names == ("input_ids", "attention_mask")
        out = m(attention_mask=mask, input_ids=ids)
        assert sorted(out) == ["ids", "logits"]
        np.testing.assert_array_equal(out["logits"], (ids * mask).astype(np.float32))
        np.testing.assert_array_equal(out["ids"], ids + 1)


def test_unknown_keyword_is_a_type_error_before_anything_is_sent(start_runtime):
    rt = start_runtime(_hf())
    with SharedModel("hf", namespace=rt.namespace) as m:
        before = m.stats()["requests"]
        with pytest.raises(TypeError, match=r"unexpected keyword input 'input_idz'.*accepts "
                                            r"input_ids, attention_mask, token_type_ids"):
            m.forward(input_idz=_ids())
        with pytest.raises(TypeError, match=r"unexpected keyword input 'labels'"):
            m({"input_ids": _ids(), "labels": _ids()})
        with pytest.raises(TypeError, match=r"multiple values for input 'input_ids'"):
            m(_ids(), input_ids=_ids())
        assert m.stats()["requests"] == before
        _assert_dict_equal(m(input_ids=_ids()), _expect(_ids()))


def test_a_missing_required_keyword_input_is_a_type_error_before_anything_is_sent(start_runtime, tmp_path):
    path = str(tmp_path / "scripted.pt")
    torch.jit.script(models.Scriptable()).save(path)   # both inputs required (its schema)
    rt = start_runtime(_hf(), cpu_model("ts", None, path=path, max_batch_size=4, input_shapes=[(4,), (4,)],
                                         input_dtypes=("int64", "int64")))
    with SharedModel("ts", namespace=rt.namespace) as m:
        with pytest.raises(TypeError, match=r"model 'ts' is missing required input\(s\) 'attention_mask'; it "
                                            r"takes input_ids, attention_mask, got input_ids"):
            m(input_ids=_ids())
        with pytest.raises(TypeError, match=r"missing required input\(s\) 'input_ids'.*got attention_mask"):
            m({"attention_mask": _ids()})
        assert m.stats()["requests"] == 0
    with SharedModel("hf", namespace=rt.namespace) as m:   # only input_ids has no default
        with pytest.raises(TypeError, match=r"missing required input\(s\) 'input_ids'"):
            m(attention_mask=_ids())
        assert m.stats()["requests"] == 0
        _assert_dict_equal(m(input_ids=_ids()), _expect(_ids()))   # optional ones may be left out


def test_a_dtype_other_than_the_declared_one_is_refused_in_the_client(start_runtime):
    rt = start_runtime(_hf())
    with SharedModel("hf", namespace=rt.namespace) as m:
        assert [str(d) for d in m.dtypes] == list(I64)
        with pytest.raises(TypeError, match=r"input 'input_ids': expected int64, got float32"):
            m(input_ids=_ids().astype(np.float32))
        with pytest.raises(TypeError, match=r"input 'attention_mask': expected int64, got int32"):
            m(_ids(), _ids().astype(np.int32), _ids())
        assert m.stats()["requests"] == 0
    with pytest.raises(TypeError, match=r"input 'input_ids': model 'hf' declares int64, got float32"):
        SharedModel("hf", max_shape=[(2, 4)] * 3, dtype="float32", namespace=rt.namespace)


def test_max_shape_defaults_to_the_declared_shapes_without_reserving_them(start_runtime):
    big = 1 << 16  # 256 KiB a row of float32: 64 rows is 16 MiB an input
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=64, input_shapes=[(big,)]),
                       cpu_model("bare", models.affine, max_batch_size=4))
    with SharedModel("affine", namespace=rt.namespace) as m:
        assert m.max_shapes == ((64, big),)
        x = np.ones((1, big), np.float32)
        np.testing.assert_array_equal(m(x), x * 2 + 1)
        (slot,) = m._h.idle
        allocated = os.fstat(slot.seg.fd).st_blocks * 512
        assert allocated < 4 * 2**20, allocated   # the 16 MiB input region is sparse until used
        x = np.ones((64, big), np.float32)
        np.testing.assert_array_equal(m(x), x * 2 + 1)
    with pytest.raises(TypeError, match=r"expected max_shape=.*declare input_shapes in its ModelConfig"):
        SharedModel("bare", namespace=rt.namespace)


def test_structures_the_runtime_cannot_carry_are_a_clear_model_error(start_runtime):
    rt = start_runtime(cpu_model("nested", models.nested, max_batch_size=2))
    with SharedModel("nested", max_shape=(1, 2), namespace=rt.namespace) as m:
        with pytest.raises(ModelError, match=r"expected a tensor, or a tuple/list/dict/namedtuple of "
                                             r"at most 8 tensors.*got a dict of Tensor, tuple"):
            m(np.ones((1, 2), np.float32))
        with pytest.raises(TypeError, match=r"takes no inputs by name|unexpected keyword input 'y'"):
            m(y=np.ones((1, 2), np.float32))


def _wait_for(cond, timeout=30.0):
    """Bounded wait on a shared-memory condition (no event exists for 'a request is published')."""
    pause = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        pause.wait(0.01)
    assert cond(), "condition not reached"


def _call_in_thread(m, kwargs, results, key):
    def run():
        try:
            out = m.forward(timeout=60, **kwargs)
            results[key] = (out, m.last_timing()["batch_rows"])
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            results[key] = e
    t = threading.Thread(target=run)
    t.start()
    return t


def test_requests_with_different_names_are_never_batched_together(start_runtime, gate):
    """Two clients send requests of equal item shapes and dtypes but different input names while
    the model process is held: both are pending together, and each must come back from a batch
    of its own, called with its own names."""
    rt = start_runtime(_hf(gate=gate, wait_time=0.05))
    ns = rt.namespace
    g, a, b = (SharedModel("hf", namespace=ns) for _ in range(3))
    try:
        results = {}
        held = _call_in_thread(g, {"input_ids": np.full((1, 4), int(models.GATE), np.int64)}, results, "g")
        gate.wait_entered()
        ids_a, mask = _ids(1, 10), np.array([[1, 0, 1, 0]], np.int64)
        ids_b, types = _ids(2, 50), np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.int64)
        threads = [_call_in_thread(a, {"input_ids": ids_a, "attention_mask": mask}, results, "a"),
                   _call_in_thread(b, {"input_ids": ids_b, "token_type_ids": types}, results, "b")]
        wait_queued(a, b, n=2)   # both behind the held one
        gate.open()
        for t in [held] + threads:
            t.join(60)
        assert not isinstance(results["g"], BaseException), results["g"]
        for key, want, rows in (("a", _expect(ids_a, mask), 1), ("b", _expect(ids_b, types=types), 2)):
            got = results[key]
            assert not isinstance(got, BaseException), got
            _assert_dict_equal(got[0], want)
            assert got[1] == rows, (key, got[1])  # a batch of its own
    finally:
        for m in (g, a, b):
            m.close()


def test_forged_flags_are_rejected_or_served_correctly(start_runtime):
    """A hostile client sends flags values in its request datagrams (a valid request's layout
    with one word changed: the model process keeps layouts it validated): invalid name masks are
    rejected with a clear text, the one valid mask is served as the keyword call it says it is;
    an honest client is served throughout and no model process dies."""
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=4, model_num=2, wait_time=0.001))
    pids = _pids(rt, "affine")
    ns = rt.namespace
    x = np.full((1, 3), 2.0, np.float32)
    evil = [2, 3, -1, 1 << 47, 1 << 48, 1 << 62, 2**63 - 1, -2**63, 0x100, 0xFF, 5, 1 << 40]
    rng = np.random.default_rng(3)
    evil += [int(v) for v in rng.integers(-2**63, 2**63 - 1, 20, dtype=np.int64)]
    with SharedModel("affine", max_shape=(2, 3), namespace=ns) as honest, \
            SharedModel("affine", max_shape=(2, 3), namespace=ns, poll_interval=0.05) as hostile:
        assert honest.input_names == ("x",)
        np.testing.assert_array_equal(honest(x=x), x * 2 + 1)   # by keyword
        for value in evil + [1]:
            hostile.forward(x, timeout=10)  # a valid request first: the model keeps its layout
            (slot,) = hostile._h.idle
            (key, layout), = slot._layouts.items()   # the layout bytes this client sends
            slot._layouts[key] = layout[:8] + np.int64(value).tobytes() + layout[16:]
            if value == 1:  # "input 0 is named x": a valid keyword request
                np.testing.assert_array_equal(hostile.forward(x, timeout=10), x * 2 + 1)
            else:
                with pytest.raises(ValueError, match=r"rejected the request: request flags -?0x[0-9a-f]+: "
                                                     r"expected a mask of the model's 1 input names"):
                    hostile.forward(x, timeout=10)
            slot._layouts[key] = layout
            del slot
            h = rng.standard_normal((2, 3)).astype(np.float32)
            np.testing.assert_array_equal(honest.forward(h, timeout=10), h * 2 + 1)
            np.testing.assert_array_equal(honest(x=h, timeout=10), h * 2 + 1)
    assert _pids(rt, "affine") == pids
    assert rt.ctls["affine"].counters["bad_requests"].sum() >= len(evil)
