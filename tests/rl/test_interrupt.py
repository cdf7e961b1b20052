"""Ctrl-C during a DQN search keeps the best plan so far instead of losing the search.

KeyboardInterrupt is raised deterministically from a callback or a cost evaluation after a
set number of calls: no real signals, so the tests are exact and quick.
"""

import pytest

import automap as am
from automap._space import ShardSpace
from automap._zoo import get_model
from automap.rl import search

from .toy import SMALL, AssignmentProcess


def test_search_keeps_the_best_plan_when_interrupted():
    def on_episode(episode, best, current, exploration, loss):
        if episode == 5:
            raise KeyboardInterrupt

    process = AssignmentProcess(seed=0)
    result = search(process, budget_s=60, config=SMALL, on_episode=on_episode)
    assert result.interrupted and result.episodes == 5 and len(result.curve) == 5
    assert len(result.best_decisions) == process.n_units
    assert result.best_time == min(row["current_time"] for row in result.curve)


class _InterruptedAtOnce(AssignmentProcess):
    def result(self):
        raise KeyboardInterrupt


def test_search_interrupted_before_any_plan_propagates():
    with pytest.raises(KeyboardInterrupt):
        search(_InterruptedAtOnce(seed=0), budget_s=60, config=SMALL)


def _interrupt_at(monkeypatch, n: int) -> None:
    """The n-th evaluation of a finished plan raises KeyboardInterrupt (once)."""
    real, calls = ShardSpace.evaluate, [0]

    def evaluate(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ShardSpace, "evaluate", evaluate)


@pytest.mark.slow  # a DQN search through am.plan
def test_plan_with_the_dqn_returns_the_best_so_far(monkeypatch):
    spec = get_model("mlp", layers=2, hidden=64, features=32, classes=8, batch=16)
    cluster = am.Cluster.preset("a100", 8)
    _interrupt_at(monkeypatch, 12)
    plan = am.plan(
        spec.step_fn, *spec.abstract_args(), cluster=cluster, searcher="dqn", budget_s=60.0
    )
    assert plan.decisions["interrupted"] is True
    assert plan.decisions["episodes"] == 11  # one evaluation per finished episode
    assert plan.predicted is not None and plan.predicted.feasible
    experts = am.expert_plans(spec.step_fn, *spec.abstract_args(), cluster=cluster)
    assert plan.predicted.step_time_s <= experts["data_parallel"].predicted.step_time_s


def test_plan_with_the_dqn_interrupted_at_once_raises(monkeypatch):
    spec = get_model("mlp", layers=2, hidden=64, features=32, classes=8, batch=16)
    _interrupt_at(monkeypatch, 1)
    with pytest.raises(KeyboardInterrupt):
        am.plan(
            spec.step_fn, *spec.abstract_args(), cluster=am.Cluster.preset("a100", 8),
            searcher="dqn",
        )  # fmt: skip
