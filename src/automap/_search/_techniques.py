"""The dp searcher's last step: Megatron's 2022 techniques tried on its best pipelines.

The stage DP chooses the stage count, the stage mesh, the microbatches, the cuts, ZeRO and
full recomputation (`_dp.py`). Three more decisions change the price of a point without
changing what the DP's tables hold per segment, or change it in ways its objective cannot
see, so they are tried afterwards on the best few plans, each variant priced by the whole
pipeline model (`estimate_pipeline`, what `CostModel.estimate` prices), the fastest that
fits kept:

- sequence parallelism (Korthikanti et al. 2022), where the stage mesh has a model axis
  the plan splits: the residual stream split on the sequence over it (`_groups/_seqpar.py`);
- recomputation: none and each of the plan's policies (`REMAT_POLICIES`: selective, the
  attention core only; projections, each layer but its weight matmuls' outputs, MaxText's
  `minimal`; full), on cuts between layers (a cut inside one would split its recompute
  unit);
- interleaved 1F1B with v = 2 or 3 chunks per device group, re-cut into S x v chunks of
  equal layers (`layer_cuts`, Megatron's virtual pipeline), where the layers divide and
  the microbatches come in whole rounds of S;
- ZB-H1 (Qi et al. 2024) on the plan's own cuts: each backward split into B and W, the
  W's deferred into 1F1B's bubble at 1F1B's in-flight count. The stage DP also cuts for
  it (`dp_schedules`, its tables timing F, B and W apart: `_cut_tables.py`); this tries
  it on 1F1B's cuts too, which may fit where the DP's ZB-H1 cuts do not (the deferred
  W's hold more than the DP's tables count). Without recomputation only: the split
  backward does not recompute (`check_remat`), so a plan the DP had to recompute gets
  it only where dropping recomputation still fits.

Then the fastest of those at the other ZeRO stages (`ZERO_STAGES`), where the stage mesh
has a data axis: ZeRO is a time decision too, not only the DP's memory saver (the DP
prices it only where a point does not fit plain). Each stage's update runs on its data
shard, and ZeRO-3 gathers the parameters the stages read once a step where ZeRO-1
gathers the updated ones whole: on SC'21's 1.7B row (32 A100s) the DP's pipe 2 x data 16
plan at ZeRO-3 is 2.652 s against 2.677 plain (ZeRO-1: 2.741). Each ZeRO stage is a
chain of recomputations from none up to the plan's own, the first that fits kept (as
the one-stage walk's chains): less recompute may fit in what ZeRO frees.

The one-stage plans the ILP priced get the same variants (`technique_options`, with ZeRO-3
besides: `_one_stage.py`), priced by `CostModel.estimate`.

A polish step rather than more DP dimensions: selective recomputation as one more stage-DP
memory saver tripled the DP's work and ran a tight-memory search out of its budget. The
variants are enumerated in a fixed order, so the result is deterministic for a budget;
each is counted as work (`Work`), not wall time.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import NamedTuple

from .._axes import DATA, MODEL, PIPE
from .._cost import estimate_pipeline, pipeline_decisions
from .._errors import PlanError
from .._groups import sequence_parallel
from .._pipeline import (
    PipelineSchedule,
    chunked_variant,
    pipeline_plan,
    pipeline_schedule,
    split_variant,
)
from .._plan import REMAT_POLICIES, Plan
from .._space import layer_cuts
from ._work import Work

#: Virtual stages per device group tried (1: the DP's own cuts). Megatron-LM's runs use
#: 2 to 4; past 3 the chunks of a small model are single layers and the sends dominate.
CHUNKS = (1, 2, 3)
#: Recomputation tried, as (remat, remat_policy): none, then every policy a plan may name,
#: cheapest recompute first (a tie keeps the earlier).
REMATS = ((False, "full"), *((True, policy) for policy in REMAT_POLICIES))
#: The policies whose recompute unit is a whole layer: their stages start between layers.
#: (The cost model's variant for "projections" is built once per policy, on whole layers;
#: a selective unit, an attention core, sits inside one block and no cut splits it.)
LAYER_UNITS = ("projections", "full")
#: The ZeRO stages tried on the polished plan, where its stage mesh has a data axis. Not
#: 2: a pipeline stage sums its gradients whole over the microbatches and reduce-scatters
#: them once a step under ZeRO-1 as under ZeRO-2 (`_run/_accumulate.py`), so ZeRO-2 runs
#: and prices as ZeRO-1 (`_dp.MEMORY_SAVERS` leaves it out too).
ZERO_STAGES = (0, 1, 3)
#: Work counted per variant priced, in passes over the program's ops (`Work`): its op
#: costs, its partition or layouts, and its price.
VARIANT_WORK = 3


def dp_schedules(schedule: PipelineSchedule) -> tuple[PipelineSchedule, ...]:
    """The schedules the stage DP cuts for in a search asked for `schedule`: itself, and
    its split variant where it names one (`split_variant`: ZB-H1 for 1F1B; read at each
    call, so a test may take it away)."""
    split = split_variant(schedule)
    return (schedule,) if split is None else (schedule, split)


class Layout(NamedTuple):
    """A way to run the plan's stages: the schedule, chunks per device group and cuts."""

    schedule: str
    chunks: int
    cuts: tuple[int, ...]


def polish_techniques(model, plan: Plan, aligned: Sequence[int], work: Work | None = None) -> Plan:
    """The fastest feasible of `plan` and its variants with sequence parallelism,
    recomputation policy, interleaving and ZB-H1, then of that one's ZeRO stages (module
    doc); `aligned`: the cut candidates between layers, where a recomputing plan's stages
    may start."""
    best = _polish_layouts(model, plan, aligned, work)
    return _polish_zero(model, best, aligned, work)


def _polish_layouts(model, plan: Plan, aligned: Sequence[int], work: Work | None) -> Plan:
    """The fastest feasible of `plan` and its technique variants at its own ZeRO stage."""
    best, best_time = plan, _time_of(plan)
    # Sequence parallelism first: where the budget ends the polish of a large model
    # early, the variants that save most are priced (a stable sort: a tie keeps the
    # earlier as before).
    options = sorted(technique_options(model, plan), key=lambda option: not option[0])
    for layout in _layouts(model, plan):
        for sp, (remat, policy) in options:
            if not _applies(layout, remat, aligned):
                continue
            if (layout.schedule, layout.chunks, sp, remat, policy) == (
                plan.schedule, 1, False, plan.remat, plan.remat_policy,
            ):  # fmt: skip
                continue  # the plan itself
            if not _count(model, work):
                return best
            trial = _variant(model, plan, layout, sp, remat, policy)
            if trial is not None and trial.predicted.step_time_s < best_time * (1 - 1e-9):
                best, best_time = trial, trial.predicted.step_time_s
    return best


def _polish_zero(model, plan: Plan, aligned: Sequence[int], work: Work | None) -> Plan:
    """The fastest feasible of `plan` and its variants at the other `ZERO_STAGES`, where
    its stage mesh has a data axis: its layout and split stream, each ZeRO stage a chain
    of recomputations from none up to the plan's own (`REMATS` order, fastest first, as
    the one-stage walk's chains), the first that fits the chain's best. Less recompute
    than the plan's own may fit in the memory ZeRO frees; more is no faster."""
    if plan.mesh.get(DATA, 1) < 2:
        return plan
    best, best_time = plan, _time_of(plan)
    layout = Layout(plan.schedule, plan.virtual_stages, tuple(plan.decisions["cuts"]))
    sp = plan.sequence_parallel is not None
    own = REMATS.index((True, plan.remat_policy)) if plan.remat else 0
    for zero in ZERO_STAGES:
        if zero == plan.zero_stage:
            continue
        for remat, policy in REMATS[: own + 1]:
            if not _applies(layout, remat, aligned):
                continue
            if not _count(model, work):
                return best
            trial = _variant(model, plan, layout, sp, remat, policy, zero)
            if trial is None:
                continue  # over the limit (or not applicable): recompute more
            if trial.predicted.step_time_s < best_time * (1 - 1e-9):
                best, best_time = trial, trial.predicted.step_time_s
            break  # the chain's first that fits is its fastest
    return best


def _applies(layout: Layout, remat: bool, aligned: Sequence[int]) -> bool:
    """Whether recomputation `remat` may run on `layout`."""
    if remat and pipeline_schedule(layout.schedule).splits_backward:
        return False  # a split backward does not recompute (`check_remat`)
    # The DP's cuts may split a layer: no recomputation on them.
    return not (layout.chunks == 1 and remat and not set(layout.cuts) <= set(aligned))


def _count(model, work: Work | None) -> bool:
    """Count one variant's price as work; False (nothing counted) where it is spent."""
    if work is None:
        return True
    if work.spent():
        return False
    work.add(VARIANT_WORK * len(model.graph.ops))
    return True


def _time_of(plan: Plan) -> float:
    cost = plan.predicted
    return cost.step_time_s if cost is not None and cost.feasible else float("inf")


def _layouts(model, plan: Plan) -> list[Layout]:
    """The plan's own schedule and cuts; on a plan of two stages or more, its schedule's
    variants (`split_variant`, `chunked_variant`: for 1F1B, ZB-H1 on the same cuts and
    interleaving; none for GPipe): chunks of equal layers, where the layers split so and
    the microbatches make whole rounds. In this order, so
    that a tie keeps the earlier (the simpler schedule)."""
    cuts = tuple(plan.decisions["cuts"])
    out = [Layout(plan.schedule, 1, cuts)]
    S, schedule = plan.mesh.get(PIPE, 1), pipeline_schedule(plan.schedule, plan.virtual_stages)
    if S < 2:
        return out
    split = split_variant(schedule)
    out += [Layout(split.name, 1, cuts)] if split is not None else []
    if plan.microbatches % S:
        return out
    for v in CHUNKS[1:]:
        chunked = chunked_variant(schedule, v)
        if chunked is None:
            break
        try:
            out.append(Layout(chunked.name, v, layer_cuts(model.graph, model.groups, S, v)))
        except PlanError:  # the layers do not split into S x v equal chunks
            continue
    return out


def technique_options(model, plan: Plan) -> list[tuple[bool, tuple[bool, str]]]:
    """The variants of `plan` both polishes try, as (sequence parallel, (remat, policy)):
    each of `sp_options` with each of `REMATS`, in that order (a tie keeps the earlier)."""
    return list(itertools.product(sp_options(model, plan), REMATS))


def sp_options(model, plan: Plan) -> tuple[bool, ...]:
    """Sequence parallelism off, and on where the (stage) mesh has a model axis in use."""
    assignment = model.plan_assignment(plan)
    if plan.mesh.get(MODEL, 1) > 1 and MODEL in assignment.values():
        return (False, True)
    return (False,)


def _variant(
    model, plan: Plan, layout: Layout, sp: bool, remat: bool, policy: str, zero: int | None = None
) -> Plan | None:
    """`plan` re-cut and scheduled as `layout` says, with these techniques and ZeRO stage
    (None: its own), priced; None where it does not apply (a sequence tp does not divide,
    no residual stream) or fit."""
    graph, groups = model.graph, model.groups
    stage_mesh = {k: n for k, n in plan.mesh.items() if k != PIPE}
    try:
        new = pipeline_plan(
            graph, groups, layout.cuts, stage_mesh, model.plan_assignment(plan),
            plan.microbatches, layout.schedule, name=plan.name,
            zero_stage=plan.zero_stage if zero is None else zero,
            virtual_stages=layout.chunks,
        )  # fmt: skip
        new = dataclasses.replace(new, remat=remat, remat_policy=policy)
        if sp:
            new = sequence_parallel(graph, groups, new, MODEL)
        pc = estimate_pipeline(model, new)
    except PlanError:
        return None
    if not pc.cost.feasible:
        return None
    return dataclasses.replace(
        new,
        predicted=pc.cost,
        decisions={**plan.decisions, **new.decisions, **pipeline_decisions(pc)},
    )
