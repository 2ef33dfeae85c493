"""CPU smoke run of benchmark.py, both modes: it runs end to end and its figures add up."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    import fake_resnet50
    return fake_resnet50.export(str(tmp_path_factory.mktemp("m")), "torchscript", tiny=True, name="tiny")[0]


@pytest.fixture(scope="module")
def resnet18_model(tmp_path_factory):
    import fake_models
    return fake_models.export("resnet18", str(tmp_path_factory.mktemp("m")), "torchscript")[0]


def _run(args, out):
    cmd = [sys.executable, "benchmark.py", *args, "--device", "cpu", "--worker_num", "3",
           "--max_batch_size", "3", "--model_num", "1", "--wait_time", "0.002", "--duration", "3",
           "--warmup", "0.5", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads(out.read_text())


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["--dynamic_batch", "--no_dynamic_batch"])
def test_benchmark_cpu_smoke(tiny_model, tmp_path, mode):
    proc, r = _run([mode, "--model_path", tiny_model, "--image_size", "32"], tmp_path / "r.json")
    assert r["requests"] > 0 and r["throughput"] > 0
    assert 0 < r["latency_ms"]["p50"] <= r["latency_ms"]["p99"]
    assert "throughput" in proc.stdout and "CPU/request" in proc.stdout
    cpu = r["cpu"]
    assert cpu["requests"] == r["requests"] and cpu["window_s"] > 0
    assert cpu["processes"]["clients"] == 3 and cpu["processes"]["supervisor"] >= 1
    assert cpu["seconds"]["total"] == pytest.approx(sum(v for g, v in cpu["seconds"].items() if g != "total"))
    assert cpu["per_request_us"]["total"] > 0   # model processes or plain workers ran the forwards
    if mode == "--dynamic_batch":
        assert cpu["processes"]["model"] == 1
        assert r["batches"] > 0 and 1 <= r["mean_batch_size"] <= 3
        assert sum(r["batch_size_histogram"].values()) == r["batches"]
        assert r["per_batch_ms"]["forward"]["p50"] > 0
    else:
        assert "model" not in cpu["processes"]


@pytest.mark.timeout(180)
def test_benchmark_resnet18_smoke(resnet18_model, tmp_path):
    """--model resnet18 serves 112 x 112 images unless told otherwise (32 here, to stay cheap)."""
    _, r = _run(["--model", "resnet18", "--model_path", resnet18_model, "--image_size", "32"],
                tmp_path / "r.json")
    assert r["config"]["model"] == "resnet18" and r["config"]["image_size"] == 32
    assert r["requests"] > 0 and r["batches"] > 0


def test_model_defaults_and_shapes():
    import benchmark
    import fake_encoder
    import fake_models
    assert benchmark.BenchSpec().image_size == 224 and benchmark.BenchSpec().item_shape == (3, 224, 224)
    assert benchmark.BenchSpec(model="resnet18").item_shape == (3, 112, 112)
    assert benchmark.BenchSpec(model="resnet18", image_size=64).item_shape == (3, 64, 64)
    assert benchmark.BenchSpec(model="encoder").item_shape == (fake_encoder.SEQ, fake_encoder.D_MODEL)
    assert benchmark.parse_args([]).model == "resnet50"
    with pytest.raises(ValueError, match="expected one of"):
        fake_models.item_shape("resnet7")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["resnet18", "encoder"])
def test_fake_model_traces_with_a_dynamic_batch(tmp_path, name):
    import warnings
    import torch
    import fake_models
    path = fake_models.export(name, str(tmp_path), "torchscript")[0]
    with warnings.catch_warnings():   # TorchScript is deprecated; the benchmark serves it anyway
        warnings.simplefilter("ignore", DeprecationWarning)
        model = torch.jit.load(path)
    ref = fake_models.build(name)
    shape = fake_models.item_shape(name, 32)
    for batch in (1, 3):
        x = torch.randn(batch, *shape)
        with torch.inference_mode():
            y = model(x)
            assert y.shape[0] == batch and torch.allclose(y, ref(x), atol=1e-4)
