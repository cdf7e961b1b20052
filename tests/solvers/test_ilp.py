"""The HiGHS ILP against exhaustive search on random factored problems."""

import dataclasses

import numpy as np
import pytest

from _cases import seeds
from automap._solvers import (
    Factor,
    FactorProblem,
    Overlap,
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


@pytest.mark.parametrize("seed", seeds(full=30, quick=6))
def test_overlapped_seconds_are_taken_off_once_by_every_solver(seed):
    # A collective beside compute costs max(comm, compute): the time factors charge both,
    # each Overlap takes min(comm, compute) off. The ILP's continuous column for the min
    # finds the exhaustive optimum, though the objective is no longer a sum of factors.
    rng = np.random.default_rng(seed)
    problem = random_problem(
        rng,
        n_units=int(rng.integers(2, 7)),
        n_time_factors=int(rng.integers(1, 6)),
        n_points=int(rng.integers(0, 2)),
        memory_tightness=_TIGHTNESS[seed % 4],
        n_overlaps=int(rng.integers(1, 4)),
    )
    exact = solve_exhaustive(problem)
    ilp = solve_ilp(problem, time_limit_s=20.0)
    assert ilp.feasible == exact.feasible
    if exact.feasible:
        assert ilp.optimal
        assert ilp.time == pytest.approx(exact.time, rel=1e-9, abs=1e-12)
    # evaluate: the plain sum less each overlap's min, on every assignment of the space
    plain = dataclasses.replace(problem, overlaps=())
    rows = np.stack(np.meshgrid(*map(np.arange, problem.n_options), indexing="ij"), -1)
    rows = rows.reshape(-1, problem.n_units)
    time, _, _ = evaluate_batch(problem, rows)
    full, _, _ = evaluate_batch(plain, rows)
    shared = np.zeros(len(rows))
    for o in problem.overlaps:
        comm = sum(f.table[tuple(rows[:, u] for u in f.units)] for f in o.comm)
        compute = sum(f.table[tuple(rows[:, u] for u in f.units)] for f in o.compute)
        shared += np.minimum(comm, compute)
    finite = np.isfinite(full)
    assert np.allclose(time[finite], full[finite] - shared[finite], rtol=1e-12)
    assert shared.any()  # the overlaps took something off somewhere


def test_an_overlap_over_a_constant_and_a_pair_prices_its_min():
    # Unit 0 picks the collective's bytes (2 or 5 s), units (0, 1) the compute beside it
    # (a table), a constant 1 s of compute more: the best plan is the one whose
    # comm + compute - min(comm, compute) = max is least, not whose sum is.
    comm = Factor((0,), np.array([2.0, 5.0]))
    compute = Factor((0, 1), np.array([[4.0, 0.5], [3.5, 0.0]]))
    problem = FactorProblem(
        n_options=(2, 2),
        allowed=(np.ones(2, bool), np.ones(2, bool)),
        time_factors=(comm, compute, Factor((), np.array(1.0))),
        overlaps=(Overlap((comm,), (compute, Factor((), np.array(1.0)))),),
    )
    # max(2, 4 + 1) = 5, max(2, 0.5 + 1) = 2, max(5, 3.5 + 1) = 5, max(5, 0 + 1) = 5
    assert evaluate(problem, (0, 1))[0] == pytest.approx(2.0)
    assert evaluate(problem, (1, 0))[0] == pytest.approx(5.0)
    for solve in (solve_exhaustive, solve_ilp):
        assert solve(problem).choices == (0, 1)
    with pytest.raises(ValueError, match="finite, non-negative"):
        Overlap((Factor((0,), np.array([1.0, np.inf])),), ())


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
