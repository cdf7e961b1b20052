"""The pipeline and hybrid tasks as sequential decision processes, for the DQN (`automap.rl`).

Both use the shard task's conventions (`automap._process`: OBS_DIM features, N_ACTIONS
actions, every first action valid) so that one network serves every task.

pipeline: the stage count S, the microbatch count m, then the S - 1 cuts one by one. The
intra-stage plan is fixed per S: data parallel over the stage's devices, or Megatron x data
(tensor parallel inside the node), whichever the quick evaluation (balanced cuts, the most
microbatches) prices faster. A cut action is relative to where the cut would balance the
remaining time: offsets -2..+2 candidates from that balanced cut, the first or the last
candidate that still leaves every later stage a segment, or the candidate in range with the
cheapest send. Candidates outside [first, last] are masked: no stage is ever empty.

hybrid: S (1 included), then the shard task's decisions for one stage (mesh data x model,
one option per unit, ZeRO) on `cluster.with_devices(devices // S)`, then m and
rematerialization. The cuts are not decisions: the exact stage DP (`_optimal_cuts`) places
them inside the reward. Given the rest of the point the DP's cuts are optimal in its
objective and cost one pass over the tables the reward needs anyway, so the agent spends
its episodes on the choices no exact solver makes for it. S = 1 is the plain shard task.

Reward (through `rl.plan_reward`): minus the simulated pipeline step time relative to data
parallelism; an over-memory stage is penalized by how far over.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .._expert import DATA, MODEL, _assign, batch_groups, block_groups
from .._graph import Role
from .._plan import Plan
from .._process import N_ACTIONS, OBS_DIM, ShardProcess, _summary
from .._space import ShardSpace
from ._pricer import Intra, PipelinePricer
from ._search import _polish, microbatch_counts, stage_counts

_STAGES, _MICRO, _REMAT, _CUT, _SHARD = range(5)
OFFSETS = (-2, -1, 0, 1, 2)  # cut actions 0..4: candidates from the balanced cut
_FIRST, _LAST, _CHEAPEST = 5, 6, 7  # cut actions 5..7


class _Base:
    """What both tasks share: the stage-count choice and the pipeline features."""

    obs_dim = OBS_DIM

    def __init__(self, pricer: PipelinePricer, baseline_time: float, stage_choices):
        self.pricer, self.model = pricer, pricer.model
        self.cluster = self.model.cluster
        self.baseline_time = float(baseline_time)
        self.stage_choices = tuple(stage_choices)
        most_mb = len(microbatch_counts(pricer.batch, 1, 1, pricer.microbatching))
        self.n_actions = max(N_ACTIONS, len(self.stage_choices), most_mb)
        self._log_devices = math.log2(max(self.cluster.devices, 2))
        graph = self.model.graph
        # Parameters, their gradients and the optimizer state: the memory S stages share.
        state = 2 * graph.role_bytes(Role.PARAM) + graph.role_bytes(Role.OPT_STATE)
        self._state_per_limit = state / self.cluster.memory_limit

    def _features(self, phase: int, mesh, stages: int, m: int | None, a, b) -> np.ndarray:
        """[OBS_DIM]: [0:3] off (the shard phases), [3] progress, [4:7] data, model and
        pipe axes (log, of the devices), [7] running cost, [8] phase, [9] microbatches,
        [10:18] and [18:26] two features per action (see each phase)."""
        obs = np.zeros(OBS_DIM, np.float32)
        obs[3] = len(self._actions) / max(self._length(), 1)
        obs[4] = math.log2(mesh.get(DATA, 1)) / self._log_devices
        obs[5] = math.log2(mesh.get(MODEL, 1)) / self._log_devices
        obs[6] = math.log2(stages) / self._log_devices
        time_s, _, over = self.running()
        obs[7] = min(time_s / self.baseline_time + over, 10.0) / 10.0
        obs[8] = (1 + phase) / 4.0
        obs[9] = math.log2(m) / 11.0 if m else 0.0
        obs[10 : 10 + len(a)] = np.clip(a, 0.0, 1.0)[:8]
        obs[18 : 18 + len(b)] = np.clip(b, 0.0, 1.0)[:8]
        return obs

    def _stage_features(self) -> np.ndarray:
        """Per stage-count action: log S, and the model's state per stage over the limit."""
        s = np.array(self.stage_choices, float)
        return self._features(
            _STAGES, {}, 1, None, np.log2(s) / self._log_devices, self._state_per_limit / s / 4
        )

    def _micro_features(self, mesh, stages: int, choices) -> np.ndarray:
        """Per microbatch action: the textbook bubble share, and log m."""
        m = np.array(choices, float)
        return self._features(
            _MICRO, mesh, stages, None, (stages - 1) / (m + stages - 1), np.log2(m) / 11
        )

    def _stage_action(self, action: int) -> int:
        # Every action is valid (a checker replays a sampled action after a reset): past the
        # last choice means the last one, as the shard task's meshes.
        return self.stage_choices[min(action, len(self.stage_choices) - 1)]

    def __deepcopy__(self, memo: dict):
        # The cost model holds a traced program that cannot be copied; a copy shares it and
        # starts a fresh episode (Gymnasium's spec deep-copies the environment's arguments).
        return self._fresh()


class PipelineProcess(_Base):
    """DecisionProcess of the pipeline task (see the module doc)."""

    def __init__(self, pricer: PipelinePricer, baseline_time: float, stage_choices=None):
        devices = pricer.model.cluster.devices
        choices = stage_choices or stage_counts(devices, len(pricer.cands))
        super().__init__(pricer, baseline_time, choices)
        self._intra: dict[int, Intra] = {}
        self.reset()

    def _fresh(self) -> PipelineProcess:
        return PipelineProcess(self.pricer, self.baseline_time, self.stage_choices)

    def reset(self) -> None:
        self._actions: list[int] = []
        self._stages: int | None = None
        self._m: int | None = None
        self._cuts: list[int] = []

    def _length(self) -> int:
        return 2 + (self._stages or 2) - 1

    def _phase(self) -> int:
        if self._stages is None:
            return _STAGES
        return _MICRO if self._m is None else _CUT

    def done(self) -> bool:
        return self._stages is not None and len(self._cuts) == self._stages - 1

    def decisions(self) -> tuple[int, ...]:
        return tuple(self._actions)

    def intra(self, stages: int) -> Intra:
        """The intra-stage plan of S stages: data parallel or Megatron x data, whichever
        prices faster (fitting first) with balanced cuts and the most microbatches."""
        if stages not in self._intra:
            groups, per = self.model.groups, self.cluster.devices // stages
            data = _assign(batch_groups(groups), DATA, per)
            options = [Intra.of({DATA: per}, data)]
            tp = min(self.cluster.devices_per_node, per)
            block = _assign(block_groups(groups), MODEL, tp)
            if tp > 1 and block:
                mesh = {k: v for k, v in ((DATA, per // tp), (MODEL, tp)) if v > 1}
                options.append(
                    Intra.of(mesh, {**_assign(batch_groups(groups), DATA, per // tp), **block})
                )

            def quick(intra: Intra):
                m = self.micro_choices(intra, stages)[-1]
                tables = self.pricer.tables(intra, m)
                time_s, fits, over = _summary(
                    self.pricer.price(intra, m, self.pricer.balanced(tables, stages)).cost
                )
                return (not fits, over, time_s)

            self._intra[stages] = min(options, key=quick)
        return self._intra[stages]

    def micro_choices(self, intra: Intra, stages: int) -> list[int]:
        data = intra.stage_mesh.get(DATA, 1)
        return microbatch_counts(self.pricer.batch, data, stages, self.pricer.microbatching)

    def _targets(self) -> list[int | None]:
        """The candidate index of each cut action, None where masked."""
        tables = self.pricer.tables(self.intra(self._stages), self._m)
        lo, hi = self.pricer.cut_range(self._stages, self._cuts)
        mid = self.pricer.balanced_cut(tables, self._stages, self._cuts)
        cheapest = lo + int(np.argmin(tables.send[lo : hi + 1]))
        out: list[int | None] = []
        for i in [mid + o for o in OFFSETS] + [lo, hi, cheapest]:
            ok = lo <= i <= hi and i not in out  # an alias of an earlier action is masked
            out.append(i if ok else None)
        return out + [None] * (self.n_actions - len(out))

    def action_mask(self) -> np.ndarray:
        mask = np.zeros(self.n_actions, bool)
        phase = self._phase()
        if phase == _STAGES:
            mask[:] = True
        elif phase == _MICRO:
            mask[: len(self.micro_choices(self.intra(self._stages), self._stages))] = True
        elif not self.done():
            mask[:] = [t is not None for t in self._targets()]
        return mask

    def step(self, action: int) -> None:
        action = int(action)
        if not self.action_mask()[action]:
            raise ValueError(f"action {action} is masked in this state")
        phase = self._phase()
        if phase == _STAGES:
            self._stages = self._stage_action(action)
        elif phase == _MICRO:
            self._m = self.micro_choices(self.intra(self._stages), self._stages)[action]
        else:
            self._cuts.append(self._targets()[action])
        self._actions.append(action)

    def _point(self) -> tuple[Intra, int, tuple[int, ...]]:
        """The plan so far: undecided microbatches the most, undecided cuts balanced."""
        intra = self.intra(self._stages)
        m = self._m or self.micro_choices(intra, self._stages)[-1]
        cuts = self.pricer.balanced(self.pricer.tables(intra, m), self._stages, self._cuts)
        return intra, m, cuts

    def running(self) -> tuple[float, bool, float]:
        """(step time s, fits, over-ratio) of the plan so far (`_point`); the baseline
        before the stage count is chosen."""
        if self._stages is None:
            return self.baseline_time, True, 0.0
        return _summary(self.pricer.price(*self._point()).cost)

    def result(self) -> tuple[float, bool, float]:
        return self.running()

    def observation(self) -> np.ndarray:
        phase = self._phase()
        if phase == _STAGES:
            return self._stage_features()
        intra = self.intra(self._stages)
        if phase == _MICRO:
            choices = self.micro_choices(intra, self._stages)
            return self._micro_features(intra.stage_mesh, self._stages, choices)
        # Per cut action: the current stage's time per microbatch (its send included) over
        # an equal share, and its memory per device over the limit.
        tables, S = self.pricer.tables(intra, self._m), self._stages
        first = self._cuts[-1] + 1 if self._cuts else 0
        share = tables.time[first:].sum() / (S - len(self._cuts)) or 1.0
        a, b = np.zeros(self.n_actions), np.zeros(self.n_actions)
        for k, i in enumerate(self._targets() if not self.done() else []):
            if i is not None:
                a[k] = (tables.span(tables.time, first, i) + tables.send[i]) / share / 4
                memory = self.pricer.stage_memory(tables, S, self._m, self._cuts, i)
                b[k] = memory / self.cluster.memory_limit / 2
        return self._features(_CUT, intra.stage_mesh, S, self._m, a, b)

    def to_plan(self, decisions: Sequence[int], name: str = "dqn") -> Plan:
        """The priced Plan of a finished decision sequence."""
        self.reset()
        for a in decisions:
            self.step(a)
        point = self._point()
        self.reset()
        return self.pricer.plan(*point, name=f"{name} ({point[0].stage_mesh}, pipeline)")


class HybridProcess(_Base):
    """DecisionProcess of the hybrid task (see the module doc)."""

    def __init__(self, pricer: PipelinePricer | None, shard: ShardProcess):
        self.shard_top = shard  # the S = 1 process: the plain shard task
        self.space = shard.space
        devices = self.space.cluster.devices
        pipes = stage_counts(devices, len(pricer.cands)) if pricer is not None else []
        if pricer is None:  # no cut candidates: the hybrid space is the shard task's
            pricer = _NoPipeline(shard.space.cost_model)
        super().__init__(pricer, shard.baseline_time, [1, *pipes])
        self.n_actions = max(self.n_actions, shard.n_actions)
        self._subs: dict[int, ShardProcess] = {1: shard}
        self.reset()

    def _fresh(self) -> HybridProcess:
        pricer = None if isinstance(self.pricer, _NoPipeline) else self.pricer
        return HybridProcess(pricer, ShardProcess(self.space, self.baseline_time))

    def sub(self, stages: int) -> ShardProcess:
        """The shard task of one stage: its mesh, units and ZeRO on devices // S."""
        if stages not in self._subs:
            s = self.space
            cluster = s.cluster.with_devices(s.cluster.devices // stages)
            space = ShardSpace(s.graph, s.groups, cluster, s.cost_model, s.pruning)
            self._subs[stages] = ShardProcess(space, self.baseline_time)
        return self._subs[stages]

    def reset(self) -> None:
        self._actions: list[int] = []
        self._stages: int | None = None
        self._m: int | None = None
        self._remat: bool | None = None

    def _length(self) -> int:
        return 1 + len(self.space.units) + 2

    def _phase(self) -> int:
        if self._stages is None:
            return _STAGES
        if not self.sub(self._stages).done():
            return _SHARD
        return _MICRO if self._m is None else _REMAT

    def done(self) -> bool:
        if self._stages is None or not self.sub(self._stages).done():
            return False
        return self._stages == 1 or self._remat is not None

    def decisions(self) -> tuple[int, ...]:
        return tuple(self._actions)

    def _intra(self) -> Intra:
        sub = self.sub(self._stages)
        mesh, options, zero = sub.to_point(sub.decisions())
        assignment = sub.space.assignment(options)
        return Intra.of(sub.space.meshes[mesh], assignment, zero, bool(self._remat))

    def _mb_choices(self) -> list[int]:
        sub = self.sub(self._stages)
        data = sub.space.meshes[sub.to_point(sub.decisions())[0]].get(DATA, 1)
        return microbatch_counts(self.pricer.batch, data, self._stages, self.pricer.microbatching)

    def action_mask(self) -> np.ndarray:
        mask = np.zeros(self.n_actions, bool)
        phase = self._phase()
        if phase == _STAGES:
            mask[:] = True
        elif phase == _SHARD:
            inner = self.sub(self._stages).action_mask()
            mask[: len(inner)] = inner
        elif phase == _MICRO:
            mask[: len(self._mb_choices())] = True
        elif not self.done():
            mask[:2] = True  # rematerialization off, on
        return mask

    def step(self, action: int) -> None:
        action = int(action)
        if not self.action_mask()[action]:
            raise ValueError(f"action {action} is masked in this state")
        phase = self._phase()
        if phase == _STAGES:
            self._stages = self._stage_action(action)
            self.sub(self._stages).reset()
        elif phase == _SHARD:
            self.sub(self._stages).step(action)
        elif phase == _MICRO:
            self._m = self._mb_choices()[action]
        else:
            self._remat = bool(action)
        self._actions.append(action)

    def _cuts(self, intra: Intra) -> tuple[int, ...]:
        """The stage DP's cuts; balanced ones when no partition fits (priced over memory)."""
        cuts = self.pricer.optimal(intra, self._stages, self._m)
        if cuts is None:
            cuts = self.pricer.balanced(self.pricer.tables(intra, self._m), self._stages)
        return cuts

    def running(self) -> tuple[float, bool, float]:
        """Before the pipeline is complete: the shard process's plan so far on one stage's
        devices, as S equal stages with no bubble (time and memory over S)."""
        if self._stages is None:
            return self.baseline_time, True, 0.0
        if self.done() and self._stages > 1:
            return self.result()
        time_s, fits, over = self.sub(self._stages).running()
        if self._stages == 1:
            return time_s, fits, over
        over = max(0.0, (1.0 + over) / self._stages - 1.0)
        return time_s / self._stages, over == 0.0, over

    def result(self) -> tuple[float, bool, float]:
        if self._stages == 1:
            return self.shard_top.result()
        intra = self._intra()
        return _summary(self.pricer.price(intra, self._m, self._cuts(intra)).cost)

    def observation(self) -> np.ndarray:
        phase = self._phase()
        if phase == _STAGES:
            return self._stage_features()
        if phase == _SHARD:
            return self.sub(self._stages).observation()
        sub = self.sub(self._stages)
        mesh = sub.space.meshes[sub.to_point(sub.decisions())[0]]
        if phase == _MICRO:
            return self._micro_features(mesh, self._stages, self._mb_choices())
        # Rematerialization: the plan so far's memory over the limit says whether it pays.
        over = self.running()[2]
        return self._features(_REMAT, mesh, self._stages, self._m, [0.0, 1.0], [over, over])

    def to_plan(self, decisions: Sequence[int], name: str = "dqn") -> Plan:
        """The priced Plan of a finished decision sequence; pipeline cuts polished against
        the whole pipeline model as the dp searcher does (it only ever gets faster)."""
        self.reset()
        for a in decisions:
            self.step(a)
        try:
            if self._stages == 1:
                return self.space.to_plan(*self.shard_top.to_point(decisions[1:]), name=name)
            intra = self._intra()
            plan = self.pricer.plan(intra, self._m, self._cuts(intra), f"{name} (hybrid)")
            return _polish(self.model, plan, self.pricer.cands) if plan.predicted.feasible else plan
        finally:
            self.reset()

    def decisions_for(self, stages: int, mesh, assignment, zero: int, m: int) -> tuple | None:
        """The decisions of a point given as an assignment (an expert's), if in the space."""
        if stages not in self.stage_choices:
            return None
        inner = self.sub(stages).decisions_for(mesh, assignment, zero)
        if inner is None:
            return None
        if stages == 1:
            return (0, *inner)
        self.reset()
        for a in (self.stage_choices.index(stages), *inner):
            self.step(a)
        choices = self._mb_choices()
        self.reset()
        return (
            (self.stage_choices.index(stages), *inner, choices.index(m), 0)
            if m in choices
            else None
        )


class _NoPipeline:
    """Stands in for the pricer when the step cannot be cut: S = 1 only."""

    cands: tuple[int, ...] = ()
    batch, microbatching = 1, False

    def __init__(self, model):
        self.model = model


def make_pipeline_process(space: ShardSpace, task: str, baseline_time: float):
    """The DecisionProcess of the "pipeline" or "hybrid" task over the shard space of the
    whole cluster (its cost model, groups and pruning)."""
    from .._errors import AutomapError

    try:
        pricer = PipelinePricer(space.cost_model)
    except AutomapError:
        if task == "pipeline":
            raise
        pricer = None
    if task == "pipeline":
        return PipelineProcess(pricer, baseline_time)
    return HybridProcess(pricer, ShardProcess(space, baseline_time))
