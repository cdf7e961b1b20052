"""Expert pipeline plans: what a practitioner would write by hand.

- `gpipe_uniform`: GPipe. Equal layer counts per stage (`uniform_cuts`), every stage data
  parallel over its devices.
- `megatron_3d`: Megatron-LM's recipe. Tensor parallel over a whole node (column then row,
  as the `megatron` expert), pipeline stages across nodes, data parallel over the rest.

A practitioner picks the fewest stages that fit in memory and enough microbatches to
hide the bubble: both choose the smallest stage count (a power of two) whose plan fits,
with the most microbatches the batch allows, by the cost model's estimate. 1F1B
throughout (the same time as GPipe's all-forward-then-all-backward, less memory).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .._cluster import Cluster
from .._errors import PlanError
from .._expert import DATA, MODEL, _assign, batch_groups, block_groups
from .._graph import Graph
from .._linkage import Groups
from .._plan import Cost, Plan
from ._plans import cut_candidates, pipeline_plan, uniform_cuts
from ._search import microbatch_counts, stage_counts


def pipeline_experts(
    graph: Graph, groups: Groups, cluster: Cluster, estimate: Callable[[Plan], Cost]
) -> dict[str, Plan]:
    """Name -> priced plan for each pipeline expert that applies (none without cuts)."""
    if groups.batch_size is None:
        return {}
    cands = cut_candidates(graph, groups)
    batch = groups.batch_size
    out: dict[str, Plan] = {}
    tp = cluster.devices_per_node if cluster.devices > cluster.devices_per_node else 1
    recipes = {"gpipe_uniform": 1, "megatron_3d": tp} if tp > 1 else {"gpipe_uniform": 1}
    for name, model in recipes.items():
        plan = _fewest_stages(graph, groups, cluster, estimate, cands, batch, name, model)
        if plan is not None:
            out[name] = plan
    return out


def _fewest_stages(graph, groups, cluster, estimate, cands, batch, name, tp) -> Plan | None:
    leanest: Plan | None = None
    for S in (s for s in stage_counts(cluster.devices, len(cands)) if s & (s - 1) == 0):
        if (cluster.devices // S) % tp:
            continue
        data = cluster.devices // S // tp
        mesh = {k: v for k, v in ((DATA, data), (MODEL, tp)) if v > 1} or {DATA: 1}
        assignment = {
            **_assign(batch_groups(groups), DATA, data),
            **_assign(block_groups(groups), MODEL, tp),
        }
        if tp > 1 and MODEL not in assignment.values():
            return None  # nothing to split over the node: not Megatron
        counts = microbatch_counts(batch, data, S, allowed=True)
        if not counts:  # the batch (6 on 8 devices, say) does not split over the data axis
            continue
        m = counts[-1]
        cuts = uniform_cuts(graph, groups, S)
        plan = pipeline_plan(graph, groups, cuts, mesh, assignment, m, "1f1b", name=name)
        try:
            cost = estimate(plan)
        except PlanError:  # a step that cannot be microbatched (batch norm): one microbatch
            plan = dataclasses.replace(plan, microbatches=1)
            try:
                cost = estimate(plan)
            except PlanError:  # no pipeline applies (a step that returns no loss): skip it
                return None
        plan = dataclasses.replace(plan, predicted=cost)
        if cost.feasible:
            return plan
        if leanest is None or cost.memory_bytes < leanest.predicted.memory_bytes:
            leanest = plan
    return leanest  # nothing fits: the leanest, marked infeasible
