"""What an operator hit with the `simpledbi` command and benchmark.py: each test failed on the code before."""
from __future__ import annotations

import dataclasses
import json
import os
import secrets
import socket
import subprocess
import sys

import pytest

from simpledbi import Runtime

from . import models
from .conftest import FAST, cpu_model, stderr_lines

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _simpledbi(*args: str, cwd: str = ROOT, timeout: float = 100, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "simpledbi", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": ROOT, **(env or {})})


@pytest.mark.timeout(120)
def test_an_unknown_flag_after_a_command_shows_that_commands_usage_and_names_the_flag():
    # it printed "usage: simpledbi [-h] {serve,status,reload} ...", which lists none of serve's flags
    out = _simpledbi("serve", "--bogus", "x")
    assert out.returncode == 2, out
    assert out.stderr.startswith("usage: simpledbi serve [-h]") and "--max-batch-size" in out.stderr, out.stderr
    assert out.stderr.rstrip().endswith("simpledbi serve: error: unrecognized arguments: --bogus x"), out.stderr


def test_serve_help_describes_every_flag_with_its_default_and_says_flags_override_the_config(capsys):
    # --max-batch-size, --batching, --precision, --max-clients, --input-dtype, --mps, --log-level had no
    # help; none showed its default; nothing said whether a flag or the --config file wins
    from simpledbi.cli import _parser
    from simpledbi.config import ModelConfig
    serve = _parser().parse_args(["serve"]).parser
    for action in serve._actions:   # (argparse lists a parser's flags nowhere public)
        assert action.help, f"{action.option_strings} has no help"
        if action.dest not in ("help", "name", "config", "model"):
            assert "(default: " in action.help, f"{action.option_strings}: {action.help!r}"
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())   # (argparse wraps the lines)
    assert "A flag given overrides the same setting of the --config file" in text
    assert f"most rows in one batch (default: {ModelConfig.max_batch_size})" in text
    assert "(default: INFO)" in text and "address for /metrics (default: 0.0.0.0)" in text


def test_serve_help_of_max_clients_and_input_dtype_says_what_they_do(capsys):
    # --max-clients said "most clients (SharedModel threads) attached at once": it bounds the client
    # slots one model process maps (a slot per call in flight; idle ones unmapped to make room).
    # --input-dtype said "(default: float32)": it is optional, and without it any dtype is taken.
    from simpledbi.cli import _parser
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())   # (argparse wraps the lines)
    assert "SharedModel threads" not in text and "attached at once" not in text
    assert ("--max-clients MAX_CLIENTS client slots one model process maps at once: a slot per call in "
            "flight; idle ones are unmapped to make room (default: 512)") in text
    assert "another dtype are refused (default: float32)" not in text
    assert "(default: none: requests of any dtype are taken; clients and the warm-up use float32)" in text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("toml,words", [
    ('[[models]]\nname = "a"\nfactory = "tests.models:affine"\nmax_batch_sise = 4\n',
     "model 'a' ([[models]]): unknown setting 'max_batch_sise' (did you mean 'max_batch_size'?); "
     "expected some of name, path, factory, max_batch_size, model_num, wait_time,"),
    ('[options]\npoll_intervall = 1\n[[models]]\nname = "a"\nfactory = "tests.models:affine"\n',
     "[options]: unknown setting 'poll_intervall' (did you mean 'poll_interval'?); expected some of "
     "poll_interval, join_timeout, mps"),
    ('metrics_prot = 9100\n[[models]]\nname = "a"\nfactory = "tests.models:affine"\n',
     "unknown setting 'metrics_prot' (did you mean 'metrics_port'?); expected some of name, metrics_port,"),
])
def test_a_mistyped_setting_in_the_config_file_is_named_with_the_valid_ones_and_the_close_match(
        tmp_path, toml, words):
    # a typo under [[models]] said "unknown settings ['max_batch_sise']; expected ModelConfig fields",
    # listing none of them; [options] listed them but, like the top level, suggested nothing
    from simpledbi.cli import _parser, load_serve_config
    from simpledbi.config import ModelConfig
    cfg = tmp_path / "serve.toml"
    cfg.write_text(f'name = "x"\n{toml}')
    with pytest.raises(ValueError) as info:
        load_serve_config(_parser().parse_args(["serve", "--config", str(cfg)]))
    assert words in str(info.value), str(info.value)
    if "[[models]]" in words:
        assert str(info.value).endswith(", ".join(f.name for f in dataclasses.fields(ModelConfig))), info.value


@pytest.mark.timeout(60)
def test_a_relative_model_path_in_the_config_file_is_relative_to_the_files_directory(tmp_path, monkeypatch):
    # it was relative to the working directory: the same file served another model, or none, from elsewhere
    from simpledbi.cli import _parser, load_serve_config
    (tmp_path / "conf").mkdir()
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.pt").write_bytes(b"")
    absolute = tmp_path / "abs.pt"
    absolute.write_bytes(b"")
    cfg = tmp_path / "conf" / "serve.toml"
    cfg.write_text('name = "x"\n[[models]]\nname = "a"\npath = "../models/m.pt"\n'
                   f'[[models]]\nname = "b"\npath = "{absolute}"\n')
    monkeypatch.chdir(tmp_path / "models")   # where a path relative to the working directory would miss
    sc = load_serve_config(_parser().parse_args(["serve", "--config", os.path.relpath(cfg)]))
    assert [m.path for m in sc.models] == [str(tmp_path / "models" / "m.pt"), str(absolute)]
    cfg.write_text('name = "x"\n[[models]]\nname = "a"\npath = "m.pt"\n')
    with pytest.raises(ValueError, match=f"model 'a': no model file at '{tmp_path / 'conf' / 'm.pt'}'"):
        load_serve_config(_parser().parse_args(["serve", "--config", str(cfg)]))


@pytest.mark.timeout(120)
def test_a_metrics_port_in_use_fails_serve_before_any_model_loads(tmp_path):
    # it was found once the models had loaded (minutes for a large one), then said "[Errno 98] ..."
    pytest.importorskip("prometheus_client")
    loading = tmp_path / "loading"   # tests.models.slow_to_load touches it as it starts loading
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _simpledbi("serve", "--name", f"t{os.getpid()}-metrics", "--device", "cpu", "--model",
                         "m=tests.models:slow_to_load", "--metrics-addr", "127.0.0.1", "--metrics-port",
                         str(port), env={"SDBI_TEST_LOADING": str(loading)})
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"simpledbi serve: --metrics-port {port} on 127.0.0.1: Address already in use"], out.stderr
    assert not loading.exists()


@pytest.mark.timeout(120)
def test_status_json_check_prints_json_and_keeps_the_health_check_exit_code():
    # with no such runtime it printed "NOT READY: ..." as text; a runtime's JSON did not say "ready"
    name = f"t{os.getpid()}-{secrets.token_hex(3)}"
    out = _simpledbi("status", name, "--json", "--check")
    assert out.returncode == 1, out
    assert json.loads(out.stdout) == {"name": name, "ready": False,
                                      "error": f"no simpledbi runtime named {name!r} is running (a `simpledbi serve` "
                     f"registers its name once its models start loading, after importing their "
                     f"modules: if one is starting, try again in a few seconds)"}
    with Runtime([cpu_model("m", models.affine)], FAST, name=name):
        out = _simpledbi("status", name, "--json", "--check")
    assert out.returncode == 0, out
    got = json.loads(out.stdout)
    assert got["ready"] is True and got["name"] == name and got["models"][0]["name"] == "m"


@pytest.mark.timeout(180)
def test_reload_without_path_says_it_loaded_the_same_source_again():
    # it said "model 'm' reloaded from tests.models.affine": a dotted name no flag takes, and no word
    # that nothing new was loaded
    name = f"t{os.getpid()}-{secrets.token_hex(3)}"
    proc = subprocess.Popen([sys.executable, "-m", "simpledbi", "serve", "--name", name, "--device", "cpu",
                             "--model", "m=tests.models:affine"], cwd=ROOT, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        lines = stderr_lines(proc)
        seen = []
        while not seen or "ready" not in seen[-1]:
            seen.append(lines.get(timeout=100))
            assert seen[-1] is not None, "".join(seen[:-1])
        out = _simpledbi("reload", "m", "--runtime", name, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout == "model 'm' reloaded: its factory tests.models:affine loaded again\n"
        proc.terminate()
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


@pytest.mark.timeout(120)
def test_benchmark_mps_without_the_mps_program_exits_with_one_line(tmp_path):
    # on a host without an NVIDIA driver it ended in a RuntimeError traceback
    out = subprocess.run([sys.executable, "benchmark.py", "--mps", "--device", "cpu", "--model_path",
                          str(tmp_path / "never_built.pt")], cwd=ROOT, capture_output=True, text=True, timeout=100,
                         env={**os.environ, "PATH": str(tmp_path)})   # (no nvidia-cuda-mps-control there)
    assert out.returncode == 1, out
    assert out.stderr.strip().splitlines() == [
        "--mps: nvidia-cuda-mps-control is not on PATH: CUDA MPS needs an NVIDIA GPU and its driver "
        "(run without --mps)"], out.stderr


def test_benchmark_reports_sequences_per_second_for_the_encoder():
    # it printed "images/s" (and "per image") whatever the model
    import benchmark
    spec = benchmark.BenchSpec(model="encoder", worker_batch=4, dynamic_batch=False)
    r = {"config": dataclasses.asdict(spec), "mode": "plain", "throughput": 100.0, "requests": 250,
         "latency_ms": {"mean": 1.0, "p50": 1.0, "p90": 1.0, "p99": 1.0},
         "cpu": {"per_request_us": {"clients": 8.0, "total": 8.0}, "per_item_us": {"total": 2.0},
                 "processes": {"clients": 8}, "unread_processes": 0}}
    text = benchmark.format_report(r)
    assert "100.0 sequences/s" in text and "per sequence 2.0 us" in text and "image" not in text, text
    r["config"] = dataclasses.asdict(dataclasses.replace(spec, model="resnet18", image_size=0))
    assert "100.0 images/s" in benchmark.format_report(r) and "per image 2.0 us" in benchmark.format_report(r)
