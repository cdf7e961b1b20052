"""The pipeline stage DP against brute force over every contiguous partition."""

import itertools

import numpy as np
import pytest

from _cases import seeds
from automap._pipeline import pipeline_schedule
from automap._solvers import (
    Factor,
    FactorProblem,
    optimal_partition,
    optimal_pipeline,
    optimal_two_level,
    pipeline_step_time,
    solve_exhaustive,
)

ONE_F_ONE_B = pipeline_schedule("1f1b")


def _brute_force(t, m, a, c, *, S, M, in_flight, limit, bandwidth, latency):
    """Every placement of S - 1 cuts among L - 1 gaps, costed straight from the formulas
    (`in_flight`: the schedule's microbatches held per stage)."""
    L = len(t)
    best = (np.inf, None)
    for cuts in itertools.combinations(range(1, L), S - 1):
        bounds = (0, *cuts, L)
        times, ok = [], True
        for s in range(S):
            lo, hi = bounds[s], bounds[s + 1]
            tau = sum(t[lo:hi])
            if s < S - 1:
                tau += 2 * (latency + c[hi - 1] / bandwidth)
            ok = ok and sum(m[lo:hi]) + in_flight[s] * sum(a[lo:hi]) <= limit
            times.append(tau)
        value = sum(times) + (M - 1) * max(times)
        if ok and value < best[0]:
            best = (value, bounds)
    return best


def _random_instance(rng):
    L = int(rng.integers(1, 11))
    S = int(rng.integers(1, min(L, 4) + 1))
    # Integer-valued costs make equal stage times (ties for the bottleneck) common.
    t = rng.integers(1, 20, size=L) * 1e-3
    m = rng.integers(0, 10, size=L) * 1e8
    a = rng.integers(0, 5, size=L) * 1e7
    c = rng.integers(0, 10, size=max(L - 1, 0)) * 1e6
    M = int(rng.integers(1, 9))
    schedule = pipeline_schedule(str(rng.choice(["gpipe", "1f1b"])))
    kwargs = dict(
        S=S,
        M=M,
        in_flight=schedule.in_flight(S, M),
        bandwidth=float(rng.choice([np.inf, 1e9, 1e10])),
        latency=float(rng.choice([0.0, 1e-5])),
    )
    # A limit between the heaviest layer and the whole model: sometimes binds, sometimes
    # leaves no feasible partition.
    total = m.sum() + kwargs["M"] * a.sum()
    kwargs["limit"] = float(rng.choice([np.inf, rng.uniform(0.2, 1.0) * total]))
    return t, m, a, c, kwargs


@pytest.mark.parametrize("seed", seeds(full=150, quick=20))
def test_dp_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    t, m, a, c, kw = _random_instance(rng)
    ref_value, ref_bounds = _brute_force(t, m, a, c, **kw)
    solution = optimal_pipeline(
        t,
        m,
        a,
        c,
        n_stages=kw["S"],
        n_microbatches=kw["M"],
        in_flight=kw["in_flight"],
        memory_limit=kw["limit"],
        p2p_bandwidth=kw["bandwidth"],
        p2p_latency=kw["latency"],
    )
    if ref_bounds is None:
        assert not solution.feasible and solution.stages == () and solution.time == np.inf
        return
    assert solution.feasible
    assert solution.time == pytest.approx(ref_value, rel=1e-9)
    # The returned partition is contiguous, covers every layer, and costs what it says.
    stages = solution.stages
    assert len(stages) == kw["S"] and stages[0][0] == 0 and stages[-1][1] == len(t)
    assert all(lo < hi for lo, hi in stages)
    assert all(stages[s][1] == stages[s + 1][0] for s in range(len(stages) - 1))
    assert solution.time == pytest.approx(pipeline_step_time(solution.stage_times, kw["M"]))
    assert max(solution.stage_memory) <= kw["limit"]
    assert solution.cuts == tuple(hi - 1 for _, hi in stages[:-1])


def test_generic_tables_match_brute_force():
    # Arbitrary per-(stage, range) times, as the two-level (stage x intra-stage ILP) driver
    # will supply: no additive structure for the DP to lean on.
    rng = np.random.default_rng(0)
    for _ in range(30):
        L, S, M = int(rng.integers(2, 9)), int(rng.integers(1, 4)), int(rng.integers(1, 6))
        S = min(S, L)
        table = rng.integers(1, 30, size=(S, L, L)).astype(np.float64)
        table[rng.random((S, L, L)) < 0.1] = np.inf
        best = np.inf
        for cuts in itertools.combinations(range(1, L), S - 1):
            b = (0, *cuts, L)
            times = [table[s, b[s], b[s + 1] - 1] for s in range(S)]
            if not np.all(np.isfinite(times)):
                continue
            best = min(best, sum(times) + (M - 1) * max(times))
        solution = optimal_partition(table, M)
        assert solution.feasible == np.isfinite(best)
        if np.isfinite(best):
            assert solution.time == best


def test_schedules_differ_in_memory_only():
    t, m, a, c = [1.0] * 4, [1.0] * 4, [1.0] * 4, [0.0] * 3
    kwargs = dict(n_stages=2, n_microbatches=8)
    gpipe = optimal_pipeline(
        t, m, a, c, in_flight=pipeline_schedule("gpipe").in_flight(2, 8), **kwargs
    )
    one_f = optimal_pipeline(t, m, a, c, in_flight=ONE_F_ONE_B.in_flight(2, 8), **kwargs)
    assert gpipe.time == one_f.time == 2 * 2.0 + 7 * 2.0
    assert gpipe.stage_memory == (2.0 + 8 * 2.0, 2.0 + 8 * 2.0)
    assert one_f.stage_memory == (2.0 + 2 * 2.0, 2.0 + 1 * 2.0)
    with pytest.raises(ValueError, match="in_flight must hold one count"):
        optimal_pipeline(t, m, a, c, in_flight=(8,), **kwargs)


def test_more_stages_than_layers_is_infeasible():
    solution = optimal_pipeline(
        [1.0, 1.0],
        [0.0] * 2,
        [0.0] * 2,
        [0.0],
        n_stages=3,
        n_microbatches=2,
        in_flight=ONE_F_ONE_B.in_flight(3, 2),
    )
    assert not solution.feasible


def test_balanced_layers_split_evenly():
    solution = optimal_pipeline(
        [1.0] * 8,
        [0.0] * 8,
        [0.0] * 8,
        [0.0] * 7,
        n_stages=4,
        n_microbatches=16,
        in_flight=ONE_F_ONE_B.in_flight(4, 16),
    )
    assert solution.stages == ((0, 2), (2, 4), (4, 6), (6, 8))
    assert solution.time == 4 * 2.0 + 15 * 2.0


def test_dp_scales_to_a_hundred_layers():
    rng = np.random.default_rng(0)
    L = 96
    solution = optimal_pipeline(
        rng.uniform(1, 2, size=L) * 1e-3,
        rng.uniform(1, 2, size=L) * 1e8,
        rng.uniform(1, 2, size=L) * 1e7,
        rng.uniform(1, 2, size=L - 1) * 1e6,
        n_stages=8,
        n_microbatches=32,
        in_flight=ONE_F_ONE_B.in_flight(8, 32),
        memory_limit=4e9,
        p2p_bandwidth=1e10,
    )
    assert solution.feasible and len(solution.stages) == 8
    # It scales by pruning: of the 37,248 distinct stage times (S x L(L+1)/2), each a
    # bottleneck bound the DP (S x L^2 a run) could be run for, it runs a handful (4).
    # Counted, not timed: a wall-clock bound depends on the machine and its load.
    assert solution.explored < L


def _layered_stage_problems(rng, L, S):
    """Per-layer costs over two units each, plus a resharding factor between neighbours;
    the stage memory limit shrinks for early stages as 1F1B's activation copies would."""
    sizes = [tuple(int(x) for x in rng.integers(2, 4, size=2)) for _ in range(L + 1)]
    layers = [
        (
            n,
            rng.integers(1, 20, size=n) * 1e-3,  # time over the layer's two units
            rng.integers(1, 10, size=n[0]) * 1e8,  # memory of unit 0
            rng.integers(0, 5, size=(n[1], after[1])) * 1e-3,  # reshard to the next layer
        )
        for n, after in itertools.pairwise(sizes)
    ]
    limits = [rng.uniform(1.5, 3.5) * 1e9 / (S - s) for s in range(S)]

    def stage_problem(s, start, stop):
        n_options, time, memory = [], [], []
        for k, layer in enumerate(layers[start:stop]):
            n, table, mem, reshard = layer
            n_options += n
            time.append(Factor((2 * k, 2 * k + 1), table))
            memory.append(Factor((2 * k,), mem))
            if start + k + 1 < stop:  # the next layer's unit 1 reads this layer's unit 1
                time.append(Factor((2 * k + 1, 2 * k + 3), reshard))
        return FactorProblem(
            n_options=tuple(n_options),
            allowed=tuple(np.ones(n, bool) for n in n_options),
            time_factors=tuple(time),
            memory_factors=(tuple(memory),),
            memory_limit=limits[s],
        )

    return stage_problem


@pytest.mark.parametrize("seed", seeds(full=4, quick=2))
def test_two_level_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    L, S, M = int(rng.integers(2, 5)), int(rng.integers(1, 4)), int(rng.integers(1, 6))
    S = min(S, L)
    stage_problem = _layered_stage_problems(rng, L, S)
    p2p = rng.integers(0, 3, size=L - 1) * 1e-3
    best = np.inf
    for cuts in itertools.combinations(range(1, L), S - 1):
        b = (0, *cuts, L)
        plans = [solve_exhaustive(stage_problem(s, b[s], b[s + 1])) for s in range(S)]
        if all(p.feasible for p in plans):
            times = [
                p.time + (p2p[b[s + 1] - 1] if s < S - 1 else 0.0) for s, p in enumerate(plans)
            ]
            best = min(best, sum(times) + (M - 1) * max(times))
    partition, inner = optimal_two_level(
        stage_problem, n_layers=L, n_stages=S, n_microbatches=M, p2p_time=p2p
    )
    assert partition.feasible == np.isfinite(best)
    if np.isfinite(best):
        assert partition.time == pytest.approx(best, rel=1e-9)
        assert len(inner) == S and all(plan.optimal for plan in inner)


def test_a_fill_weight_weighs_the_sum_against_brute_force():
    # kappa sum tau + (M - 1) max tau: ZB-H1's objective, its bubble a third of 1F1B's.
    rng = np.random.default_rng(1)
    for _ in range(30):
        L, S, M = int(rng.integers(2, 9)), int(rng.integers(1, 4)), int(rng.integers(1, 6))
        S, kappa = min(S, L), float(rng.uniform(0.3, 1.0))
        table = rng.integers(1, 30, size=(S, L, L)).astype(np.float64)
        best = min(
            kappa * sum(t) + (M - 1) * max(t)
            for cuts in itertools.combinations(range(1, L), S - 1)
            for b in [(0, *cuts, L)]
            for t in [[table[s, b[s], b[s + 1] - 1] for s in range(S)]]
        )
        solution = optimal_partition(table, M, fill_weight=kappa)
        assert solution.time == pytest.approx(best)
        assert solution.time == pytest.approx(pipeline_step_time(solution.stage_times, M, kappa))
    with pytest.raises(ValueError, match="fill_weight must be > 0"):
        optimal_partition(table, 2, fill_weight=0.0)


ZB_H1 = pipeline_schedule("zb-h1")


def _zb_tables(phase_s: np.ndarray, S: int) -> np.ndarray:
    """[S, L, L, 3] (F, B, W) of stage s holding layers i..j; the first stage's backward all
    W (it sends nothing upstream), as the search's tables hold it."""
    L = len(phase_s)
    prefix = np.concatenate([np.zeros((1, 3)), np.cumsum(phase_s, 0)])
    out = np.repeat((prefix[None, 1:] - prefix[:-1, None])[None], S, 0)
    out[0, ..., 2] += out[0, ..., 1]
    out[0, ..., 1] = 0.0
    out[:, ~np.triu(np.ones((L, L), dtype=bool))] = np.inf
    return out


def _zb_step(per_phase, stages, S: int, m: int) -> float:
    times = [tuple(per_phase[s, i, j - 1]) for s, (i, j) in enumerate(stages)]
    return max(u.end for u in ZB_H1.simulate(S, m, times))


def _zb_instance(seed: int):
    """A random ZB-H1 cutting problem: per-phase tables, stages, microbatches, layers."""
    rng = np.random.default_rng(seed)
    L = int(rng.integers(3, 10))
    S = int(rng.integers(2, min(L, 4) + 1))
    m = int(rng.choice([S, 2 * S, 4 * S]))
    layers = rng.integers(0, 10, size=(L, 3)).astype(float)
    layers[:, 0] += 1  # every layer has a forward
    return _zb_tables(layers, S), S, m, L


def _zb_found_and_best(seed: int):
    """The DP rescored by ZB-H1's simulation, its closed form's choice, and the best time
    of every partition (by enumeration)."""
    per_phase, S, m, L = _zb_instance(seed)
    kappa = (1 + ZB_H1.idle_slots(S, m)) / S
    closed = optimal_partition(per_phase.sum(-1), m, fill_weight=kappa)
    found = optimal_partition(
        per_phase.sum(-1), m, fill_weight=kappa, rescore=lambda st: _zb_step(per_phase, st, S, m)
    )
    best = min(
        _zb_step(per_phase, tuple(zip((0, *c), (*c, L), strict=True)), S, m)
        for c in itertools.combinations(range(1, L), S - 1)
    )
    return per_phase, S, m, closed, found, best


@pytest.mark.parametrize("seed", seeds(full=200, quick=25))
def test_a_rescore_by_zb_h1s_simulation_is_never_worse_than_its_closed_form(seed):
    """Random per-layer (F, B, W): the DP rescored by ZB-H1's simulation returns the time
    the simulation gives its partition, never slower than the closed form's own choice,
    and never faster than the best partition (a local search, not a proof: how close it
    comes is the next test's, over many instances)."""
    per_phase, S, m, closed, found, best = _zb_found_and_best(seed)
    assert found.feasible and found.time == _zb_step(per_phase, found.stages, S, m)
    assert found.time <= _zb_step(per_phase, closed.stages, S, m)
    assert best <= found.time


def test_the_rescored_zb_h1_cuts_are_mostly_the_best():
    """Over 100 random instances the rescored DP finds the best partition in most and is
    close on average; one instance may be well off (seed 194 of 200: 12%), so no single
    instance is held to a bound."""
    gaps = np.array(
        [found.time / best - 1 for *_, found, best in map(_zb_found_and_best, range(100))]
    )
    assert (gaps < 1e-12).mean() >= 0.9 and gaps.mean() <= 0.01 and gaps.max() <= 0.25
