"""The DQN agent: masking, dueling, double-Q targets, determinism, state dicts, learning."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from automap.rl import (
    Batch,
    DQNAgent,
    DQNConfig,
    TrainState,
    dueling,
    init_params,
    q_values,
    search,
    select_action,
    train_step,
)

from .toy import SMALL, AssignmentProcess, random_search

PLAIN = dataclasses.replace(SMALL, noisy=False)


def test_masked_actions_are_never_selected():
    rng = np.random.default_rng(0)
    for noisy in (True, False):
        params = init_params(jax.random.key(1), 6, 5, (16,), noisy=noisy)
        key = jax.random.key(2)
        for _ in range(30):
            obs = rng.normal(size=6).astype(np.float32)
            mask = rng.uniform(size=5) < 0.4
            mask[rng.integers(5)] = True
            for epsilon in (0.0, 0.5, 1.0):
                key, action = select_action(params, obs, mask, key, np.float32(epsilon))
                assert mask[int(action)]


def test_dueling_mean_runs_over_valid_actions_only():
    value = jnp.array([[2.0], [-1.0]])  # [B, 1]
    advantage = jnp.array([[1.0, 3.0, 100.0], [0.0, -4.0, 5.0]])  # [B, A]
    mask = jnp.array([[True, True, False], [True, True, True]])
    q = np.asarray(dueling(value, advantage, mask))
    # Over the valid actions the advantages average to zero, so Q averages to V there.
    np.testing.assert_allclose(q[0, :2], [2.0 + 1.0 - 2.0, 2.0 + 3.0 - 2.0])
    np.testing.assert_allclose(q[1], [-1.0 - 1 / 3, -1.0 - 4.0 - 1 / 3, -1.0 + 5.0 - 1 / 3])
    assert q[0, :2].mean() == pytest.approx(2.0)


def _tiny_batch(obs_dim: int, n_actions: int, size: int, seed: int) -> Batch:
    rng = np.random.default_rng(seed)
    next_mask = rng.uniform(size=(size, n_actions)) < 0.5
    next_mask[:, 0] = True
    next_mask[-1] = False  # a terminal transition: nothing to bootstrap from
    discount = np.full(size, 0.9, np.float32)
    discount[-1] = 0.0
    return Batch(
        obs=rng.normal(size=(size, obs_dim)).astype(np.float32),
        mask=np.ones((size, n_actions), bool),
        action=rng.integers(n_actions, size=size).astype(np.int32),
        ret=rng.normal(size=size).astype(np.float32),
        discount=discount,
        next_obs=rng.normal(size=(size, obs_dim)).astype(np.float32),
        next_mask=next_mask,
        weight=rng.uniform(0.5, 1.0, size).astype(np.float32),
    )


def test_double_q_target_matches_a_hand_computation():
    agent = DQNAgent(4, 3, PLAIN, seed=0)
    # Make the target network differ from the online one, as it does between copies.
    target = jax.tree.map(lambda p: p * 1.5 + 0.1, agent.state.params)
    state = agent.state._replace(target_params=target)
    batch = _tiny_batch(4, 3, 6, seed=0)
    _, loss, td = train_step(state, batch, PLAIN)

    q_fn = jax.jit(q_values)  # one compilation rather than one per primitive
    online_next = np.asarray(q_fn(state.params, batch.next_obs, batch.next_mask))  # [B, A]
    target_next = np.asarray(q_fn(target, batch.next_obs, batch.next_mask))  # [B, A]
    best = np.where(batch.next_mask, online_next, -np.inf).argmax(axis=1)  # [B]
    expected_target = batch.ret + batch.discount * target_next[np.arange(6), best]  # [B]
    q = np.asarray(q_fn(state.params, batch.obs, batch.mask))  # [B, A]
    expected_td = expected_target - q[np.arange(6), batch.action]  # [B]
    np.testing.assert_allclose(np.asarray(td), expected_td, rtol=1e-5, atol=1e-5)
    abs_td = np.abs(expected_td)
    huber = np.where(abs_td <= 1.0, 0.5 * abs_td**2, abs_td - 0.5)
    assert float(loss) == pytest.approx(float((batch.weight * huber).mean()), rel=1e-5)


def test_target_network_updates_hard_and_polyak():
    batch = _tiny_batch(4, 3, 6, seed=1)
    # PLAIN's own period (not a new one) so that no extra compilation is needed.
    period = PLAIN.target_update_period
    state = DQNAgent(4, 3, PLAIN, seed=0).state
    start = state.target_params
    for step in range(1, period + 1):
        state, _, _ = train_step(state, batch, PLAIN)
        if step in (1, period - 1, period):
            expected = start if step < period else state.params
            same = jax.tree.map(np.array_equal, state.target_params, expected)
            assert all(jax.tree.leaves(same)), step
    polyak = dataclasses.replace(PLAIN, tau=0.25)
    state = DQNAgent(4, 3, polyak, seed=0).state
    old = state.target_params
    state, _, _ = train_step(state, batch, polyak)
    expected = jax.tree.map(lambda o, n: 0.25 * n + 0.75 * o, old, state.params)
    for got, want in zip(
        jax.tree.leaves(state.target_params), jax.tree.leaves(expected), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def _params_equal(a: TrainState, b: TrainState) -> bool:
    return all(
        np.array_equal(x, y)
        for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True)
    )


@pytest.mark.slow  # two agents trained
def test_same_seed_same_actions_and_same_learning():
    config = dataclasses.replace(SMALL, max_episodes=12)  # noisy: the noise is seeded too
    runs, agents = [], []
    for _ in range(2):
        agent = DQNAgent(AssignmentProcess().obs_dim, 3, config, seed=7)
        runs.append(search(AssignmentProcess(seed=0), budget_s=60, agent=agent))
        agents.append(agent)
    assert [r["current_time"] for r in runs[0].curve] == [r["current_time"] for r in runs[1].curve]
    assert runs[0].best_decisions == runs[1].best_decisions
    assert agents[0].train_steps > 0
    assert _params_equal(agents[0].state, agents[1].state)
    other = search(AssignmentProcess(seed=0), budget_s=60, seed=8, config=config)
    assert [r["current_time"] for r in other.curve] != [r["current_time"] for r in runs[0].curve]


@pytest.mark.slow  # agents trained and resumed
def test_state_dict_round_trip_resumes_identically(tmp_path):
    config = dataclasses.replace(PLAIN, max_episodes=8)
    process = AssignmentProcess(seed=1)
    agent = DQNAgent(process.obs_dim, process.n_actions, config, seed=3)
    search(process, budget_s=60, agent=agent)
    agent.save(tmp_path / "agent.msgpack")
    restored = DQNAgent.load(tmp_path / "agent.msgpack", config)
    assert restored.env_steps == agent.env_steps and restored.train_steps == agent.train_steps
    assert len(restored.replay) == len(agent.replay)
    # Both continue the same way: same exploration draws, same replay samples, same updates.
    a = search(AssignmentProcess(seed=1), budget_s=60, agent=agent)
    b = search(AssignmentProcess(seed=1), budget_s=60, agent=restored)
    assert [r["current_time"] for r in a.curve] == [r["current_time"] for r in b.curve]
    assert _params_equal(agent.state, restored.state)


def test_warm_start_takes_weights_only():
    config = dataclasses.replace(PLAIN, max_episodes=8)
    process = AssignmentProcess(seed=1)
    trained = DQNAgent(process.obs_dim, process.n_actions, config, seed=3)
    search(process, budget_s=60, agent=trained)
    fresh = DQNAgent(process.obs_dim, process.n_actions, config, seed=4)
    fresh.from_state_dict(trained.to_state_dict(), weights_only=True)
    assert _params_equal(fresh.state, trained.state)
    assert len(fresh.replay) == 0 and fresh.env_steps == 0
    other = DQNAgent(process.obs_dim + 1, process.n_actions, config)
    with pytest.raises(ValueError, match="obs_dim"):
        other.from_state_dict(trained.to_state_dict())
    for hidden in ((8, 8), (32,)):  # other widths, another depth
        other = DQNAgent(
            process.obs_dim, process.n_actions, dataclasses.replace(config, hidden=hidden)
        )
        with pytest.raises(ValueError, match="hidden"):
            other.from_state_dict(trained.to_state_dict(), weights_only=True)


# The learning test's settings: the defaults, but returns over 5 of the 8 steps (3 is the
# default; 5 found the optimum sooner here) and a smaller network than for real models.
LEARN = dataclasses.replace(
    DQNConfig(), hidden=(64, 64), n_step=5, warmup_steps=128, max_episodes=300
)


@pytest.mark.slow
def test_dqn_finds_the_optimum_more_often_than_random_search():
    dqn_hits, random_hits = [], []
    for seed in (0, 2, 4):
        process = AssignmentProcess(seed=seed)
        optimum, _, _ = process.exhaustive()
        # Stopping at the optimum changes no outcome, only the time the test takes.
        result = search(process, budget_s=120, seed=seed, config=LEARN, stop_at=optimum)
        dqn_hits.append(result.best_time <= optimum * (1 + 1e-9))
        random_best = random_search(AssignmentProcess(seed=seed), LEARN.max_episodes, seed)[-1]
        random_hits.append(random_best <= optimum * (1 + 1e-9))
        assert result.best_feasible
    assert sum(dqn_hits) > sum(random_hits), (dqn_hits, random_hits)
    assert sum(dqn_hits) >= 2, dqn_hits
