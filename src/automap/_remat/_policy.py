"""What a plan's remat fields recompute: one `Recompute` for the runtime and the cost model.

- "full", every layer: Megatron's full recomputation (`recompute_plan`).
- "full" with `remat_layers` k: the first k layers of each stage in full, the others keep
  their activations (Megatron's "block" method; a stage is the whole forward of a plan
  without stages). A layer here is the program's recompute unit, the run of forward ops
  between two cut candidates: a transformer's attention half or its MLP half.
- "selective": only each layer's attention core (`_selective.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .._graph import Graph
from .._groups import Groups
from .._pipeline import Phase, partition
from .._plan import Plan
from ._recompute import Recompute, layer_ops, recompute_plan, recompute_units
from ._selective import attention_cores


def plan_recompute(graph: Graph, groups: Groups, plan: Plan) -> Recompute:
    """What `plan` recomputes in `graph` (its remat is on)."""
    if plan.remat_policy == "selective":
        return recompute_units(graph, attention_cores(graph, layer_ops(graph, groups)))
    full = recompute_plan(graph, groups)
    if plan.remat_layers is None:
        return full
    return full.only(first_layers(full, stage_forwards(graph, groups, plan), plan.remat_layers))


def stage_forwards(graph: Graph, groups: Groups, plan: Plan) -> list[tuple[int, ...]]:
    """Each stage's per-microbatch forward ops (one stage: the whole forward)."""
    if not plan.stages:
        return [tuple(range(len(graph.ops)))]
    bounds = [(s.op_start, s.op_stop) for s in plan.stages]
    part = partition(graph, groups, bounds, plan.microbatches)
    return [tuple(part.ops(s, Phase.FWD)) for s in range(part.n_stages)]


def first_layers(rc: Recompute, stages: Sequence[Sequence[int]], k: int) -> list[int]:
    """The numbers of the first `k` layers lying in each stage's forward."""
    out = []
    for ops in stages:
        inside = set(ops)
        out += [j for j, layer in enumerate(rc.layers) if layer and set(layer) <= inside][:k]
    return out


def remat_key(plan: Plan) -> tuple | None:
    """What sets a plan's recompute apart from every layer in full (None: nothing does):
    the cost model prices such a plan with residuals of its own."""
    if not plan.remat or (plan.remat_policy == "full" and plan.remat_layers is None):
        return None
    stages = tuple((s.op_start, s.op_stop) for s in plan.stages)
    if plan.remat_layers is None:
        stages = ()
    return (plan.remat_policy, plan.remat_layers, stages, plan.microbatches if stages else 1)


def full_remat(plan: Plan) -> Plan:
    """`plan` with its recompute called full over every layer: how a cost model built on
    the plan's own `Recompute` (`CostModel.for_plan`) reads it."""
    if remat_key(plan) is None:
        return plan
    return dataclasses.replace(plan, remat_policy="full", remat_layers=None)
