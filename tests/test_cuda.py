"""The CUDA data path (registered shared memory, pinned staging, streams). Skipped without a GPU."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from simpledbi import ModelConfig, SharedModel

from . import models
from .conftest import hammer_affine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("gather", ["device", "host"])
def test_cuda_round_trip_with_mixed_rows_and_shapes(start_runtime, gather):
    rt = start_runtime(ModelConfig(name="affine", factory=models.affine, max_batch_size=8, model_num=2,
                                   device="cuda", gather=gather, wait_time=0.002))
    with SharedModel("affine", max_shape=(3, 4, 5), namespace=rt.namespace) as model:
        rng = np.random.default_rng(0)
        for _ in range(200):
            x = rng.standard_normal((int(rng.integers(1, 4)), int(rng.integers(1, 5)), 5)).astype(np.float32)
            np.testing.assert_array_equal(model.forward(x), x * 2 + 1)


def test_cuda_half_precision(start_runtime):
    rt = start_runtime(ModelConfig(name="mean", factory=models.channel_mean, max_batch_size=4,
                                   device="cuda", precision="float16", input_shapes=[(3, 8, 8)]))
    with SharedModel("mean", max_shape=(2, 3, 8, 8), namespace=rt.namespace) as model:
        x = np.random.default_rng(1).standard_normal((2, 3, 8, 8)).astype(np.float32)
        y = model.forward(x)
        assert y.dtype == np.float16
        np.testing.assert_allclose(y.astype(np.float32), x.mean(axis=(2, 3)), atol=1e-2)


def test_cuda_graphs_pad_and_never_leak_padding(start_runtime):
    rt = start_runtime(ModelConfig(name="affine", factory=models.affine, max_batch_size=8, device="cuda",
                                   input_shapes=[(4,)], cuda_graphs=[2, 8], wait_time=0.002))
    with SharedModel("affine", max_shape=(3, 4), namespace=rt.namespace) as model:
        rng = np.random.default_rng(2)
        for _ in range(100):
            x = rng.standard_normal((int(rng.integers(1, 4)), 4)).astype(np.float32)
            y = model.forward(x)
            assert y.shape == x.shape
            np.testing.assert_array_equal(y, x * 2 + 1)
        x = np.ones((2, 3), np.float32)  # another item shape: runs eagerly
        np.testing.assert_array_equal(model.forward(x), x * 2 + 1)


@pytest.mark.parametrize("graphs", [False, True])
def test_cuda_pipelined_batches_under_concurrency(start_runtime, graphs):
    kw = dict(input_shapes=[(6,)], cuda_graphs=True) if graphs else {}
    rt = start_runtime(ModelConfig(name="affine", factory=models.affine, max_batch_size=4, model_num=2,
                                   device="cuda", wait_time=0.001, **kw))
    model = SharedModel("affine", max_shape=(2, 6), namespace=rt.namespace)
    hammer_affine(model, threads=8, requests=300, max_rows=2, width=6)
    assert model.stats()["mean_batch_size"] > 1
    model.close()


def test_auto_cuda_graphs_fall_back_to_eager_when_capture_fails(start_runtime):
    rt = start_runtime(ModelConfig(name="sync", factory=models.syncing, max_batch_size=4, device="cuda",
                                   input_shapes=[(3,)]))  # cuda_graphs="auto" by default
    with SharedModel("sync", max_shape=(2, 3), namespace=rt.namespace) as model:
        x = np.ones((2, 3), np.float32)
        np.testing.assert_array_equal(model.forward(x), x * 2 + 1)


def _wait_for(cond, timeout=60.0):
    import time
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)  # polling a condition, with a deadline


def test_cuda_graphs_are_captured_for_the_shapes_that_arrive(start_runtime):
    """No input_shapes: batches of an item shape run eagerly at first; once a batch size has
    occurred a few times its graph is captured off the serving thread and put to use (at the
    next batch, or after a poll interval without one), and later batches replay it with the
    same answers."""
    rt = start_runtime(ModelConfig(name="affine", factory=models.affine, max_batch_size=8,
                                   device="cuda"))
    with SharedModel("affine", max_shape=(3, 4), namespace=rt.namespace) as model:
        rng = np.random.default_rng(3)
        for rows in (1, 2, 3) * 3:                                # buckets 1, 2 and 4, thrice each
            x = rng.standard_normal((rows, 4)).astype(np.float32)
            np.testing.assert_array_equal(model.forward(x), x * 2 + 1)
        _wait_for(lambda: model.stats()["cuda_graphs"] >= 3)
        for _ in range(50):
            x = rng.standard_normal((int(rng.integers(1, 4)), 4)).astype(np.float32)
            np.testing.assert_array_equal(model.forward(x), x * 2 + 1)
        x = np.ones((1, 3), np.float32)                          # a second item shape
        for _ in range(3):
            np.testing.assert_array_equal(model.forward(x), x * 2 + 1)
        _wait_for(lambda: model.stats()["cuda_graphs"] >= 4)
        np.testing.assert_array_equal(model.forward(x), x * 2 + 1)


def test_lazy_cuda_graph_capture_that_fails_leaves_the_shape_eager(start_runtime):
    rt = start_runtime(ModelConfig(name="sync", factory=models.syncing, max_batch_size=4, device="cuda"))
    with SharedModel("sync", max_shape=(2, 3), namespace=rt.namespace) as model:
        x = np.ones((2, 3), np.float32)
        for _ in range(20):
            np.testing.assert_array_equal(model.forward(x), x * 2 + 1)
        assert model.stats()["cuda_graphs"] == 0 and model.stats()["restarts"] == 0


def test_cuda_a_new_batch_size_is_padded_to_one_already_run_then_run_when_quiet(start_runtime):
    import time
    rt = start_runtime(ModelConfig(name="rows", factory=models.rows_run, max_batch_size=32, device="cuda",
                                   wait_time=0.0),
                       ModelConfig(name="plain", factory=models.rows_run, max_batch_size=32, device="cuda",
                                   cuda_graphs=False, wait_time=0.0))
    with SharedModel("plain", max_shape=(20, 4), namespace=rt.namespace) as model:
        assert model.forward(np.ones((20, 4), np.float32))[0, 0] == 20
        assert model.forward(np.ones((12, 4), np.float32)).tolist() == [[12.0]] * 12  # never padded
    with SharedModel("rows", max_shape=(20, 4), namespace=rt.namespace) as model:
        assert model.forward(np.ones((20, 4), np.float32))[0, 0] == 20    # a size never run: as is
        y = model.forward(np.ones((12, 4), np.float32))
        assert y.shape == (12, 1) and (y == 20).all()   # padded to 20 rows; 12 come back
        deadline = time.monotonic() + 30
        while model.forward(np.ones((12, 4), np.float32))[0, 0] != 12:  # run on its own when quiet
            assert time.monotonic() < deadline, "size 12 was never run on its own"
            threading.Event().wait(0.2)   # quiet: longer than the poll interval


def test_cuda_a_padded_size_under_constant_load_is_run_once_its_padding_cost_a_few_batches(start_runtime):
    """No quiet moment ever comes: the size is bought once its padding rows reach the budget."""
    from simpledbi.graphs import PAD_BUDGET_BATCHES
    rt = start_runtime(ModelConfig(name="rows", factory=models.rows_run, max_batch_size=32, device="cuda",
                                   wait_time=0.0))
    with SharedModel("rows", max_shape=(20, 4), namespace=rt.namespace) as model:
        assert model.forward(np.ones((20, 4), np.float32))[0, 0] == 20
        padded = 0
        while model.forward(np.ones((12, 4), np.float32))[0, 0] == 20:   # back to back: never quiet
            padded += 1
            assert padded <= PAD_BUDGET_BATCHES * 32 // 8, "a frequent size stayed padded"
        assert padded >= 1   # it was padded first: 12 rows had not run
        assert model.forward(np.ones((12, 4), np.float32)).tolist() == [[12.0]] * 12


def test_cuda_graphs_are_captured_off_the_serving_thread_under_constant_load(start_runtime):
    """No idle moment ever comes, and graphs still appear; answers stay exact while they do,
    from eager batches, replays, and concurrent callers on both."""
    import time
    rt = start_runtime(ModelConfig(name="affine", factory=models.affine, max_batch_size=8, device="cuda",
                                   wait_time=0.0))
    with SharedModel("affine", max_shape=(8, 5), namespace=rt.namespace) as model:
        rng = np.random.default_rng(3)
        deadline = time.monotonic() + 60
        while model.stats()["cuda_graphs"] < 2:   # back to back: the process is never quiet
            assert time.monotonic() < deadline, "no graph was captured under constant load"
            for rows in (1, 2, 3, 1, 2):
                x = rng.standard_normal((rows, 5)).astype(np.float32)
                np.testing.assert_array_equal(model.forward(x), x * 2 + 1)
        hammer_affine(model, threads=6, requests=200, max_rows=3, width=5)
        assert model.stats()["restarts"] == 0


def test_auto_cuda_graphs_capture_large_batches_of_a_launch_bound_model_only(start_runtime):
    """Batches of 20 rows (above the 8 that "auto" always captures): a model of two tiny kernels,
    which take longer to enqueue than to run, gets a graph for them; one whose forward pass is a
    long matrix product runs them eagerly."""
    rt = start_runtime(ModelConfig(name="fast", factory=models.affine, max_batch_size=32, device="cuda"),
                       ModelConfig(name="heavy", factory=models.heavy, max_batch_size=32, device="cuda"))
    x = np.random.default_rng(5).standard_normal((20, 4)).astype(np.float32)
    for name in ("fast", "heavy"):
        with SharedModel(name, max_shape=(20, 4), namespace=rt.namespace) as model:
            for _ in range(30):
                np.testing.assert_array_equal(model.forward(x), x * 2 + 1)
            if name == "fast":
                _wait_for(lambda: model.stats()["cuda_graphs"] >= 1)
                for _ in range(5):   # replayed, padded from 20 rows to its bucket
                    np.testing.assert_array_equal(model.forward(x), x * 2 + 1)
            else:
                assert model.stats()["cuda_graphs"] == 0
