"""Prioritized replay: the sum-tree, proportional sampling, n-step returns, state dicts."""

import numpy as np
import pytest

from automap.rl import PrioritizedReplay, SumTree


def _fill(replay: PrioritizedReplay, n: int, obs_dim: int = 2, n_actions: int = 3) -> None:
    # One-step episodes: each add is a whole transition, tagged by its reward.
    for i in range(n):
        obs = np.full(obs_dim, i, np.float32)
        mask = np.ones(n_actions, bool)
        replay.add(obs, mask, i % n_actions, float(i), obs, mask, True)


def test_sum_tree_total_and_find():
    tree = SumTree(5)  # not a power of two: the tree pads to 8 leaves
    tree.set(np.arange(5), np.array([1.0, 0.0, 2.0, 3.0, 4.0]))
    assert tree.total == pytest.approx(10.0)
    # Cumulative intervals: [0,1) -> 0, [1,3) -> 2, [3,6) -> 3, [6,10) -> 4.
    found = tree.find(np.array([0.0, 0.99, 1.0, 2.9, 3.0, 5.99, 6.0, 9.999]))
    assert found.tolist() == [0, 0, 2, 2, 3, 3, 4, 4]
    tree.set(np.array([4, 4]), np.array([1.0, 1.0]))  # a repeated index in one update
    assert tree.total == pytest.approx(7.0)
    # A target at the very top never lands on an empty padding leaf.
    assert tree.find(np.array([7.0]))[0] == 4


def test_sampling_is_proportional_to_priorities():
    replay = PrioritizedReplay(16, 2, 3, n_step=1, alpha=1.0, eps=0.0, seed=0)
    _fill(replay, 4)
    priorities = np.array([1.0, 2.0, 3.0, 4.0])
    replay.update_priorities(np.arange(4), priorities)
    counts = np.zeros(4)
    for _ in range(500):
        _, idx = replay.sample(40, beta=1.0)
        counts += np.bincount(idx, minlength=4)
    freq = counts / counts.sum()
    np.testing.assert_allclose(freq, priorities / priorities.sum(), atol=0.01)


def test_importance_weights_undo_the_prioritization():
    replay = PrioritizedReplay(16, 2, 3, n_step=1, alpha=1.0, eps=0.0, seed=1)
    _fill(replay, 4)
    replay.update_priorities(np.arange(4), np.array([1.0, 2.0, 3.0, 4.0]))
    batch, idx = replay.sample(64, beta=1.0)
    # With beta = 1, weight ∝ 1 / P(i); normalized by the batch's largest (the rarest item).
    expected = (1.0 / (idx + 1.0)) / (1.0 / (idx.min() + 1.0))
    np.testing.assert_allclose(batch.weight, expected, rtol=1e-6)
    # Transitions are read back intact: the reward tags the slot.
    np.testing.assert_array_equal(batch.ret, idx.astype(np.float32))


def test_new_transitions_get_the_largest_priority():
    replay = PrioritizedReplay(16, 2, 3, n_step=1, alpha=1.0, eps=0.0, seed=0)
    _fill(replay, 2)
    replay.update_priorities(np.arange(2), np.array([5.0, 0.5]))
    _fill(replay, 1)
    np.testing.assert_allclose(replay.priorities(), [5.0, 0.5, 5.0])


def test_n_step_returns_on_a_hand_case():
    gamma = 0.5
    replay = PrioritizedReplay(16, 1, 2, n_step=2, gamma=gamma, seed=0)
    obs = [np.array([t], np.float32) for t in range(5)]
    mask = np.array([True, False])
    rewards = [1.0, 2.0, 4.0, 8.0]
    for t, r in enumerate(rewards):
        replay.add(obs[t], mask, 0, r, obs[t + 1], mask, t == len(rewards) - 1)
        # A transition waits until n rewards (or the episode's end) are known.
        assert len(replay) == (max(0, t) if t < len(rewards) - 1 else 4)
    state = replay.to_state_dict()
    # s0: 1 + .5*2 = 2, bootstraps from s2 with gamma^2; s1: 2 + .5*4 = 4 from s3;
    # s2: 4 + .5*8 = 8 and s3: 8 end the episode (discount 0, no valid next action).
    np.testing.assert_allclose(state["ret"], [2.0, 4.0, 8.0, 8.0])
    np.testing.assert_allclose(state["discount"], [0.25, 0.25, 0.0, 0.0])
    np.testing.assert_allclose(state["obs"][:, 0], [0, 1, 2, 3])
    np.testing.assert_allclose(state["next_obs"][:2, 0], [2, 3])
    assert state["next_mask"][:2].any(axis=1).all()
    assert not state["next_mask"][2:].any()


def test_ring_buffer_overwrites_the_oldest():
    replay = PrioritizedReplay(3, 2, 3, n_step=1, seed=0)
    _fill(replay, 5)
    assert len(replay) == 3
    assert sorted(replay.to_state_dict()["ret"].tolist()) == [2.0, 3.0, 4.0]


def test_state_dict_round_trip_samples_the_same():
    a = PrioritizedReplay(32, 2, 3, n_step=2, seed=3)
    _fill(a, 10)
    # An unfinished episode is pending at save time.
    a.add(np.zeros(2), np.ones(3, bool), 1, 1.0, np.ones(2), np.ones(3, bool), False)
    a.update_priorities(np.arange(10), np.linspace(0.1, 2.0, 10))
    b = PrioritizedReplay(32, 2, 3, n_step=2, seed=99)
    b.from_state_dict(a.to_state_dict())
    for replay in (a, b):
        replay.add(np.ones(2), np.ones(3, bool), 2, 5.0, np.ones(2), np.ones(3, bool), True)
    batch_a, idx_a = a.sample(8, beta=0.5)
    batch_b, idx_b = b.sample(8, beta=0.5)
    np.testing.assert_array_equal(idx_a, idx_b)
    for x, y in zip(batch_a, batch_b, strict=True):
        np.testing.assert_array_equal(x, y)
