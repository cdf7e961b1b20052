"""Optimal contiguous pipeline stage partition (PipeDream / DAPPLE / Alpa style), exactly.

The step time of a pipeline with S stages and M microbatches (GPipe and 1F1B alike: both
run every microbatch through every stage once forward and once backward, and their bubbles
are the same length) is

    step = sum_s tau_s + (M - 1) * max_s tau_s

where tau_s is the time stage s spends on one microbatch, forward plus backward:

    tau_s = sum_{layers i in s} t[i]  +  p[last layer of s]     (p only if s is not last)
    p[k]  = 2 * (p2p_latency + c[k] / p2p_bandwidth)

p[k] is the point-to-point traffic on the cut after layer k: activations sent forward and
their gradients sent back, both c[k] bytes, charged to the sending stage (not overlapped).
The first microbatch crosses every stage (the sum); the other M - 1 follow at the pace of
the slowest stage (the max). With equal stages that is (M + S - 1) tau: S - 1 idle slots per
stage, the bubble `_pipeline.PipelineSchedule.idle_slots` gives for both schedules.

Memory of stage s (0-based) is its layers' parameter/optimizer bytes plus the activations
it keeps for backward: sum m[i] + k_s * sum a[i], where k_s is the microbatches stage s
holds in flight under the schedule, which the caller gives (`in_flight`, from
`_pipeline.PipelineSchedule.in_flight`: M for GPipe, all forwards before any backward;
min(M, S - s) for 1F1B). A stage over the memory limit is infeasible.

The max term makes a plain DP inexact; the standard exact trick (Alpa's stage DP) is to
fix the bottleneck: for every candidate value B of a stage time, a DP finds the least
sum_s tau_s with every tau_s <= B, and the answer is the least (M - 1) * B + that sum over
all B. At the optimal partition's own bottleneck the DP finds a partition at least as good,
and no B yields a value below the true cost of the partition it finds, so this is exact.
Candidates run in increasing order, batched in numpy, and stop once (M - 1) * B plus the
unconstrained least sum cannot beat the best found.

Schedules whose bubble is not S - 1 slots (ZB-H1: each backward split into B and W, the
W's deferred into the drain, `_pipeline/_zero_bubble.py`) weigh the sum by kappa =
(1 + idle) / S, idle the schedule's `idle_slots`: with equal stages the objective is then
(M + idle) tau, the schedule's own step (kappa = 1 for GPipe and 1F1B). On unequal
stages ZB-H1's step depends on how each stage's time splits into F, B and W, which no
closed form in tau holds, so the caller may `rescore` the few best partitions by the
schedule's simulation of their per-phase times, then move one boundary at a time while
that says the step gets faster: exact for each partition timed, a local search among them.

`optimal_partition` takes any (S, L, L) table of stage times; `optimal_two_level` fills it
with the optimal intra-stage plan of every (stage, layer range) (Alpa's two levels: the
ILP inside a stage, this DP across stages). Exact too: stages do not share decisions, and
the step time only grows with each stage's time, so each stage takes its own optimum.
"""

from __future__ import annotations

import dataclasses
import time as _time
from collections.abc import Callable

import numpy as np

from ._factor import FactorProblem, Solution
from ._ilp import solve_ilp

#: Partitions a `rescore` times (the best by the closed-form objective): ZB-H1's step on
#: unequal stages is within about 10% of the objective (kappa from its bubble), so the
#: fastest by its own simulation is among the few best by the objective.
RESCORED = 8


@dataclasses.dataclass(frozen=True)
class PipelineSolution:
    """A stage partition and its cost.

    Attributes:
        stages: per stage, the half-open layer range (start, stop); `()` when infeasible.
        time: pipeline step time (the module formula); inf when infeasible.
        stage_times: tau_s per stage (seconds per microbatch, forward + backward + p2p).
        stage_memory: bytes per device of each stage (when memory tables were given).
        feasible: a partition exists within the memory limit.
        solve_time_s: wall time of the solve.
        explored: bottleneck candidates for which the DP ran.
    """

    stages: tuple[tuple[int, int], ...]
    time: float
    stage_times: tuple[float, ...]
    stage_memory: tuple[float, ...]
    feasible: bool
    solve_time_s: float
    explored: int

    @property
    def cuts(self) -> tuple[int, ...]:
        """Layer index after which each cut falls (stop - 1 of all but the last stage)."""
        return tuple(stop - 1 for _, stop in self.stages[:-1])


def pipeline_step_time(stage_times, n_microbatches: int, fill_weight: float = 1.0) -> float:
    """kappa sum_s tau_s + (M - 1) * max_s tau_s: the formula the DP minimizes (kappa =
    `fill_weight`, 1 for GPipe and 1F1B)."""
    stage_times = np.asarray(stage_times, dtype=np.float64)
    return float(fill_weight * stage_times.sum() + (n_microbatches - 1) * stage_times.max())


def stage_tables(
    layer_time,
    layer_memory,
    layer_activation,
    cut_bytes,
    *,
    n_stages: int,
    in_flight,
    p2p_bandwidth: float = np.inf,
    p2p_latency: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Stage time and memory of every (stage s, first layer i, last layer j), (S, L, L) each.

    Entries with j < i are inf. `cut_bytes[k]` is the activation size crossing the cut
    after layer k, k < L - 1. `in_flight[s]`: the microbatches of activations stage s
    holds at once under the schedule.
    """
    t = np.asarray(layer_time, dtype=np.float64)  # (L,)
    L = t.size
    m = np.asarray(layer_memory, dtype=np.float64).reshape(L)
    a = np.asarray(layer_activation, dtype=np.float64).reshape(L)
    c = np.asarray(cut_bytes, dtype=np.float64).reshape(L - 1) if L else np.zeros(0)
    p2p = np.append(2.0 * (p2p_latency + c / p2p_bandwidth), 0.0)  # (L,), no cut after last

    def range_sums(x):  # (L, L): sum of x[i..j]
        prefix = np.concatenate([[0.0], np.cumsum(x)])
        return prefix[None, 1:] - prefix[:-1, None]

    valid = np.triu(np.ones((L, L), dtype=bool))  # (L, L): j >= i
    compute = range_sums(t)
    is_last = np.arange(n_stages) == n_stages - 1  # (S,)
    time = compute[None] + np.where(is_last[:, None, None], 0.0, p2p[None, None, :])
    copies = _copies(in_flight, n_stages)  # (S,)
    memory = range_sums(m)[None] + copies[:, None, None] * range_sums(a)[None]
    time = np.where(valid[None], time, np.inf)
    memory = np.where(valid[None], memory, np.inf)
    return time, memory


def _copies(in_flight, n_stages: int) -> np.ndarray:
    """`in_flight` as (S,) counts, checked: one positive whole count per stage."""
    copies = np.asarray(in_flight, dtype=np.int64).reshape(-1)
    if copies.shape != (n_stages,) or (copies < 1).any():
        raise ValueError(
            f"in_flight must hold one count >= 1 per stage ({n_stages}), got {in_flight!r}"
        )
    return copies


def _dp(cost: np.ndarray, bounds: np.ndarray, trace: bool = False):
    """Least sum of stage times with every stage <= bound, for a batch of bounds.

    cost: (S, L, L) stage times (inf = not allowed). bounds: (nb,).
    Returns the sums (nb,) and, with `trace`, the argmin start index tables (S, nb, L).
    """
    n_stages, L, _ = cost.shape
    nb = bounds.size
    best = np.full((nb, L), np.inf)  # (nb, L): least sum covering layers 0..j
    starts = np.zeros((n_stages, nb, L), dtype=np.int64) if trace else None
    for s in range(n_stages):
        capped = np.where(cost[s][None] <= bounds[:, None, None], cost[s][None], np.inf)
        if s == 0:
            best = capped[:, 0, :]  # (nb, L): stage 0 always starts at layer 0
            continue
        before = np.concatenate([np.full((nb, 1), np.inf), best[:, :-1]], axis=1)  # (nb, L)
        total = before[:, :, None] + capped  # (nb, L start, L end)
        if trace:
            starts[s] = np.argmin(total, axis=1)
        best = total.min(axis=1)
    return best[:, L - 1], starts


def _least_bottleneck(cost: np.ndarray) -> float:
    """min over partitions of max_s tau_s (a min-max DP), inf when no partition exists."""
    n_stages, L, _ = cost.shape
    best = cost[0, 0, :]  # (L,): least bottleneck covering layers 0..j with stage 0 only
    for s in range(1, n_stages):
        before = np.concatenate([[np.inf], best[:-1]])  # (L,) by start layer
        best = np.maximum(before[:, None], cost[s]).min(axis=0)
    return float(best[L - 1])


def optimal_partition(
    stage_time,
    n_microbatches: int,
    *,
    stage_memory=None,
    memory_limit: float = np.inf,
    chunk_elements: int = 1 << 20,
    fill_weight: float = 1.0,
    rescore: Callable[[tuple[tuple[int, int], ...]], float] | None = None,
    rescored: int = RESCORED,
) -> PipelineSolution:
    """Exact least-step-time contiguous partition, from per-(stage, range) tables.

    Args:
        stage_time: (S, L, L) tau of stage s holding layers i..j (inf where not allowed).
        n_microbatches: M >= 1.
        stage_memory: optional (S, L, L) bytes of the same; entries over `memory_limit`
            (or infinite) make that stage placement infeasible.
        fill_weight: kappa in the objective (M - 1) max_s tau_s + kappa sum_s tau_s
            (`fill_weight`: 1 for GPipe and 1F1B, the module formula).
        rescore: where the schedule's step time is not that closed form (ZB-H1), a
            function of a partition's stages giving its step time: the `rescored` best
            partitions by the objective (each the least sum under one bottleneck bound)
            are timed by it, the fastest improved by moving one boundary at a time, and
            returned with the rescore's `time`.
    """
    start = _time.perf_counter()
    cost = np.array(stage_time, dtype=np.float64)
    n_stages, L, _ = cost.shape
    if n_stages < 1:
        raise ValueError(f"n_stages must be >= 1, got {n_stages}")
    if n_microbatches < 1:
        raise ValueError(f"n_microbatches must be >= 1, got {n_microbatches}")
    if not fill_weight > 0:
        raise ValueError(f"fill_weight must be > 0, got {fill_weight}")
    memory = None if stage_memory is None else np.asarray(stage_memory, dtype=np.float64)
    # A range must hold at least one layer, whatever the caller's table says below the diagonal.
    cost[:, ~np.triu(np.ones((L, L), dtype=bool))] = np.inf
    if memory is not None:
        cost[~(np.isfinite(memory) & (memory <= memory_limit))] = np.inf
    values, bounds = _explore(cost, n_microbatches, fill_weight, chunk_elements)
    explored = values.size + (n_microbatches > 1)  # the unconstrained DP ran too
    if not np.isfinite(values).any():
        return PipelineSolution((), np.inf, (), (), False, _time.perf_counter() - start, explored)
    order = np.argsort(values, kind="stable")  # ties keep the smaller bound, found first
    keep = 1 if rescore is None else max(1, rescored)
    options = []
    for k in order[:keep]:
        if np.isfinite(values[k]):
            stages = _trace(cost, float(bounds[k]))
            if stages not in (o[1] for o in options):
                options.append((float(values[k]), stages))
    if rescore is not None:
        options = [(float(rescore(stages)), stages) for _, stages in options]
    value, stages = min(options, key=lambda o: o[0])
    if rescore is not None:
        value, stages = _climb(cost, stages, value, rescore)
    times = tuple(float(cost[s, i, j - 1]) for s, (i, j) in enumerate(stages))
    mem = (
        ()
        if memory is None
        else tuple(float(memory[s, i, j - 1]) for s, (i, j) in enumerate(stages))
    )
    return PipelineSolution(
        stages=stages,
        time=value
        if rescore is not None
        else pipeline_step_time(times, n_microbatches, fill_weight),
        stage_times=times,
        stage_memory=mem,
        feasible=True,
        solve_time_s=_time.perf_counter() - start,
        explored=explored,
    )


def _explore(
    cost: np.ndarray, n_microbatches: int, fill_weight: float, chunk_elements: int
) -> tuple[np.ndarray, np.ndarray]:
    """(objective value, bottleneck bound) of every bound the DP ran for (module doc), in
    increasing order of bound, stopping once none further can beat the best found."""
    L = cost.shape[1]
    M1, kappa = n_microbatches - 1, fill_weight
    unconstrained, _ = _dp(cost, np.array([np.inf]))
    if n_microbatches == 1 or not np.isfinite(unconstrained[0]):  # no bottleneck term
        return np.array([kappa * float(unconstrained[0])]), np.array([np.inf])
    # Below the least achievable bottleneck every DP is infinite; above the bound where
    # (M - 1) * B alone, plus the least sum, exceeds a known plan, none can win.
    least_bottleneck = _least_bottleneck(cost)
    sums, _ = _dp(cost, np.array([least_bottleneck]))
    values = [M1 * least_bottleneck + kappa * float(sums[0])]
    bounds = [least_bottleneck]
    best = values[0]
    ceiling = (best - kappa * unconstrained[0]) / M1
    candidates = np.unique(cost[(cost > least_bottleneck) & (cost <= ceiling)])
    chunk = max(1, chunk_elements // max(1, L * L))
    for lo in range(0, candidates.size, chunk):
        batch = candidates[lo : lo + chunk]  # ascending
        # Any bound >= this one costs at least (M - 1) * B + the unconstrained sum.
        if M1 * batch[0] + kappa * unconstrained[0] >= best:
            break
        sums, _ = _dp(cost, batch)
        found = M1 * batch + kappa * sums
        values.extend(found.tolist())
        bounds.extend(batch.tolist())
        best = min(best, float(found.min()))
    return np.array(values), np.array(bounds)


def _climb(cost: np.ndarray, stages, value: float, rescore) -> tuple[float, tuple]:
    """Move one stage boundary a layer either way while `rescore` says the step gets
    faster (every stage kept non-empty and allowed): repeated layers make many
    partitions tie in the objective, and the DP traces only one of each tie."""
    L = cost.shape[1]
    starts = [i for i, _ in stages]
    improved = True
    while improved:
        improved = False
        for k in range(1, len(starts)):
            for step in (-1, 1):
                trial = [*starts[:k], starts[k] + step, *starts[k + 1 :]]
                stops = [*trial[1:], L]
                if not all(i < j for i, j in zip(trial, stops, strict=True)):
                    continue
                placed = tuple(zip(trial, stops, strict=True))
                if not all(np.isfinite(cost[s, i, j - 1]) for s, (i, j) in enumerate(placed)):
                    continue
                found = float(rescore(placed))
                if found < value * (1 - 1e-12):
                    starts, value, stages, improved = trial, found, placed, True
    return value, stages


def _trace(cost: np.ndarray, bound: float) -> tuple[tuple[int, int], ...]:
    """The stages of the least-sum partition with every stage time <= `bound`."""
    n_stages, L, _ = cost.shape
    _, starts = _dp(cost, np.array([bound]), trace=True)
    stages = []
    stop = L
    for s in range(n_stages - 1, -1, -1):
        first = int(starts[s, 0, stop - 1]) if s else 0
        stages.append((first, stop))
        stop = first
    return tuple(reversed(stages))


def optimal_pipeline(
    layer_time,
    layer_memory,
    layer_activation,
    cut_bytes,
    *,
    n_stages: int,
    n_microbatches: int,
    in_flight,
    memory_limit: float = np.inf,
    p2p_bandwidth: float = np.inf,
    p2p_latency: float = 0.0,
) -> PipelineSolution:
    """Exact optimal partition of L layers into `n_stages` contiguous stages.

    Args:
        layer_time: (L,) forward + backward seconds of each layer for one microbatch.
        layer_memory: (L,) parameter, gradient and optimizer bytes of each layer.
        layer_activation: (L,) activation bytes each layer keeps per microbatch.
        cut_bytes: (L - 1,) activation bytes crossing the cut after layer k.
        n_stages, n_microbatches: S, M.
        in_flight: (S,) microbatches of activations each stage holds at once under the
            schedule (`PipelineSchedule.in_flight`).
        memory_limit: bytes per device of every stage.
        p2p_bandwidth, p2p_latency: bytes/s and seconds of a stage-to-stage send.

    See the module docstring for the exact objective and memory formulas.
    """
    time, memory = stage_tables(
        layer_time,
        layer_memory,
        layer_activation,
        cut_bytes,
        n_stages=n_stages,
        in_flight=in_flight,
        p2p_bandwidth=p2p_bandwidth,
        p2p_latency=p2p_latency,
    )
    return optimal_partition(time, n_microbatches, stage_memory=memory, memory_limit=memory_limit)


def optimal_two_level(
    stage_problem: Callable[[int, int, int], FactorProblem | None],
    *,
    n_layers: int,
    n_stages: int,
    n_microbatches: int,
    p2p_time=None,
    solver: Callable[[FactorProblem], Solution] = solve_ilp,
) -> tuple[PipelineSolution, tuple[Solution, ...]]:
    """Best partition with the best intra-stage plan in every stage.

    Args:
        stage_problem: `(s, start, stop) -> FactorProblem` of stage s holding layers
            [start, stop) on its sub-mesh, with that stage's memory limit (activation copies
            of the schedule included); None where the placement is not allowed.
        n_layers, n_stages, n_microbatches: L, S, M.
        p2p_time: (L - 1,) seconds per microbatch of the cut after layer k (both
            directions), added to every stage but the last; zeros when None.
        solver: the intra-stage solver, `solve_ilp` or `solve_exhaustive`.

    Returns:
        The partition (its `stage_memory` holds each stage plan's peak memory) and the
        intra-stage plan of each of its stages. Only ranges some partition can use are
        solved: stage s starts at layer >= s and leaves a layer for each later stage.
    """
    L, S = n_layers, n_stages
    p2p = np.zeros(L) if p2p_time is None else np.append(np.asarray(p2p_time, float), 0.0)
    time = np.full((S, L, L), np.inf)
    memory = np.full((S, L, L), np.inf)
    plans: dict[tuple[int, int, int], Solution] = {}
    for s in range(S):
        for i in range(s, L - (S - s) + 1):
            for j in range(i, L - (S - s) + 1):
                problem = stage_problem(s, i, j + 1)
                if problem is None:
                    continue
                plan = solver(problem)
                if plan.feasible:
                    plans[s, i, j] = plan
                    time[s, i, j] = plan.time + (p2p[j] if s < S - 1 else 0.0)
                    memory[s, i, j] = plan.memory
    partition = optimal_partition(time, n_microbatches, stage_memory=memory)
    inner = tuple(plans[s, i, j - 1] for s, (i, j) in enumerate(partition.stages))
    return partition, inner
