"""Every caller gets exactly its own result: across processes, threads, shapes, models and dtypes."""
from __future__ import annotations

import functools
import threading

import numpy as np
import pytest
import torch

from simpledbi import ModelConfig, ModelError, Run, Runtime, SharedModel

from . import models, workers
from .conftest import FAST, cpu_model, hammer_affine


@pytest.mark.timeout(120)
def test_many_workers_each_get_their_own_results():
    n_workers, n_requests = 12, 150
    results = Run(target=workers.affine_worker, worker_num=n_workers, args=(n_requests, 4, 1234),
                  models=[cpu_model("affine", models.affine, max_batch_size=16, model_num=2,
                                    wait_time=0.002)], options=FAST)
    assert results == [n_requests] * n_workers


@pytest.mark.timeout(120)
def test_requests_are_batched_under_load_with_the_fixed_policy():
    # A long wait_time: a batch closes only when full or when every attached client is pending.
    stats = Run(target=workers.load_worker, worker_num=6, args=(40, 6),
                models=[cpu_model("slow", models.slow, max_batch_size=6, wait_time=1.0,
                                  batching="fixed")], options=FAST)
    final = max(stats, key=lambda s: s["requests"])
    assert final["mean_batch_size"] > 2.0, final
    assert final["errors"] == 0


@pytest.mark.timeout(120)
def test_adaptive_policy_batches_a_closed_loop_when_a_batch_has_a_fixed_cost():
    # 20 ms per batch whatever its size, clients that come straight back: waiting for them pays,
    # so batches grow (the policy learns the cost and the clients' turnaround as it goes).
    stats = Run(target=workers.load_worker, worker_num=6, args=(40, 6, "lb"),
                models=[cpu_model("lb", models.launch_bound, max_batch_size=6, wait_time=0.1)],
                options=FAST)
    final = max(stats, key=lambda s: s["requests"])
    assert final["mean_batch_size"] > 3.0, final
    assert final["errors"] == 0


def test_threads_sharing_one_handle_get_their_own_results(start_runtime):
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=8, wait_time=0.001))
    model = SharedModel("affine", max_shape=(3, 4), namespace=rt.namespace)
    hammer_affine(model, threads=6, requests=100, max_rows=3, width=4)
    assert model.stats()["requests"] >= 600
    model.close()


def test_torch_in_torch_out_numpy_in_numpy_out(start_runtime):
    rt = start_runtime(cpu_model("affine", models.affine, max_batch_size=4))
    with SharedModel("affine", max_shape=(2, 3), namespace=rt.namespace) as model:
        t = torch.randn(2, 3)
        y = model.forward(t)
        assert isinstance(y, torch.Tensor) and torch.equal(y, t * 2 + 1)
        a = np.arange(3, dtype=np.float32).reshape(1, 3)
        z = model(a)
        assert isinstance(z, np.ndarray) and np.array_equal(z, a * 2 + 1)
        # outputs are the caller's own copies: the next call does not change them
        model.forward(np.zeros((1, 3), np.float32))
        assert np.array_equal(z, a * 2 + 1)


def test_several_inputs_and_outputs_of_several_dtypes(start_runtime):
    rt = start_runtime(cpu_model("multi", models.multi_io, max_batch_size=8, wait_time=0.001))
    with SharedModel("multi", max_shape=[(4, 5), (4, 3)], dtype=["float32", "int64"],
                     namespace=rt.namespace) as model:
        rng = np.random.default_rng(0)
        for rows in (1, 4, 2):
            a = rng.standard_normal((rows, 5)).astype(np.float32)
            b = rng.integers(-100, 100, (rows, 3))
            doubled, total = model.forward(a, b)
            assert doubled.dtype == np.float32 and total.dtype == np.float64
            np.testing.assert_array_equal(doubled, a * 2)
            np.testing.assert_allclose(total[:, 0], b.sum(1) + a.astype(np.float64).sum(1), rtol=1e-6)


def test_dynamic_item_shapes(start_runtime):
    rt = start_runtime(cpu_model("mean", models.channel_mean, max_batch_size=8, wait_time=0.001),
                       cpu_model("affine", models.affine, max_batch_size=8, wait_time=0.001))
    mean = SharedModel("mean", max_shape=(2, 3, 16, 16), namespace=rt.namespace)
    same = SharedModel("affine", max_shape=(2, 3, 16, 16), namespace=rt.namespace)
    rng = np.random.default_rng(1)
    for h, w in [(16, 16), (5, 9), (1, 1), (16, 3)]:
        x = rng.standard_normal((2, 3, h, w)).astype(np.float32)
        np.testing.assert_allclose(mean.forward(x), x.mean(axis=(2, 3)), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(same.forward(x), x * 2 + 1)
    mean.close()
    same.close()


@pytest.mark.timeout(120)
def test_concurrent_requests_of_different_shapes_are_not_mixed():
    assert Run(target=workers.mixed_shape_worker, worker_num=6,
               models=[cpu_model("affine", models.affine, max_batch_size=8, model_num=2,
                                 wait_time=0.003)], options=FAST) == [True] * 6


@pytest.mark.timeout(120)
def test_two_models_in_one_run():
    out = Run(target=workers.two_models_worker, worker_num=3,
              models=[cpu_model("affine", models.affine, max_batch_size=4),
                      cpu_model("mean", models.channel_mean, max_batch_size=4)], options=FAST)
    # Each worker reads the counters right after its 20th answer; the batch that carried it may
    # be counted a moment later (counters are written after the callers are woken): >= 19.
    assert len(out) == 3 and all(a >= 19 and m >= 19 for a, m in out)


def test_model_num_2_serves_two_batches_at_once(start_runtime, sem_prefix):
    prefix, arrived, go = sem_prefix
    rt = start_runtime(cpu_model("bar", functools.partial(models.barrier, prefix), max_batch_size=2,
                                 model_num=2, wait_time=0.0))
    model = SharedModel("bar", max_shape=(1, 3), namespace=rt.namespace)
    results, errors = {}, []

    def call(i):
        try:
            x = np.full((1, 3), i + 1, np.float32)
            results[i] = model.forward(x, timeout=60)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    # Both instances must hold a batch at the same time before either may finish.
    arrived.acquire(60)
    arrived.acquire(60)
    go.release()
    go.release()
    for t in threads:
        t.join(60)
    assert errors == [] and len(results) == 4
    for i, y in results.items():
        np.testing.assert_array_equal(y[:, :3], np.full((1, 3), (i + 1) * 2 + 1, np.float32))
    assert len({int(y[0, 3]) for y in results.values()}) == 2  # served by two processes
    model.close()


def test_attaching_sends_nothing_and_outputs_of_any_size_come_back(start_runtime):
    # No probe: output shapes come with each answer, and outputs larger than the request (64x
    # here) extend the client's segment.
    rt = start_runtime(cpu_model("mean", models.channel_mean, max_batch_size=4),
                       cpu_model("expand", models.expand, max_batch_size=4))
    with SharedModel("mean", max_shape=(2, 5, 8, 8), namespace=rt.namespace) as mean, \
            SharedModel("expand", max_shape=(2, 3), namespace=rt.namespace) as expand:
        assert mean.stats()["requests"] == 0 and expand.stats()["requests"] == 0
        x = np.ones((2, 5, 4, 4), np.float32)
        np.testing.assert_array_equal(mean.forward(x), np.ones((2, 5), np.float32))
        for rows in (1, 2, 1):
            y = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
            np.testing.assert_array_equal(expand.forward(y), np.repeat(y, 64, axis=1))


def test_torchscript_and_torch_export_files(start_runtime, tmp_path):
    import fake_resnet50
    paths = fake_resnet50.export(str(tmp_path), "both", tiny=True, name="tiny")
    rt = start_runtime(*(ModelConfig(name=f"m{i}", path=p, max_batch_size=2, device="cpu", num_threads=1)
                         for i, p in enumerate(paths)))
    x = np.random.default_rng(0).standard_normal((2, 3, 224, 224)).astype(np.float32)
    ref = fake_resnet50.build_tiny()(torch.from_numpy(x)).detach().numpy()
    for i in range(len(paths)):
        with SharedModel(f"m{i}", max_shape=(2, 3, 224, 224), namespace=rt.namespace) as model:
            np.testing.assert_allclose(model.forward(x), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.timeout(120)
def test_a_torch_export_file_with_a_fixed_batch_size_is_refused_at_load_saying_how_to_export_it(tmp_path):
    # It loaded, and the first batch of another row count failed its caller with "Guard failed:
    # x.size()[0] == 2" (helper-45), long after start-up.
    path = str(tmp_path / "fixed.pt2")
    torch.export.save(torch.export.export(models.Affine(), (torch.ones(2, 3),)), path)
    with pytest.raises(ModelError, match=r"fixed\.pt2 was exported with a fixed batch size: input 'x' "
                                           r"has 2 rows.*dynamic_shapes=\{'x': \{0: torch\.export\.Dim"):
        Runtime([ModelConfig(name="m", path=path, max_batch_size=4, device="cpu", num_threads=1)]).start()
    batch = torch.export.Dim("batch", min=1, max=64)
    torch.export.save(torch.export.export(models.Affine(), (torch.ones(2, 3),), dynamic_shapes={"x": {0: batch}}),
                      path)
    with Runtime([ModelConfig(name="m", path=path, max_batch_size=4, device="cpu", num_threads=1)]) as rt:
        with SharedModel("m", (3, 3), namespace=rt.namespace) as model:
            x = np.ones((3, 3), np.float32)
            np.testing.assert_array_equal(model.forward(x), x * 2 + 1)
