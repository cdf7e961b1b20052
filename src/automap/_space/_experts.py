"""Expert plans: the hand-written strategies a practitioner would try first.

Each is expressed as an assignment of linkage groups to mesh axes, so it works on any
captured program (a Flax, Keras-on-JAX or plain-JAX step), not only on the zoo: the
batch group goes on "data", and Megatron's column-then-row split is the set of
parameter groups that live inside a block (attention heads, MLP hidden, vocabulary).
"One weird trick" puts a CNN's convolution batch and its dense layers' weights on one axis.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from .._axes import DATA, MODEL
from .._cluster import Cluster
from .._graph import Graph
from .._groups import Group, Groups, group_partners, plan_from_assignment
from .._plan import Plan

Assignment = dict[int, str | None]


def batch_groups(groups: Groups) -> list[Group]:
    return [g for g in groups.groups if g.batch and not g.conflicted]


def block_groups(groups: Groups) -> list[Group]:
    """Groups Megatron splits: parameter dimensions internal to a block.

    Every parameter group except the residual stream's: that one ties the hidden size of
    every layer (residual adds, layer norms, every projection's input), so it has by far the
    most members; splitting it is sequence/feature parallelism, not Megatron.
    """
    candidates = [g for g in groups.groups if g.param_dims and not g.batch]
    if not candidates:
        return []
    # Found among all parameter groups: the residual group is often conflicted itself (a
    # square [hidden, hidden] weight ties both its dims to it), and must still be the one
    # left out, not the next largest.
    residual = max(candidates, key=lambda g: (len(g.members), g.bytes))
    kept = [g for g in candidates if g.id != residual.id and not g.conflicted]
    return _alternating(groups, kept)


def _alternating(groups: Groups, candidates: list[Group]) -> list[Group]:
    """Megatron's column-then-row pattern: in program order, skip a group that shares a
    tensor with one already split (W2 of an MLP chain splits its input, so its output, the
    next layer's input, stays whole). Without it both dims of a weight would want the same
    axis, which no layout can give."""
    first = {g.id: min(t for t, _ in g.members) for g in candidates}
    partners = group_partners(groups, {g.id for g in candidates})
    picked: list[Group] = []
    taken: set[int] = set()
    for g in sorted(candidates, key=lambda g: (first[g.id], g.id)):
        if partners[g.id] & taken:
            continue
        picked.append(g)
        taken.add(g.id)
    return picked


def owt_groups(graph: Graph, groups: Groups) -> tuple[list[Group], list[Group]]:
    """The groups of "one weird trick" (Krizhevsky 2014): the convolutions' batch groups,
    and the fully connected layers' groups to split Megatron-style. Both empty unless a seam
    cut the batch at a flatten (`build_groups`): without one the batch cannot be split for
    the convolutions and whole for the dense layers.

    FC groups are the parameter groups no convolution touches (a conv kernel ties its
    channels and bias to it), alternated column-then-row as in `block_groups`."""
    if not groups.seams:
        return [], []
    conv = {t for op in graph.ops if op.primitive == "conv_general_dilated" for t in op.inputs}
    conv_groups = {groups.of(t, d) for t in conv for d in range(graph.tensors[t].ndim)}
    conv_batch = [g for g in batch_groups(groups) if g.id in conv_groups]
    fc = [
        g
        for g in groups.groups
        if g.param_dims and not g.batch and not g.conflicted and g.id not in conv_groups
    ]
    return conv_batch, _alternating(groups, fc)


def axis_assignment(groups: list[Group], axis: str, size: int) -> Assignment:
    # An axis may split a group only where every member dimension divides evenly.
    return {g.id: axis for g in groups if size > 1 and g.divisor % size == 0}


def _tp_sizes(cluster: Cluster) -> list[int]:
    """Tensor-parallel sizes Megatron would use: powers of two inside one node."""
    sizes, tp = [], 2
    while tp <= min(cluster.devices_per_node, cluster.devices):
        if cluster.devices % tp == 0:
            sizes.append(tp)
        tp *= 2
    return sizes


def expert_assignments(
    graph: Graph, groups: Groups, cluster: Cluster
) -> dict[str, tuple[dict[str, int], Assignment, int]]:
    """Name -> (mesh, assignment, ZeRO stage) for every expert plan that applies here."""
    n = cluster.devices
    data = axis_assignment(batch_groups(groups), DATA, n)
    out: dict[str, tuple[dict[str, int], Assignment, int]] = {}
    if data or n == 1:  # one device: the step as written is the data-parallel plan
        out["data_parallel"] = ({DATA: n}, data, 0)
    if data:
        for stage in (1, 2, 3):
            out[f"zero{stage}"] = ({DATA: n}, data, stage)
    conv_batch, fc = owt_groups(graph, groups)
    owt = {**axis_assignment(conv_batch, DATA, n), **axis_assignment(fc, DATA, n)}
    if any(g.id in owt for g in conv_batch) and any(g.id in owt for g in fc):
        # One axis for both: every device holds a batch slice in the convolutions and a
        # slice of each FC weight; the flatten gathers the batch between the two.
        out["owt"] = ({DATA: n}, owt, 0)
    blocks = block_groups(groups)
    tp_all = axis_assignment(blocks, MODEL, n)
    if tp_all:
        out["megatron"] = ({MODEL: n}, tp_all, 0)
    for tp in _tp_sizes(cluster):
        dp = n // tp
        if dp == 1:
            continue
        assignment = {
            **axis_assignment(batch_groups(groups), DATA, dp),
            **axis_assignment(blocks, MODEL, tp),
        }
        if any(a == MODEL for a in assignment.values()):
            out[f"megatron_dp_tp{tp}"] = ({DATA: dp, MODEL: tp}, assignment, 0)
    return out


def expert_plans_for(
    graph: Graph,
    groups: Groups,
    cluster: Cluster,
    estimate: Callable[[Plan], object] | None = None,
) -> dict[str, Plan]:
    """Build every expert plan; `megatron_dp` is the best of the tensor-parallel sizes tried
    inside a node (by `estimate`, or the largest when there is no estimate)."""
    plans: dict[str, Plan] = {}
    for name, (mesh, assignment, zero) in expert_assignments(graph, groups, cluster).items():
        plans[name] = plan_from_assignment(
            graph, groups, mesh, assignment, name=name, zero_stage=zero
        )
    hybrids = {k: v for k, v in plans.items() if k.startswith("megatron_dp_tp")}
    for k in hybrids:
        del plans[k]
    if hybrids:
        if estimate is None:
            best = max(hybrids, key=lambda k: int(k.removeprefix("megatron_dp_tp")))
        else:
            best = min(hybrids, key=lambda k: _rank(estimate(hybrids[k])))
        plans["megatron_dp"] = _renamed(hybrids[best], "megatron_dp")
    return plans


def _rank(cost: object) -> tuple[bool, float]:
    return (not getattr(cost, "feasible", True), float(getattr(cost, "step_time_s", math.inf)))


def _renamed(plan: Plan, name: str) -> Plan:
    return dataclasses.replace(plan, name=name)
