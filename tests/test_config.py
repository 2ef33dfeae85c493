"""ModelConfig and RuntimeOptions refuse bad values up front, saying what was expected."""
import pytest

from simpledbi import ModelConfig, Run, RuntimeOptions


def ok(**kw):
    base = dict(name="m", factory=dict)
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize("kw,exc,words", [
    (dict(name="a b"), ValueError, "letters, digits"),
    (dict(name="m\n"), ValueError, "letters, digits"),   # (a regex "$" let a final newline in)
    (dict(name=3), TypeError, "expected str"),
    (dict(path="x.pt"), ValueError, "exactly one of path= or factory="),
    (dict(factory=None), ValueError, "exactly one of path= or factory="),
    (dict(factory=3), TypeError, "expected a callable"),
    (dict(max_batch_size=0), ValueError, "max_batch_size: expected 1..262084, got 0"),
    # (a larger one failed to load: "... is not a simpledbi v10 control block")
    (dict(max_batch_size=300000), ValueError, "max_batch_size: expected 1..262084, got 300000"),
    (dict(model_num=5000), ValueError, "model_num: expected 1..4096, got 5000"),
    (dict(max_batch_size=2.5), TypeError, "max_batch_size: expected int"),
    (dict(model_num=0), ValueError, "model_num"),
    (dict(wait_time=-1), ValueError, "wait_time"),
    (dict(wait_time=3), ValueError, "wait_time: expected 0 <= seconds <= 1 (e.g. wait_time=0.003 for 3 ms), got 3"),
    (dict(device="tpu"), ValueError, "'cpu', 'cuda', 'cuda:N' or 'auto', got 'tpu'"),
    (dict(device=[]), TypeError, "non-empty list"),
    (dict(precision="int8"), ValueError, "precision"),
    (dict(gather="magic"), ValueError, "gather"),
    (dict(input_shapes=[(3, 0)]), ValueError, "input_shapes"),
    (dict(input_shapes=[(3,)], input_dtypes=["float32", "int64"]), ValueError, "one dtype per entry"),
    (dict(input_shapes=(16,)), ValueError, "input_shapes: expected a list of item shapes"),
    (dict(input_shapes=[(3,)], input_dtypes=["flaot32"]), ValueError, "input_dtypes: expected numpy dtypes"),
    (dict(max_clients=0), ValueError, "max_clients"),
    (dict(cuda_graphs="sometimes"), ValueError, "cuda_graphs"),
    (dict(latency_target=0), ValueError, "latency_target: expected 0 < seconds"),
    (dict(latency_target="fast"), TypeError, "latency_target: expected seconds"),
    (dict(batching="greedy"), ValueError, "batching: expected 'adaptive' or 'fixed', got 'greedy'"),
])
def test_bad_model_config(kw, exc, words):
    with pytest.raises(exc, match=None) as info:
        ok(**kw)
    assert words in str(info.value)


def test_good_model_config_normalises():
    cfg = ok(device=["cuda:0", "cuda:1"], model_num=3, input_shapes=[[3, 4]], wait_time=1,
             cuda_graphs=True, max_batch_size=16)
    assert cfg.device_of(0) == "cuda:0" and cfg.device_of(1) == "cuda:1" and cfg.device_of(2) == "cuda:0"
    assert cfg.input_shapes == ((3, 4),) and isinstance(cfg.wait_time, float)
    assert cfg.cuda_graphs == (1, 2, 4, 6, 8, 10, 12, 14, 16)
    # the default captures small batches on CUDA, for the item shapes given or (lazily) those that arrive
    assert ok(input_shapes=[(3,)], max_batch_size=1).graph_batch_sizes() == (1,)
    assert ok(input_shapes=[(3,)], max_batch_size=4).graph_batch_sizes() == (1, 2, 3, 4)
    assert ok().graph_batch_sizes() == (1, 2, 4, 8)
    assert ok(cuda_graphs=False).graph_batch_sizes() == ()
    assert ok(input_shapes=[(3,)], max_batch_size=32).graph_batch_sizes() == (1, 2, 4, 8)
    assert ok(input_shapes=[(3,)], cuda_graphs=False).graph_batch_sizes() == ()
    # ... and large ones too for a model found launch-bound
    assert ok(max_batch_size=32).graph_batch_sizes(launch_bound=True) == (1, 2, 4, 8, 12, 16, 20, 24, 28, 32)
    assert ok(max_batch_size=32, cuda_graphs=[4]).graph_batch_sizes(launch_bound=True) == (4, 32)
    assert ok(cuda_graphs=False).graph_batch_sizes(launch_bound=True) == ()


def test_auto_cuda_graphs_take_large_batches_only_once_eager_ones_proved_launch_bound():
    from simpledbi.graphs import GraphsAndSizes, signature

    class Graphs(GraphsAndSizes):
        cuda = True

        def __init__(self, cfg):
            self.cfg = cfg
            self._init_graphs(cfg)

    sig = signature([(3, 112, 112)], ["float32"])
    g = Graphs(ok(max_batch_size=32))
    assert g._may_capture(sig, 8) and not g._may_capture(sig, 32)
    for _ in range(20):   # device-bound: enqueueing takes a fifth of the device time
        g._saw_eager(sig, 32, 0.002, 0.010)
    g._saw_eager(sig, 8, 0.010, 0.001)   # a small batch says nothing (its graph is always wanted)
    assert not g._may_capture(sig, 32)
    for _ in range(2):    # launch-bound: the device waits for the enqueueing
        g._saw_eager(sig, 32, 0.002, 0.002)
    assert not g._may_capture(sig, 32)   # an average, not one batch
    for _ in range(2):
        g._saw_eager(sig, 32, 0.002, 0.002)
    assert g._may_capture(sig, 32) and g._may_capture(sig, 12)
    assert not g._may_capture(signature([(3, 224, 224)], ["float32"]), 32)   # per item shape
    fixed = Graphs(ok(max_batch_size=32, cuda_graphs=[4, 32]))
    assert fixed._may_capture(sig, 32)   # sizes asked for: no proof needed


def test_bad_runtime_options_and_run_arguments():
    with pytest.raises(ValueError, match="poll_interval"):
        RuntimeOptions(poll_interval=0)
    with pytest.raises(TypeError, match="non-empty list of ModelConfig"):
        Run(target=print, worker_num=1, models=[])
    with pytest.raises(ValueError, match="unique names"):
        Run(target=print, worker_num=1, models=[ok(), ok()])
    with pytest.raises(ValueError, match="worker_num"):
        Run(target=print, worker_num=-1, models=[ok()])
    with pytest.raises(TypeError, match="target"):
        Run(target=3, worker_num=1, models=[ok()])
