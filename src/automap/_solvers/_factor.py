"""The factored plan space that the exact solvers work on, and its vectorized evaluation.

A plan is one option per decision *unit* (a linkage group, or a class of groups repeated
across layers). The step time is a sum of factors, each a dense table over the options of a
few units; memory per device is such a sum at each of several time points (liveness peaks)
and must stay under one limit at every point. Everything here is plain numpy so that the
solvers stay testable on random costs, far from the cost model that fills the tables
(`random_problem` makes such problems: Alpa's practice of testing solver kernels on random
costs, and the benchmark for solve times).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

# Memory sums taken in different orders (the ILP's rows, the numpy evaluation) differ in the
# last bits; this slack keeps a plan sitting exactly at the limit feasible for both.
MEMORY_RTOL = 1e-9


@dataclasses.dataclass(frozen=True)
class Factor:
    """One additive term: `table[o_0, ..., o_k-1]` for options `o_j` of `units[j]`.

    `table` has shape `tuple(n_options[u] for u in units)`, float64 seconds (or bytes for a
    memory factor); `np.inf` marks a forbidden combination. Zero units means a constant.
    """

    units: tuple[int, ...]
    table: np.ndarray

    def __post_init__(self) -> None:
        units = tuple(int(u) for u in self.units)
        if len(set(units)) != len(units):
            raise ValueError(f"factor units must be distinct, got {units}")
        table = np.asarray(self.table, dtype=np.float64)
        if table.ndim != len(units):
            raise ValueError(f"factor over {len(units)} units has a {table.ndim}-d table")
        if np.isnan(table).any() or np.isneginf(table).any():
            raise ValueError("factor table holds NaN or -inf; use +inf to forbid a combination")
        object.__setattr__(self, "units", units)
        object.__setattr__(self, "table", table)


@dataclasses.dataclass(frozen=True)
class Overlap:
    """Seconds two sums of factors share: a collective in flight while compute runs costs
    max(comm, compute) = comm + compute - min(comm, compute), so the step time (whose
    time factors charge both in full) is lowered by min(sum of `comm`, sum of `compute`).
    The tables hold finite, non-negative seconds; the ILP prices the min exactly with one
    continuous column bounded by both sums (minimizing, it rises to the smaller)."""

    comm: tuple[Factor, ...]
    compute: tuple[Factor, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "comm", tuple(self.comm))
        object.__setattr__(self, "compute", tuple(self.compute))
        for f in self.comm + self.compute:
            if not np.all(np.isfinite(f.table)) or np.any(f.table < 0):
                raise ValueError("an overlap's tables hold finite, non-negative seconds")


@dataclasses.dataclass(frozen=True)
class FactorProblem:
    """A plan space with additive costs: choose one allowed option per unit.

    Attributes:
        n_options: number of options of each unit.
        allowed: per unit, a bool mask over its options (the action masks).
        time_factors: the step time is `constant_time` plus the sum of these.
        memory_factors: one tuple of factors per time point; each point's sum is the memory
            per device at that point and must be `<= memory_limit`.
        memory_limit: bytes per device; `np.inf` for none.
        constant_time: seconds that no decision changes.
        minimize: "time", or "peak": the objective is the peak memory over the points plus
            the time sum, whose factors then only forbid (0 or `np.inf`: `leanest_problem`
            over several points, where a peak is not a sum).
        overlaps: seconds the time sum charges twice, each `Overlap`'s min taken off it.
    """

    n_options: tuple[int, ...]
    allowed: tuple[np.ndarray, ...]
    time_factors: tuple[Factor, ...]
    memory_factors: tuple[tuple[Factor, ...], ...] = ()
    memory_limit: float = np.inf
    constant_time: float = 0.0
    minimize: str = "time"
    overlaps: tuple[Overlap, ...] = ()

    def __post_init__(self) -> None:
        if self.minimize not in ("time", "peak"):
            raise ValueError(f"minimize must be 'time' or 'peak', got {self.minimize!r}")
        n_options = tuple(int(n) for n in self.n_options)
        if any(n < 1 for n in n_options):
            raise ValueError(f"every unit needs at least one option, got {n_options}")
        allowed = tuple(np.asarray(a, dtype=bool) for a in self.allowed)
        if len(allowed) != len(n_options):
            raise ValueError(f"{len(allowed)} masks for {len(n_options)} units")
        for u, (n, mask) in enumerate(zip(n_options, allowed, strict=True)):
            if mask.shape != (n,):
                raise ValueError(f"unit {u}: mask shape {mask.shape}, expected ({n},)")
        object.__setattr__(self, "n_options", n_options)
        object.__setattr__(self, "allowed", allowed)
        object.__setattr__(self, "time_factors", tuple(self.time_factors))
        object.__setattr__(self, "memory_factors", tuple(tuple(p) for p in self.memory_factors))
        object.__setattr__(self, "overlaps", tuple(self.overlaps))
        overlapped = tuple(f for o in self.overlaps for f in o.comm + o.compute)
        for factor in self.all_factors() + overlapped:
            expected = tuple(n_options[u] for u in factor.units)
            if factor.table.shape != expected:
                raise ValueError(
                    f"factor on units {factor.units}: table {factor.table.shape}, "
                    f"expected {expected}"
                )

    @property
    def n_units(self) -> int:
        return len(self.n_options)

    def all_factors(self) -> tuple[Factor, ...]:
        return self.time_factors + tuple(f for point in self.memory_factors for f in point)


@dataclasses.dataclass(frozen=True)
class Solution:
    """What a solver found.

    Attributes:
        choices: the option of each unit; `()` when no feasible plan was found.
        time: step time of `choices` under `evaluate` (inf when none).
        memory: peak memory per device of `choices` over the time points.
        feasible: `choices` respects masks, finite costs and the memory limit.
        optimal: proven optimal (exhaustive: always when feasible; ILP: HiGHS said so).
        gap: relative optimality gap the solver reports (0.0 when proven).
        solve_time_s: wall time of the solve.
        explored: assignments enumerated (exhaustive) or branch-and-bound nodes (ILP).
        status: the solver's word for how it ended.
    """

    choices: tuple[int, ...]
    time: float
    memory: float
    feasible: bool
    optimal: bool
    gap: float
    solve_time_s: float
    explored: int
    status: str

    @classmethod
    def infeasible(cls, solve_time_s: float, explored: int, status: str = "infeasible"):
        """No feasible plan: empty choices, infinite time and memory."""
        return cls((), np.inf, np.inf, False, False, np.inf, solve_time_s, explored, status)


def space_size(problem: FactorProblem) -> int:
    """Number of assignments that respect the masks (an exact Python int)."""
    return math.prod(int(mask.sum()) for mask in problem.allowed)


def evaluate_batch(
    problem: FactorProblem, choices: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Time, peak memory and feasibility of many assignments at once.

    Args:
        choices: int array of shape (n, n_units), one assignment per row.

    Returns:
        time (n,), peak memory over the time points (n,), feasible (n,) bool. Rows with an
        out-of-range or masked option are infeasible (their time and memory are still
        computed, on option 0 in place of the bad entries, to keep the arrays dense).
    """
    choices = np.asarray(choices, dtype=np.intp)  # (n, U)
    if choices.ndim != 2 or choices.shape[1] != problem.n_units:
        raise ValueError(f"expected choices of shape (n, {problem.n_units}), got {choices.shape}")
    n = choices.shape[0]
    ok = np.ones(n, dtype=bool)
    safe = choices.copy()
    for u, mask in enumerate(problem.allowed):
        column = choices[:, u]
        in_range = (column >= 0) & (column < problem.n_options[u])
        safe[:, u] = np.where(in_range, column, 0)
        ok &= in_range & mask[safe[:, u]]
    time = np.full(n, float(problem.constant_time))  # (n,)
    for factor in problem.time_factors:
        time += factor.table[tuple(safe[:, u] for u in factor.units)]
    for overlap in problem.overlaps:
        sides = [np.zeros(n), np.zeros(n)]
        for side, factors in zip(sides, (overlap.comm, overlap.compute), strict=True):
            for factor in factors:
                side += factor.table[tuple(safe[:, u] for u in factor.units)]
        time -= np.minimum(*sides)
    memory = np.zeros((len(problem.memory_factors), n))  # (points, n)
    for p, point in enumerate(problem.memory_factors):
        for factor in point:
            memory[p] += factor.table[tuple(safe[:, u] for u in factor.units)]
    peak = memory.max(axis=0) if memory.shape[0] else np.zeros(n)
    if problem.minimize == "peak":
        time = time + peak
    # Infinite memory is a forbidden combination even when there is no limit.
    within = np.isfinite(memory) & (memory <= problem.memory_limit * (1.0 + MEMORY_RTOL))
    feasible = ok & np.isfinite(time) & within.all(axis=0)
    return time, peak, feasible


def evaluate(problem: FactorProblem, choices) -> tuple[float, float, bool]:
    """`(time, peak_memory, feasible)` of one assignment."""
    choices = np.asarray(choices, dtype=np.intp)
    if choices.shape != (problem.n_units,):
        raise ValueError(f"expected {problem.n_units} choices, got shape {choices.shape}")
    time, peak, feasible = evaluate_batch(problem, choices[None, :])
    return float(time[0]), float(peak[0]), bool(feasible[0])


def memory_by_point(problem: FactorProblem, choices) -> np.ndarray:
    """Memory per device at each time point for one assignment, shape (points,)."""
    choices = np.asarray(choices, dtype=np.intp)
    return np.array(
        [
            sum((float(f.table[tuple(choices[u] for u in f.units)]) for f in point), 0.0)
            for point in problem.memory_factors
        ]
    )


def canonical(factor: Factor) -> Factor:
    """The same factor with its units sorted (table axes permuted to match)."""
    order = np.argsort(factor.units, kind="stable")
    units = tuple(factor.units[i] for i in order)
    if units == factor.units:
        return factor
    return Factor(units, np.transpose(factor.table, order))


def merge_factors(factors) -> dict[tuple[int, ...], np.ndarray]:
    """Sum the factors that share a unit set: `{sorted units: table}`.

    Order of the units inside a factor does not matter to the cost, so merging on the sorted
    tuple keeps the ILP one block of variables per distinct unit set.
    """
    merged: dict[tuple[int, ...], np.ndarray] = {}
    for factor in factors:
        factor = canonical(factor)
        if factor.units in merged:
            merged[factor.units] = merged[factor.units] + factor.table
        else:
            merged[factor.units] = factor.table.copy()
    return merged


def leanest_problem(problem: FactorProblem) -> FactorProblem:
    """The same space with its memory as the objective and no memory limit: its optimum is
    the leanest assignment, and its optimal objective that assignment's memory. The time
    factors stay for what they forbid: an infinite time entry keeps its combination out.
    One time point's memory is a sum, made the time factors; several points' peak is
    not, and the problem minimizes it (`minimize="peak"`)."""
    if len(problem.memory_factors) > 1:
        forbid = [
            Factor(f.units, np.where(np.isfinite(f.table), 0.0, np.inf))
            for f in problem.time_factors
        ]
        return FactorProblem(
            n_options=problem.n_options,
            allowed=problem.allowed,
            time_factors=tuple(forbid),
            memory_factors=problem.memory_factors,
            constant_time=0.0 if np.isfinite(problem.constant_time) else np.inf,
            minimize="peak",
        )
    if not problem.memory_factors:
        raise ValueError("the leanest assignment needs a memory time point, got none")
    time = merge_factors(problem.time_factors)
    memory = merge_factors(problem.memory_factors[0])
    factors = []
    for units in sorted(set(time) | set(memory), key=lambda u: (len(u), u)):
        shape = tuple(problem.n_options[u] for u in units)
        t, m = time.get(units, np.zeros(shape)), memory.get(units, np.zeros(shape))
        factors.append(Factor(units, np.where(np.isfinite(t), m, np.inf)))
    return FactorProblem(
        n_options=problem.n_options,
        allowed=problem.allowed,
        time_factors=tuple(factors),
        constant_time=0.0 if np.isfinite(problem.constant_time) else np.inf,
    )


# ---- random problems: the test bed on which the exact solvers are held against each other


def random_problem(
    rng: np.random.Generator,
    *,
    n_units: int = 6,
    max_options: int = 4,
    n_time_factors: int = 8,
    max_arity: int = 3,
    n_points: int = 2,
    n_memory_factors: int = 4,
    inf_fraction: float = 0.05,
    mask_fraction: float = 0.15,
    memory_tightness: float | None = 0.5,
    n_overlaps: int = 0,
) -> FactorProblem:
    """A random FactorProblem.

    Args:
        rng: the source of randomness (seed it for a reproducible problem).
        n_units: decision units; each has 2..max_options options.
        n_time_factors: time factors of random arity 1..max_arity over distinct units.
        n_points: memory time points, each with n_memory_factors random factors.
        inf_fraction: share of time entries set to inf (forbidden combinations).
        mask_fraction: share of options masked off (each unit keeps at least one).
        memory_tightness: where the limit falls between the smallest and largest possible
            memory sum (0 tight, 1 loose); None for no limit.
        n_overlaps: `Overlap`s, each of two random time factors' finite entries (a
            collective and the compute beside it), each also among the time factors.
    """
    n_options = tuple(int(n) for n in rng.integers(2, max_options + 1, size=n_units))
    allowed = []
    for n in n_options:
        mask = rng.random(n) >= mask_fraction
        if not mask.any():
            mask[rng.integers(n)] = True
        allowed.append(mask)

    def factor(scale: float, inf_share: float) -> Factor:
        arity = int(rng.integers(1, min(max_arity, n_units) + 1))
        units = tuple(int(u) for u in rng.choice(n_units, size=arity, replace=False))
        shape = tuple(n_options[u] for u in units)
        # Few distinct values make ties common, which exercises tie handling too.
        table = rng.integers(0, 50, size=shape).astype(np.float64) * scale
        table[rng.random(shape) < inf_share] = np.inf
        return Factor(units, table)

    time_factors = tuple(factor(1e-3, inf_fraction) for _ in range(n_time_factors))
    memory_factors = tuple(
        tuple(factor(1e6, 0.0) for _ in range(n_memory_factors)) for _ in range(n_points)
    )
    limit = np.inf
    if memory_tightness is not None and n_points:
        # Bounds from the per-factor extremes: the limit lands where some plans fit and
        # some do not, so the constraint actually binds.
        low = max(sum(f.table.min() for f in point) for point in memory_factors)
        high = max(sum(f.table.max() for f in point) for point in memory_factors)
        limit = float(low + memory_tightness * (high - low))
    overlaps = []
    for _ in range(n_overlaps):  # none drawn at 0: the other problems stay as they were
        comm, compute = factor(1e-3, 0.0), factor(1e-3, 0.0)
        overlaps.append(Overlap((comm,), (compute,)))
        time_factors += (comm, compute)  # charged in full, the shared part taken off
    return FactorProblem(
        n_options=n_options,
        allowed=tuple(allowed),
        time_factors=time_factors,
        memory_factors=memory_factors,
        memory_limit=limit,
        constant_time=float(rng.random()),
        overlaps=tuple(overlaps),
    )
