"""The shard ILP's own price of a point: what the price-once tests hold against the cost
model's estimate."""

from __future__ import annotations

import itertools

import numpy as np

from automap._solvers import evaluate_batch


def ilp_price(problem, n_units: int, options) -> tuple[float, float, bool]:
    """(step time, peak memory, fits) of the ILP's factors at `options` (the first
    `n_units` units' options), its auxiliary units (the combined collectives) at their
    fastest: what the MILP's objective is at that point."""
    aux = list(itertools.product(*map(range, problem.n_options[n_units:])))
    rows = np.array([[*options, *a] for a in aux]).reshape(len(aux), -1)
    time, peak, feasible = evaluate_batch(problem, rows)
    best = int(np.argmin(time))
    return float(time[best]), float(peak[best]), bool(feasible[best])
