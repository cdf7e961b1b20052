"""Exhaustive search and the factor model's evaluation, checked against plain Python loops."""

import itertools

import numpy as np
import pytest

from _cases import seeds
from automap._solvers import (
    Factor,
    FactorProblem,
    evaluate,
    evaluate_batch,
    memory_by_point,
    merge_factors,
    random_problem,
    solve_exhaustive,
    space_size,
)


def _slow_evaluate(problem, choices):
    """The factor model written out one entry at a time: the reference for the numpy code."""
    time = problem.constant_time
    for f in problem.time_factors:
        time += f.table[tuple(choices[u] for u in f.units)]
    points = [
        sum(f.table[tuple(choices[u] for u in f.units)] for f in point)
        for point in problem.memory_factors
    ]
    ok = all(problem.allowed[u][o] for u, o in enumerate(choices))
    ok = ok and np.isfinite(time) and all(np.isfinite(p) for p in points)
    ok = ok and all(p <= problem.memory_limit * (1 + 1e-9) for p in points)
    return time, max(points, default=0.0), bool(ok)


def _all_assignments(problem):
    return itertools.product(*(np.flatnonzero(m) for m in problem.allowed))


@pytest.mark.parametrize("seed", seeds(full=12, quick=6))
def test_exhaustive_matches_loop(seed):
    rng = np.random.default_rng(seed)
    problem = random_problem(
        rng, n_units=int(rng.integers(1, 6)), memory_tightness=[None, 0.3, 0.7][seed % 3]
    )
    best = (np.inf, None)
    for choice in _all_assignments(problem):
        time, _, ok = _slow_evaluate(problem, choice)
        if ok and time < best[0]:
            best = (time, choice)
    solution = solve_exhaustive(problem, chunk=7)  # a tiny chunk exercises the chunk seams
    assert solution.explored == space_size(problem)
    if best[1] is None:
        assert not solution.feasible and solution.choices == ()
        assert solution.status == "infeasible"
        return
    assert solution.feasible and solution.optimal and solution.gap == 0.0
    assert solution.time == pytest.approx(best[0], rel=1e-12)
    # Ties go to the first assignment in enumeration order, which the loop also keeps.
    assert solution.choices == tuple(int(c) for c in best[1])


def test_evaluate_batch_matches_loop():
    rng = np.random.default_rng(1)
    problem = random_problem(rng, n_units=5, memory_tightness=0.5)
    # Include masked and out-of-range options: they must come back infeasible.
    choices = np.stack([rng.integers(-1, n + 1, size=64) for n in problem.n_options], axis=1)
    times, peaks, feasible = evaluate_batch(problem, choices)
    for row, time, peak, ok in zip(choices, times, peaks, feasible, strict=True):
        in_range = all(0 <= o < n for o, n in zip(row, problem.n_options, strict=True))
        if not in_range:
            assert not ok
            continue
        ref_time, ref_peak, ref_ok = _slow_evaluate(problem, tuple(row))
        assert ok == ref_ok
        assert time == pytest.approx(ref_time) or time == ref_time == np.inf
        assert peak == pytest.approx(ref_peak)
        assert evaluate(problem, row) == (time, peak, ok)
        assert np.max(memory_by_point(problem, row)) == pytest.approx(peak)


def test_infinite_memory_is_forbidden_without_limit():
    problem = FactorProblem(
        n_options=(2,),
        allowed=(np.array([True, True]),),
        time_factors=(Factor((0,), np.array([1.0, 2.0])),),
        memory_factors=((Factor((0,), np.array([np.inf, 5.0])),),),
    )
    solution = solve_exhaustive(problem)
    assert solution.choices == (1,) and solution.time == 2.0 and solution.memory == 5.0


def test_space_too_large_says_use_ilp():
    problem = FactorProblem(n_options=(4,) * 12, allowed=(np.ones(4, bool),) * 12, time_factors=())
    assert space_size(problem) == 4**12
    with pytest.raises(ValueError, match=r"16,777,216 assignments.*solve_ilp"):
        solve_exhaustive(problem)


def test_empty_mask_and_empty_problem():
    masked = FactorProblem(
        n_options=(2, 3), allowed=(np.ones(2, bool), np.zeros(3, bool)), time_factors=()
    )
    assert space_size(masked) == 0
    assert not solve_exhaustive(masked).feasible
    empty = FactorProblem(n_options=(), allowed=(), time_factors=(), constant_time=3.0)
    solution = solve_exhaustive(empty)
    assert solution.feasible and solution.choices == () and solution.time == 3.0


def test_merge_factors_sorts_units_and_sums():
    rng = np.random.default_rng(0)
    a = rng.random((2, 3))
    merged = merge_factors([Factor((1, 0), a.T), Factor((0, 1), a), Factor((2,), np.ones(4))])
    assert set(merged) == {(0, 1), (2,)}
    np.testing.assert_allclose(merged[(0, 1)], 2 * a)


@pytest.mark.parametrize(
    ("units", "table", "match"),
    [
        ((0, 0), np.zeros((2, 2)), "distinct"),
        ((0,), np.zeros((2, 2)), "2-d table"),
        ((0,), np.array([0.0, np.nan]), "NaN"),
        ((0,), np.zeros(3), "expected"),
    ],
)
def test_bad_factors_are_refused(units, table, match):
    with pytest.raises(ValueError, match=match):
        FactorProblem(
            n_options=(2,), allowed=(np.ones(2, bool),), time_factors=(Factor(units, table),)
        )
