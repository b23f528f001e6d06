"""The per-row-count linear layouts: same products, measured choice, clean removal."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_model import tiny_model

from verifier_service.model import step_costs
from verifier_service.model.kv_cache import KVCache, KVCacheShape
from verifier_service.model.linear_layout import Layout, LinearLayouts
from verifier_service.model.runner import ModelRunner


def _two_layers() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(48, 80), torch.nn.Linear(80, 32, bias=False))


@pytest.mark.parametrize("layout", list(Layout))
def test_every_layout_computes_the_same_product_for_every_row_count(layout: Layout) -> None:
    model = _two_layers()
    layouts = LinearLayouts(model)
    if layout not in layouts.available:
        pytest.skip(f"{layout} is not available in this torch build")
    layouts.choose({1: layout, 4: layout, 16: layout})
    for rows in (1, 2, 3, 4, 7, 16, 17, 40):
        x = torch.randn(1, rows, 48)
        expected = F.linear(F.linear(x, model[0].weight, model[0].bias), model[1].weight)
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


def test_counts_between_measured_points_take_the_next_choice_above() -> None:
    layouts = LinearLayouts(_two_layers())
    layouts.choose({1: Layout.TRANSPOSED, 4: Layout.PACKED, 8: Layout.PLAIN, 16: Layout.TRANSPOSED})
    assert [layouts.layout_for(r) for r in (1, 2, 4, 5, 8, 9, 16, 17)] == [
        Layout.TRANSPOSED, Layout.PACKED, Layout.PACKED, Layout.PLAIN, Layout.PLAIN,
        Layout.TRANSPOSED, Layout.TRANSPOSED, Layout.PLAIN]


def test_prepacking_can_be_refused() -> None:
    assert Layout.PACKED not in LinearLayouts(_two_layers(), prepack=False).available


def test_uninstall_gives_back_the_class_forward() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    LinearLayouts(model).uninstall()
    assert "forward" not in model[0].__dict__
    # A newer installation is not undone by an older one's uninstall.
    older, newer = LinearLayouts(model), LinearLayouts(model)
    older.uninstall()
    assert model[0].__dict__["forward"].func.__self__ is newer


def test_tune_and_measure_chooses_a_layout_per_count_and_returns_every_cost() -> None:
    model = tiny_model()
    cache = KVCache(KVCacheShape.for_model(model.config, num_slots=1, capacity=512), model.dtype, model.device)
    runner = ModelRunner(model, cache)
    try:
        points = [1, 2, 3, 5, 16, 128]
        seconds = step_costs.tune_and_measure(runner, points, context_len=32, repeats=2)
        assert sorted(seconds) == points and all(s > 0 for s in seconds.values())
        assert runner.layouts is not None
        assert runner.layouts._points == points
        assert cache.num_free_slots == 1  # the probe's scratch slot was given back
    finally:
        runner.close()
    assert not any("forward" in m.__dict__ for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_every_layout_and_count_is_timed_once_a_round() -> None:
    """A machine whose speed drifts must slow every shape alike: each round times each (layout, token
    count) once, rather than all runs of one shape back to back."""
    model = tiny_model()
    cache = KVCache(KVCacheShape.for_model(model.config, num_slots=1, capacity=512), model.dtype, model.device)
    runner = ModelRunner(model, cache)
    forward, shapes = runner.forward, []

    def recorded(batch):  # noqa: ANN001, ANN202
        tokens = len(batch.input_ids)
        shapes.append((runner.layouts.layout_for(tokens), tokens))
        return forward(batch)

    runner.forward = recorded  # type: ignore[method-assign]
    try:
        seconds = step_costs.measure_layouts(runner, [1, 2, 5], context_len=32, repeats=3)
        every = [(layout, t) for t in (1, 2, 5) for layout in runner.layouts.available]
        assert shapes[0][1] == 32  # the context's prefill, once
        assert shapes[1:] == every * 4  # a warm-up of each shape, then three rounds
        assert {name: sorted(s) for name, s in seconds.items()} == {
            layout.value: [1, 2, 5] for layout in runner.layouts.available}
    finally:
        runner.close()
