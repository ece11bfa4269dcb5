"""The hook's what-if trace recorder in one process: sampled steps, a single-process trace that
loads, nothing installed with tracing off. Real gloo jobs: tests/integration/test_whatif_hook.py."""

from __future__ import annotations

from robust_metrics.analysis.whatif import analyze, load_model


def test_recorder_samples_the_same_steps_on_every_rank(tmp_path):
    from robust_metrics.hooks.trace import TraceRecorder

    recorder = TraceRecorder(trace_dir=str(tmp_path), every=10, steps=3, rank=5,
                             topology={"dp_rank": 1, "pp_rank": 2}, on_error=_raise,
                             current_step=lambda: 0)
    assert [s for s in range(25) if recorder.is_sampled(s)] == [0, 1, 2, 10, 11, 12, 20, 21, 22]
    assert (recorder.dp_rank, recorder.stage) == (1, 2)


def test_single_process_watch_writes_a_trace_that_loads(tmp_path):
    import torch

    import robust_metrics

    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with robust_metrics.watch(model, opt, backend="null", trace_dir=str(tmp_path),
                              trace_every=1, trace_steps=1, checkpoint_signal=None):
        for _ in range(3):
            for _ in range(2):  # two microbatches
                model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    model_ = load_model(tmp_path)
    assert list(model_.steps) == [0, 1, 2]
    names = {op.name for op in model_.graph.ops}
    assert {"forward-compute_1_0", "backward-compute_1_0", "optimizer_0_0", "gc_0_0"} <= names
    assert analyze(model_).slowdown > 0


def test_tracing_off_installs_nothing(tmp_path):
    import torch

    import robust_metrics
    from robust_metrics.hooks import trace

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    backward = torch.Tensor.backward
    with robust_metrics.watch(model, opt, backend="null", checkpoint_signal=None) as handle:
        assert trace._active is None
        assert handle.options.trace_every == 0
        model(torch.randn(1, 2)).sum().backward()
        opt.step()
    assert torch.Tensor.backward is backward
    assert not list(tmp_path.iterdir())


def _raise(where: str, exc: BaseException) -> None:
    raise exc
