"""Exhaustive search: every allowed assignment, scored in numpy chunks.

This is the proof of optimality on small spaces and the reference the ILP is tested against,
so it is deliberately simple: no pruning whose correctness would itself need a proof.
"""

from __future__ import annotations

import dataclasses
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
    space = _DenseSpace.of(problem, chunk)
    best_time, best_index, best_peak = np.inf, None, np.inf
    for prefix in np.ndindex(*space.counts[: space.split]) if size else ():
        scored, peak = space.score(prefix)
        i = int(np.argmin(scored))  # argmin returns the first of equal minima
        # Strict < keeps the earlier prefix's plan on a tie: enumeration order decides.
        if scored[i] < best_time:
            best_time, best_peak = float(scored[i]), float(peak[i])
            best_index = prefix + np.unravel_index(i, space.suffix)

    elapsed = _time.perf_counter() - start
    if best_index is None:
        return Solution.infeasible(elapsed, size)
    return Solution(
        choices=tuple(int(space.options[u][d]) for u, d in enumerate(best_index)),
        time=best_time,
        memory=best_peak,
        feasible=True,
        optimal=True,
        gap=0.0,
        solve_time_s=elapsed,
        explored=size,
        status="optimal",
    )


_Table = tuple[tuple[int, ...], np.ndarray]
"""A factor cut down to the allowed options: (its units, its table over their options)."""


@dataclasses.dataclass(frozen=True)
class _DenseSpace:
    """The allowed assignments, as dense tensors: units [0, split) are fixed one prefix at a
    time, units [split, n) vary over a tensor of shape `suffix` (about `chunk` entries)."""

    options: list[np.ndarray]
    """Allowed option ids per unit."""
    counts: tuple[int, ...]
    """Allowed options per unit."""
    split: int
    time_factors: list[_Table]
    memory_factors: list[list[_Table]]
    """Per memory point, its factors."""
    constant_time: float
    limit: float
    """The memory limit with the solvers' shared tolerance."""
    add_peak: bool
    """Whether the score adds the peak memory (`minimize == "peak"`)."""
    overlaps: list[tuple[list[_Table], list[_Table]]] = dataclasses.field(default_factory=list)
    """Per `Overlap`, its comm and compute factors: min(comm, compute) off the time."""

    @property
    def suffix(self) -> tuple[int, ...]:
        return self.counts[self.split :]

    @classmethod
    def of(cls, problem: FactorProblem, chunk: int) -> _DenseSpace:
        options = [np.flatnonzero(mask) for mask in problem.allowed]
        counts = tuple(len(o) for o in options)
        split = next(k for k in range(problem.n_units + 1) if math.prod(counts[k:]) <= chunk)

        def restricted(factor) -> _Table:
            factor = canonical(factor)
            return factor.units, factor.table[np.ix_(*(options[u] for u in factor.units))]

        return cls(
            options=options,
            counts=counts,
            split=split,
            time_factors=[restricted(f) for f in problem.time_factors],
            memory_factors=[[restricted(f) for f in point] for point in problem.memory_factors],
            constant_time=float(problem.constant_time),
            limit=problem.memory_limit * (1.0 + MEMORY_RTOL),
            add_peak=problem.minimize == "peak",
            overlaps=[
                ([restricted(f) for f in o.comm], [restricted(f) for f in o.compute])
                for o in problem.overlaps
            ],
        )

    def dense(self, units: tuple[int, ...], table: np.ndarray, prefix: tuple[int, ...]):
        """A factor's table over the suffix tensor, the prefix's units fixed."""
        # Fixed units index to a single option (a view); the others broadcast in place.
        view = table[tuple(prefix[u] if u < self.split else slice(None) for u in units)]
        shape = [1] * len(self.suffix)
        for u in units:
            if u >= self.split:
                shape[u - self.split] = self.counts[u]
        return view.reshape(shape)

    def score(self, prefix: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """(score, peak memory) of every assignment under `prefix`, flattened in enumeration
        order; infeasible assignments score inf."""
        suffix = self.suffix
        time = np.full(suffix, self.constant_time)
        feasible = np.ones(suffix, dtype=bool)
        peak = np.zeros(suffix)
        for units, table in self.time_factors:
            time += self.dense(units, table, prefix)
        for comm, compute in self.overlaps:
            sides = [np.zeros(suffix), np.zeros(suffix)]
            for side, factors in zip(sides, (comm, compute), strict=True):
                for units, table in factors:
                    side += self.dense(units, table, prefix)
            time -= np.minimum(*sides)
        for point in self.memory_factors:
            memory = np.zeros(suffix)
            for units, table in point:
                memory += self.dense(units, table, prefix)
            # Infinite memory is a forbidden combination even when there is no limit.
            feasible &= np.isfinite(memory) & (memory <= self.limit)
            np.maximum(peak, memory, out=peak)
        feasible &= np.isfinite(time)
        if self.add_peak:
            time = time + peak
        return np.where(feasible, time, np.inf).ravel(), peak.ravel()
