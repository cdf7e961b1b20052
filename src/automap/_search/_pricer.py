"""Pricing many pipelines of one program fast, for the DQN's pipeline and hybrid tasks.

A search prices thousands of (intra-stage plan, microbatches, cuts) points that share
almost everything, so the pricer caches at every level:

- the per-op costs of an intra-stage plan (`op_costs`), once per plan;
- the finest partition (every cut candidate a boundary) and its per-segment tables (time
  per microbatch, state and activation bytes, the send lag after the segment), once per
  (plan, microbatches): what the stage DP reads, and what the agent's features are made of;
- a coarse partition is the finest one with its segments merged: the stage of every op is
  a monotone function of the stage it has in the finest partition (forward ops by range,
  backward ops by the lowest stage they read, updates by their largest input, all of which
  commute with a monotone map), so it costs an index lookup instead of a `partition` call;
- the full pipeline cost (`stage_costs`) of each point priced.

Cuts are candidate indices here: cut i starts a stage at `cands[i]` (the segment i + 1 of
the finest partition).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from .._cost import (
    PipelineCost,
    estimate_pipeline,
    op_costs,
    pipeline_decisions,
    stage_costs,
)
from .._errors import AutomapError, PlanError
from .._pipeline import (
    Partition,
    cut_candidates,
    partition,
    pipeline_plan,
    pipeline_schedule,
)
from .._plan import Plan
from .._space import Point
from ._dp import one_chunk, optimal_cuts


@dataclasses.dataclass(frozen=True)
class Intra:
    """One intra-stage plan: every stage runs it on its own copy of the stage mesh."""

    mesh: tuple[tuple[str, int], ...]
    assignment: tuple[tuple[int, str], ...]  # group -> axis; groups kept whole left out
    zero_stage: int = 0
    remat: bool = False

    @classmethod
    def of(
        cls,
        mesh: Mapping[str, int],
        assignment: Mapping[int, str | None],
        zero_stage: int = 0,
        remat: bool = False,
    ) -> Intra:
        split = tuple(sorted((g, a) for g, a in assignment.items() if a is not None))
        return cls(tuple(mesh.items()), split, int(zero_stage), bool(remat))

    @property
    def stage_mesh(self) -> dict[str, int]:
        return dict(self.mesh)

    @property
    def assign(self) -> dict[int, str]:
        return dict(self.assignment)


@dataclasses.dataclass(frozen=True, eq=False)
class PipelineTables:
    """Per segment of the finest partition, for one intra-stage plan and microbatch count."""

    time: np.ndarray  # [L] seconds per microbatch (forward + backward + remat)
    state: np.ndarray  # [L] parameter, gradient and optimizer bytes per device
    act: np.ndarray  # [L] activation bytes per device per microbatch held for backward
    send: np.ndarray  # [L] lag of a microbatch crossing the boundary after it (0 after last)

    def span(self, x: np.ndarray, first: int, last: int) -> float:
        return float(x[first : last + 1].sum())


class PipelinePricer:
    """Prices pipelines of one program on one cost model (see the module doc)."""

    def __init__(self, model, schedule: str = "1f1b"):
        graph, groups = model.graph, model.groups
        self.model, self.schedule = model, pipeline_schedule(schedule)
        one_chunk(pipeline_schedule(schedule))
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
        self.batch = groups.batch_size
        self._seg = np.asarray(self.fine.op_stage)
        self._per_mb = np.array([p.per_microbatch for p in self.fine.op_phase])
        self._oc: dict[Intra, object] = {}
        self._tables: dict[tuple[Intra, int], PipelineTables] = {}
        self._priced: dict[tuple[Intra, int, tuple[int, ...]], PipelineCost] = {}
        self._optimal: dict[tuple[Intra, int, int], tuple[int, ...] | None] = {}

    @property
    def n_segments(self) -> int:
        return self.fine.n_stages

    def op_costs(self, intra: Intra):
        if intra not in self._oc:
            self._oc[intra] = op_costs(
                self.model,
                intra.assign,
                intra.stage_mesh,
                zero_stage=intra.zero_stage,
                remat=intra.remat,
            )
        return self._oc[intra]

    def tables(self, intra: Intra, microbatches: int) -> PipelineTables:
        key = (intra, microbatches)
        if key not in self._tables:
            pc = stage_costs(
                self.model, self.fine, self.op_costs(intra), microbatches, self.schedule
            )
            L = self.n_segments
            run = np.where(self._per_mb, pc.op_run_s + pc.op_remat_s, 0.0)
            self._tables[key] = PipelineTables(
                time=np.bincount(self._seg, run, minlength=L),
                state=np.bincount(self._seg, pc.op_state_bytes, minlength=L),
                act=np.bincount(self._seg, pc.op_act_bytes, minlength=L),
                send=np.append(np.asarray(pc.send_s, dtype=float), 0.0),
            )
        return self._tables[key]

    def coarse(self, cuts: Sequence[int]) -> Partition:
        """The partition with stages starting at candidates `cuts` (ascending indices)."""
        starts = np.asarray(cuts, dtype=int) + 1  # the first segment of stages 1..S-1
        stage = np.searchsorted(starts, self._seg, side="right")
        return dataclasses.replace(
            self.fine, n_stages=len(cuts) + 1, op_stage=tuple(int(s) for s in stage)
        )

    def price(self, intra: Intra, microbatches: int, cuts: Sequence[int]) -> PipelineCost:
        key = (intra, microbatches, tuple(cuts))
        if key not in self._priced:
            self._priced[key] = stage_costs(
                self.model,
                self.coarse(cuts),
                self.op_costs(intra),
                microbatches,
                self.schedule,
            )
        return self._priced[key]

    # ---- where cuts go ------------------------------------------------------------------

    def cut_range(self, stages: int, cuts: Sequence[int]) -> tuple[int, int]:
        """Candidate indices the next cut may take so that this stage and every one after
        it keeps at least one segment."""
        first = cuts[-1] + 1 if cuts else 0  # the first segment of the current stage
        after = stages - 1 - len(cuts)  # stages after the current one
        return first, self.n_segments - 1 - after

    def balanced_cut(self, tables: PipelineTables, stages: int, cuts: Sequence[int]) -> int:
        """The next cut that gives the current stage an equal share of the remaining
        per-microbatch time."""
        lo, hi = self.cut_range(stages, cuts)
        done = np.concatenate([[0.0], np.cumsum(tables.time)])  # [L+1]
        target = (done[-1] - done[lo]) / (stages - len(cuts))
        own = done[lo + 1 : hi + 2] - done[lo]  # the stage's time if cut at lo..hi
        return lo + int(np.argmin(np.abs(own - target)))

    def balanced(
        self, tables: PipelineTables, stages: int, cuts: Sequence[int] = ()
    ) -> tuple[int, ...]:
        """`cuts` completed with balanced cuts."""
        out = list(cuts)
        while len(out) < stages - 1:
            out.append(self.balanced_cut(tables, stages, out))
        return tuple(out)

    def stage_memory(
        self, tables: PipelineTables, stages: int, microbatches: int, cuts, cut
    ) -> float:
        """Bytes per device of the current stage if it ends at candidate `cut`."""
        first = cuts[-1] + 1 if cuts else 0
        copies = self.schedule.in_flight(stages, microbatches)[len(cuts)]
        return tables.span(tables.state, first, cut) + copies * tables.span(tables.act, first, cut)

    def optimal(self, intra: Intra, stages: int, microbatches: int) -> tuple[int, ...] | None:
        """The stage DP's cuts (candidate indices) for one point; None when none fits."""
        key = (intra, stages, microbatches)
        if key not in self._optimal:
            point = Point(stages, intra.stage_mesh, microbatches, "dqn")
            oc = self.op_costs(intra)
            found = optimal_cuts(self.model, self.fine, self.cands, oc, point, self.schedule)
            index = {c: i for i, c in enumerate(self.cands)}
            self._optimal[key] = None if found is None else tuple(index[c] for c in found)
        return self._optimal[key]

    def plan(self, intra: Intra, microbatches: int, cuts: Sequence[int], name: str) -> Plan:
        """The Plan of a point, priced by the pipeline cost model from scratch."""
        model = self.model
        plan = pipeline_plan(
            model.graph,
            model.groups,
            tuple(self.cands[i] for i in cuts),
            intra.stage_mesh,
            intra.assign,
            microbatches,
            self.schedule.name,
            name=name,
            zero_stage=intra.zero_stage,
        )
        plan = dataclasses.replace(plan, remat=intra.remat)
        return priced(model, plan)


def priced(model, plan: Plan) -> Plan:
    """`plan` with its pipeline cost and the report's per-stage decisions."""
    pc = estimate_pipeline(model, plan)
    return dataclasses.replace(
        plan, predicted=pc.cost, decisions={**plan.decisions, **pipeline_decisions(pc)}
    )
