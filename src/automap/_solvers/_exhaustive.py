"""Exhaustive search: every allowed assignment, scored in numpy chunks.

This is the proof of optimality on small spaces and the reference the ILP is tested against,
so it is deliberately simple: no pruning whose correctness would itself need a proof.
"""

from __future__ import annotations

import time as _time

import numpy as np

from ._factor import FactorProblem, Solution, evaluate_batch, space_size

# Rows scored per numpy pass: large enough to amortize Python overhead per factor, small
# enough that the (chunk, units) index array and per-point memory stay a few MB.
_CHUNK = 1 << 16


def solve_exhaustive(
    problem: FactorProblem, *, max_size: int = 2_000_000, chunk: int = _CHUNK
) -> Solution:
    """Enumerate every assignment allowed by the masks and return the fastest feasible one.

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

    best_time = np.inf
    best_choice: np.ndarray | None = None
    best_peak = np.inf
    for lo in range(0, size, chunk):
        flat = np.arange(lo, min(lo + chunk, size))  # (c,)
        digits = np.unravel_index(flat, counts) if counts else ()
        choices = np.empty((flat.size, problem.n_units), dtype=np.intp)  # (c, U)
        for u, digit in enumerate(digits):
            choices[:, u] = options[u][digit]
        times, peaks, feasible = evaluate_batch(problem, choices)
        times = np.where(feasible, times, np.inf)
        i = int(np.argmin(times))  # argmin returns the first of equal minima
        # Strict < keeps the earlier chunk's plan on a tie: enumeration order decides.
        if feasible[i] and times[i] < best_time:
            best_time, best_choice, best_peak = float(times[i]), choices[i], float(peaks[i])

    elapsed = _time.perf_counter() - start
    if best_choice is None:
        return Solution(
            choices=(),
            time=np.inf,
            memory=np.inf,
            feasible=False,
            optimal=False,
            gap=np.inf,
            solve_time_s=elapsed,
            explored=size,
            status="infeasible",
        )
    return Solution(
        choices=tuple(int(c) for c in best_choice),
        time=best_time,
        memory=best_peak,
        feasible=True,
        optimal=True,
        gap=0.0,
        solve_time_s=elapsed,
        explored=size,
        status="optimal",
    )
