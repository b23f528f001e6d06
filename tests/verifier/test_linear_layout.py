"""The per-row-count linear layouts: same products, measured choice, clean removal."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tiny_model import tiny_model
from verifier_service import step_costs
from verifier_service.kv_cache import KVCache, KVCacheShape
from verifier_service.linear_layout import MAX_TUNED_ROWS, LinearLayouts
from verifier_service.model_runner import ModelRunner


def test_transposed_layout_computes_the_same_product_for_every_row_count() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 80), torch.nn.Linear(80, 32, bias=False))
    layouts = LinearLayouts(model)
    layouts.choose({1: True, 4: True, 8: False, 16: True})
    for rows in (1, 2, 3, 4, 7, 8, 9, 16, 17, 40):
        x = torch.randn(1, rows, 48)
        expected = F.linear(F.linear(x, model[0].weight, model[0].bias), model[1].weight)
        torch.testing.assert_close(model(x), expected)
    # 2..4 follow the choice at 4, 5..8 at 8, 9..16 at 16; past the largest point: F.linear.
    assert [layouts._uses_transposed(r) for r in (1, 2, 4, 5, 8, 9, 16, 17)] == [
        True, True, True, False, False, True, True, False]


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
        assert runner.layouts._points == [p for p in points if p <= MAX_TUNED_ROWS]
        assert cache.num_free_slots == 1  # the probe's scratch slot was given back
    finally:
        runner.close()
    assert not any("forward" in m.__dict__ for m in model.modules() if isinstance(m, torch.nn.Linear))
