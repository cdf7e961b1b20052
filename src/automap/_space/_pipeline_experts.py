"""Expert pipeline plans: what a practitioner would write by hand.

- `gpipe_uniform`: GPipe. Equal layer counts per stage (`uniform_cuts`), every stage data
  parallel over its devices.
- `megatron_3d`: Megatron-LM's 2022 recipe (`Recipe`, `_recipes.py`; Korthikanti et al.).
  Tensor parallel inside the node (column then row, as the `megatron` expert; the fastest
  of the sizes that split the blocks, as Megatron-LM's runs choose per model) with
  sequence parallelism where the sequence divides, the fewest stages equal in layers that
  fit with full recomputation (one stage included), microbatch size 1, data parallel over
  the rest; data sizes that do not divide the batch are skipped. At those sizes it then
  interleaves (v = 3, else 2, where pp x v divides the layers and the microbatches come in
  whole rounds of pp) and recomputes selectively (the attention core only), each where
  the plan still fits: selective before interleaving, as the paper's gains rank them
  (29-32% against 10+%), full recomputation and one chunk per stage otherwise.
  `gpipe_uniform` stays GPipe's (one chunk per stage, no recomputation): it is the
  2019 baseline the others are held against.

A practitioner picks the fewest stages that fit in memory: both choose the smallest stage
count whose plan fits, by the cost model's estimate, among node-aligned counts
(`stage_counts`): GPipe's powers of two, Megatron's every count that leaves whole tensor
parallel groups (Korthikanti et al. run 530B on 35 stages). GPipe takes the most
microbatches the batch allows. 1F1B throughout (the same time as GPipe's
all-forward-then-all-backward, less memory).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .._axes import DATA, MODEL
from .._cluster import Cluster
from .._errors import PlanError
from .._graph import Graph
from .._groups import Groups, sequence_dims
from .._pipeline import cut_candidates, pipeline_plan, uniform_cuts
from .._plan import Cost, Plan
from ._experts import axis_assignment, batch_groups, block_groups
from ._pipelined import microbatch_counts, stage_counts, state_bytes
from ._recipes import Recipe, layer_count, recipe_plan


def pipeline_experts(
    graph: Graph, groups: Groups, cluster: Cluster, estimate: Callable[[Plan], Cost]
) -> dict[str, Plan]:
    """Name -> priced plan for each pipeline expert that applies (none without cuts)."""
    if groups.batch_size is None:
        return {}
    cands = cut_candidates(graph, groups)
    out: dict[str, Plan] = {}
    plan = _gpipe(graph, groups, cluster, estimate, cands, groups.batch_size)
    if plan is not None:
        out["gpipe_uniform"] = plan
    plan = _megatron_3d(graph, groups, cluster, estimate, len(cands))
    if plan is not None:
        out["megatron_3d"] = plan
    return out


def _megatron_3d(graph, groups, cluster, estimate, cands: int) -> Plan | None:
    """Megatron's recipe: for each tensor parallel size inside the node (a power of two
    that splits the blocks, as Megatron-LM's runs pick per model), the fewest stages that
    fit with full recomputation and microbatches of one sequence (`megatron_stage_counts`;
    `cands`: the cut candidates); the fastest of them.
    None when nothing tensor-parallel applies. A stage count whose stored state alone
    cannot fit (`_state_floor`) is not priced, unless nothing fits at all: then the
    leanest of every candidate."""
    per_node = cluster.devices_per_node
    counts = {
        tp: megatron_stage_counts(cluster.devices, tp, per_node, cands)
        for tp in _node_tps(groups, cluster)
    }
    floor = _state_floor(graph, groups)
    priced: dict[tuple[int, int], Plan | None] = {}  # (tp, pp) -> its recipe, once

    def fewest(floor: float | None) -> list[Plan]:
        found = (
            _fewest_megatron_stages(graph, groups, cluster, estimate, tp, floor, priced, pps)
            for tp, pps in counts.items()
        )
        return [plan for plan in found if plan is not None]

    found = fewest(floor)
    fits = [p for p in found if p.predicted.feasible]
    if fits:
        return min(fits, key=lambda p: p.predicted.step_time_s)
    if floor is not None:
        found = fewest(None)  # the skipped counts too: the leanest of every candidate
    return min(found, key=lambda p: p.predicted.memory_bytes, default=None)


def _state_floor(graph: Graph, groups: Groups) -> float | None:
    """Bytes per device that a Megatron recipe's busiest stage holds at least, times its
    tensor parallel and stage counts (`StateBytes.floor` of one stage and no split): every
    parameter a stage reads, with its gradient, and every optimizer-state leaf. None where
    such a leaf shares a linkage group with the batch. A 1T GPT on 3072 GPUs: most of its
    candidates need no pricing."""
    state = state_bytes(graph, groups)
    return None if state is None else state.floor(1, 1)


def megatron_stage_counts(devices: int, tp: int, per_node: int, cands: int) -> list[int]:
    """The stage counts Megatron's recipe tries at tensor parallel size `tp`, fewest
    first: one, then those of the pipelined space (`stage_counts`: enough cut candidates,
    stages that fill whole nodes or divide one) that leave whole tp groups. Not only
    powers of two: 280 A100s at tp 8 (Korthikanti et al.'s 530B) pipeline over 5, 7, 35
    stages, and no power of two divides the 35 tp groups."""
    if devices % tp:
        return []
    return [1] + [s for s in stage_counts(devices, cands, per_node) if (devices // tp) % s == 0]


def _fewest_megatron_stages(
    graph, groups, cluster, estimate, tp: int, floor: float | None, priced: dict, pps
) -> Plan | None:
    """The fewest stages of `pps` (ascending) whose recipe fits, with Megatron's 2022
    techniques where they still fit (`_megatron_2022`); where selective recomputation does
    not fit there, also the fewest more stages where it does (`_selective_later`), the
    faster of the two. Else the leanest recipe of those priced (`floor`: see
    `_state_floor`; None prices every one). `priced`: (tp, pp) -> recipe already priced
    (None: it does not apply), filled in."""
    leanest: Plan | None = None
    for i, pp in enumerate(pps):
        dp = cluster.devices // (tp * pp)
        if not _worth_pricing(groups, cluster, floor, tp, pp):
            continue
        if (tp, pp) not in priced:
            priced[tp, pp] = _megatron_recipe(graph, groups, cluster, estimate, tp, pp, dp)
        plan = priced[tp, pp]
        if plan is None:
            continue
        if plan.predicted.feasible:
            found = _megatron_2022(graph, groups, cluster, estimate, tp, pp, dp, plan)
            if found.remat_policy == "selective":
                return found
            later = _selective_later(graph, groups, cluster, estimate, tp, floor, pps[i + 1 :])
            options = [found] if later is None else [found, later]
            return min(options, key=lambda p: p.predicted.step_time_s)  # a tie: fewer stages
        if leanest is None or plan.predicted.memory_bytes < leanest.predicted.memory_bytes:
            leanest = plan
    return leanest  # nothing fits: the leanest, marked infeasible


def _worth_pricing(groups: Groups, cluster: Cluster, floor: float | None, tp: int, pp: int):
    """Whether Megatron's recipe at tp x pp applies to the batch and may fit its state."""
    dp = cluster.devices // (tp * pp)
    lean_enough = floor is None or floor / (tp * pp) <= cluster.memory_limit
    return groups.batch_size % dp == 0 and lean_enough


#: Megatron-LM's virtual pipeline sizes, tried most first (Korthikanti et al. run v = 3
#: where the layers allow: 175B and 530B of their Table 5).
VIRTUAL_STAGES = (3, 2)


def _megatron_2022(
    graph, groups, cluster, estimate, tp: int, pp: int, dp: int, fitted: Plan
) -> Plan:
    """At the sizes `fitted` (full recomputation, one chunk per stage) fits with: the
    first of selective recomputation, then full, each interleaved as much as the layers
    and rounds allow, then not, that still fits; `fitted` where none does."""
    for remat in ("selective", "full"):
        plan = _interleaved_fit(graph, groups, cluster, estimate, tp, pp, dp, remat)
        if plan is not None:
            return plan
    return fitted


def _interleaved_fit(graph, groups, cluster, estimate, tp, pp, dp, remat) -> Plan | None:
    """Megatron's recipe recomputing by `remat`, the most interleaved that fits (full
    recomputation one chunk per stage is the caller's), or None."""
    chunks = [*VIRTUAL_STAGES, 1] if pp > 1 else [1]
    for v in chunks:
        if (remat, v) == ("full", 1):
            return None
        plan = _megatron_recipe(graph, groups, cluster, estimate, tp, pp, dp, remat, v)
        if plan is not None and plan.predicted.feasible:
            return plan
    return None


def _selective_later(graph, groups, cluster, estimate, tp, floor, pps) -> Plan | None:
    """Where selective recomputation does not fit at the fewest stages that fit: the
    fewest of `pps` (more stages) at which it does, Megatron's 2022 choice on SC'21's
    310B (16 stages selective over 12 recomputing in full), or None."""
    for pp in pps:
        if _worth_pricing(groups, cluster, floor, tp, pp):
            dp = cluster.devices // (tp * pp)
            plan = _interleaved_fit(graph, groups, cluster, estimate, tp, pp, dp, "selective")
            if plan is not None:
                return plan
    return None


def _megatron_recipe(
    graph, groups, cluster, estimate, tp: int, pp: int, dp: int, remat="full", v=1
) -> Plan | None:
    """Megatron's recipe at these sizes, priced; None where it does not apply (layers not
    divisible by pp (x v), a step that cannot microbatch, microbatches not in whole rounds
    of pp when interleaved, no attention core to recompute selectively)."""
    if pp > 1 and layer_count(graph, groups) % (pp * v):
        return None  # Megatron's 2022 stages hold equal layers; a Recipe would split unevenly
    schedule = "interleaved" if v > 1 else "1f1b"
    recipe = Recipe(
        tp=tp, pp=pp, dp=dp, microbatch_size=1, remat=remat, schedule=schedule,
        virtual_stages=v, name="megatron_3d",
    )  # fmt: skip
    try:
        plan = recipe_plan(graph, groups, cluster, _with_sequence_parallel(graph, groups, recipe))
        return dataclasses.replace(plan, predicted=estimate(plan))
    except PlanError:
        return None


def _with_sequence_parallel(graph: Graph, groups: Groups, recipe: Recipe) -> Recipe:
    """Megatron's 2022 recipe splits the residual stream on the sequence over the tensor
    parallel axis (Korthikanti et al.), where the program has one that tp divides."""
    lengths = {graph.tensors[t].shape[d] for t, d in sequence_dims(graph, groups).items()}
    if lengths and all(n % recipe.tp == 0 for n in lengths):
        return dataclasses.replace(recipe, sequence_parallel=True)
    return recipe


def _node_tps(groups: Groups, cluster: Cluster) -> list[int]:
    """Tensor parallel sizes 2, 4, ... up to the node that split every block group."""
    blocks = block_groups(groups)
    sizes, tp = [], 2
    while blocks and tp <= min(cluster.devices_per_node, cluster.devices):
        if len(axis_assignment(blocks, MODEL, tp)) == len(blocks):
            sizes.append(tp)
        tp *= 2
    return sizes


def _gpipe(graph, groups, cluster, estimate, cands, batch) -> Plan | None:
    """GPipe: uniform stages, data parallel inside, the most microbatches: the fewest
    stages that fit, else the leanest. A stage count whose stored state alone cannot fit
    (`_state_floor` over the stages: data parallelism splits none of it) is not priced;
    where none may fit, only the most stages that apply are, the leanest by that floor
    (a 1T GPT's seven counts took a fifth of its planning). None where no pipeline
    applies (a step that returns no loss)."""
    counts = [
        s
        for s in stage_counts(cluster.devices, len(cands), cluster.devices_per_node)
        if s & (s - 1) == 0
    ]
    floor = _state_floor(graph, groups)
    lean = [s for s in counts if floor is None or floor / s <= cluster.memory_limit]
    leanest: Plan | None = None
    for S in lean or reversed(counts):
        try:
            plan = _gpipe_plan(graph, groups, cluster, estimate, S, batch)
        except PlanError:
            return None
        if plan is None:  # the batch does not divide over this data axis: skip it
            continue
        if plan.predicted.feasible or not lean:
            return plan  # the fewest that fit; or, where none may, the most stages
        if leanest is None or plan.predicted.memory_bytes < leanest.predicted.memory_bytes:
            leanest = plan
    return leanest  # nothing fits: the leanest, marked infeasible


def _gpipe_plan(graph, groups, cluster, estimate, S: int, batch: int) -> Plan | None:
    """GPipe's plan in S stages, priced; None where the batch does not divide over its
    data axis. Raises PlanError where the step cannot be pipelined at all."""
    data = cluster.devices // S
    counts = microbatch_counts(batch, data, S, allowed=True)
    if not counts:
        return None
    mesh = {DATA: data}
    assignment = axis_assignment(batch_groups(groups), DATA, data)
    cuts = uniform_cuts(graph, groups, S)
    plan = pipeline_plan(
        graph, groups, cuts, mesh, assignment, counts[-1], "1f1b", name="gpipe_uniform"
    )
    try:
        cost = estimate(plan)
    except PlanError:  # a step that cannot be microbatched (batch norm): one microbatch
        plan = dataclasses.replace(plan, microbatches=1)
        cost = estimate(plan)  # PlanError again: no pipeline applies (no loss returned)
    return dataclasses.replace(plan, predicted=cost)
