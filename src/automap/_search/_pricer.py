"""Pricing many pipelines of one program fast, for the DQN's pipeline and hybrid tasks.

A search prices thousands of (intra-stage plan, microbatches, cuts) points that share
almost everything, so the pricer caches at every level:

- the per-op costs of an intra-stage plan (`op_costs`), once per plan;
- the finest partition (every cut candidate a boundary) and its per-segment tables (time
  per microbatch, state and activation bytes, the bytes and messages sent after the
  segment, timed on the link of the cut between S stages it becomes), once per (plan,
  microbatches, S): the stage DP's own
  (`segment_tables`), what the agent's features are made of;
- a coarse partition is the finest one with its segments merged: the stage of every op is
  a monotone function of the stage it has in the finest partition (forward ops by range,
  backward ops by the lowest stage they read, updates by their largest input, all of which
  commute with a monotone map), so it costs an index lookup instead of a `partition` call;
- the full pipeline cost (`stage_costs`) of each point priced.

An intra-stage plan (`Intra`) carries the decisions of Megatron's 2022 recipe too, so that
the agent chooses them as actions: the recomputation policy (one other than full is priced
on the cost model's variant for it, `CostModel.for_plan`), sequence parallelism (the op costs
of `plan_op_costs` on a plan with the residual stream split) and, per point, the chunks per
device group: interleaved 1F1B with v > 1 runs on `layer_cuts`' S x v chunks of equal
layers (Megatron's virtual pipeline), as the dp searcher's techniques polish tries it, or
ZB-H1 (`split`: each backward split into B and W, the W's deferred into the drain) on one
chunk, its cuts the agent's or the stage DP's cut for it.

Cuts are candidate indices here: cut i starts a stage at `cands[i]` (the segment i + 1 of
the finest partition).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from .._axes import MODEL
from .._cost import (
    PipelineCost,
    estimate_pipeline,
    layout_rate,
    op_costs,
    pipeline_decisions,
    plan_op_costs,
    stage_costs,
)
from .._errors import AutomapError, PlanError
from .._groups import sequence_parallel
from .._pipeline import (
    Partition,
    PipelineSchedule,
    chunked_variant,
    cut_candidates,
    partition,
    pipeline_plan,
    pipeline_schedule,
    split_variant,
)
from .._plan import Plan
from .._remat import aligned_cuts, layer_spans
from .._space import Point, layer_cuts
from ._cut_tables import SegmentTables, optimal_cuts, segment_tables
from ._dp import one_chunk
from ._techniques import CHUNKS, LAYER_UNITS


@dataclasses.dataclass(frozen=True)
class Intra:
    """One intra-stage plan: every stage runs it on its own copy of the stage mesh."""

    mesh: tuple[tuple[str, int], ...]
    assignment: tuple[tuple[int, str], ...]  # group -> axis; groups kept whole left out
    zero_stage: int = 0
    remat: bool = False
    remat_policy: str = "full"  # what `remat` recomputes: one of `REMAT_POLICIES`
    sequence_parallel: bool = False  # the residual stream split on the model axis

    @classmethod
    def of(
        cls,
        mesh: Mapping[str, int],
        assignment: Mapping[int, str | None],
        zero_stage: int = 0,
        remat: bool = False,
        remat_policy: str = "full",
        sequence_parallel: bool = False,
    ) -> Intra:
        split = tuple(sorted((g, a) for g, a in assignment.items() if a is not None))
        policy = remat_policy if remat else "full"  # one key for every plan without remat
        return cls(
            tuple(mesh.items()), split, int(zero_stage), bool(remat), policy,
            bool(sequence_parallel),
        )  # fmt: skip

    def with_techniques(self, remat: bool, remat_policy: str, sequence_parallel: bool) -> Intra:
        """This plan with another recomputation and sequence parallelism."""
        return Intra.of(
            self.stage_mesh, self.assign, self.zero_stage, remat, remat_policy, sequence_parallel
        )

    @property
    def stage_mesh(self) -> dict[str, int]:
        return dict(self.mesh)

    @property
    def assign(self) -> dict[int, str]:
        return dict(self.assignment)


class PipelinePricer:
    """Prices pipelines of one program on one cost model (see the module doc)."""

    def __init__(self, model, schedule: str = "1f1b"):
        graph, groups = model.graph, model.groups
        self.model, self.schedule = model, pipeline_schedule(schedule)
        one_chunk(self.schedule)  # the agent's and the DP's cuts: one chunk per group
        if self.schedule.splits_backward:  # remat actions and chunks assume 1F1B's pricer
            raise PlanError(
                f"the DQN's pipeline search chooses schedule {self.schedule.name!r} itself, as "
                "an action of a '1f1b' search (without recomputation): search with schedule "
                "'1f1b', or price a ZB-H1 configuration with am.Recipe(schedule='zb-h1') or "
                "`automap estimate --schedule zb-h1`."
            )
        self.cands = cut_candidates(graph, groups) if groups.batch_size is not None else ()
        if not self.cands:
            raise AutomapError(
                "this step has no place to cut it into pipeline stages (no batch dimension, "
                "or no repeated layers): search it without the pipeline task."
            )
        bounds = list(zip((0, *self.cands), (*self.cands, len(graph.ops)), strict=True))
        try:  # as the dp searcher: a step that mixes examples runs one microbatch only
            self.fine = partition(graph, groups, bounds, 2)
            self.microbatching = True
        except PlanError:
            self.fine = partition(graph, groups, bounds, 1)
            self.microbatching = False
        # Under full recomputation stages start between layers only (the dp searcher's
        # grid): a cut inside a layer splits its recompute unit, which the cost model prices
        # on a model of its own per cut set.
        whole = set(aligned_cuts(self.cands, layer_spans(graph, groups)))
        self.aligned = tuple(i for i, c in enumerate(self.cands) if c in whole)
        self.batch = groups.batch_size
        self._seg = np.asarray(self.fine.op_stage)
        self._oc: dict[Intra, object] = {}
        self._templates: dict[Intra, Plan | None] = {}
        self._tables: dict[tuple[Intra, int, int], SegmentTables] = {}
        self._priced: dict[tuple, PipelineCost] = {}
        self._optimal: dict[tuple[Intra, int, int], tuple[int, ...] | None] = {}
        self._chunk_cuts: dict[tuple[int, int], tuple[int, ...] | None] = {}
        self._aligned_fine: Partition | None = None

    @property
    def n_segments(self) -> int:
        return self.fine.n_stages

    # ---- the techniques of an intra-stage plan ----------------------------------------

    def _template(self, intra: Intra) -> Plan | None:
        """A two-stage plan of `intra` (its recomputation and sequence parallelism), what
        the cost model reads them from; None where sequence parallelism does not apply
        (no model axis in use, a sequence the tp does not divide, no residual stream)."""
        if intra not in self._templates:
            graph, groups = self.model.graph, self.model.groups
            # The cost model's variant for a policy recomputing whole layers less than in
            # full is built on this plan's cuts: one between layers keeps its units whole.
            whole = intra.remat and intra.remat_policy in LAYER_UNITS and self.aligned
            first = self.aligned[0] if whole and intra.remat_policy != "full" else 0
            plan = pipeline_plan(
                graph, groups, self.cands[first : first + 1], intra.stage_mesh, intra.assign, 1,
                self.schedule.name, zero_stage=intra.zero_stage,
            )  # fmt: skip
            plan = dataclasses.replace(plan, remat=intra.remat, remat_policy=intra.remat_policy)
            try:
                if intra.sequence_parallel:
                    plan = sequence_parallel(graph, groups, plan, MODEL)
            except PlanError:
                plan = None
            self._templates[intra] = plan
        return self._templates[intra]

    def sequence_parallel_applies(self, intra: Intra) -> bool:
        """Whether `intra` can split its residual stream over its model axis."""
        on = intra.with_techniques(intra.remat, intra.remat_policy, True)
        return intra.stage_mesh.get(MODEL, 1) > 1 and self._template(on) is not None

    def model_for(self, intra: Intra):
        """The cost model whose `remat=True` prices `intra`'s recomputation: the base one
        for full recomputation, its variant for any other policy (built once per policy)."""
        if not intra.remat or intra.remat_policy == "full":
            return self.model
        template = self._template(intra.with_techniques(True, intra.remat_policy, False))
        return self.model.for_plan(template)

    def op_costs(self, intra: Intra, microbatches: int):
        """`intra`'s per-op costs in a pipeline of `microbatches`: they depend on it where
        the residual stream is split on a backend that collects on major dims alone (a
        batch-major stream's layout transposes, which a microbatch of one sequence does
        without, `_cost/_seqpar_layout.py`); built once per intra-stage plan elsewhere."""
        per_microbatch = intra.sequence_parallel and layout_rate(self.model.cluster) > 0
        key = (intra, microbatches if per_microbatch else 1)
        if key not in self._oc:
            model = self.model_for(intra)
            if intra.sequence_parallel:
                template = self._template(intra)
                if template is None:
                    raise PlanError(
                        "sequence parallelism does not apply to this intra-stage plan: ask "
                        "`sequence_parallel_applies` first."
                    )
                template = dataclasses.replace(template, microbatches=key[1])
                self._oc[key] = plan_op_costs(model, template)
            else:
                self._oc[key] = op_costs(
                    model, intra.assign, intra.stage_mesh,
                    zero_stage=intra.zero_stage, remat=intra.remat,
                )  # fmt: skip
        return self._oc[key]

    # ---- tables and prices --------------------------------------------------------------

    def tables(self, intra: Intra, microbatches: int, stages: int) -> SegmentTables:
        """The finest partition's segment tables for a pipeline of `stages` stages: the
        stage DP's own (`segment_tables`), so that the agent's features and the DP read
        one price, sends timed on the links between S stages' device groups, each cut on
        its own (not the finest partition's, which crosses nodes where S stages may not)."""
        key = (intra, microbatches, stages)
        if key not in self._tables:
            self._tables[key] = segment_tables(
                self.model_for(intra),
                self.fine,
                self.op_costs(intra, microbatches),
                microbatches,
                self.schedule,
                stages,
            )
        return self._tables[key]

    def coarse(self, cuts: Sequence[int]) -> Partition:
        """The partition with stages starting at candidates `cuts` (ascending indices)."""
        starts = np.asarray(cuts, dtype=int) + 1  # the first segment of stages 1..S-1
        stage = np.searchsorted(starts, self._seg, side="right")
        return dataclasses.replace(
            self.fine, n_stages=len(cuts) + 1, op_stage=tuple(int(s) for s in stage)
        )

    def schedule_for(self, chunks: int, split: bool = False) -> PipelineSchedule:
        """The schedule of `chunks` model chunks per device group (the search's schedule's
        chunked variant past one: interleaved 1F1B); `split`: its split variant (ZB-H1),
        one chunk with each backward split into B and W. Asked only where
        `chunk_choices` and `split_applies` offer them."""
        if split:
            return split_variant(self.schedule)
        return self.schedule if chunks == 1 else chunked_variant(self.schedule, chunks)

    def split_applies(self, stages: int, intra: Intra) -> bool:
        """Whether a point of `stages` stages and `intra` may run the search's schedule's
        split variant (ZB-H1 for 1F1B): a pipeline without recomputation (a split
        backward does not recompute)."""
        return stages > 1 and split_variant(self.schedule) is not None and not intra.remat

    def price(
        self,
        intra: Intra,
        microbatches: int,
        cuts: Sequence[int],
        chunks: int = 1,
        split: bool = False,
    ) -> PipelineCost:
        """The pipeline cost of a point; `chunks` > 1: `cuts` are the S x v chunks';
        `split`: run in ZB-H1 (`schedule_for`)."""
        key = (intra, microbatches, tuple(cuts), chunks, split)
        if key not in self._priced:
            self._priced[key] = stage_costs(
                self.model_for(intra),
                self.coarse(cuts),
                self.op_costs(intra, microbatches),
                microbatches,
                self.schedule_for(chunks, split),
            )
        return self._priced[key]

    # ---- interleaving -------------------------------------------------------------------

    def chunk_cuts(self, stages: int, chunks: int) -> tuple[int, ...] | None:
        """The cuts (candidate indices) of S x v chunks of equal layers (`layer_cuts`),
        or None where the layers do not split so."""
        key = (stages, chunks)
        if key not in self._chunk_cuts:
            index = {c: i for i, c in enumerate(self.cands)}
            try:
                cuts = layer_cuts(self.model.graph, self.model.groups, stages, chunks)
            except PlanError:
                cuts = None
            if cuts is not None and all(c in index for c in cuts):
                self._chunk_cuts[key] = tuple(index[c] for c in cuts)
            else:
                self._chunk_cuts[key] = None
        return self._chunk_cuts[key]

    def chunk_choices(self, stages: int, microbatches: int) -> tuple[int, ...]:
        """Chunks per device group a point may take: one, and 2 or 3 (`CHUNKS`) where the
        search's schedule runs chunked (`chunked_variant`: 1F1B's, interleaved), the microbatches come in whole rounds of S and the layers split
        into S x v equal chunks (as the dp searcher's techniques polish)."""
        out = [1]
        chunked = chunked_variant(self.schedule, CHUNKS[1]) is not None
        if stages > 1 and chunked and microbatches % stages == 0:
            out += [v for v in CHUNKS[1:] if self.chunk_cuts(stages, v) is not None]
        return tuple(out)

    # ---- where cuts go ------------------------------------------------------------------

    def pool(self, intra: Intra) -> tuple[int, ...] | None:
        """The candidates `intra`'s stages may start at: between layers under full
        recomputation or any policy whose unit is a layer (`LAYER_UNITS`), anywhere (None)
        otherwise."""
        return self.aligned if intra.remat and intra.remat_policy in LAYER_UNITS else None

    def cut_choices(
        self, stages: int, cuts: Sequence[int], pool: Sequence[int] | None = None
    ) -> np.ndarray:
        """Candidate indices the next cut may take (ascending) so that this stage and every
        one after it keeps at least one segment; within `pool` (with a pool element for
        each later cut) where given."""
        first = cuts[-1] + 1 if cuts else 0  # the first segment of the current stage
        after = stages - 1 - len(cuts)  # stages after the current one
        if pool is None:
            return np.arange(first, self.n_segments - after)
        inside = np.asarray([i for i in pool if i >= first], dtype=int)
        return inside[: max(len(inside) - (after - 1), 0)]

    def balanced_cut(
        self,
        tables: SegmentTables,
        stages: int,
        cuts: Sequence[int],
        pool: Sequence[int] | None = None,
    ) -> int:
        """The next cut that gives the current stage an equal share of the remaining
        per-microbatch time."""
        choices = self.cut_choices(stages, cuts, pool)
        lo = cuts[-1] + 1 if cuts else 0
        done = np.concatenate([[0.0], np.cumsum(tables.time)])  # [L+1]
        target = (done[-1] - done[lo]) / (stages - len(cuts))
        own = done[choices + 1] - done[lo]  # the stage's time if cut at each choice
        return int(choices[np.argmin(np.abs(own - target))])

    def balanced(
        self,
        tables: SegmentTables,
        stages: int,
        cuts: Sequence[int] = (),
        pool: Sequence[int] | None = None,
    ) -> tuple[int, ...]:
        """`cuts` completed with balanced cuts."""
        out = list(cuts)
        while len(out) < stages - 1:
            out.append(self.balanced_cut(tables, stages, out, pool))
        return tuple(out)

    def stage_memory(
        self, tables: SegmentTables, stages: int, microbatches: int, cuts, cut
    ) -> float:
        """Bytes per device of the current stage if it ends at candidate `cut`."""
        first = cuts[-1] + 1 if cuts else 0
        copies = self.schedule.in_flight(stages, microbatches)[len(cuts)]
        return tables.span(tables.state, first, cut) + copies * tables.span(tables.act, first, cut)

    def optimal(
        self, intra: Intra, stages: int, microbatches: int, split: bool = False
    ) -> tuple[int, ...] | None:
        """The stage DP's cuts (candidate indices) for one point, between layers under full
        recomputation (`pool`), cut for ZB-H1 where `split`; None when none fits."""
        key = (intra, stages, microbatches, split)
        if key not in self._optimal:
            point = Point(stages, intra.stage_mesh, microbatches, "dqn")
            oc, model = self.op_costs(intra, microbatches), self.model_for(intra)
            fine, cands = self.fine, self.cands
            if self.pool(intra) is not None:
                fine, cands = (
                    self._fine_between_layers(),
                    tuple(self.cands[i] for i in self.aligned),
                )
            found = (
                optimal_cuts(model, fine, cands, oc, point, self.schedule_for(1, split))
                if len(cands) >= stages - 1
                else None
            )
            index = {c: i for i, c in enumerate(self.cands)}
            self._optimal[key] = None if found is None else tuple(index[c] for c in found)
        return self._optimal[key]

    def _fine_between_layers(self) -> Partition:
        """The finest partition whose segments start between layers only."""
        if self._aligned_fine is None:
            graph = self.model.graph
            starts = [self.cands[i] for i in self.aligned]
            bounds = list(zip((0, *starts), (*starts, len(graph.ops)), strict=True))
            m = 2 if self.microbatching else 1
            self._aligned_fine = partition(graph, self.model.groups, bounds, m)
        return self._aligned_fine

    def plan(
        self,
        intra: Intra,
        microbatches: int,
        cuts: Sequence[int],
        name: str,
        chunks: int = 1,
        split: bool = False,
    ) -> Plan:
        """The Plan of a point, priced by the pipeline cost model from scratch."""
        model = self.model
        plan = pipeline_plan(
            model.graph,
            model.groups,
            tuple(self.cands[i] for i in cuts),
            intra.stage_mesh,
            intra.assign,
            microbatches,
            self.schedule_for(chunks, split).name,
            name=name,
            zero_stage=intra.zero_stage,
            virtual_stages=chunks,
        )
        plan = dataclasses.replace(plan, remat=intra.remat, remat_policy=intra.remat_policy)
        if intra.sequence_parallel:
            plan = sequence_parallel(model.graph, model.groups, plan, MODEL)
        return priced(model, plan)


def priced(model, plan: Plan) -> Plan:
    """`plan` with its pipeline cost and the report's per-stage decisions."""
    pc = estimate_pipeline(model, plan)
    return dataclasses.replace(
        plan, predicted=pc.cost, decisions={**plan.decisions, **pipeline_decisions(pc)}
    )
