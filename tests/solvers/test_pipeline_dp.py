"""The pipeline stage DP against brute force over every contiguous partition."""

import itertools

import numpy as np
import pytest

from automap._solvers import (
    activation_copies,
    optimal_partition,
    optimal_pipeline,
    pipeline_step_time,
)


def _brute_force(t, m, a, c, *, S, M, schedule, limit, bandwidth, latency):
    """Every placement of S - 1 cuts among L - 1 gaps, costed straight from the formulas."""
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
            copies = M if schedule == "gpipe" else min(M, S - s)
            ok = ok and sum(m[lo:hi]) + copies * sum(a[lo:hi]) <= limit
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
    kwargs = dict(
        S=S,
        M=int(rng.integers(1, 9)),
        schedule=str(rng.choice(["gpipe", "1f1b"])),
        bandwidth=float(rng.choice([np.inf, 1e9, 1e10])),
        latency=float(rng.choice([0.0, 1e-5])),
    )
    # A limit between the heaviest layer and the whole model: sometimes binds, sometimes
    # leaves no feasible partition.
    total = m.sum() + kwargs["M"] * a.sum()
    kwargs["limit"] = float(rng.choice([np.inf, rng.uniform(0.2, 1.0) * total]))
    return t, m, a, c, kwargs


@pytest.mark.parametrize("seed", range(150))
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
        schedule=kw["schedule"],
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
    gpipe = optimal_pipeline(t, m, a, c, schedule="gpipe", **kwargs)
    one_f = optimal_pipeline(t, m, a, c, schedule="1f1b", **kwargs)
    assert gpipe.time == one_f.time == 2 * 2.0 + 7 * 2.0
    assert gpipe.stage_memory == (2.0 + 8 * 2.0, 2.0 + 8 * 2.0)
    assert one_f.stage_memory == (2.0 + 2 * 2.0, 2.0 + 1 * 2.0)
    assert activation_copies(4, 2, "1f1b").tolist() == [2, 2, 2, 1]
    with pytest.raises(ValueError, match="schedule"):
        activation_copies(2, 2, "zero-bubble")


def test_more_stages_than_layers_is_infeasible():
    solution = optimal_pipeline(
        [1.0, 1.0], [0.0] * 2, [0.0] * 2, [0.0], n_stages=3, n_microbatches=2
    )
    assert not solution.feasible


def test_balanced_layers_split_evenly():
    solution = optimal_pipeline(
        [1.0] * 8, [0.0] * 8, [0.0] * 8, [0.0] * 7, n_stages=4, n_microbatches=16
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
        memory_limit=4e9,
        p2p_bandwidth=1e10,
    )
    assert solution.feasible and len(solution.stages) == 8
    assert solution.solve_time_s < 5.0
