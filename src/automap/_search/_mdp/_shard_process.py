"""The shard space as a sequential decision process, for the DQN agent (`automap.rl`).

An episode is: choose the mesh, then one option per unit (keep whole, split on data, split
on model), the units that hold the batch first and the others in program order (see
`decision_order`), then a ZeRO stage when the mesh has a data axis. Observations
are fixed-size feature vectors of the next decision and of the plan so far, so one network
serves models of any size (and a trained agent can warm-start another model).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from ..._axes import DATA, MODEL
from ..._space import OPTIONS, ShardSpace
from ._observation import N_ACTIONS, OBS_DIM, ShardSlot

_MESH, _UNIT, _ZERO = 0, 1, 2


class ShardProcess:
    """DecisionProcess over a ShardSpace (see automap.rl.DecisionProcess)."""

    obs_dim = OBS_DIM

    def __init__(self, space: ShardSpace, baseline_time: float):
        self.space = space
        self.baseline_time = float(baseline_time)
        self.n_actions = max(N_ACTIONS, len(space.meshes))
        units = space.units
        self.order = decision_order(space)
        self._total_bytes = sum(u.bytes for u in units) or 1.0
        self._total_flops = sum(u.flops for u in units) or 1.0
        self._log_devices = math.log2(max(space.cluster.devices, 2))
        # Per mesh: the cost model's state of the plan with nothing split and its step time;
        # each episode patches it one unit at a time (`CostModel.evaluate_delta`).
        self._whole: dict[int, tuple[object, tuple[float, bool, float]]] = {}
        self.reset()

    def __deepcopy__(self, memo: dict) -> ShardProcess:
        # The space (graph, groups, cost model) is read-only and holds a traced program that
        # cannot be copied: a copy shares it and starts a fresh episode (Gymnasium's spec
        # rebuilds environments by deep-copying their arguments).
        return ShardProcess(self.space, self.baseline_time)

    # ---- the protocol -----------------------------------------------------------------

    def reset(self) -> None:
        self._mesh: int | None = None
        self._options: list[int] = []  # in decision order
        self._taken: list[int | None] = [None] * len(self.space.units)  # in the space's order
        self._zero: int | None = None
        self._actions: list[int] = []
        # (step time s, fits, over-ratio) of the partial plan, undecided units whole; before
        # the mesh is chosen, the baseline's time (a constant: the first potential).
        self._running = (self.baseline_time, True, 0.0)
        self._cost_state = None  # the cost model's state of the partial plan

    def _phase(self) -> int:
        if self._mesh is None:
            return _MESH
        if len(self._options) < len(self.space.units):
            return _UNIT
        return _ZERO

    def done(self) -> bool:
        if self._mesh is None or len(self._options) < len(self.space.units):
            return False
        return self._zero is not None or len(self._zero_options()) == 1

    def _zero_options(self) -> tuple[int, ...]:
        # The options are taken in decision order (`self.order`); the space reads them by
        # unit, and not all are taken before the last one.
        by_unit: list[int | None] = [None] * len(self.space.units)
        for u, k in zip(self.order, self._options, strict=False):
            by_unit[u] = k
        return self.space.zero_options(self.space.meshes[self._mesh], by_unit)

    def action_mask(self) -> np.ndarray:
        mask = np.zeros(self.n_actions, bool)
        phase = self._phase()
        if phase == _MESH:
            # Every action is valid here (Gymnasium's checker replays a sampled action after
            # a reset): actions past the last mesh choose the last one. Meshes are ordered by
            # model-axis size, so action k means the same on 16 devices as on 32 (transfer).
            mask[:] = True
        elif phase == _UNIT:
            mesh = self.space.meshes[self._mesh]
            allowed = self.space.allowed(mesh, self.order[len(self._options)], self._taken)
            mask[: len(OPTIONS)] = allowed
        else:
            mask[list(self._zero_options())] = True
        return mask

    def step(self, action: int) -> None:
        action = int(action)
        if not self.action_mask()[action]:
            raise ValueError(f"action {action} is masked in this state")
        self._actions.append(action)
        phase = self._phase()
        if phase == _MESH:
            self._mesh = min(action, len(self.space.meshes) - 1)
            self._cost_state, self._running = self._whole_plan(self._mesh)
        elif phase == _UNIT:
            u = self.order[len(self._options)]
            unit = self.space.units[u]
            self._options.append(action)
            self._taken[u] = action
            # Undecided units count as kept whole, so keeping this one whole changes nothing;
            # a split patches only the rows its groups touch.
            if OPTIONS[action] is not None:
                change = {g: OPTIONS[action] for g in unit.groups}
                cost, self._cost_state = self.space.cost_model.evaluate_delta(
                    self._cost_state, change
                )
                self._running = cost_summary(cost)
        else:
            self._zero = action

    def _whole_plan(self, mesh_index: int) -> tuple[object, tuple[float, bool, float]]:
        if mesh_index not in self._whole:
            mesh = self.space.meshes[mesh_index]
            state = self.space.cost_model.state({}, mesh)
            self._whole[mesh_index] = (
                state,
                cost_summary(self.space.cost_model.evaluate({}, mesh)),
            )
        return self._whole[mesh_index]

    def running(self) -> tuple[float, bool, float]:
        """(step time s, fits, over-ratio) of the partial plan, undecided units whole and
        ZeRO off: the potential of the DQN's shaped rewards (automap.rl.ShapedProcess)."""
        return self._running

    def result(self) -> tuple[float, bool, float]:
        cost = self.space.evaluate(self._mesh, self._taken, zero_stage=self._zero or 0)
        return cost_summary(cost)

    def decisions(self) -> tuple[int, ...]:
        return tuple(self._actions)

    def observation(self) -> np.ndarray:
        obs = np.zeros(OBS_DIM, np.float32)
        phase = self._phase()
        obs[ShardSlot.PHASE + phase] = 1.0
        n_units = max(len(self.space.units), 1)
        obs[ShardSlot.PROGRESS] = len(self._options) / n_units
        if self._mesh is not None:
            mesh = self.space.meshes[self._mesh]
            obs[ShardSlot.LOG_DATA] = math.log2(mesh.get(DATA, 1)) / self._log_devices
            obs[ShardSlot.LOG_MODEL] = math.log2(mesh.get(MODEL, 1)) / self._log_devices
            outer = float(next(iter(mesh)) == MODEL) if len(mesh) > 1 else 0.0
            obs[ShardSlot.MODEL_OUTER] = outer
        time_s, _, over = self._running
        obs[ShardSlot.RUNNING_TIME] = min(time_s / self.baseline_time, 10.0) / 10.0
        if phase == _UNIT:
            self._unit_features(obs)
        for u, k in zip(self.order, self._options, strict=False):
            obs[ShardSlot.BYTES_SPLIT + k] += self.space.units[u].bytes / self._total_bytes
        obs[ShardSlot.UNITS] = len(self.space.units) / 256.0
        obs[ShardSlot.LOG_DEVICES] = self._log_devices / 10.0
        obs[ShardSlot.ZERO_ALLOWED] = 1.0 if self.space.pruning.zero else 0.0
        obs[ShardSlot.OVER] = min(over, 10.0) / 10.0
        obs[ShardSlot.FITS] = float(over == 0.0)
        return obs

    def _unit_features(self, obs: np.ndarray) -> None:
        i = self.order[len(self._options)]
        unit = self.space.units[i]
        mesh = self.space.meshes[self._mesh]
        obs[ShardSlot.UNIT_BYTES] = unit.bytes / self._total_bytes
        obs[ShardSlot.UNIT_FLOPS] = unit.flops / self._total_flops
        obs[ShardSlot.UNIT_PARAMS] = float(unit.params)
        obs[ShardSlot.UNIT_BATCH] = float(unit.batch)
        obs[ShardSlot.UNIT_POSITION] = unit.position
        obs[ShardSlot.DATA_DIVIDES] = float(unit.divisor % mesh.get(DATA, 1) == 0)
        obs[ShardSlot.MODEL_DIVIDES] = float(unit.divisor % mesh.get(MODEL, 1) == 0)
        neighbours = self.space.neighbours[i]
        decided = [self._taken[v] for v in neighbours if self._taken[v] is not None]
        if decided:
            obs[ShardSlot.NEIGHBOURS_DATA] = sum(k == 1 for k in decided) / len(decided)
            obs[ShardSlot.NEIGHBOURS_MODEL] = sum(k == 2 for k in decided) / len(decided)
        obs[ShardSlot.NEIGHBOURS] = len(neighbours) / max(len(self.space.units), 1)

    # ---- to and from plans ------------------------------------------------------------

    def to_point(self, decisions: Sequence[int]) -> tuple[int, tuple[int, ...], int]:
        """(mesh index, options in the space's unit order, ZeRO stage) of a decision sequence."""
        mesh, rest = min(decisions[0], len(self.space.meshes) - 1), list(decisions[1:])
        n = len(self.space.units)
        options = [0] * n
        for u, k in zip(self.order, rest[:n], strict=True):
            options[u] = k
        zero = rest[n] if len(rest) > n else 0
        return mesh, tuple(options), zero

    def decisions_for(
        self, mesh: Mapping[str, int], assignment: Mapping[int, str | None], zero_stage: int
    ) -> tuple[int, ...] | None:
        """The decision sequence of a plan given as an assignment (an expert plan), if it is
        a point of this space (same mesh, every unit's groups on one option, not masked)."""
        if dict(mesh) not in self.space.meshes:
            return None
        mesh_index = self.space.meshes.index(dict(mesh))
        options: list[int] = []
        for u, unit in enumerate(self.space.units):
            chosen = {assignment.get(g) for g in unit.groups}
            if len(chosen) != 1:
                return None
            k = OPTIONS.index(chosen.pop())
            if not self.space.allowed(self.space.meshes[mesh_index], u, options)[k]:
                return None
            options.append(k)
        zeros = self.space.zero_options(self.space.meshes[mesh_index], options)
        if zero_stage not in zeros:
            return None
        tail = (zero_stage,) if len(zeros) > 1 else ()
        # A complete plan passes the masks in any order (they forbid pairs of units), so
        # checking them in the space's order above is checking them in the decision order.
        return (mesh_index, *(options[u] for u in self.order), *tail)


def decision_order(space: ShardSpace) -> list[int]:
    """The order in which an episode decides the units: those holding the batch first, then
    the others in program order.

    The shaped reward prices each partial plan with its undecided units kept whole. Decided
    last (in program order t5-large's batch unit is the last of its 11), the batch leaves
    every earlier step priced as if the whole batch ran on every device: the cost of a
    weight split then mostly measures the compute it divides, so the agent learns to split
    weights (Megatron) rather than data. t5-large on a100 x 16 stayed at the
    Megatron x data plan (1.105x the optimum) that way; the optimum splits the batch 8-way
    and only a few weights on the other axis, seven units away from any expert plan, each
    single step of which is slower. Deciding the batch first makes every later reward a
    change against a data-parallel plan.
    """
    units = space.units
    return sorted(range(len(units)), key=lambda u: (not units[u].batch, u))


def cost_summary(cost) -> tuple[float, bool, float]:
    """(step time s, fits, how far over the memory limit as a ratio) of a Cost."""
    over = max(0.0, cost.memory_bytes / max(cost.memory_limit_bytes, 1.0) - 1.0)
    return cost.step_time_s, cost.feasible, over
