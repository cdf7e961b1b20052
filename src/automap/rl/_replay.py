"""Prioritized experience replay with n-step returns, in numpy.

Proportional prioritization (Schaul et al., 2016): transition i is drawn with probability
p_i^alpha / sum_k p_k^alpha, where p_i = |td_i| + eps, and its loss is weighted by the
importance weight (N P(i))^-beta, normalized by the largest weight in the batch (as Dopamine
does). A sum-tree makes drawing and updating O(log N).

n-step returns are folded in as transitions arrive: planning episodes are short (one step
per decision), so the last n steps are held back until their return is known, and the end of
an episode flushes them all with a zero bootstrap discount.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple, Protocol

import numpy as np


class Batch(NamedTuple):
    """A batch of n-step transitions; every field has the batch as its first axis."""

    obs: Any  # [B, D] float32
    mask: Any  # [B, A] bool: the valid actions at obs
    action: Any  # [B] int32
    ret: Any  # [B] float32: the discounted sum of the next (up to) n rewards
    discount: Any  # [B] float32: gamma^n, or 0 when the episode ended within n steps
    next_obs: Any  # [B, D] float32: the observation n steps later
    next_mask: Any  # [B, A] bool
    weight: Any  # [B] float32: importance weight


class Sampler(Protocol):
    """What the agent needs from a replay memory."""

    def add(self, obs, mask, action, reward, next_obs, next_mask, done) -> None: ...
    def sample(self, batch_size: int, beta: float) -> tuple[Batch, np.ndarray]: ...
    def update_priorities(self, indices: np.ndarray, td_errors: np.ndarray) -> None: ...
    def __len__(self) -> int: ...
    def discard_pending(self) -> None: ...
    def to_state_dict(self) -> dict[str, Any]: ...
    def from_state_dict(self, state: dict[str, Any]) -> None: ...


class SumTree:
    """A binary tree over `capacity` leaves whose inner nodes hold the sum of their children.

    Node 1 is the root and the leaves sit at [size, 2 size) with size a power of two, so the
    children of node i are 2i and 2i + 1. Lookups and updates run for a whole batch at once.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._size = 1 << max(0, capacity - 1).bit_length()
        self._tree = np.zeros(2 * self._size, np.float64)  # [2 size]

    @property
    def total(self) -> float:
        return float(self._tree[1])

    def get(self, indices: np.ndarray) -> np.ndarray:
        return self._tree[self._size + np.asarray(indices)]

    def set(self, indices: np.ndarray, values: np.ndarray) -> None:
        nodes = self._size + np.asarray(indices, np.int64)  # [K]
        self._tree[nodes] = values
        # Recomputing each parent from both children (rather than adding deltas) is exact
        # and stays right when one batch updates the same leaf (or parent) twice.
        while nodes[0] > 1:
            nodes = nodes // 2
            self._tree[nodes] = self._tree[2 * nodes] + self._tree[2 * nodes + 1]

    def find(self, targets: np.ndarray) -> np.ndarray:
        """The leaf whose cumulative-sum interval holds each target in [0, total)."""
        targets = np.array(targets, np.float64)  # [K]
        nodes = np.ones(len(targets), np.int64)  # [K]
        while nodes[0] < self._size:
            left = 2 * nodes  # [K]
            left_sum = self._tree[left]  # [K]
            # Never step into an empty right subtree: rounding can leave a target a hair
            # above the total of the non-empty leaves.
            right = (targets >= left_sum) & (self._tree[left + 1] > 0)  # [K]
            targets = np.where(right, targets - left_sum, targets)
            nodes = np.where(right, left + 1, left)
        return nodes - self._size

    def to_array(self) -> np.ndarray:
        return self._tree[self._size : self._size + self.capacity].copy()


class PrioritizedReplay:
    """A ring buffer of n-step transitions drawn in proportion to their priorities."""

    def __init__(
        self,
        capacity: int,
        obs_dim: int,
        n_actions: int,
        *,
        n_step: int = 3,
        gamma: float = 1.0,
        alpha: float = 0.5,
        eps: float = 1e-3,
        seed: int = 0,
    ):
        self.capacity, self.n_step, self.gamma = capacity, n_step, gamma
        self.alpha, self.eps = alpha, eps
        self._obs = np.zeros((capacity, obs_dim), np.float32)  # [C, D]
        self._mask = np.zeros((capacity, n_actions), bool)  # [C, A]
        self._action = np.zeros(capacity, np.int32)  # [C]
        self._ret = np.zeros(capacity, np.float32)  # [C]
        self._discount = np.zeros(capacity, np.float32)  # [C]
        self._next_obs = np.zeros((capacity, obs_dim), np.float32)  # [C, D]
        self._next_mask = np.zeros((capacity, n_actions), bool)  # [C, A]
        self._tree = SumTree(capacity)
        self._cursor = 0
        self._count = 0
        # New transitions enter with the largest priority seen, so each is replayed at least
        # once soon after it arrives.
        self._max_priority = 1.0
        self._pending: list[tuple[np.ndarray, np.ndarray, int, float]] = []
        self._rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        return self._count

    def add(self, obs, mask, action, reward, next_obs, next_mask, done) -> None:
        """Record one environment step; n-step transitions are written as their returns close."""
        self._pending.append(
            (np.asarray(obs, np.float32), np.asarray(mask, bool), int(action), float(reward))
        )
        if done:
            while self._pending:
                self._write_oldest(next_obs, next_mask, terminal=True)
        elif len(self._pending) == self.n_step:
            self._write_oldest(next_obs, next_mask, terminal=False)

    def _write_oldest(self, next_obs, next_mask, *, terminal: bool) -> None:
        rewards = np.array([step[3] for step in self._pending], np.float64)  # [k]
        ret = float((self.gamma ** np.arange(len(rewards)) * rewards).sum())
        obs, mask, action, _ = self._pending.pop(0)
        i = self._cursor
        self._obs[i], self._mask[i], self._action[i], self._ret[i] = obs, mask, action, ret
        self._discount[i] = 0.0 if terminal else self.gamma ** len(rewards)
        self._next_obs[i] = next_obs
        self._next_mask[i] = False if terminal else np.asarray(next_mask, bool)
        self._tree.set(np.array([i]), np.array([self._max_priority]))
        self._cursor = (i + 1) % self.capacity
        self._count = min(self._count + 1, self.capacity)

    def sample(self, batch_size: int, beta: float) -> tuple[Batch, np.ndarray]:
        """A stratified proportional sample: one draw from each of `batch_size` equal slices."""
        if self._count == 0:
            raise ValueError("cannot sample from an empty replay memory")
        total = self._tree.total
        offsets = self._rng.uniform(size=batch_size)  # [B]
        targets = (np.arange(batch_size) + offsets) * (total / batch_size)  # [B]
        idx = np.minimum(self._tree.find(targets), self._count - 1)  # [B]
        probs = self._tree.get(idx) / total  # [B]
        weight = (self._count * probs) ** -beta  # [B]
        weight = (weight / weight.max()).astype(np.float32)
        batch = Batch(
            self._obs[idx],
            self._mask[idx],
            self._action[idx],
            self._ret[idx],
            self._discount[idx],
            self._next_obs[idx],
            self._next_mask[idx],
            weight,
        )
        return batch, idx

    def update_priorities(self, indices: np.ndarray, td_errors: np.ndarray) -> None:
        priority = (np.abs(np.asarray(td_errors, np.float64)) + self.eps) ** self.alpha  # [B]
        self._tree.set(indices, priority)
        self._max_priority = max(self._max_priority, float(priority.max()))

    def discard_pending(self) -> None:
        """Forget the steps of an unfinished episode that wait for their n-step return."""
        self._pending.clear()

    def priorities(self) -> np.ndarray:
        """The stored priorities p^alpha of the transitions held, in slot order."""
        return self._tree.to_array()[: self._count]

    def to_state_dict(self) -> dict[str, Any]:
        n = self._count
        pending = self._pending
        return {
            "obs": self._obs[:n].copy(),
            "mask": self._mask[:n].copy(),
            "action": self._action[:n].copy(),
            "ret": self._ret[:n].copy(),
            "discount": self._discount[:n].copy(),
            "next_obs": self._next_obs[:n].copy(),
            "next_mask": self._next_mask[:n].copy(),
            "priority": self.priorities(),
            "cursor": self._cursor,
            "max_priority": self._max_priority,
            "pending_obs": np.array([p[0] for p in pending], np.float32).reshape(
                len(pending), self._obs.shape[1]
            ),
            "pending_mask": np.array([p[1] for p in pending], bool).reshape(
                len(pending), self._mask.shape[1]
            ),
            "pending_action": np.array([p[2] for p in pending], np.int32),
            "pending_reward": np.array([p[3] for p in pending], np.float32),
            # The bit generator's state holds integers wider than 64 bits: JSON keeps them.
            "rng": json.dumps(self._rng.bit_generator.state),
        }

    def from_state_dict(self, state: dict[str, Any]) -> None:
        n = len(state["action"])
        if n > self.capacity:
            raise ValueError(f"the saved replay holds {n} transitions, capacity is {self.capacity}")
        for name in ("obs", "mask", "action", "ret", "discount", "next_obs", "next_mask"):
            getattr(self, f"_{name}")[:n] = state[name]
        self._count = n
        self._tree = SumTree(self.capacity)
        if n:
            self._tree.set(np.arange(n), np.asarray(state["priority"], np.float64))
        self._cursor = int(state["cursor"]) % self.capacity
        self._max_priority = float(state["max_priority"])
        self._pending = [
            (np.asarray(o, np.float32), np.asarray(m, bool), int(a), float(r))
            for o, m, a, r in zip(
                state["pending_obs"],
                state["pending_mask"],
                state["pending_action"],
                state["pending_reward"],
                strict=True,
            )
        ]
        self._rng.bit_generator.state = json.loads(state["rng"])
