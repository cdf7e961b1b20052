"""A toy decision process small enough to solve exhaustively.

K units each get one of O options, in a fixed order. Step time = unary + pairwise costs of
the choices (the interactions make greedy choice wrong), memory = a per-unit, per-option
footprint against a limit (too much means infeasible), and the masks forbid some unit/option
pairs and cap how many units take the last option. Option 0 everywhere is the "data
parallel" baseline: always allowed and always feasible.
"""

from __future__ import annotations

import itertools

import numpy as np

from automap.rl import DQNConfig

# One small agent config shared by the tests, so that the jitted steps compile once.
SMALL = DQNConfig(hidden=(32, 32), noisy=True, batch_size=16, warmup_steps=32, replay_capacity=2048)


class AssignmentProcess:
    def __init__(self, n_units: int = 8, n_options: int = 3, *, seed: int = 0, cap: int = 4):
        rng = np.random.default_rng(seed)
        k, o = n_units, n_options
        self.n_units, self.n_options, self.cap = k, o, cap
        self.unary = rng.uniform(0.5, 1.5, (k, o))  # [K, O]
        # Neighbours interact strongly (like the resharding between a producer and its
        # consumer), all other pairs weakly; only pairs i < j count, so each is charged once.
        pair = rng.uniform(0.0, 0.05, (k, k, o, o))  # [K, K, O, O]
        pair[np.arange(k - 1), np.arange(1, k)] = rng.uniform(0.0, 0.8, (k - 1, o, o))
        self.pair = pair * np.triu(np.ones((k, k)), 1)[:, :, None, None]
        self.memory = rng.uniform(0.6, 1.4, (k, o))  # [K, O]
        self.memory[:, 0] = 1.0
        self.limit = 1.05 * k
        self.allowed = rng.uniform(size=(k, o)) > 0.08  # [K, O]
        self.allowed[:, 0] = True
        # Unit 0 allows everything, so a random action drawn at a later step is still valid
        # at the first one (gymnasium's check_env replays such an action after a reset).
        self.allowed[0] = True
        self.obs_dim = k + k * o + 2
        self.n_actions = o
        self.baseline_time = self.cost((0,) * k)
        self.reset()

    def cost(self, assignment: tuple[int, ...]) -> float:
        a = np.asarray(assignment)
        idx = np.arange(len(a))
        unary = self.unary[idx, a].sum()
        pair = self.pair[idx[:, None], idx[None, :], a[:, None], a[None, :]].sum()
        return float(unary + pair)

    def mem(self, assignment: tuple[int, ...]) -> float:
        a = np.asarray(assignment, int)
        return float(self.memory[np.arange(len(a)), a].sum())

    # --- the DecisionProcess protocol ---
    def reset(self) -> None:
        self._taken: list[int] = []

    def observation(self) -> np.ndarray:
        k, o = self.n_units, self.n_options
        obs = np.zeros(self.obs_dim, np.float32)
        t = len(self._taken)
        if t < k:
            obs[t] = 1.0
        for i, a in enumerate(self._taken):
            obs[k + i * o + a] = 1.0
        obs[-2] = self.mem(tuple(self._taken)) / self.limit
        obs[-1] = self.cost(tuple(self._taken)) / self.baseline_time if self._taken else 0.0
        return obs

    def action_mask(self) -> np.ndarray:
        t = len(self._taken)
        if t >= self.n_units:
            return np.zeros(self.n_options, bool)
        mask = self.allowed[t].copy()
        if sum(a == self.n_options - 1 for a in self._taken) >= self.cap:
            mask[-1] = False
        return mask

    def step(self, action: int) -> None:
        self._taken.append(int(action))

    def done(self) -> bool:
        return len(self._taken) == self.n_units

    def result(self) -> tuple[float, bool, float]:
        a = tuple(self._taken)
        over = max(0.0, self.mem(a) / self.limit - 1.0)
        return self.cost(a), over == 0.0, over

    def decisions(self) -> tuple[int, ...]:
        return tuple(self._taken)

    # --- yardsticks ---
    def valid(self, assignment: tuple[int, ...]) -> bool:
        return all(self.allowed[i, a] for i, a in enumerate(assignment)) and (
            sum(a == self.n_options - 1 for a in assignment) <= self.cap
        )

    def exhaustive(self) -> tuple[float, tuple[int, ...], int]:
        """(optimal time, its assignment, number of valid assignments), all scored at once."""
        k, o = self.n_units, self.n_options
        every = np.array(list(itertools.product(range(o), repeat=k)))  # [N, K]
        units = np.arange(k)
        allowed = self.allowed[units, every].all(axis=1)  # [N]
        valid = allowed & ((every == o - 1).sum(axis=1) <= self.cap)  # [N]
        fits = self.memory[units, every].sum(axis=1) <= self.limit  # [N]
        unary = self.unary[units, every].sum(axis=1)  # [N]
        pair = self.pair[units[:, None], units[None, :], every[:, :, None], every[:, None, :]]
        cost = unary + pair.sum(axis=(1, 2))  # [N]
        cost = np.where(valid & fits, cost, np.inf)
        best = int(np.argmin(cost))
        return float(cost[best]), tuple(int(a) for a in every[best]), int(valid.sum())


def random_search(process: AssignmentProcess, episodes: int, seed: int) -> list[float]:
    """Best feasible time after each episode of uniform random valid decisions."""
    rng = np.random.default_rng(seed)
    best, curve = float("inf"), []
    for _ in range(episodes):
        process.reset()
        while not process.done():
            process.step(int(rng.choice(np.flatnonzero(process.action_mask()))))
        time_s, feasible, _ = process.result()
        if feasible:
            best = min(best, time_s)
        curve.append(best)
    return curve
