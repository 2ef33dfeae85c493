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


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["--dynamic_batch", "--no_dynamic_batch"])
def test_benchmark_cpu_smoke(tiny_model, tmp_path, mode):
    out = tmp_path / "r.json"
    cmd = [sys.executable, "benchmark.py", mode, "--model_path", tiny_model, "--device", "cpu",
           "--image_size", "32", "--worker_num", "3", "--max_batch_size", "3", "--model_num", "1",
           "--wait_time", "0.002", "--duration", "1.5", "--warmup", "0.5", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert r["requests"] > 0 and r["throughput"] > 0
    assert 0 < r["latency_ms"]["p50"] <= r["latency_ms"]["p99"]
    assert "throughput" in proc.stdout
    if mode == "--dynamic_batch":
        assert r["batches"] > 0 and 1 <= r["mean_batch_size"] <= 3
        assert sum(r["batch_size_histogram"].values()) == r["batches"]
        assert r["per_batch_ms"]["forward"]["p50"] > 0
