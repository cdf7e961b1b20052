"""The shard space, its pruning, and the searchers that need no learning."""

import numpy as np
import pytest

import automap as am
from _cnn import cnn
from automap._bench import compare, speedups, to_json
from automap._cost import CostModel
from automap._search import (
    Problem,
    Tracker,
    evaluate,
    run_searcher,
    search_exhaustive,
    search_mcmc,
    search_random,
)
from automap._space import Pruning, ShardSpace, candidate_meshes
from automap._zoo import get_model


@pytest.fixture(scope="module")
def problem():
    spec = get_model("mlp", layers=3, hidden=64, features=32, classes=8, batch=16)
    return Problem.build(spec.step_fn, spec.abstract_args(), am.Cluster.preset("a100", 8), None)


def _space(problem, **pruning):
    return ShardSpace(
        problem.graph, problem.groups, problem.cluster, problem.cost_model, Pruning(**pruning)
    )


def test_candidate_meshes_and_symmetry():
    assert candidate_meshes(8) == [
        {"data": 8},
        {"data": 4, "model": 2},
        {"data": 2, "model": 4},
        {"model": 8},
    ]
    assert len(candidate_meshes(8, symmetry=False)) == 6


def test_each_pruning_shrinks_the_space(problem):
    full = _space(problem).size()
    assert full > 0
    assert _space(problem, masks=False).size() > full
    assert _space(problem, symmetry=False).size() > full
    assert _space(problem, zero=False).size() < full


def test_masks_forbid_one_axis_twice_in_a_tensor(problem):
    space = _space(problem)
    mesh = {"data": 2, "model": 4}
    for unit, neighbours in enumerate(space.neighbours):
        for other in neighbours:
            taken = [None] * len(space.units)
            taken[other] = 2  # the other unit took "model"
            assert not space.allowed(mesh, unit, taken)[2]


def test_exhaustive_is_the_optimum_of_the_space(problem):
    space = _space(problem)
    tracker = search_exhaustive(space, Tracker(budget_s=60))
    assert tracker.evaluated == space.size()
    rand = search_random(space, Tracker(budget_s=1, max_evals=300), seed=0)
    assert tracker.best_time <= rand.best_time
    assert evaluate(space, tracker.best).step_time_s == pytest.approx(tracker.best_time)


def test_exhaustive_stops_at_its_budget_and_says_it_proved_nothing(problem, monkeypatch):
    space = _space(problem)
    full = search_exhaustive(space, Tracker(budget_s=60))
    assert full.complete
    # A clock on which each evaluation takes a second: a 20 s budget runs out early.
    monkeypatch.setattr(Tracker, "elapsed", property(lambda self: float(self.evaluated)))
    cut = search_exhaustive(space, Tracker(budget_s=20))
    assert not cut.complete and cut.evaluated == 20 < full.evaluated
    plan = run_searcher(problem, "exhaustive", budget_s=20, seed=0)
    assert plan.decisions["complete"] is False
    assert plan.decisions["space_points"] == space.size()
    spec = get_model("mlp", layers=3, hidden=64, features=32, classes=8, batch=16)
    args = spec.abstract_args()
    (row,) = compare(spec.step_fn, *args, cluster=problem.cluster, searchers=["exhaustive"])
    assert "not a proven optimum" in row.note and f"of {space.size():,} points" in row.note


def test_searchers_are_deterministic_under_a_seed(problem):
    space = _space(problem)
    a = search_mcmc(space, Tracker(budget_s=1, max_evals=200), seed=3)
    b = search_mcmc(space, Tracker(budget_s=1, max_evals=200), seed=3)
    assert a.best == b.best and a.curve == b.curve
    p1 = run_searcher(problem, "random", budget_s=1.0, seed=1)
    p2 = run_searcher(problem, "random", budget_s=1.0, seed=1)
    assert p1.specs == p2.specs and p1.mesh == p2.mesh


def test_searched_plans_are_never_worse_than_experts_in_the_space(problem):
    exhaustive = run_searcher(problem, "exhaustive", budget_s=60, seed=0)
    expert = run_searcher(problem, "expert", budget_s=60, seed=0)
    assert exhaustive.predicted.step_time_s <= expert.predicted.step_time_s * (1 + 1e-9)


def test_compare_rows_and_json():
    spec = get_model("mlp", layers=2, hidden=32, features=16, classes=4, batch=8)
    cluster = am.Cluster.preset("cpu", devices=8)
    rows = compare(
        spec.step_fn,
        *spec.abstract_args(),
        cluster=cluster,
        searchers=("expert", "random", "dp"),
        budget_s=0.5,
    )
    names = [r.searcher for r in rows]
    assert names.count("expert") >= 4 and "random" in names
    dp = rows[-1]
    best_expert = min(r.step_time_s for r in rows if r.searcher == "expert" and r.feasible)
    assert dp.plan is not None and dp.feasible and dp.step_time_s <= best_expert * (1 + 1e-9)
    assert any(v is not None for v in speedups(rows).values())
    out = to_json("mlp", cluster, rows)
    assert set(out) == {"model", "cluster", "devices", "rows"}
    assert {
        "searcher",
        "plan_name",
        "step_time_s",
        "memory_bytes",
        "feasible",
        "search_time_s",
        "mfu",
        "plan",
    } <= set(out["rows"][0])


def test_tasks_choose_the_space(problem):
    import automap as am
    from automap._zoo import get_model

    spec = get_model("mlp", layers=3, hidden=64, features=32, classes=8, batch=16)
    cluster = am.Cluster.preset("a100", 8)
    for searcher in ("expert", "exhaustive"):
        plan = am.plan(
            spec.step_fn,
            *spec.abstract_args(),
            cluster=cluster,
            searcher=searcher,
            tasks=("replicate",),
        )
        assert set(plan.mesh) == {"data"}, searcher
    with pytest.raises(am.AutomapError, match="does not search pipeline plans"):
        am.plan(
            spec.step_fn,
            *spec.abstract_args(),
            cluster=cluster,
            searcher="random",  # the DQN, dp and expert searchers do search pipelines
            tasks=("pipeline",),
        )
    piped = am.plan(
        spec.step_fn, *spec.abstract_args(), cluster=cluster, searcher="expert", tasks="pipeline"
    )
    assert len(piped.stages) >= 2 and piped.mesh["pipe"] == len(piped.stages)


def _interrupt_at(monkeypatch, n: int) -> None:
    """Ctrl-C, deterministically: the n-th cost evaluation raises KeyboardInterrupt."""
    import automap._search._classic as search_module

    real, calls = search_module.evaluate, [0]

    def evaluate(space, point):
        calls[0] += 1
        if calls[0] == n:
            raise KeyboardInterrupt
        return real(space, point)

    monkeypatch.setattr(search_module, "evaluate", evaluate)


@pytest.mark.parametrize("searcher", ["random", "mcmc"])
def test_ctrl_c_keeps_the_best_plan_so_far(problem, monkeypatch, searcher):
    _interrupt_at(monkeypatch, 30)
    spec = get_model("mlp", layers=3, hidden=64, features=32, classes=8, batch=16)
    plan = am.plan(
        spec.step_fn, *spec.abstract_args(), cluster=problem.cluster, searcher=searcher,
        budget_s=60.0,
    )  # fmt: skip
    assert plan.decisions["interrupted"] is True
    assert plan.decisions["evaluated"] == 29  # stopped at once, not after the budget
    dp = am.expert_plans(spec.step_fn, *spec.abstract_args(), cluster=problem.cluster)
    assert plan.predicted.step_time_s <= dp["data_parallel"].predicted.step_time_s


def test_ctrl_c_before_any_plan_propagates(problem, monkeypatch):
    _interrupt_at(monkeypatch, 1)
    tracker = Tracker(budget_s=1.0)
    with pytest.raises(KeyboardInterrupt):
        search_random(_space(problem), tracker, seed=0)
    assert tracker.best is None and not tracker.interrupted


def test_a_seams_dense_side_splits_only_on_the_convolutions_axis():
    graph, groups = cnn()
    cluster = am.Cluster.preset("a100", 8)
    space = ShardSpace(graph, groups, cluster, CostModel(graph, cluster, groups))
    ((conv, dense),) = space.seam_units
    assert conv == 0 < dense  # the convolutions' batch is decided first
    seen = set()
    for mesh_index in range(len(space.meshes)):
        stack = [()]
        while stack:
            chosen = stack.pop()
            if len(chosen) == len(space.units):
                seen.add((space.meshes[mesh_index].get("data"), chosen[conv], chosen[dense]))
                continue
            mask = space.allowed(space.meshes[mesh_index], len(chosen), chosen)
            stack.extend((*chosen, int(k)) for k in np.flatnonzero(mask))
    assert all(d in (0, c) for _, c, d in seen)
    assert (8, 1, 0) in seen and (8, 1, 1) in seen  # one weird trick; data parallel
    # Decided the other way round (MCMC's moves), the convolutions follow the dense side.
    taken = [None] * len(space.units)
    taken[dense] = 1
    assert list(np.flatnonzero(space.allowed({"data": 8}, conv, taken))) == [1]
