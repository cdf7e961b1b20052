"""Sequence parallelism (Korthikanti et al. 2022): the residual stream split on its sequence
dimension over the tensor-parallel axis, as sharding constraints.

Inside a tensor-parallel layer the activations outside the column/row matmul pairs (layer
norms, dropout, residual adds) are replicated over the tensor-parallel axis: every device
computes and keeps the same copy. Splitting them on the sequence over that axis turns each
all-reduce of a row matmul's partial sums into a reduce-scatter (the output arrives split),
and each column matmul's input is all-gathered first: the same volume, and those
activations shrink t-fold.

The linkage groups cannot say it: the sequence group ties the queries' and the keys'
positions through the attention scores, so it is conflicted (one tensor holds it twice)
and no assignment splits it. What can: constraints on the residual stream's tensors,
found from the program's structure. They are the activations that carry the residual
group (the hidden size every layer's adds, norms and projections share, the parameter
group with the most members) beside the batch, whose one other dimension is the sequence:
forward tensors and their cotangents alike, so the backward pass splits them too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from .._errors import PlanError
from .._graph import Graph, TensorKind
from .._plan import Plan, Spec, SpecEntry
from ._layouts import layouts
from ._linkage import Group, Groups

#: An embedding lookup and its gradient keep the plan's own layout on their indices,
#: output and updates: the lookup's sum over the vocabulary split is all-reduced where it is
#: made and its gradient reads the cotangent whole, as Megatron's vocabulary-parallel
#: embedding does. Split on the sequence there, XLA all-gathers the table, or reshuffles
#: the indices and the cotangent with all-to-alls and permutes.
KEPT_WHOLE = frozenset({"gather", "scatter-add", "scatter_add"})


def residual_group(groups: Groups) -> Group | None:
    """The residual stream's hidden group: the group (not the batch) that ties the most
    parameter dims, every layer's norms, biases and projection inputs. Counted in
    members, the sequence can win: Keras-Hub's GPT-2 ties its position table's rows to
    660 tensor dims (heads reshaped apart) against the hidden size's 658, and its 1
    parameter dim against 28."""
    candidates = [g for g in groups.groups if g.param_dims and not g.batch]
    if not candidates:
        return None
    return max(candidates, key=lambda g: (len(g.param_dims), len(g.members), g.bytes))


def sequence_dims(graph: Graph, groups: Groups) -> dict[int, int]:
    """Residual-stream activation -> its sequence dimension: the intermediate tensors that
    hold the residual group and a batch group and one other dimension longer than one."""
    residual = residual_group(groups)
    batch = set(groups.batch_groups)
    if residual is None or not batch:
        return {}
    made_by_kept = {
        t for op in graph.ops if op.primitive in KEPT_WHOLE for t in (*op.inputs[1:], *op.outputs)
    }
    out: dict[int, int] = {}
    for t, tg in enumerate(groups.tensor_groups):
        tensor = graph.tensors[t]
        if tensor.kind is not TensorKind.INTERMEDIATE or t in made_by_kept:
            continue
        if residual.id not in tg or not batch.intersection(tg):
            continue
        others = [
            d
            for d, g in enumerate(tg)
            if g != residual.id and g not in batch and tensor.shape[d] > 1
        ]
        if len(others) == 1:
            out[t] = others[0]
    return out


def sequence_parallel(graph: Graph, groups: Groups, plan: Plan, axis: str) -> Plan:
    """`plan` with its residual stream split on the sequence over `axis` (its tensor-parallel
    axis): `sequence_parallel` set and a constraint on each residual-stream tensor. A
    one-line PlanError where the plan splits nothing on `axis` or the sequence does not
    divide by it."""
    size = plan.mesh.get(axis, 1)
    if plan.stages:
        stage_meshes = {s.mesh.get(axis, 1) for s in plan.stages}
        size = max(stage_meshes | {size})
    assignment = plan.assignment or {}
    if size <= 1 or axis not in assignment.values():
        raise PlanError(
            f"sequence parallelism splits the residual stream over the tensor-parallel axis "
            f"{axis!r}, but the plan splits nothing on it: use tensor parallelism (tp > 1)."
        )
    dims = sequence_dims(graph, groups)
    if not dims:
        raise PlanError(
            "sequence parallelism found no residual stream in this program (activations of "
            "[batch, sequence, hidden] sharing the layers' hidden size): plan without it."
        )
    lengths = sorted({graph.tensors[t].shape[d] for t, d in dims.items()})
    bad = [n for n in lengths if n % size]
    if bad:
        raise PlanError(
            f"the sequence of {bad[0]} does not divide by the tensor-parallel size {size}: "
            f"choose a tp that divides {bad[0]}, or plan without sequence parallelism."
        )
    constraints = dict(plan.constraints)
    constraints.update(_split_specs(graph, groups, assignment, dims, axis))
    return dataclasses.replace(plan, constraints=constraints, sequence_parallel=axis)


def _split_specs(
    graph: Graph,
    groups: Groups,
    assignment: Mapping[int, str],
    dims: Mapping[int, int],
    axis: str,
) -> dict[int, Spec]:
    """Each residual tensor's layout under the assignment, with `axis` on its sequence."""
    lay = layouts(graph, groups, assignment)
    out: dict[int, Spec] = {}
    for op in graph.ops:
        if op.primitive in KEPT_WHOLE:
            for t in (*op.inputs[1:], *op.outputs):
                if graph.tensors[t].ndim and graph.tensors[t].kind is TensorKind.INTERMEDIATE:
                    out[t] = lay[t]
    for t, d in dims.items():
        spec = list(lay[t])
        if axis in spec or spec[d] is not None:
            continue  # the axis is already on another dim of it (XLA allows one)
        spec[d] = axis
        out[t] = tuple(spec)
    return out


def sequence_as_recorded(graph: Graph, groups: Groups, plan: Plan) -> Plan:
    """`plan` with its residual stream split as its `sequence_parallel` field says, which
    the cost model and the runtime both read through the constraints: the constraints
    made from the field where a hand edit left them out, so that the field is never
    ignored; a one-line PlanError where the constraints split the stream on the sequence
    and the field does not say so (it would run split and be priced whole)."""
    axis = plan.sequence_parallel
    if axis is not None:
        return sequence_parallel(graph, groups, plan, str(axis))
    split = _sequence_split(graph, groups, plan)
    if split:
        raise PlanError(
            f"the plan's constraints split the residual stream on its sequence over "
            f"{split!r} but its sequence_parallel field is null (was it edited by hand?): "
            "set sequence_parallel to that tensor-parallel axis, or drop those constraints."
        )
    return plan


def _sequence_split(graph: Graph, groups: Groups, plan: Plan) -> SpecEntry:
    """The axis the plan's constraints put on a residual tensor's sequence dimension where
    the plan's own layout of that tensor leaves it whole (None: none does)."""
    if not plan.constraints or plan.assignment is None:
        return None
    lay = layouts(graph, groups, plan.assignment)
    for t, d in sequence_dims(graph, groups).items():
        spec = plan.constraints.get(t)
        if spec is not None and spec[d] is not None and lay[t][d] is None:
            return spec[d]
    return None
