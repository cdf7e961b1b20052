"""The Gymnasium environment over a decision process, and the search loop around it."""

import dataclasses
import math

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from automap.rl import DecisionProcess, DQNAgent, PlanningEnv, plan_reward, search, write_curve

from .toy import SMALL, AssignmentProcess


def _play(env: PlanningEnv, actions) -> tuple[float, dict]:
    _, info = env.reset()
    reward = 0.0
    for a in actions:
        assert info["action_mask"][a]
        _, reward, done, truncated, info = env.step(a)
        assert not truncated
    assert done
    return reward, info


def test_toy_is_a_decision_process():
    assert isinstance(AssignmentProcess(), DecisionProcess)


def test_check_env_passes():
    check_env(PlanningEnv(AssignmentProcess(seed=0)).unwrapped)


def test_spaces_and_masks():
    process = AssignmentProcess(seed=0)
    env = PlanningEnv(process)
    assert env.observation_space.shape == (process.obs_dim,)
    assert env.action_space.n == process.n_actions
    obs, info = env.reset(seed=0)
    assert obs.dtype == np.float32 and obs in env.observation_space
    assert info["action_mask"].dtype == bool and info["action_mask"].any()
    # The action space's own sampler draws valid actions only.
    for _ in range(process.n_units):
        action = env.action_space.sample()
        assert info["action_mask"][action]
        obs, _, done, _, info = env.step(action)
    assert done


def test_data_parallel_scores_minus_one():
    process = AssignmentProcess(seed=0)
    reward, info = _play(PlanningEnv(process), [0] * process.n_units)
    assert reward == pytest.approx(-1.0)
    assert info["feasible"] and info["step_time_s"] == pytest.approx(process.baseline_time)
    assert info["decisions"] == (0,) * process.n_units


def test_intermediate_rewards_are_zero_and_optimum_beats_baseline():
    process = AssignmentProcess(seed=0)
    optimum, best, _ = process.exhaustive()
    env = PlanningEnv(process)
    env.reset()
    rewards = [env.step(a)[1] for a in best]
    assert rewards[:-1] == [0.0] * (len(best) - 1)
    assert rewards[-1] == pytest.approx(-optimum / process.baseline_time) and rewards[-1] > -1


def test_infeasible_plan_is_penalized_by_its_overshoot():
    process = AssignmentProcess(seed=0)
    env = PlanningEnv(process, infeasible_penalty=10.0)
    heavy = tuple(int(np.argmax(process.memory[i] * process.allowed[i])) for i in range(8))
    if not process.valid(heavy) or process.mem(heavy) <= process.limit:
        pytest.skip("this toy instance has no simple infeasible plan")
    reward, info = _play(env, heavy)
    assert not info["feasible"] and info["over_ratio"] > 0
    assert reward == pytest.approx(-(10.0 + info["over_ratio"]))
    assert plan_reward(2.0, True, 0.0, 4.0) == -0.5
    assert plan_reward(2.0, False, 0.3, 4.0) == pytest.approx(-10.3)


def test_invalid_actions_and_misuse_raise():
    process = AssignmentProcess(seed=0)
    env = PlanningEnv(process)
    with pytest.raises(RuntimeError, match="reset"):
        env.step(0)
    env.reset()
    with pytest.raises(ValueError, match="not valid"):
        env.step(process.n_actions)
    # Walk to a step with a masked option, then try it.
    _, info = env.reset()
    while info["action_mask"].all():
        _, _, done, _, info = env.step(0)
        assert not done, "the toy instance should mask something"
    bad = int(np.flatnonzero(~info["action_mask"])[0])
    with pytest.raises(ValueError, match=f"action {bad} is not valid"):
        env.step(bad)
    with pytest.raises(TypeError, match="DecisionProcess"):
        PlanningEnv(object())


def test_search_plays_seed_episodes_first_and_keeps_the_best(tmp_path):
    process = AssignmentProcess(seed=0)
    optimum, best, _ = process.exhaustive()
    calls = []
    config = dataclasses.replace(SMALL, max_episodes=6)
    result = search(
        process,
        budget_s=60,
        seed=0,
        config=config,
        seed_episodes=[(0,) * 8, best],
        on_episode=lambda *args: calls.append(args),
    )
    assert result.episodes == 6 and len(result.curve) == 6 and len(calls) == 6
    assert result.best_decisions == best and result.best_feasible
    assert result.best_time == pytest.approx(optimum)
    assert calls[0][1] == pytest.approx(process.baseline_time)  # best after the first episode
    assert calls[1][1] == pytest.approx(optimum)
    assert result.curve[1]["current_time"] == pytest.approx(optimum)
    assert result.time_to_best_s <= result.curve[1]["elapsed_s"]
    assert set(result.curve[0]) >= {"episode", "best_time", "current_time", "exploration", "loss"}
    write_curve(result.curve, tmp_path / "curve.csv")
    lines = (tmp_path / "curve.csv").read_text().splitlines()
    assert lines[0].startswith("episode,elapsed_s,best_time") and len(lines) == 7


def test_search_rejects_a_wrong_seed_episode_and_stops_on_time():
    process = AssignmentProcess(seed=0)
    with pytest.raises(ValueError, match="ends before"):
        search(process, budget_s=10, config=SMALL, seed_episodes=[(0, 0)])
    agent = DQNAgent(process.obs_dim, process.n_actions, SMALL)
    with pytest.raises(ValueError, match="either an agent or a config"):
        search(process, budget_s=10, agent=agent, config=dataclasses.replace(SMALL, n_step=2))
    result = search(process, budget_s=0.0, config=SMALL)
    assert result.episodes == 0 and math.isinf(result.best_time) and not result.best_feasible
    # stop_at ends the search on the first plan that good: here the seeded baseline.
    config = dataclasses.replace(SMALL, max_episodes=50)
    result = search(process, budget_s=60, config=config, seed_episodes=[(0,) * 8], stop_at=1e9)
    assert result.episodes == 1


class ShapedToy(AssignmentProcess):
    """The toy, also pricing its partial plan (undecided units on option 0)."""

    def running(self) -> tuple[float, bool, float]:
        full = tuple(self._taken) + (0,) * (self.n_units - len(self._taken))
        over = max(0.0, self.mem(full) / self.limit - 1.0)
        return self.cost(full), over == 0.0, over


@pytest.mark.parametrize("log_scale", [False, True])
def test_shaped_rewards_add_up_to_the_plan_reward(log_scale):
    process = ShapedToy(seed=3)
    env = PlanningEnv(process, shaping=True, log_scale=log_scale)
    rng = np.random.default_rng(0)
    start = plan_reward(*process.running(), process.baseline_time, log_scale=log_scale)
    for _ in range(20):
        _, info = env.reset()
        total, done = 0.0, False
        while not done:
            action = int(rng.choice(np.flatnonzero(info["action_mask"])))
            _, reward, done, _, info = env.step(action)
            total += reward
        final = plan_reward(
            info["step_time_s"],
            info["feasible"],
            info["over_ratio"],
            process.baseline_time,
            log_scale=log_scale,
        )
        # Potential-based: the episode's return is the plan's reward less a constant.
        assert total == pytest.approx(final - start, abs=1e-9)
    with pytest.raises(TypeError, match="running"):
        PlanningEnv(AssignmentProcess(), shaping=True)
