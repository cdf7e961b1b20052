"""The auto and dp searchers' one-stage plan: the ILP's points, with the techniques polish.

The shard space the ILP solves has no recomputation and no sequence parallelism: its MILPs
price a step that keeps every activation, its residual stream whole on every
tensor-parallel device. On a large model no such plan fits (MaxText's 32B Llama on 64 v5p
chips: the fastest point of each mesh needs 480 to 920 GB a chip, of 92), so the one-stage
plan MaxText runs (FSDP x tensor 4, the stream split, `minimal` recomputation) was never
priced, and the planner returned a pipeline 1.05 times slower. So every point the ILP
priced, feasible or not (each mesh's optimum with ZeRO 0 and 2 without a memory limit, and
those under it), is tried with the pipeline polish's variants (`technique_options`:
sequence parallelism where the plan splits the model axis, each recomputation of
`REMATS`), and on a ZeRO-2 point ZeRO-3 too: the memory saver the ILP prices only
without recomputation. Each variant is priced by the whole cost model
(`CostModel.estimate`); the fastest that fits is kept.

Pricing every variant of every point is too much work on the models that need it (some
15 a point, two points or more a mesh; a variant of MaxText's 32B, 13,600 ops, takes 0.3 s
to price, the first of each recomputation policy 10 s more to build its cost-model
variant). So the walk takes the points in the ILP's order (fastest first) and each chain
of a point, a ZeRO stage and a sequence-parallel choice with each recomputation in
`REMATS` order, which the cost model prices cheapest recompute first and leanest last
(tests/pipeline/test_process_techniques.py holds projections between selective and full
in time and memory):

- with a best so far, a chain's fastest variant (no recomputation) first: no faster than
  the best, the chain is done;
- then its leanest (full recomputation): where it does not fit, no variant of the chain
  does;
- then from the fastest: the first that fits is the chain's best, and a variant no faster
  than the best so far ends the chain (the rest are slower still);
- a chain without sequence parallelism is no faster than the ILP's price of its point
  (ZeRO-3 only adds gathers to ZeRO-2): where that is no faster than the best so far, it
  is skipped unpriced;
- of a point's two chains, the split stream's first: its variants hold less (the stream
  split over the model axis) and on a TPU are no slower, so the best it sets lets the
  other chain's fastest variant end that chain (on a GPU, where the split stream's
  transposes can make it slower, the other chain is still walked wherever its point
  prices under the best, as above). Taken the other way, MaxText's 64B row
  spent its work walking the chain without the split stream of a ZeRO-2 point (all four
  of its variants) and stopped one variant before the split-stream plan of the ZeRO-3
  point, 7.13 s where that plan prices 6.91.

Where the backend runs attention as one flash kernel (`Lowering.flash_attention`: the TPU)
and it prices the first point faster, every variant runs it (`_attention_of`): MaxText's
configuration is priced so, and the walk's plans with the attention written out were
slower than it.

Every variant priced is counted as work (`Work`, `VARIANT_WORK` passes over the ops), in
a fixed order, so a budget gives the same plan on any machine; the walk stops when the
work is spent, with the best found so far.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from .._axes import DATA, MODEL
from .._errors import PlanError
from .._groups import plan_from_assignment, sequence_parallel
from .._plan import Cost, Plan
from ._techniques import VARIANT_WORK, technique_options
from ._work import Work

#: The name the one-stage candidate carries among the dp searcher's candidates.
NAME = "dp (one stage, ilp)"


class OneStagePoint(NamedTuple):
    """A one-stage point the ILP priced: its mesh, assignment {group: axis}, ZeRO stage
    and the cost model's cost of it without recomputation (feasible or not)."""

    mesh: Mapping[str, int]
    assignment: Mapping[int, str | None]
    zero_stage: int
    cost: Cost


class _Spent(Exception):
    """The work is spent: the walk ends with the best so far."""


@dataclasses.dataclass
class OneStagePolish:
    """The walk over the points' variants (module doc): the best so far and its work."""

    model: object  # the CostModel
    work: Work
    best: Plan | None = None
    on_variant: Callable[..., None] | None = None  # (best_time=...) after each variant
    priced: int = 0  # variants priced
    _seen: dict = dataclasses.field(default_factory=dict)  # variant key -> plan or None
    _attention: str | None = None  # how the variants run attention (`_attention_of`)

    @property
    def best_time(self) -> float:
        return self.best.predicted.step_time_s if self.best is not None else float("inf")

    def run(self, points: Sequence[OneStagePoint]) -> Plan | None:
        """The fastest feasible variant of `points` found within the work, or None."""
        distinct: dict[tuple, OneStagePoint] = {}
        for point in points:
            distinct.setdefault(_point_key(point), point)
        try:
            for point in sorted(distinct.values(), key=lambda p: p.cost.step_time_s):
                self._point(point)
        except _Spent:
            pass
        return self.best

    def _point(self, point: OneStagePoint) -> None:
        zeros = (point.zero_stage, 3) if _zero3_applies(point) else (point.zero_stage,)
        for zero in zeros:
            try:
                base = plan_from_assignment(
                    self.model.graph, self.model.groups, dict(point.mesh), dict(point.assignment),
                    name=NAME, zero_stage=zero,
                )  # fmt: skip
            except PlanError:
                continue
            options = technique_options(self.model, base)
            chains = [
                (sp, [r for _, r in c]) for sp, c in itertools.groupby(options, key=lambda o: o[0])
            ]
            for sp, remats in sorted(chains, key=lambda chain: not chain[0]):  # split first
                if not sp and point.cost.step_time_s >= self.best_time:
                    continue  # no variant of this chain is faster than its point
                self._chain(base, sp, remats)

    def _chain(self, base: Plan, sp: bool, remats: list[tuple[bool, str]]) -> None:
        """The chain's fastest feasible variant becomes the best where it is faster."""
        if self.best is not None:  # its fastest first: no faster than the best, none is
            fastest = self._variant(base, sp, remats[0])
            if fastest is None or fastest.predicted.step_time_s >= self.best_time * (1 - 1e-9):
                return
            if fastest.predicted.feasible:  # faster and it fits: the chain's best
                self.best = fastest
                return
        leanest = self._variant(base, sp, remats[-1])
        if leanest is None or not leanest.predicted.feasible:
            return  # the leanest does not fit: no variant of the chain does
        for remat in remats:  # fastest first
            trial = self._variant(base, sp, remat)
            if trial is None or trial.predicted.step_time_s >= self.best_time * (1 - 1e-9):
                return  # the rest of the chain is no faster
            if trial.predicted.feasible:
                self.best = trial
                return

    def _variant(self, base: Plan, sp: bool, remat: tuple[bool, str]) -> Plan | None:
        """`base` with these techniques, priced (once per variant; counted as work); None
        where sequence parallelism does not apply (the sequence does not divide)."""
        key = (_plan_key(base), sp, remat)
        if key in self._seen:
            return self._seen[key]
        if self.work.spent():
            raise _Spent
        self.work.add(VARIANT_WORK * len(self.model.graph.ops))
        self.priced += 1
        try:
            plan = technique_variant(self.model, base, sp, remat, self._attention_of(base))
        except PlanError:
            plan = None
        self._seen[key] = plan
        if self.on_variant is not None:
            self.on_variant(best_time=self.best_time)
        return plan

    def _attention_of(self, base: Plan) -> str:
        """The attention every variant runs: "flash" where the backend runs the kernel
        (`Lowering.flash_attention`), the program's cores match it and it prices the
        first point faster than its attention written out (one more variant priced,
        counted), else "written". One choice for the walk: a kernel's time and memory
        saving is the same whatever the variant's recomputation and split (MaxText's
        rows on v5p: 0.85 to 0.97 of the published throughput)."""
        if self._attention is None:
            self._attention = "written"
            if self.model.cluster.lowering.flash_attention:  # two prices, counted
                self.work.add(2 * VARIANT_WORK * len(self.model.graph.ops))
                try:
                    flash = self.model.estimate(dataclasses.replace(base, attention="flash"))
                except PlanError:  # no core the kernel runs (BERT's is not causal)
                    flash = None
                if flash is not None and flash.step_time_s < self.model.estimate(base).step_time_s:
                    self._attention = "flash"
        return self._attention


def technique_variant(
    model, base: Plan, sp: bool, remat: tuple[bool, str], attention: str = "written"
) -> Plan:
    """`base` (a one-stage plan) with sequence parallelism, a (remat, policy) and its
    attention, priced by the whole cost model; PlanError where the split does not apply."""
    plan = dataclasses.replace(base, remat=remat[0], remat_policy=remat[1], attention=attention)
    if sp:
        plan = sequence_parallel(model.graph, model.groups, plan, MODEL)
    return dataclasses.replace(plan, predicted=model.estimate(plan))


def _zero3_applies(point: OneStagePoint) -> bool:
    return point.zero_stage == 2 and point.mesh.get(DATA, 1) > 1


def _point_key(point: OneStagePoint) -> tuple:
    return (tuple(point.mesh.items()), point.zero_stage, tuple(sorted(point.assignment.items())))


def _plan_key(plan: Plan) -> tuple:
    return (
        tuple(plan.mesh.items()),
        plan.zero_stage,
        tuple(sorted((plan.assignment or {}).items())),
    )
