"""`watch()` under torch.compile: no graph break, no recompilation, fullgraph still compiles.

Dynamo's own counters are compared for the same compiled model with and without the hook; the
hook's forward pre-hook is traced along with a module compiled in place (`module.compile()`).
"""

from __future__ import annotations

import pytest
import torch

import robust_metrics

torch_dynamo = pytest.importorskip("torch._dynamo")


def _train(compiled_in_place: bool, hooked: bool, fullgraph: bool) -> dict[str, dict[str, int]]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if compiled_in_place:
        model.compile(backend="eager", fullgraph=fullgraph)
        run = model
    else:
        run = torch.compile(model, backend="eager", fullgraph=fullgraph)
    handle = (robust_metrics.watch(model, optimizer, backend="null", run="compile", rank=0,
                                   checkpoint_signal=None) if hooked else None)
    try:
        for _ in range(4):
            loss = run(torch.randn(8, 16)).pow(2).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        if handle is not None:
            assert handle.global_step == 4
            assert not any(s.spec.name == "robust_hook_errors_total"
                           for s in handle.store.all_series())
    finally:
        if handle is not None:
            handle.close()
    return {key: dict(value) for key, value in counters.items()}


def test_the_hook_adds_no_graph_break_and_no_recompilation() -> None:
    """Dynamo's counters (graphs, captured calls, graph breaks, recompiles) are the same with
    the hook as without."""
    plain = _train(compiled_in_place=False, hooked=False, fullgraph=False)
    hooked = _train(compiled_in_place=False, hooked=True, fullgraph=False)
    assert "graph_break" not in hooked
    assert hooked == plain


def test_a_module_compiled_in_place_traces_the_hook_without_a_break() -> None:
    """`module.compile()` compiles `_call_impl`, forward hooks included: the hook's pre-hook is
    traced, and every frame compiles in one graph."""
    counters = _train(compiled_in_place=True, hooked=True, fullgraph=False)
    assert "graph_break" not in counters
    assert counters["frames"]["ok"] == counters["frames"]["total"]
    assert counters["stats"]["unique_graphs"] == 1


def test_fullgraph_still_compiles_with_the_hook() -> None:
    counters = _train(compiled_in_place=False, hooked=True, fullgraph=True)
    assert counters["stats"]["unique_graphs"] == 1
