"""The pipeline and hybrid tasks as sequential decision processes, for the DQN (`automap.rl`).

Both use the shard task's conventions (`_observation.py`: OBS_DIM features, N_ACTIONS
actions, every first action valid) so that one network serves every task.

pipeline: the stage count S, the microbatch count m, Megatron's 2022 techniques (below),
then the S - 1 cuts one by one. The intra-stage plan is fixed per S: data parallel over the
stage's devices, or Megatron x data (tensor parallel inside the node), whichever the quick
evaluation (balanced cuts, the most microbatches) prices faster. A cut action is relative to
where the cut would balance the remaining time: offsets -2..+2 candidates from that balanced
cut, the first or the last candidate that still leaves every later stage a segment, or the
candidate in range with the cheapest send. Candidates outside [first, last] are masked: no
stage is ever empty.

The techniques (issue 26), decided after m by both staged tasks, each only where it has a
choice: recomputation none, selective (the attention cores) or full (stages then start
between layers: full is masked where too few such cuts exist); sequence parallelism off or
on, where the stage mesh has a model axis the plan splits and the sequence divides by it;
and the chunks per device group v = 1, 2 or 3, v > 1 being interleaved 1F1B on S x v chunks
of equal layers (no cut decisions then), where the microbatches come in whole rounds of S
and the layers divide; or ZB-H1 (the chunks decision's last action: one chunk, each
backward split into B and W, the W's deferred into the drain), where the recomputation
chosen is none (a split backward does not recompute). Real actions rather than a polish
after the search: three small decisions, each priced in the reward, and the agent learns
which pay on which program.

Reward (through `rl.plan_reward`): minus the simulated pipeline step time relative to data
parallelism; an over-memory stage is penalized by how far over.

The hybrid task composes this with the shard task: `_hybrid.py`.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence

import numpy as np

from ..._axes import DATA, MODEL
from ..._graph import Role
from ..._pipeline import pipeline_schedule, split_variant
from ..._plan import DEFAULT_SCHEDULE, Plan
from ..._space import axis_assignment, batch_groups, block_groups, microbatch_counts, stage_counts
from .._pricer import Intra, PipelinePricer
from .._techniques import CHUNKS, LAYER_UNITS, REMATS
from ._observation import N_ACTIONS, OBS_DIM, PER_ACTION, StagedSlot
from ._shard_process import cost_summary

STAGES, MICRO, REMAT, _CUT, SHARD, SEQPAR, CHUNK = range(7)
#: The decisions' kinds by number, for a reader (`StagedProcess.phase_name`).
PHASE_NAMES = ("stages", "microbatches", "remat", "cut", "shard", "sequence_parallel", "chunks")
N_PHASES = len(PHASE_NAMES)
OFFSETS = (-2, -1, 0, 1, 2)  # cut actions 0..4: candidates from the balanced cut
_FIRST, _LAST, _CHEAPEST = 5, 6, 7  # cut actions 5..7
#: Per recomputation policy, about the share of the forward it runs again (an agent's
#: feature, not a price): the attention cores; those and each layer's elementwise ops
#: between its projections; every op.
RERUN = {"selective": 0.2, "projections": 0.3, "full": 1.0}
#: The chunks decision's last action: ZB-H1 (one chunk, each backward split into B and W).
SPLIT_ACTION = len(CHUNKS)
SPLIT = split_variant(pipeline_schedule(DEFAULT_SCHEDULE))


class StagedProcess(abc.ABC):
    """What both staged tasks (pipeline, hybrid) share: the stage-count choice, the
    microbatch choice and the pipeline features. A subclass is a whole
    `automap.rl.DecisionProcess`; the methods below are the ones this base calls."""

    obs_dim = OBS_DIM
    _actions: list[int]  # the episode's actions so far (set by `reset`)

    @abc.abstractmethod
    def reset(self) -> None:
        """Start a new episode."""

    @abc.abstractmethod
    def phase(self) -> int:
        """The next decision's kind: STAGES, MICRO, REMAT, a cut, or SHARD."""

    def phase_name(self) -> str:
        """The next decision's kind in words (`PHASE_NAMES`)."""
        return PHASE_NAMES[self.phase()]

    @abc.abstractmethod
    def episode_length(self) -> int:
        """How many decisions this episode takes, as far as known."""

    @abc.abstractmethod
    def action_mask(self) -> np.ndarray:
        """[n_actions] bool: the valid actions now."""

    @abc.abstractmethod
    def running(self) -> tuple[float, bool, float]:
        """(step time s, fits, over-ratio) of the partial plan."""

    @abc.abstractmethod
    def fresh(self) -> StagedProcess:
        """A new process over the same pricer, at the start of an episode."""

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

    # ---- the techniques: recomputation, sequence parallelism, chunks -------------------

    def _reset_techniques(self) -> None:
        self._remat: int | None = None  # an index into REMATS
        self._sp: bool | None = None
        self._v: int | None = None
        self._split = False  # ZB-H1: the chunks action past CHUNKS (`SPLIT_ACTION`)

    def _technique_phase(self, base: Intra, stages: int, m: int) -> int | None:
        """The next technique decision of a point whose stages, intra-stage plan and
        microbatches are chosen; None when every one with a choice is made."""
        if self._remat is None:
            return REMAT
        if self._sp is None and self.pricer.sequence_parallel_applies(base):
            return SEQPAR
        if self._v is None and (
            len(self.pricer.chunk_choices(stages, m)) > 1 or self._split_ok(base, stages)
        ):
            return CHUNK
        return None

    def _split_ok(self, base: Intra, stages: int) -> bool:
        """ZB-H1 is a choice: the recomputation chosen is none (`split_applies`)."""
        return self.pricer.split_applies(stages, self._with_techniques(base))

    def _with_techniques(self, base: Intra) -> Intra:
        """`base` with the recomputation and sequence parallelism chosen (none, off while
        undecided)."""
        remat, policy = REMATS[self._remat or 0]
        return base.with_techniques(remat, policy, bool(self._sp))

    @property
    def _chunks(self) -> int:
        return self._v or 1

    def _technique_mask(self, phase: int, stages: int, m: int) -> np.ndarray:
        mask = np.zeros(self.n_actions, bool)
        if phase == REMAT:
            # A policy recomputing whole layers starts stages between them: it needs S - 1
            # such cuts.
            whole_ok = len(self.pricer.aligned) >= stages - 1
            mask[: len(REMATS)] = [not r or p not in LAYER_UNITS or whole_ok for r, p in REMATS]
        elif phase == SEQPAR:
            mask[:2] = True
        else:
            choices = self.pricer.chunk_choices(stages, m)
            mask[: len(CHUNKS)] = [v in choices for v in CHUNKS]
            mask[SPLIT_ACTION] = self._split_ok(self._base_intra(), stages)
        return mask

    @abc.abstractmethod
    def _base_intra(self) -> Intra:
        """The chosen stages' intra-stage plan before the techniques."""

    def _technique_step(self, phase: int, action: int) -> None:
        if phase == REMAT:
            self._remat = action
        elif phase == SEQPAR:
            self._sp = bool(action)
        elif action == SPLIT_ACTION:
            self._v, self._split = 1, True
        else:
            self._v = CHUNKS[action]

    def _technique_features(self, phase: int, mesh, stages: int, m: int) -> np.ndarray:
        """Per action: recomputation, the share of the forward run again (0, then
        `RERUN` per policy); sequence parallelism, off / on; chunks, the bubble
        share of the step on equal stages (ZB-H1's last), and v / 3. The second feature
        of the first two: how far over the memory limit the plan so far is (what they
        trade time for)."""
        over = self.running()[2]
        if phase == REMAT:
            again = [RERUN[p] if r else 0.0 for r, p in REMATS]
            return self._features(phase, mesh, stages, m, again, [over] * len(REMATS))
        if phase == SEQPAR:
            return self._features(phase, mesh, stages, m, [0.0, 1.0], [over] * 2)
        v = np.array([*CHUNKS, 1], float)  # the last: ZB-H1, one chunk
        idle = np.append((stages - 1) / v[:-1], SPLIT.idle_slots(stages, m))
        return self._features(phase, mesh, stages, m, idle / (m + idle), v / 3)

    def _checked(self, action: int) -> tuple[int, int]:
        """(action, phase) for a step; a masked action is a caller's error."""
        action = int(action)
        if not self.action_mask()[action]:
            raise ValueError(f"action {action} is masked in this state")
        return action, self.phase()

    def _features(self, phase: int, mesh, stages: int, m: int | None, a, b) -> np.ndarray:
        """[OBS_DIM]: [0:3] off (the shard phases), [3] progress, [4:7] data, model and
        pipe axes (log, of the devices), [7] running cost, [8] phase, [9] microbatches,
        [10:18] and [18:26] two features per action (see each phase)."""
        obs = np.zeros(OBS_DIM, np.float32)
        obs[StagedSlot.PROGRESS] = len(self._actions) / max(self.episode_length(), 1)
        obs[StagedSlot.LOG_DATA] = math.log2(mesh.get(DATA, 1)) / self._log_devices
        obs[StagedSlot.LOG_MODEL] = math.log2(mesh.get(MODEL, 1)) / self._log_devices
        obs[StagedSlot.LOG_STAGES] = math.log2(stages) / self._log_devices
        time_s, _, over = self.running()
        obs[StagedSlot.RUNNING_TIME] = min(time_s / self.baseline_time + over, 10.0) / 10.0
        obs[StagedSlot.PHASE] = (1 + phase) / N_PHASES
        obs[StagedSlot.LOG_MICRO] = math.log2(m) / 11.0 if m else 0.0
        # Eight slots a feature: a decision of more choices (512 sequences a step offer ten
        # microbatch counts) shows the agent its first eight; the rest are still actions.
        a_at, b_at = StagedSlot.PER_ACTION_A, StagedSlot.PER_ACTION_B
        a, b = (np.clip(np.ravel(x), 0.0, 1.0)[:PER_ACTION] for x in (a, b))
        obs[a_at : a_at + len(a)] = a
        obs[b_at : b_at + len(b)] = b
        return obs

    def _stage_features(self) -> np.ndarray:
        """Per stage-count action: log S, and the model's state per stage over the limit."""
        s = np.array(self.stage_choices, float)
        return self._features(
            STAGES, {}, 1, None, np.log2(s) / self._log_devices, self._state_per_limit / s / 4
        )

    def _micro_features(self, mesh, stages: int, choices) -> np.ndarray:
        """Per microbatch action: the schedule's bubble share on equal stages, and log m."""
        m = np.array(choices, float)
        bubble = self.pricer.schedule.bubble(stages, m)
        return self._features(MICRO, mesh, stages, None, bubble, np.log2(m) / 11)

    def _stage_action(self, action: int) -> int:
        # Every action is valid (a checker replays a sampled action after a reset): past the
        # last choice means the last one, as the shard task's meshes.
        return self.stage_choices[min(action, len(self.stage_choices) - 1)]

    def __deepcopy__(self, memo: dict):
        # The cost model holds a traced program that cannot be copied; a copy shares it and
        # starts a fresh episode (Gymnasium's spec deep-copies the environment's arguments).
        return self.fresh()


class PipelineProcess(StagedProcess):
    """DecisionProcess of the pipeline task (see the module doc)."""

    def __init__(
        self,
        pricer: PipelinePricer,
        baseline_time: float,
        stage_choices=None,
        techniques: bool = True,
    ):
        cluster = pricer.model.cluster
        choices = stage_choices or stage_counts(
            cluster.devices, len(pricer.cands), cluster.devices_per_node
        )
        super().__init__(pricer, baseline_time, choices)
        # False: the 2021 space (no recomputation, sequence parallelism or interleaving),
        # to measure what the agent learns of the microbatches and cuts alone.
        self.techniques = techniques
        self._intra: dict[int, Intra] = {}
        self.reset()

    def fresh(self) -> PipelineProcess:
        return PipelineProcess(self.pricer, self.baseline_time, self.stage_choices, self.techniques)

    def reset(self) -> None:
        self._actions: list[int] = []
        self._stages: int | None = None
        self._m: int | None = None
        self._cuts: list[int] = []
        self._reset_techniques()

    def episode_length(self) -> int:
        cuts = (self._stages or 2) - 1 if self._chunks == 1 else 0
        return 2 + 3 + cuts  # S, m, at most three techniques, the cuts

    def phase(self) -> int:
        if self._stages is None:
            return STAGES
        if self._m is None:
            return MICRO
        if not self.techniques:
            return _CUT
        technique = self._technique_phase(self.intra(self._stages), self._stages, self._m)
        return _CUT if technique is None else technique

    def done(self) -> bool:
        if self.phase() != _CUT:
            return False
        return self._chunks > 1 or len(self._cuts) == self._stages - 1

    def decisions(self) -> tuple[int, ...]:
        return tuple(self._actions)

    def _base_intra(self) -> Intra:
        return self.intra(self._stages)

    def effective(self) -> Intra:
        """The intra-stage plan of the chosen S with the techniques chosen so far."""
        return self._with_techniques(self.intra(self._stages))

    def intra(self, stages: int) -> Intra:
        """The intra-stage plan of S stages: data parallel or Megatron x data, whichever
        prices faster (fitting first) with balanced cuts and the most microbatches."""
        if stages not in self._intra:
            groups, per = self.model.groups, self.cluster.devices // stages
            data = axis_assignment(batch_groups(groups), DATA, per)
            options = [Intra.of({DATA: per}, data)]
            tp = min(self.cluster.devices_per_node, per)
            block = axis_assignment(block_groups(groups), MODEL, tp)
            if tp > 1 and block:
                mesh = {k: v for k, v in ((DATA, per // tp), (MODEL, tp)) if v > 1}
                options.append(
                    Intra.of(
                        mesh, {**axis_assignment(batch_groups(groups), DATA, per // tp), **block}
                    )
                )

            def quick(intra: Intra):
                m = self.micro_choices(intra, stages)[-1]
                tables = self.pricer.tables(intra, m, stages)
                time_s, fits, over = cost_summary(
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
        intra = self.effective()
        tables = self.pricer.tables(intra, self._m, self._stages)
        choices = self.pricer.cut_choices(self._stages, self._cuts, self.pricer.pool(intra))
        mid = self.pricer.balanced_cut(tables, self._stages, self._cuts, self.pricer.pool(intra))
        at = int(np.searchsorted(choices, mid))  # its position among the choices
        # The cut closes stage len(cuts): its send is timed on that cut's link.
        cheapest = int(np.argmin(tables.send_after(len(self._cuts))[choices]))
        out: list[int | None] = []
        for k in [at + o for o in OFFSETS] + [0, len(choices) - 1, cheapest]:
            i = int(choices[k]) if 0 <= k < len(choices) else None
            out.append(i if i not in out else None)  # an alias of an earlier action is masked
        return out + [None] * (self.n_actions - len(out))

    def action_mask(self) -> np.ndarray:
        mask = np.zeros(self.n_actions, bool)
        phase = self.phase()
        if phase == STAGES:
            mask[:] = True
        elif phase == MICRO:
            mask[: len(self.micro_choices(self.intra(self._stages), self._stages))] = True
        elif phase != _CUT:
            mask = self._technique_mask(phase, self._stages, self._m)
        elif not self.done():
            mask[:] = [t is not None for t in self._targets()]
        return mask

    def step(self, action: int) -> None:
        action, phase = self._checked(action)
        if phase == STAGES:
            self._stages = self._stage_action(action)
        elif phase == MICRO:
            self._m = self.micro_choices(self.intra(self._stages), self._stages)[action]
        elif phase != _CUT:
            self._technique_step(phase, action)
        else:
            self._cuts.append(self._targets()[action])
        self._actions.append(action)

    def _point(self) -> tuple[Intra, int, tuple[int, ...], int, bool]:
        """The plan so far: undecided microbatches the most, techniques none, undecided
        cuts balanced; (intra-stage plan, m, cuts, chunks per device group, ZB-H1)."""
        intra = self.effective()
        m = self._m or self.micro_choices(intra, self._stages)[-1]
        if self._chunks > 1:
            cuts = self.pricer.chunk_cuts(self._stages, self._chunks)
            return intra, m, cuts, self._chunks, False
        tables = self.pricer.tables(intra, m, self._stages)
        cuts = self.pricer.balanced(tables, self._stages, self._cuts, self.pricer.pool(intra))
        return intra, m, cuts, 1, self._split

    def running(self) -> tuple[float, bool, float]:
        """(step time s, fits, over-ratio) of the plan so far (`_point`); the baseline
        before the stage count is chosen."""
        if self._stages is None:
            return self.baseline_time, True, 0.0
        return cost_summary(self.pricer.price(*self._point()).cost)

    def result(self) -> tuple[float, bool, float]:
        return self.running()

    def seed(self, stage_index: int) -> tuple[int, ...]:
        """The decisions of the expert recipe at stage count `stage_choices[stage_index]`:
        its quick-picked stages, the most microbatches, no technique, balanced cuts."""
        self.reset()
        self.step(stage_index)
        self.step(len(self.micro_choices(self.intra(self._stages), self._stages)) - 1)
        while not self.done():
            self.step(2 if self.phase() == _CUT else 0)  # offset 0: the balanced cut
        decisions = self.decisions()
        self.reset()
        return decisions

    def observation(self) -> np.ndarray:
        phase = self.phase()
        if phase == STAGES:
            return self._stage_features()
        base = self.intra(self._stages)
        if phase == MICRO:
            choices = self.micro_choices(base, self._stages)
            return self._micro_features(base.stage_mesh, self._stages, choices)
        if phase != _CUT:
            return self._technique_features(phase, base.stage_mesh, self._stages, self._m)
        # Per cut action: the current stage's time per microbatch (its send included) over
        # an equal share, and its memory per device over the limit.
        intra = self.effective()
        S = self._stages
        tables = self.pricer.tables(intra, self._m, S)
        first = self._cuts[-1] + 1 if self._cuts else 0
        share = tables.time[first:].sum() / (S - len(self._cuts)) or 1.0
        a, b = np.zeros(self.n_actions), np.zeros(self.n_actions)
        send = tables.send_after(len(self._cuts))  # on the link of the cut after this stage
        for k, i in enumerate(self._targets() if not self.done() else []):
            if i is not None:
                a[k] = (tables.span(tables.time, first, i) + send[i]) / share / 4
                memory = self.pricer.stage_memory(tables, S, self._m, self._cuts, i)
                b[k] = memory / self.cluster.memory_limit / 2
        return self._features(_CUT, intra.stage_mesh, S, self._m, a, b)

    def to_plan(self, decisions: Sequence[int], name: str = "dqn") -> Plan:
        """The priced Plan of a finished decision sequence."""
        self.reset()
        for a in decisions:
            self.step(a)
        intra, m, cuts, chunks, split = self._point()
        self.reset()
        label = f"{name} ({intra.stage_mesh}, pipeline)"
        return self.pricer.plan(intra, m, cuts, name=label, chunks=chunks, split=split)
