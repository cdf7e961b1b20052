"""The hybrid task as a sequential decision process, for the DQN (`automap.rl`).

hybrid: S (1 included), then the shard task's decisions for one stage (mesh data x model,
one option per unit, ZeRO) on `cluster.with_devices(devices // S)`, then m and Megatron's
2022 techniques as the pipeline task has them (`_staged.py`): recomputation none, selective
or full, sequence parallelism where the stage splits a model axis, and v chunks per device
group or ZB-H1. The cuts are not decisions: the exact stage DP (`optimal_cuts`, between
layers under full recomputation, cut for ZB-H1 under it) places them inside the reward;
with v > 1 they are the S x v chunks of equal layers. Given the rest of the point the
DP's cuts are optimal in its
objective and cost one pass over the tables the reward needs anyway, so the agent spends
its episodes on the choices no exact solver makes for it. S = 1 is the shard task followed
by the recomputation and sequence-parallel decisions (no microbatches, no chunks): the dp
searcher's one-stage plans take them (`_one_stage.py`), and without them the agent could
not reach Korthikanti's 22B row's plan (data 2 x model 4, the stream split, selective),
whose point does not fit plain. A one-stage episode with neither is priced as the shard
task prices it; with either, as the cost model prices the plan (`OneStagePlans`).

Reward as for the pipeline task (`_staged.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from ..._axes import DATA, MODEL
from ..._errors import AutomapError, PlanError
from ..._groups import plan_from_assignment
from ..._plan import Plan
from ..._space import ShardSpace, microbatch_counts, stage_counts
from .._dp import polish_cuts
from .._one_stage import technique_variant
from .._pricer import Intra, PipelinePricer
from ._shard_process import ShardProcess, cost_summary
from ._staged import MICRO, REMAT, SEQPAR, SHARD, STAGES, PipelineProcess, StagedProcess


class HybridProcess(StagedProcess):
    """DecisionProcess of the hybrid task (see the module doc)."""

    def __init__(
        self, pricer: PipelinePricer | None, shard: ShardProcess, plans: OneStagePlans | None = None
    ):
        self.shard_top = shard  # the S = 1 process: the plain shard task
        self.one_stage = plans or OneStagePlans(shard.space)  # shared by `fresh` copies
        self.space = shard.space
        cluster = self.space.cluster
        pipes = (
            stage_counts(cluster.devices, len(pricer.cands), cluster.devices_per_node)
            if pricer is not None
            else []
        )
        if pricer is None:  # no cut candidates: the hybrid space is the shard task's
            pricer = _NoPipeline(shard.space.cost_model)
        super().__init__(pricer, shard.baseline_time, [1, *pipes])
        self.n_actions = max(self.n_actions, shard.n_actions)
        self._subs: dict[int, ShardProcess] = {1: shard}
        self.reset()

    def fresh(self) -> HybridProcess:
        pricer = None if isinstance(self.pricer, _NoPipeline) else self.pricer
        return HybridProcess(pricer, ShardProcess(self.space, self.baseline_time), self.one_stage)

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
        self._reset_techniques()

    def episode_length(self) -> int:
        return 1 + len(self.space.units) + 1 + 3  # S, the units, m, at most 3 techniques

    def phase(self) -> int:
        if self._stages is None:
            return STAGES
        if not self.sub(self._stages).done():
            return SHARD
        if self._stages == 1:
            technique = self._one_stage_phase()
        elif self._m is None:
            return MICRO
        else:
            technique = self._technique_phase(self._base(), self._stages, self._m)
        return SHARD if technique is None else technique  # SHARD: nothing left (done)

    def _one_stage_phase(self) -> int | None:
        """One stage's next technique decision: recomputation, then sequence parallelism
        where the plan splits a model axis; None when both are made."""
        if self._remat is None:
            return REMAT
        if self._sp is None and self.one_stage.sequence_parallel_applies(self._base()):
            return SEQPAR
        return None

    def done(self) -> bool:
        if self._stages is None or not self.sub(self._stages).done():
            return False
        return (self._stages == 1 or self._m is not None) and self.phase() == SHARD

    def decisions(self) -> tuple[int, ...]:
        return tuple(self._actions)

    def _base(self) -> Intra:
        """The stage's shard plan, with no technique."""
        sub = self.sub(self._stages)
        mesh, options, zero = sub.to_point(sub.decisions())
        return Intra.of(sub.space.meshes[mesh], sub.space.assignment(options), zero)

    def _base_intra(self) -> Intra:
        return self._base()

    def _intra(self) -> Intra:
        return self._with_techniques(self._base())

    def _mb_choices(self) -> list[int]:
        sub = self.sub(self._stages)
        data = sub.space.meshes[sub.to_point(sub.decisions())[0]].get(DATA, 1)
        return microbatch_counts(self.pricer.batch, data, self._stages, self.pricer.microbatching)

    def action_mask(self) -> np.ndarray:
        mask = np.zeros(self.n_actions, bool)
        phase = self.phase()
        if phase == STAGES:
            mask[:] = True
        elif self.done():
            pass
        elif phase == SHARD:
            inner = self.sub(self._stages).action_mask()
            mask[: len(inner)] = inner
        elif phase == MICRO:
            mask[: len(self._mb_choices())] = True
        else:
            mask = self._technique_mask(phase, self._stages, self._m)
        return mask

    def step(self, action: int) -> None:
        action, phase = self._checked(action)
        if phase == STAGES:
            self._stages = self._stage_action(action)
            self.sub(self._stages).reset()
        elif phase == SHARD:
            self.sub(self._stages).step(action)
        elif phase == MICRO:
            self._m = self._mb_choices()[action]
        else:
            self._technique_step(phase, action)
        self._actions.append(action)

    def _cuts(self, intra: Intra) -> tuple[int, ...]:
        """The S x v chunks' cuts when interleaved; else the stage DP's, balanced ones when
        no partition fits (priced over memory)."""
        if self._chunks > 1:
            return self.pricer.chunk_cuts(self._stages, self._chunks)
        cuts = self.pricer.optimal(intra, self._stages, self._m, self._split)
        if cuts is None:
            tables = self.pricer.tables(intra, self._m, self._stages)
            cuts = self.pricer.balanced(tables, self._stages, (), self.pricer.pool(intra))
        return cuts

    def running(self) -> tuple[float, bool, float]:
        """Before the pipeline is complete: the shard process's plan so far on one stage's
        devices, as S equal stages with no bubble (time and memory over S). One stage's
        techniques: the plan so far with them."""
        if self._stages is None:
            return self.baseline_time, True, 0.0
        if self._stages > 1 and self.done():
            return self.result()
        if self._stages == 1 and (self._remat or self._sp):
            return self.result()
        time_s, fits, over = self.sub(self._stages).running()
        if self._stages == 1:
            return time_s, fits, over
        over = max(0.0, (1.0 + over) / self._stages - 1.0)
        return time_s / self._stages, over == 0.0, over

    def result(self) -> tuple[float, bool, float]:
        if self._stages == 1:
            intra = self._intra()
            if not intra.remat and not intra.sequence_parallel:
                return self.shard_top.result()
            plan = self.one_stage.plan(intra)
            return cost_summary(plan.predicted) if plan is not None else (np.inf, False, 10.0)
        intra = self._intra()
        cuts = self._cuts(intra)
        cost = self.pricer.price(intra, self._m, cuts, self._chunks, self._split).cost
        return cost_summary(cost)

    def observation(self) -> np.ndarray:
        phase = self.phase()
        if phase == STAGES:
            return self._stage_features()
        if phase == SHARD:
            return self.sub(self._stages).observation()
        mesh = self._base().stage_mesh
        if phase == MICRO:
            return self._micro_features(mesh, self._stages, self._mb_choices())
        return self._technique_features(phase, mesh, self._stages, self._m)

    def to_plan(self, decisions: Sequence[int], name: str = "dqn") -> Plan:
        """The priced Plan of a finished decision sequence; one-chunk pipeline cuts
        polished against the whole pipeline model as the dp searcher does (it only ever
        gets faster; the S x v chunks of an interleaved one are kept equal, as there)."""
        self.reset()
        for a in decisions:
            self.step(a)
        try:
            if self._stages == 1:
                intra = self._intra()
                if intra.remat or intra.sequence_parallel:
                    plan = self.one_stage.plan(intra)
                    if plan is None:  # rewarded as infeasible, never an agent's best
                        raise AutomapError(f"the decisions {tuple(decisions)} make no plan")
                    return dataclasses.replace(plan, name=name)
                point = self.shard_top.to_point(self.shard_top.decisions())
                return self.space.to_plan(*point, name=name)
            intra, chunks = self._intra(), self._chunks
            plan = self.pricer.plan(
                intra, self._m, self._cuts(intra), f"{name} (hybrid)", chunks, self._split
            )
            if chunks > 1 or not plan.predicted.feasible:
                return plan
            pool = self.pricer.pool(intra)
            cands = self.pricer.cands if pool is None else [self.pricer.cands[i] for i in pool]
            return polish_cuts(self.model, plan, tuple(cands))
        finally:
            self.reset()

    def decisions_for(
        self, stages: int, mesh, assignment, zero: int, m: int, techniques: Sequence[int] = ()
    ) -> tuple | None:
        """The decisions of a point given as an assignment (an expert's), if in the space;
        `techniques`: the actions of the technique decisions the point offers, in order
        (recomputation, sequence parallelism, chunks; none, off, one chunk past them or
        where masked)."""
        if stages not in self.stage_choices:
            return None
        inner = self.sub(stages).decisions_for(mesh, assignment, zero)
        if inner is None:
            return None
        self.reset()
        try:
            for a in (self.stage_choices.index(stages), *inner):
                self.step(a)
            if stages > 1:
                choices = self._mb_choices()
                if m not in choices:
                    return None
                self.step(choices.index(m))
            wanted = list(techniques)
            while not self.done():
                action = wanted.pop(0) if wanted else 0
                self.step(action if self.action_mask()[action] else 0)
            return self.decisions()
        finally:
            self.reset()


class OneStagePlans:
    """One-stage plans with the techniques, built and priced by the whole cost model as
    the dp searcher's one-stage walk prices its variants; each once (the agent replays
    its best points)."""

    def __init__(self, space: ShardSpace):
        self.space = space
        self._plans: dict[Intra, Plan | None] = {}

    def sequence_parallel_applies(self, intra: Intra) -> bool:
        """The plan splits its model axis and its stream splits on it."""
        if intra.stage_mesh.get(MODEL, 1) == 1 or MODEL not in intra.assign.values():
            return False
        return self.plan(intra.with_techniques(False, "full", True)) is not None

    def plan(self, intra: Intra) -> Plan | None:
        """`intra` as one stage's plan, priced; None where it cannot be built (a sequence
        the model axis does not divide)."""
        if intra not in self._plans:
            model = self.space.cost_model
            try:
                base = plan_from_assignment(
                    model.graph, model.groups, intra.stage_mesh, intra.assign,
                    name="dqn", zero_stage=intra.zero_stage,
                )  # fmt: skip
                remat = (intra.remat, intra.remat_policy)
                plan = technique_variant(model, base, intra.sequence_parallel, remat)
            except PlanError:
                plan = None
            self._plans[intra] = plan
        return self._plans[intra]


class _NoPipeline:
    """Stands in for the pricer when the step cannot be cut: S = 1 only."""

    cands: tuple[int, ...] = ()
    aligned: tuple[int, ...] = ()
    batch, microbatching = 1, False

    def __init__(self, model):
        self.model = model


def make_pipeline_process(space: ShardSpace, task: str, baseline_time: float):
    """The DecisionProcess of the "pipeline" or "hybrid" task over the shard space of the
    whole cluster (its cost model, groups and pruning)."""

    try:
        pricer = PipelinePricer(space.cost_model)
    except AutomapError:
        if task == "pipeline":
            raise
        pricer = None
    if task == "pipeline":
        return PipelineProcess(pricer, baseline_time)
    return HybridProcess(pricer, ShardProcess(space, baseline_time))
