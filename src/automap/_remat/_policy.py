"""What a plan's remat fields recompute: one `Recompute` for the runtime and the cost model.

- "full", every layer: Megatron's full recomputation (`recompute_plan`).
- "full" with `remat_layers` k: the first k layers of each stage in full, the others keep
  their activations (Megatron's "block" method, its "recompute k layers"; a stage is the
  whole forward of a plan without stages). A layer is the program's repeating unit
  (`_units.py`): a transformer layer.
- "selective": only each block's attention core (`_selective.py`).
- "projections": each layer but its projections (`_selective.projection_gaps`): the layer's
  input and its projections' outputs are kept, MaxText's `minimal`.

A pipeline stage cut inside a layer (the stage DP may cut between a layer's attention and
MLP blocks) splits it: each stage recomputes its part from the part's own input, which that
stage holds anyway (it receives it), so the runtime and the cost model keep one unit per
stage piece (`split_at_stages`); `remat_key` then sets the plan apart for the cost model.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from .._capture import find_residuals
from .._graph import Graph
from .._groups import Groups
from .._pipeline import Phase, partition
from .._plan import Plan
from ._chains import regathered_reads, split_constraints, widened_chains
from ._recompute import Recompute, recompute_units
from ._selective import attention_cores, projection_gaps
from ._units import block_ops, layer_ops


def plan_recompute(graph: Graph, groups: Groups, plan: Plan) -> Recompute:
    """What `plan` recomputes in `graph` (its remat is on)."""
    if plan.remat_policy == "selective":
        blocks = block_ops(graph, groups)
        cores = attention_cores(graph, blocks)
        res = find_residuals(graph)
        # A pipeline stage's B makes them again already (`_remake.py`).
        chains = (
            ()
            if plan.stages
            else widened_chains(graph, blocks, cores, set(res.saved), res.boundary)
        )
        units = sorted([c for c in cores if c] + list(chains), key=min)
        rc = recompute_units(graph, units)
        return rc.rereading(regathered_reads(graph, plan, blocks, res.boundary))
    layers = split_at_stages(layer_ops(graph, groups), stage_starts(plan))
    if plan.remat_policy == "projections":
        return recompute_units(graph, projection_gaps(graph, layers))
    full = recompute_units(graph, layers)
    if plan.remat_layers is None:
        return full
    return full.only(first_layers(full, stage_forwards(graph, groups, plan), plan.remat_layers))


def stage_layer_counts(graph: Graph, groups: Groups, plan: Plan) -> list[int]:
    """How many layers (recompute units) each stage of `plan` holds: what `remat_layers`
    counts in."""
    units = recompute_units(graph, split_at_stages(layer_ops(graph, groups), stage_starts(plan)))
    stages = stage_forwards(graph, groups, plan)
    return [len(first_layers(units, [ops], len(units.layers))) for ops in stages]


def stage_starts(plan: Plan) -> tuple[int, ...]:
    """The first forward op of each stage after the first (none without stages)."""
    return tuple(s.op_start for s in plan.stages[1:])


def split_at_stages(
    units: Sequence[Sequence[int]], starts: Sequence[int]
) -> tuple[tuple[int, ...], ...]:
    """`units` cut where a stage starts inside one: each piece a unit of its own."""
    out: list[tuple[int, ...]] = []
    for unit in units:
        cut = {k for k in range(1, len(unit)) for s in starts if unit[k - 1] < s <= unit[k]}
        at = [0, *sorted(cut), len(unit)]
        out += [tuple(unit[a:z]) for a, z in itertools.pairwise(at)]
    return tuple(out)


def cuts_a_layer(spans: Sequence[tuple[int, int]], plan: Plan) -> bool:
    """Whether a stage of `plan` starts inside a layer (`spans`: each layer's first and
    last forward op)."""
    return any(a < s <= z for s in stage_starts(plan) for a, z in spans)


def aligned_cuts(cands: Sequence[int], spans: Sequence[tuple[int, int]]) -> tuple[int, ...]:
    """The cut candidates no layer spans (`spans`: each layer's first and last op)."""
    return tuple(c for c in cands if not any(a < c <= z for a, z in spans))


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


def remat_key(plan: Plan, spans: Sequence[tuple[int, int]] = ()) -> tuple | None:
    """What sets a plan's recompute apart from every layer in full (None: nothing does):
    the cost model prices such a plan with residuals of its own. `spans`: each layer's
    first and last forward op, for a plan whose stages may cut a layer."""
    if not plan.remat:
        return None
    split = plan.remat_policy in ("full", "projections") and cuts_a_layer(spans, plan)
    if plan.remat_policy == "full" and plan.remat_layers is None and not split:
        return None
    stages = tuple((s.op_start, s.op_stop) for s in plan.stages)
    if plan.remat_layers is None and not split:
        stages = ()
    key = (plan.remat_policy, plan.remat_layers, stages, plan.microbatches if stages else 1)
    if plan.remat_policy == "selective":  # what `plan_recompute` reads of it besides
        return (*key, bool(plan.stages), split_constraints(plan))
    return key


def full_remat(plan: Plan) -> Plan:
    """`plan` with its recompute called full over every layer: how a cost model built on
    the plan's own `Recompute` (`CostModel.for_plan`) reads it."""
    if remat_key(plan) is None:
        return plan
    return dataclasses.replace(plan, remat_policy="full", remat_layers=None)
