"""Pearson's chi-square tests, as scipy.stats computes them (chisquare; chi2_contingency with Yates'
correction at one degree of freedom), on torch alone: the suite does not install scipy, whose presence
makes transformers import it into every verifier process (0.7 s of each start)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upper_tail(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X chi-square with `dof` degrees of freedom: the regularized upper incomplete
    gamma function Q(dof / 2, statistic / 2)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def goodness_of_fit_p(observed: Sequence[float], expected: Sequence[float]) -> float:
    """The p-value of `observed` counts drawn at `expected` ones (the same total), len - 1 degrees of freedom."""
    assert len(observed) == len(expected) > 1
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    return upper_tail(statistic, len(observed) - 1)


def independence_p(table: Sequence[Sequence[float]]) -> float:
    """The p-value of a contingency table's rows sharing one distribution over its columns."""
    rows = [sum(row) for row in table]
    columns = [sum(column) for column in zip(*table, strict=True)]
    total = sum(rows)
    dof = (len(rows) - 1) * (len(columns) - 1)
    assert dof > 0
    statistic = 0.0
    for row, row_total in zip(table, rows, strict=True):
        for observed, column_total in zip(row, columns, strict=True):
            expected = row_total * column_total / total
            gap = abs(observed - expected)
            if dof == 1:  # Yates: each count moved half a unit towards what is expected, at most all the way
                gap -= min(0.5, gap)
            statistic += gap ** 2 / expected
    return upper_tail(statistic, dof)
