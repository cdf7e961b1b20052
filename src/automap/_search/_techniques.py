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

from .._axes import MODEL, PIPE
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
    recomputation policy, interleaving and ZB-H1 (module doc); `aligned`: the cut
    candidates between layers, where a recomputing plan's stages may start."""
    best, best_time = plan, _time_of(plan)
    # Sequence parallelism first: where the budget ends the polish of a large model
    # early, the variants that save most are priced (a stable sort: a tie keeps the
    # earlier as before).
    options = sorted(technique_options(model, plan), key=lambda option: not option[0])
    for layout in _layouts(model, plan):
        for sp, (remat, policy) in options:
            if remat and pipeline_schedule(layout.schedule).splits_backward:
                continue  # a split backward does not recompute (`check_remat`)
            if layout.chunks == 1 and remat and not set(layout.cuts) <= set(aligned):
                continue  # the DP's cuts split a layer: no recomputation on them
            if (layout.schedule, layout.chunks, sp, remat, policy) == (
                plan.schedule, 1, False, plan.remat, plan.remat_policy,
            ):  # fmt: skip
                continue  # the plan itself
            if work is not None:
                if work.spent():
                    return best
                work.add(VARIANT_WORK * len(model.graph.ops))
            trial = _variant(model, plan, layout, sp, remat, policy)
            if trial is not None and trial.predicted.step_time_s < best_time * (1 - 1e-9):
                best, best_time = trial, trial.predicted.step_time_s
    return best


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


def _variant(model, plan: Plan, layout: Layout, sp: bool, remat: bool, policy: str) -> Plan | None:
    """`plan` re-cut and scheduled as `layout` says, with these techniques, priced; None
    where it does not apply (a sequence tp does not divide, no residual stream) or fit."""
    graph, groups = model.graph, model.groups
    stage_mesh = {k: n for k, n in plan.mesh.items() if k != PIPE}
    try:
        new = pipeline_plan(
            graph, groups, layout.cuts, stage_mesh, model.plan_assignment(plan),
            plan.microbatches, layout.schedule, name=plan.name, zero_stage=plan.zero_stage,
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
