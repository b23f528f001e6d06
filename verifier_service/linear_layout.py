"""Per row count, the faster of two layouts for the target's linear layers on a CPU.

A decode step or a short draft multiplies every weight by a handful of rows.
On CPU BLAS, `F.linear(x, W)` (x @ Wᵀ) with so few rows takes kernels that
stream the weights slowly, while the same product computed as `(W @ xᵀ)ᵀ` takes
GEMM kernels that do not: for SmolLM2 on a 2-core x86 VM, one forward of 2 to 8
tokens took 75-110 ms the first way and 45-65 ms the second, and one token,
computed as two identical rows, 30-40 ms instead of 55. Which layout wins at
which row count depends on the BLAS and the CPU, so the verifier measures both
at start-up (`step_costs.tune_and_measure`) and keeps the winner per row count.
"""

from __future__ import annotations

import bisect
import functools

import torch
import torch.nn.functional as F

# Past this many rows the products are compute-bound and both layouts take the same GEMM path.
MAX_TUNED_ROWS = 64


class LinearLayouts:
    """Installed on a model's nn.Linear modules; until `choose` is called every layer uses F.linear."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._modules = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        self._points: list[int] = []  # ascending row counts that were measured
        self._transposed: list[bool] = []  # the layout chosen at each of them
        self._forwards = [functools.partial(self._forward, m) for m in self._modules]
        for module, forward in zip(self._modules, self._forwards):
            module.forward = forward

    def uninstall(self) -> None:
        """Back to the class's own forward (unless a later LinearLayouts took the module over)."""
        for module, forward in zip(self._modules, self._forwards):
            if module.__dict__.get("forward") is forward:
                del module.forward

    def choose(self, transposed: dict[int, bool]) -> None:
        """Row count -> use (W @ xᵀ)ᵀ. Other counts take the choice of the next measured count above
        them, and F.linear above the largest."""
        self._points = sorted(transposed)
        self._transposed = [transposed[p] for p in self._points]

    def describe(self) -> str:
        return " ".join(f"{p}:{'W·xT' if t else 'x·WT'}" for p, t in zip(self._points, self._transposed))

    def _uses_transposed(self, rows: int) -> bool:
        i = bisect.bisect_left(self._points, rows)
        return i < len(self._points) and self._transposed[i]

    def _forward(self, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if not self._uses_transposed(rows):
            return F.linear(x, module.weight, module.bias)
        flat = x.reshape(rows, x.shape[-1])
        if rows == 1:  # a matrix-vector product would take the slow kernel again: compute two equal rows
            flat = torch.cat([flat, flat])
        out = torch.mm(module.weight, flat.t()).t()[:rows]
        if module.bias is not None:
            out = out + module.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])
