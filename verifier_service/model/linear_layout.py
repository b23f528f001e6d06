"""Per row count, the fastest way to run the target's linear layers on a CPU.

A decode step or a short draft multiplies every weight by a handful of rows,
and CPU BLAS picks poor kernels for that: `F.linear(x, W)` streams the weights
slowly. Two other layouts compute the same product faster at some row counts:

- TRANSPOSED: `(W @ xᵀ)ᵀ` takes MKL GEMM kernels that do not (one row is
  computed as two equal rows, since the matrix-vector path is slow again);
- PACKED: oneDNN's matmul on a copy of the weight reordered for it once at
  start-up (the copy costs as much memory as the weights, so it can be refused).

For SmolLM2 on a 2-core x86 VM (medians): one forward of 1 token took 55 ms
with F.linear, 30 with TRANSPOSED and 37-54 with PACKED; of 2 tokens 85, 31 and
44; of 9 tokens 80, 73 and 44.
Which wins where depends on the CPU and the BLAS, so the verifier measures every
layout at start-up (`step_costs.tune_and_measure`) and keeps the fastest per row count.
"""

from __future__ import annotations

import bisect
import enum
import functools
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# The row-count hint oneDNN reorders the weights for; measured: as good as 16 at 1-9 rows, better at 16-64.
PACK_ROWS_HINT = 64


class Layout(enum.Enum):
    PLAIN = "x·Wᵀ"
    TRANSPOSED = "W·xᵀ"
    PACKED = "oneDNN"


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's reordered copy of a weight, or None where this torch build has no such path.
    A tensor-parallel shard (a DTensor) packs its local part, which is what its forward multiplies."""
    weight = weight.to_local() if hasattr(weight, "to_local") else weight
    if weight.dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return None
    try:
        with torch.no_grad():
            return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
    except (AttributeError, RuntimeError):
        return None


class LinearLayouts:
    """Installed on a model's nn.Linear modules; until `choose` is called every layer uses F.linear."""

    def __init__(self, model: torch.nn.Module, prepack: bool = True, single_row_alone: bool = True) -> None:
        self._modules = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        # False: a single row is multiplied as two equal rows in every layout, so that it gets the bits
        # it gets among others (invariant_attention.py): a lone row takes another kernel.
        self._single_row_alone = single_row_alone
        packed = [_pack(m.weight) for m in self._modules] if prepack else []
        # All or nothing: a layout is chosen for the whole forward.
        self._packed = packed if packed and all(p is not None for p in packed) else None
        self._points: list[int] = []  # ascending row counts that were measured
        self._layouts: list[Layout] = []  # the layout chosen at each of them
        self._forwards = [functools.partial(self._forward, i) for i in range(len(self._modules))]
        for module, forward in zip(self._modules, self._forwards):
            module.forward = forward

    @property
    def available(self) -> list[Layout]:
        return [Layout.PLAIN, Layout.TRANSPOSED] + ([Layout.PACKED] if self._packed is not None else [])

    def uninstall(self) -> None:
        """Back to the class's own forward (unless a later LinearLayouts took the module over)."""
        for module, forward in zip(self._modules, self._forwards):
            if module.__dict__.get("forward") is forward:
                del module.forward
        self._packed = None

    def choose(self, layouts: dict[int, Layout]) -> None:
        """Row count -> layout. Other counts take the choice of the next measured count above
        them, and F.linear above the largest."""
        self._points = sorted(layouts)
        self._layouts = [layouts[p] for p in self._points]

    def table(self) -> dict[int, Layout]:
        """What `choose` was last given (empty before)."""
        return dict(zip(self._points, self._layouts))

    def drop_unused_packing(self) -> None:
        if Layout.PACKED not in self._layouts and self._packed is not None:
            self._packed = None
            log.info("oneDNN-packed weights are slower at every measured size here: freed")

    def describe(self) -> str:
        return " ".join(f"{p}:{layout.value}" for p, layout in zip(self._points, self._layouts))

    def layout_for(self, rows: int) -> Layout:
        i = bisect.bisect_left(self._points, rows)
        return self._layouts[i] if i < len(self._points) else Layout.PLAIN

    def _forward(self, index: int, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        layout = self.layout_for(rows)
        # One row goes in twice where alone it would take another kernel: TRANSPOSED's slow matrix-vector
        # path, and in every layout where rows must get the bits they get among others.
        if rows == 1 and (layout is Layout.TRANSPOSED or not self._single_row_alone):
            return self._product(index, torch.cat([x, x], dim=-2), layout)[..., :1, :]
        return self._product(index, x, layout)

    def _product(self, index: int, x: torch.Tensor, layout: Layout) -> torch.Tensor:
        module = self._modules[index]
        rows = x.numel() // x.shape[-1]
        if layout is Layout.PACKED and self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed[index], module.bias, "none", [], "")
        if layout is not Layout.TRANSPOSED:
            return F.linear(x, module.weight, module.bias)
        # Contiguous rows in and out: MKL takes the fast path only for a row-major x, and a
        # transposed result would slow every elementwise op that follows.
        flat = x.reshape(rows, x.shape[-1]).contiguous()
        out = torch.mm(module.weight, flat.t()).t().contiguous()
        if module.bias is not None:
            out = out + module.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])
