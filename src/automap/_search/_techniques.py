"""The dp searcher's last step: Megatron's 2022 techniques tried on its best pipelines.

The stage DP chooses the stage count, the stage mesh, the microbatches, the cuts, ZeRO and
full recomputation (`_dp.py`). Three more decisions change the price of a point without
changing what the DP's tables hold per segment, or change it in ways its objective cannot
see, so they are tried afterwards on the best few plans, each variant priced by the whole
pipeline model (`estimate_pipeline`, what `CostModel.estimate` prices), the fastest that
fits kept:

- sequence parallelism (Korthikanti et al. 2022), where the stage mesh has a model axis
  the plan splits: the residual stream split on the sequence over it (`_groups/_seqpar.py`);
- recomputation: none, selective (the attention core only) and full, on cuts between
  layers (a cut inside one would split its recompute unit);
- interleaved 1F1B with v = 2 or 3 chunks per device group, re-cut into S x v chunks of
  equal layers (`layer_cuts`, Megatron's virtual pipeline), where the layers divide and
  the microbatches come in whole rounds of S.

A polish step rather than more DP dimensions: selective recomputation as one more stage-DP
memory saver tripled the DP's work and ran a tight-memory search out of its budget. The
variants are enumerated in a fixed order, so the result is deterministic for a budget;
each is counted as work (`Work`), not wall time.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from .._axes import MODEL, PIPE
from .._cost import estimate_pipeline, pipeline_decisions
from .._errors import PlanError
from .._groups import sequence_parallel
from .._pipeline import pipeline_plan
from .._plan import Plan
from .._space import layer_cuts
from ._work import Work

#: Virtual stages per device group tried (1: the DP's own cuts). Megatron-LM's runs use
#: 2 to 4; past 3 the chunks of a small model are single layers and the sends dominate.
CHUNKS = (1, 2, 3)
#: Recomputation tried, as (remat, remat_policy).
REMATS = ((False, "full"), (True, "selective"), (True, "full"))


def polish_techniques(model, plan: Plan, aligned: Sequence[int], work: Work | None = None) -> Plan:
    """The fastest feasible of `plan` and its variants with sequence parallelism,
    recomputation policy and interleaving (module doc); `aligned`: the cut candidates
    between layers, where a recomputing plan's stages may start."""
    best, best_time = plan, _time_of(plan)
    for v, cuts in _cut_sets(model, plan, aligned).items():
        for sp, (remat, policy) in itertools.product(_sp_options(model, plan), REMATS):
            if v == 1 and remat and not set(cuts) <= set(aligned):
                continue  # the DP's cuts split a layer: no recomputation on them
            if (v, sp, remat, policy) == (1, False, plan.remat, plan.remat_policy):
                continue  # the plan itself
            if work is not None:
                if work.spent():
                    return best
                work.add(3 * len(model.graph.ops))  # op costs, a partition, its prices
            trial = _variant(model, plan, cuts, v, sp, remat, policy)
            if trial is not None and trial.predicted.step_time_s < best_time * (1 - 1e-9):
                best, best_time = trial, trial.predicted.step_time_s
    return best


def _time_of(plan: Plan) -> float:
    cost = plan.predicted
    return cost.step_time_s if cost is not None and cost.feasible else float("inf")


def _cut_sets(model, plan: Plan, aligned: Sequence[int]) -> dict[int, tuple[int, ...]]:
    """Chunks per device group -> the cuts: the plan's own for one, equal-layer chunks for
    more, where the layers split so, the microbatches make whole rounds and the plan is
    1F1B (a GPipe search asked for GPipe)."""
    out = {1: tuple(plan.decisions["cuts"])}
    S = plan.mesh.get(PIPE, 1)
    if S < 2 or plan.microbatches % S or plan.schedule != "1f1b":
        return out
    for v in CHUNKS[1:]:
        try:
            out[v] = layer_cuts(model.graph, model.groups, S, v)
        except PlanError:  # the layers do not split into S x v equal chunks
            continue
    return out


def _sp_options(model, plan: Plan) -> tuple[bool, ...]:
    """Sequence parallelism off, and on where the stage mesh has a model axis in use."""
    assignment = model.plan_assignment(plan)
    if plan.mesh.get(MODEL, 1) > 1 and MODEL in assignment.values():
        return (False, True)
    return (False,)


def _variant(model, plan: Plan, cuts, v: int, sp: bool, remat: bool, policy: str) -> Plan | None:
    """`plan` re-cut into `cuts` (v chunks per group) with these techniques, priced; None
    where it does not apply (a sequence tp does not divide, no residual stream) or fit."""
    graph, groups = model.graph, model.groups
    stage_mesh = {k: n for k, n in plan.mesh.items() if k != PIPE}
    try:
        new = pipeline_plan(
            graph, groups, cuts, stage_mesh, model.plan_assignment(plan), plan.microbatches,
            "interleaved" if v > 1 else plan.schedule, name=plan.name,
            zero_stage=plan.zero_stage, virtual_stages=v,
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
