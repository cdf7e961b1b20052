"""Exhaustive search: every allowed assignment, scored in numpy chunks.

This is the proof of optimality on small spaces and the reference the ILP is tested against,
so it is deliberately simple: no pruning whose correctness would itself need a proof.
"""

from __future__ import annotations

import math
import time as _time

import numpy as np

from ._factor import MEMORY_RTOL, FactorProblem, Solution, canonical, space_size

# Assignments scored per numpy pass: large enough to amortize Python overhead per factor,
# small enough that the time and per-point memory arrays stay a few MB.
_CHUNK = 1 << 18


def solve_exhaustive(
    problem: FactorProblem, *, max_size: int = 2_000_000, chunk: int = _CHUNK
) -> Solution:
    """Enumerate every assignment allowed by the masks and return the fastest feasible one.

    The space is scored as dense tensors: each factor's table, cut down to allowed options,
    is broadcast-added over the units it touches (contiguous adds, no gathers). The first
    units are fixed one prefix at a time so each tensor holds at most about `chunk` entries.

    Ties go to the first assignment in enumeration order (units in index order, the last
    unit varying fastest, options in increasing order), so the result is deterministic.

    Raises:
        ValueError: the space holds more than `max_size` assignments; use `solve_ilp`.
    """
    start = _time.perf_counter()
    size = space_size(problem)
    if size > max_size:
        raise ValueError(
            f"exhaustive search over {size:,} assignments exceeds max_size={max_size:,}; "
            "use solve_ilp (exact on the same factored costs) or raise max_size"
        )
    options = [np.flatnonzero(mask) for mask in problem.allowed]  # allowed option ids per unit
    counts = tuple(len(o) for o in options)
    n_units = problem.n_units
    # Fix units [0, split) per pass; the rest, units [split, n), form the dense tensor.
    split = next(k for k in range(n_units + 1) if math.prod(counts[k:]) <= chunk)
    suffix = counts[split:]

    def restricted(factor):
        factor = canonical(factor)
        return factor.units, factor.table[np.ix_(*(options[u] for u in factor.units))]

    time_factors = [restricted(f) for f in problem.time_factors]
    memory_factors = [[restricted(f) for f in point] for point in problem.memory_factors]
    limit = problem.memory_limit * (1.0 + MEMORY_RTOL)

    def dense(units, table, prefix):
        # Fixed units index to a single option (a view); the others broadcast in place.
        view = table[tuple(prefix[u] if u < split else slice(None) for u in units)]
        shape = [1] * len(suffix)
        for u in units:
            if u >= split:
                shape[u - split] = counts[u]
        return view.reshape(shape)

    best_time, best_index, best_peak = np.inf, None, np.inf
    for prefix in np.ndindex(*counts[:split]) if size else ():
        time = np.full(suffix, float(problem.constant_time))  # (counts[split:])
        feasible = np.ones(suffix, dtype=bool)
        peak = np.zeros(suffix)
        for units, table in time_factors:
            time += dense(units, table, prefix)
        for point in memory_factors:
            memory = np.zeros(suffix)
            for units, table in point:
                memory += dense(units, table, prefix)
            # Infinite memory is a forbidden combination even when there is no limit.
            feasible &= np.isfinite(memory) & (memory <= limit)
            np.maximum(peak, memory, out=peak)
        feasible &= np.isfinite(time)
        if problem.minimize == "peak":
            time = time + peak
        scored = np.where(feasible, time, np.inf).ravel()
        i = int(np.argmin(scored))  # argmin returns the first of equal minima
        # Strict < keeps the earlier prefix's plan on a tie: enumeration order decides.
        if scored[i] < best_time:
            best_time, best_peak = float(scored[i]), float(peak.ravel()[i])
            best_index = prefix + np.unravel_index(i, suffix)

    elapsed = _time.perf_counter() - start
    if best_index is None:
        return Solution.infeasible(elapsed, size)
    return Solution(
        choices=tuple(int(options[u][d]) for u, d in enumerate(best_index)),
        time=best_time,
        memory=best_peak,
        feasible=True,
        optimal=True,
        gap=0.0,
        solve_time_s=elapsed,
        explored=size,
        status="optimal",
    )
