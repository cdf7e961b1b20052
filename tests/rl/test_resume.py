"""Resuming a DQN search, and warm-starting one from a saved agent.

A resumed search must play exactly the episodes an unbroken one plays: the same seed and
total budget give the same curve (step times and losses) and the same plan.
"""

import dataclasses
import os
import signal

import jax
import numpy as np
import pytest

import automap as am
from automap._errors import AutomapError
from automap._zoo import get_model
from automap.rl import DQNAgent, SearchCheckpoint, search

from .toy import SMALL, AssignmentProcess

# Training starts after a few episodes, so resuming past that point restores a learner.
CONFIG = dataclasses.replace(SMALL, noisy=False, warmup_steps=24)


def _trace(result):
    return [(r["best_time"], r["current_time"], r["loss"]) for r in result.curve]


def _with_episodes(n: int):
    return dataclasses.replace(CONFIG, max_episodes=n)


def test_a_resumed_search_equals_an_unbroken_one(tmp_path):
    whole = search(AssignmentProcess(seed=2), budget_s=60, seed=5, config=_with_episodes(30))
    first = search(AssignmentProcess(seed=2), budget_s=60, seed=5, config=_with_episodes(12))
    first.checkpoint.save(tmp_path / "state")
    saved = SearchCheckpoint.load(tmp_path / "state")
    rest = search(
        AssignmentProcess(seed=2), budget_s=60, seed=5, config=_with_episodes(30), resume=saved
    )
    assert first.episodes == 12 and rest.episodes == 30
    assert any(loss is not None for _, _, loss in _trace(first))  # it was learning already
    assert _trace(rest) == _trace(whole)
    assert rest.best_decisions == whole.best_decisions and rest.best_time == whole.best_time


def test_a_finished_search_resumed_with_the_same_budget_plays_nothing():
    first = search(AssignmentProcess(seed=2), budget_s=60, seed=5, config=_with_episodes(10))
    again = search(
        AssignmentProcess(seed=2),
        budget_s=60,
        seed=5,
        config=_with_episodes(10),
        resume=first.checkpoint,
    )
    assert again.episodes == 10 and _trace(again) == _trace(first)


def test_ctrl_c_stops_after_the_episode_and_resumes_exactly():
    # A real SIGINT: the search's handler lets the episode finish, so the state is whole.
    def on_episode(episode, best, current, exploration, loss):
        if episode == 9:
            os.kill(os.getpid(), signal.SIGINT)

    whole = search(AssignmentProcess(seed=3), budget_s=60, seed=1, config=_with_episodes(25))
    # What Ctrl-C did before: Python's default, or ignored where the suite was started in
    # the background by a non-interactive shell (`make test &`): the search puts it back.
    before = signal.getsignal(signal.SIGINT)
    cut = search(
        AssignmentProcess(seed=3),
        budget_s=60,
        seed=1,
        config=_with_episodes(25),
        on_episode=on_episode,
    )
    assert cut.interrupted and cut.episodes == 9
    assert signal.getsignal(signal.SIGINT) is before  # handler put back
    rest = search(
        AssignmentProcess(seed=3),
        budget_s=60,
        seed=1,
        config=_with_episodes(25),
        resume=cut.checkpoint,
    )
    assert not rest.interrupted and _trace(rest) == _trace(whole)


def test_corrupt_search_state_is_refused(tmp_path):
    path = tmp_path / "plan.search.msgpack"
    path.write_bytes(b"not a search state")
    with pytest.raises(ValueError, match=r"not a DQN search state.*without resume"):
        SearchCheckpoint.load(path)


MLP = get_model("mlp", layers=2, hidden=64, features=32, classes=8, batch=16)
CPU8 = am.Cluster.preset("cpu", devices=8)


def _plan(**kwargs):
    kwargs = {"searcher": "dqn", "budget_s": 1.0, "seed": 1, **kwargs}
    return am.plan(MLP.step_fn, *MLP.abstract_args(), cluster=CPU8, **kwargs)


def _curve(plan):
    return [(r["best_time"], r["current_time"], r["loss"]) for r in plan.decisions["curve"]]


@pytest.mark.slow  # three DQN searches
def test_plan_resumed_with_a_larger_budget_equals_one_search(tmp_path):
    state = tmp_path / "plan.search.msgpack"
    whole = _plan(budget_s=3.0)
    first = _plan(budget_s=1.0, resume=state)
    assert state.exists() and first.decisions["episodes"] == 40
    rest = _plan(budget_s=3.0, resume=state)
    assert rest.decisions["episodes"] == whole.decisions["episodes"] == 120
    assert _curve(rest) == _curve(whole)
    assert rest.specs == whole.specs and rest.mesh == whole.mesh
    # The state is for this seed (and program, cluster): another one is refused.
    with pytest.raises(AutomapError, match=r"seed=1.*seed=2"):
        _plan(budget_s=3.0, seed=2, resume=state)


def test_warm_start_loads_the_saved_network(tmp_path):
    saved = tmp_path / "agent.msgpack"
    _plan(budget_s=2.0, agent_out=saved)
    trained = DQNAgent.load(saved)
    assert trained.train_steps > 0
    # On a budget of the expert seed episodes only, no training step is taken (the replay is
    # still warming up): the agent handed back holds exactly the weights it started from.
    again = tmp_path / "again.msgpack"
    _plan(budget_s=0.01, agent_in=saved, agent_out=again)
    warm = DQNAgent.load(again)
    assert warm.train_steps == 0 and warm.env_steps > 0
    for a, b in zip(
        jax.tree.leaves(trained.state.params), jax.tree.leaves(warm.state.params), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_agent_files_are_one_line_errors(tmp_path):
    corrupt = tmp_path / "corrupt.msgpack"
    corrupt.write_bytes(b"\x00garbage")
    with pytest.raises(AutomapError, match=r"not a DQN agent.*--save-agent"):
        _plan(agent_in=corrupt)
    with pytest.raises(AutomapError, match="no agent file"):
        _plan(agent_in=tmp_path / "missing.msgpack")
    toy = AssignmentProcess(seed=0)  # another observation size
    DQNAgent(toy.obs_dim, toy.n_actions, SMALL).save(tmp_path / "toy.msgpack")
    with pytest.raises(AutomapError, match=r"does not fit this search.*obs_dim"):
        _plan(agent_in=tmp_path / "toy.msgpack")
    with pytest.raises(AutomapError, match="dqn searcher"):
        _plan(searcher="random", agent_in=tmp_path / "toy.msgpack")


def test_a_failed_save_leaves_no_half_state(tmp_path):
    """A write that fails (a full disk; here the target is a directory, so the rename
    fails after the bytes are written) raises and leaves no .tmp file behind."""
    result = search(AssignmentProcess(seed=2), budget_s=60, seed=5, config=_with_episodes(4))
    target = tmp_path / "state"
    (target / "inside").mkdir(parents=True)
    with pytest.raises(OSError):
        result.checkpoint.save(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]
