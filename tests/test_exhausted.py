"""Sampling searchers end on a space they have seen all of: a point drawn again can find
nothing, and a space of one point must not be priced hundreds of thousands of times
(issue 28, item 4.2). The stop is counted in points, so it is the same on any machine."""

from __future__ import annotations

import pytest

import automap as am
from automap._search import Problem, Tracker, run_searcher, search_mcmc, search_random
from automap._space import ShardSpace
from automap._zoo import get_model

MLP = dict(layers=2, hidden=128)


def _problem(devices: int) -> Problem:
    spec = get_model("mlp", **MLP)
    cluster = am.Cluster.preset("a100", devices=devices)
    return Problem.build(spec.step_fn, spec.abstract_args(), cluster, None)


def _space(problem: Problem) -> ShardSpace:
    return ShardSpace(problem.graph, problem.groups, problem.cluster, problem.cost_model)


@pytest.mark.parametrize("searcher", ["random", "mcmc", "dqn"])
def test_a_space_of_one_point_is_priced_once(searcher):
    problem = _problem(1)
    assert _space(problem).exact_size(cap=100) == 1
    plan = run_searcher(problem, searcher, budget_s=1e6, seed=0)
    assert plan.decisions["evaluated"] == 1 and plan.decisions["exhausted"] is True


@pytest.mark.parametrize("search", [search_random, search_mcmc])
def test_a_small_space_ends_when_every_point_was_seen(search):
    problem = _problem(2)
    space = _space(problem)
    size = space.exact_size(cap=10_000)
    assert size == space.size() and size > 1
    tracker = search(space, _covered(space), seed=0)
    assert tracker.exhausted and len(tracker.seen) == size
    assert tracker.evaluated < tracker.max_evals
    # Seen every point: its best is the space's optimum.
    exhaustive = run_searcher(problem, "exhaustive", budget_s=60, seed=0)
    assert tracker.best_time == pytest.approx(exhaustive.predicted.step_time_s)
    again = search(space, _covered(space), seed=0)
    assert again.evaluated == tracker.evaluated and again.best == tracker.best


def test_a_space_too_large_to_count_runs_its_budget():
    space = _space(_problem(8))
    assert space.exact_size(cap=10) is None  # more option sequences than the cap
    tracker = Tracker(budget_s=1, max_evals=50)
    search_random(space, tracker, seed=0)
    assert tracker.evaluated == 50 and not tracker.exhausted


def _covered(space: ShardSpace) -> Tracker:
    tracker = Tracker(budget_s=1e6)
    tracker.cover(space)
    return tracker
