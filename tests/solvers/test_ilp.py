"""The HiGHS ILP against exhaustive search on random factored problems."""

import dataclasses

import numpy as np
import pytest

from _cases import seeds
from automap._solvers import (
    Factor,
    FactorProblem,
    evaluate,
    evaluate_batch,
    leanest_problem,
    random_problem,
    solve_exhaustive,
    solve_ilp,
)

# Limits cycle through none, tight (often infeasible), medium and loose.
_TIGHTNESS = [None, 0.1, 0.4, 0.8]


@pytest.mark.parametrize("seed", seeds(full=40, quick=8))
def test_ilp_matches_exhaustive(seed):
    rng = np.random.default_rng(seed)
    problem = random_problem(
        rng,
        n_units=int(rng.integers(1, 8)),
        n_time_factors=int(rng.integers(1, 12)),
        max_arity=3,
        n_points=int(rng.integers(0, 3)),
        inf_fraction=0.1,
        memory_tightness=_TIGHTNESS[seed % 4],
    )
    exact = solve_exhaustive(problem)
    ilp = solve_ilp(problem, time_limit_s=20.0)
    assert ilp.feasible == exact.feasible, (ilp.status, exact.status)
    if not exact.feasible:
        assert ilp.choices == () and not ilp.optimal
        return
    assert ilp.optimal and ilp.status == "optimal"
    assert ilp.time == pytest.approx(exact.time, rel=1e-9)
    # The ILP's plan achieves its objective under the shared evaluation.
    time, memory, feasible = evaluate(problem, ilp.choices)
    assert feasible and (time, memory) == (ilp.time, ilp.memory)
    assert memory <= problem.memory_limit * (1 + 1e-9)


def test_ilp_handles_arity_four_and_repeated_unit_sets():
    rng = np.random.default_rng(7)
    problem = random_problem(rng, n_units=5, n_time_factors=6, max_arity=4)
    # Same unit set in two orders: merged into one block of y variables.
    table = rng.random((problem.n_options[0], problem.n_options[1]))
    problem = FactorProblem(
        n_options=problem.n_options,
        allowed=problem.allowed,
        time_factors=(*problem.time_factors, Factor((0, 1), table), Factor((1, 0), table.T)),
        memory_factors=problem.memory_factors,
        memory_limit=problem.memory_limit,
        constant_time=problem.constant_time,
    )
    exact, ilp = solve_exhaustive(problem), solve_ilp(problem)
    assert ilp.feasible == exact.feasible
    if exact.feasible:
        assert ilp.time == pytest.approx(exact.time, rel=1e-9)


def test_memory_limit_binds():
    # Option 1 is faster but needs 10 bytes; the limit of 6 forces option 0.
    def problem(limit):
        return FactorProblem(
            n_options=(2, 2),
            allowed=(np.ones(2, bool), np.ones(2, bool)),
            time_factors=(Factor((0, 1), np.array([[4.0, 3.0], [2.0, 1.0]])),),
            memory_factors=(
                (Factor((0,), np.array([1.0, 10.0])), Factor((1,), np.array([5.0, 5.0]))),
            ),
            memory_limit=limit,
        )

    assert solve_ilp(problem(np.inf)).choices == (1, 1)
    tight = solve_ilp(problem(6.0))
    assert tight.choices == (0, 1) and tight.memory == 6.0 and tight.time == 3.0
    infeasible = solve_ilp(problem(5.5))
    assert not infeasible.feasible and infeasible.status == "infeasible"


def test_forbidden_combinations_and_masks():
    # Every combination but (0, 2) is forbidden; option 2 of unit 1 is masked: infeasible.
    table = np.full((2, 3), np.inf)
    table[0, 2] = 1.0
    masked = FactorProblem(
        n_options=(2, 3),
        allowed=(np.ones(2, bool), np.array([True, True, False])),
        time_factors=(Factor((0, 1), table),),
    )
    assert not solve_ilp(masked).feasible
    assert not solve_exhaustive(masked).feasible
    unmasked = FactorProblem(
        n_options=(2, 3),
        allowed=(np.ones(2, bool), np.ones(3, bool)),
        time_factors=(Factor((0, 1), table),),
    )
    assert solve_ilp(unmasked).choices == (0, 2)


def test_empty_and_trivial_problems():
    empty = FactorProblem(n_options=(), allowed=(), time_factors=(), constant_time=2.5)
    solution = solve_ilp(empty)
    assert solution.feasible and solution.optimal and solution.time == 2.5
    no_option = FactorProblem(n_options=(2,), allowed=(np.zeros(2, bool),), time_factors=())
    assert not solve_ilp(no_option).feasible


def test_ilp_is_deterministic_and_scale_free():
    rng = np.random.default_rng(3)
    problem = random_problem(rng, n_units=7, n_time_factors=14, memory_tightness=None)
    first, second = solve_ilp(problem), solve_ilp(problem)
    assert first.choices == second.choices
    # Microsecond-scale costs: scaling the objective stops HiGHS's absolute gap from ending early.
    tiny = FactorProblem(
        n_options=problem.n_options,
        allowed=problem.allowed,
        time_factors=tuple(Factor(f.units, f.table * 1e-6) for f in problem.time_factors),
    )
    assert solve_ilp(tiny).time == pytest.approx(solve_exhaustive(tiny).time, rel=1e-9)


def test_time_limit_returns_unproven_plan():
    # Dense random costs over 40 units take HiGHS minutes to prove; a short limit must come
    # back unproven, with a plan (if any) that checks feasible and a gap that says how far.
    rng = np.random.default_rng(1)
    problem = random_problem(
        rng, n_units=40, n_time_factors=120, n_points=4, n_memory_factors=20, memory_tightness=0.4
    )
    solution = solve_ilp(problem, time_limit_s=0.3)
    assert not solution.optimal and solution.status == "time limit reached"
    if solution.feasible:
        assert evaluate(problem, solution.choices)[0] == solution.time
        assert solution.gap > 0.0


@pytest.mark.parametrize("points", [1, 3])
@pytest.mark.parametrize("seed", seeds(full=20, quick=4))
def test_the_leanest_problem_finds_the_least_memory_of_the_space(seed, points):
    # With several points the leanest minimizes their peak, which is not a sum.
    rng = np.random.default_rng(seed)
    problem = random_problem(rng, n_units=5, n_points=points, inf_fraction=0.2)
    leanest = solve_ilp(leanest_problem(problem), max_nodes=1_000)
    assert leanest_problem(problem).minimize == ("peak" if points > 1 else "time")
    # Every assignment the masks allow, with a finite time (an inf time forbids it).
    grids = np.meshgrid(*(np.flatnonzero(a) for a in problem.allowed), indexing="ij")
    choices = np.stack([g.ravel() for g in grids], axis=1)
    time, memory, _ = evaluate_batch(problem, choices)
    allowed = np.isfinite(time)
    assert leanest.feasible == allowed.any()
    if allowed.any():
        assert leanest.optimal and leanest.time == pytest.approx(memory[allowed].min(), rel=1e-9)
        assert np.isfinite(evaluate(problem, leanest.choices)[0])
        # The exhaustive search agrees, and so do both under a limit that binds.
        lean = leanest_problem(problem)
        assert solve_exhaustive(lean).time == pytest.approx(leanest.time, rel=1e-9)
        limited = dataclasses.replace(lean, memory_limit=float(np.median(memory[allowed])))
        a, b = solve_ilp(limited, max_nodes=1_000), solve_exhaustive(limited)
        assert a.feasible == b.feasible and a.time == pytest.approx(b.time, rel=1e-9)
