"""The planning problem as a Gymnasium environment, over any `DecisionProcess`.

A decision process is the sequence of discrete choices that builds one plan (a mesh axis per
linkage group, a cut point, a stage count, ...). Auto-MAP's live in `automap._search._mdp`;
this module only wraps one so that any RL library, and our own agent, can drive it through the Gymnasium API.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Protocol, runtime_checkable

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.envs.registration import EnvSpec

INFEASIBLE_PENALTY = 10.0


@runtime_checkable
class DecisionProcess(Protocol):
    """A finite sequence of masked discrete decisions that ends in a scored plan."""

    obs_dim: int
    """Size of the feature vector: fixed, so that one network serves models of any size."""
    n_actions: int
    """The largest number of choices at any step; the invalid ones are masked."""
    baseline_time: float
    """Step time of data parallelism (or the best expert plan): the reward's unit."""

    def reset(self) -> None: ...
    def observation(self) -> np.ndarray: ...  # [obs_dim] float32
    def action_mask(self) -> np.ndarray: ...  # [n_actions] bool, some True while not done
    def step(self, action: int) -> None: ...
    def done(self) -> bool: ...
    def result(self) -> tuple[float, bool, float]: ...  # (step time s, feasible, over-ratio)
    def decisions(self) -> tuple[int, ...]: ...


@runtime_checkable
class ShapedProcess(DecisionProcess, Protocol):
    """A decision process that can also price the partial plan, for per-step rewards."""

    def running(self) -> tuple[float, bool, float]: ...  # like result(), of the plan so far


def plan_reward(
    time_s: float,
    feasible: bool,
    over_ratio: float,
    baseline_time: float,
    penalty: float = INFEASIBLE_PENALTY,
    log_scale: bool = False,
) -> float:
    """-time / baseline for a feasible plan (data parallel scores -1), or -log(time / baseline)
    with `log_scale`; -(penalty + over-ratio) for an infeasible one, so that of two infeasible
    plans the one less over memory is better."""
    if feasible:
        ratio = float(time_s) / float(baseline_time)
        return -math.log(ratio) if log_scale else -ratio
    return -(penalty + float(over_ratio))


class _MaskedDiscrete(spaces.Discrete):
    """Discrete whose `sample()` draws among the environment's currently valid actions.

    Generic drivers (random agents, `check_env`) sample from the action space without knowing
    about masks; drawing only valid actions lets them run on a masked planning problem.
    """

    def __init__(self, n: int, current_mask: Any, seed: int | None = None):
        super().__init__(n, seed=seed)
        self._current_mask = current_mask

    def sample(self, mask: np.ndarray | None = None, probability: np.ndarray | None = None):
        if mask is None and probability is None:
            mask = self._current_mask().astype(np.int8)
            if not mask.any():  # the episode is over: any action will be refused anyway
                mask = None
        return super().sample(mask=mask, probability=probability)


class PlanningEnv(gym.Env):
    """Gymnasium environment over a decision process.

    `PlanningEnv(process)` wraps a `DecisionProcess` (`automap._search.planning_env(graph,
    cluster, task)` builds the one of an exploration task for a captured program). Each step takes one decision; the reward is 0 until
    the plan is complete, then `plan_reward`. `info["action_mask"]` gives the valid actions
    after every reset and step; taking a masked action raises ValueError.

    `shaping=True` (for a `ShapedProcess`) adds potential-based shaping (Ng et al., 1999)
    whose potential is the `plan_reward` of the plan so far (`running()`: the undecided
    parts as the process fills them in): each step is rewarded by how much it improved
    that, in time or in memory over the limit, and the last step by the finished plan's
    reward less the potential before it. An episode's rewards add up to `plan_reward`
    less the (constant) potential at reset, so the best plan is unchanged, but every
    decision gets its own signal at once rather than a share of one reward at the end.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}

    def __init__(
        self,
        process: Any,
        *,
        infeasible_penalty: float = INFEASIBLE_PENALTY,
        shaping: bool = False,
        log_scale: bool = False,
    ):
        if not isinstance(process, DecisionProcess):
            raise TypeError(
                "PlanningEnv takes a DecisionProcess; for a captured program use "
                f"automap._search.planning_env(graph, cluster, task); got {type(process).__name__}"
            )
        self.process = process
        self.infeasible_penalty = infeasible_penalty
        if shaping and not isinstance(process, ShapedProcess):
            raise TypeError("reward shaping needs a process with running()")
        self.shaping, self.log_scale = shaping, log_scale
        self._potential = 0.0
        # Finite bounds: check_env warns about infinite ones, and features are finite anyway.
        big = np.finfo(np.float32).max
        self.observation_space = spaces.Box(-big, big, (process.obs_dim,), np.float32)
        self.action_space = _MaskedDiscrete(process.n_actions, self._current_mask)
        self._finished = True
        # A spec lets generic tools (gymnasium.make, check_env's render and close checks)
        # rebuild this environment; the process travels in its kwargs.
        self.spec = EnvSpec(
            "automap/Planning-v0",
            entry_point=PlanningEnv,
            kwargs={
                "process": process,
                "infeasible_penalty": infeasible_penalty,
                "shaping": shaping,
                "log_scale": log_scale,
            },
        )

    def _current_mask(self) -> np.ndarray:
        if self._finished:
            return np.zeros(self.process.n_actions, bool)
        return np.asarray(self.process.action_mask(), bool)

    def _observe(self) -> np.ndarray:
        obs = np.array(self.process.observation(), np.float32)  # [obs_dim], a fresh copy
        if obs.shape != (self.process.obs_dim,):
            raise ValueError(
                f"the process's observation has shape {obs.shape}, "
                f"expected ({self.process.obs_dim},)"
            )
        return obs

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.process.reset()
        self._finished = self.process.done()
        if self._finished:
            raise ValueError("the decision process has no decisions to take")
        self._potential = self._running()
        return self._observe(), {"action_mask": self._current_mask()}

    def _running(self) -> float:
        """The potential: the reward the plan so far would get (0 without shaping)."""
        return self._reward(*self.process.running()) if self.shaping else 0.0

    def _reward(self, time_s: float, feasible: bool, over: float) -> float:
        return plan_reward(
            time_s,
            feasible,
            over,
            self.process.baseline_time,
            self.infeasible_penalty,
            log_scale=self.log_scale,
        )

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if self._finished:
            raise RuntimeError("the episode is over: call reset() before step()")
        mask = self._current_mask()
        a = int(action)
        if not 0 <= a < mask.shape[0] or not mask[a]:
            raise ValueError(
                f"action {a} is not valid here; valid actions: {np.flatnonzero(mask).tolist()}"
            )
        self.process.step(a)
        obs = self._observe()
        before = self._potential
        if not self.process.done():
            # Shaped: the step's own change of the partial plan's cost (potential-based, so
            # the episode's rewards still add up to the plan's reward, less a constant).
            self._potential = self._running()
            reward = self._potential - before
            return obs, reward, False, False, {"action_mask": self._current_mask()}
        self._finished = True
        time_s, feasible, over = self.process.result()
        reward = self._reward(time_s, feasible, over) - before
        info = {
            "action_mask": self._current_mask(),
            "step_time_s": float(time_s),
            "feasible": bool(feasible),
            "over_ratio": float(over),
            "decisions": tuple(int(d) for d in self.process.decisions()),
        }
        return obs, reward, True, False, info
