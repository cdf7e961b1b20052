"""The price of sequence parallelism (`Plan.sequence_parallel`), on top of the plan's
tensor-parallel cost.

The residual stream's tensors split on the sequence over the tensor-parallel axis t
(`_groups.sequence_parallel`) change three things, as XLA compiles them:

- each matmul whose partial sums over t make a residual tensor (a row-parallel matmul, and
  in the backward a column-parallel one's input gradient) reduce-scatters them where it
  all-reduced them: the same buffer, half the ring's bytes on the wire. XLA's CPU pipeline
  has no reduce-scatter (`Lowering.reduce_scatter`): there the all-reduce stays and the
  slice is local;
- each residual tensor a matmul reads whole is all-gathered first, once per tensor (XLA
  reuses the gathered copy for every matmul that reads it: queries, keys and values);
- the ops that make residual tensors (norms, residual adds, dropout) work on 1/t of them,
  and the residuals the backward keeps of them take 1/t of their bytes.

The embedding lookup keeps its all-reduce (`_groups/_seqpar.py` says why). Held against
XLA's GPU compiler in tests/test_seqpar.py.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from .._graph import Graph
from .._groups import KEPT_WHOLE, Groups, layouts
from .._plan import Collective, Cost, Plan, Spec
from . import _collectives as C

_MATMUL = "dot_general"
_ADDS = frozenset({"add", "add_any"})


@dataclasses.dataclass(frozen=True)
class SeqparTerms:
    """What sequence parallelism changes in one step, per device."""

    reduce_scattered: tuple[float, ...]  # per partial-sum matmul: its buffer's bytes
    gathered: tuple[float, ...]  # per residual tensor a matmul reads: the gathered bytes
    compute_ops: frozenset[int]  # ops that now run on 1/t of the sequence
    kept_bytes: float  # bytes of the kept residuals the split makes 1/t of (before it)


def seqpar_terms(
    graph: Graph, groups: Groups, plan: Plan, saved: tuple[int, ...], float_bytes: int = 0
) -> SeqparTerms:
    """The terms of `plan`'s sequence parallelism, read from its constraints: a residual
    tensor is one whose constraint puts the plan's `sequence_parallel` axis on a dim its
    plain layout leaves whole."""
    axis = plan.sequence_parallel
    assignment = plan.assignment or {}
    lay = layouts(graph, groups, assignment)
    split = {
        t
        for t, spec in plan.constraints.items()
        if axis in _axes(spec) and axis not in _axes(lay[t])
    }
    consumers = graph.consumers()
    rs, ag, ops = {}, [], set()
    gathered: set[int] = set()
    for op in graph.ops:
        made = [t for t in op.outputs if t in split]
        if op.primitive == _MATMUL:
            if made and _contracts_on(op, groups, assignment, axis):
                # Partial sums added before they are reduced (the input gradient of the
                # queries', keys' and values' matmuls) are reduce-scattered once, summed.
                end = _summed(graph, made[0], split, consumers)
                rs[end] = _buffer(graph, end, lay[end], plan.mesh, float_bytes)
            reads = [t for t in op.inputs if t in split]
        elif op.primitive in KEPT_WHOLE:
            # The embedding's gradient reads its cotangent whole: gathered where it is made.
            reads = [t for t in op.inputs if _made_from(graph, t, split)]
        else:
            reads = []
            if made and len(made) == len(op.outputs):
                ops.add(op.index)
        for t in reads:
            if t not in gathered:
                gathered.add(t)
                ag.append(_buffer(graph, t, lay[t], plan.mesh, float_bytes))
    kept = sum(_buffer(graph, t, lay[t], plan.mesh, 0) for t in saved if t in split)
    return SeqparTerms(tuple(rs.values()), tuple(ag), frozenset(ops), kept)


def with_sequence_parallel(
    cost: Cost, terms: SeqparTerms, mesh: Mapping[str, int], axis: str, costs: C.AxisCosts,
    reduce_scatter: bool,
) -> Cost:  # fmt: skip
    """`cost` (the plan priced without it) with sequence parallelism's terms."""
    t = mesh[axis]
    code = costs.codes[axis]
    rs_bytes, ag_bytes = sum(terms.reduce_scattered), sum(terms.gathered)
    n_rs, n_ag = len(terms.reduce_scattered), len(terms.gathered)
    by_kind = {(c.kind, c.axis): c for c in cost.collectives}
    if reduce_scatter and n_rs:
        _move(by_kind, "all-reduce", axis, -rs_bytes, -n_rs, code, C.AR, costs)
        _move(by_kind, "reduce-scatter", axis, rs_bytes, n_rs, code, C.RS, costs)
    _move(by_kind, "all-gather", axis, ag_bytes, n_ag, code, C.AG, costs)
    comm = sum(c.time_s for c in by_kind.values())
    shrink = 1 - 1 / t
    saved_s = shrink * sum(s for i, s, _ in cost.per_op if i in terms.compute_ops)
    compute = cost.compute_s - saved_s
    freed = shrink * terms.kept_bytes
    breakdown = dict(cost.memory_breakdown)
    if "activations" in breakdown:
        breakdown["activations"] = max(0.0, breakdown["activations"] - freed)
    memory = cost.memory_bytes - freed
    step = cost.step_time_s - (cost.compute_s - compute) - (cost.comm_s - comm)
    fits = memory <= cost.memory_limit_bytes  # memory is what makes a plan infeasible
    return dataclasses.replace(
        cost,
        step_time_s=step,
        compute_s=compute,
        comm_s=comm,
        memory_bytes=memory,
        mfu=cost.mfu * cost.step_time_s / step if step > 0 else cost.mfu,
        feasible=fits,
        reason="" if fits else cost.reason,
        memory_breakdown=breakdown,
        collectives=tuple(c for c in by_kind.values() if c.count > 0),
    )


def _move(by_kind, kind, axis, nbytes, count, code, k, costs: C.AxisCosts) -> None:
    old = by_kind.get((kind, axis))
    b = (old.bytes if old else 0.0) + nbytes
    n = (old.count if old else 0) + count
    by_kind[(kind, axis)] = Collective(kind, axis, max(b, 0.0), max(n, 0), 0.0)
    by_kind[(kind, axis)] = dataclasses.replace(
        by_kind[(kind, axis)], time_s=costs.time1(k, code, max(b, 0.0), max(n, 0))
    )


def _summed(graph: Graph, t: int, split: set[int], consumers) -> int:
    """The tensor a partial sum ends in: followed through the adds that join it to others."""
    while True:
        users = consumers[t]
        if len(users) != 1 or graph.ops[users[0]].primitive not in _ADDS:
            return t
        out = graph.ops[users[0]].outputs[0]
        if out not in split:
            return t
        t = out


def _made_from(graph: Graph, t: int, split: set[int]) -> bool:
    """Tensor t is whole but made by an op from split residual tensors."""
    producer = graph.tensors[t].producer
    return (
        t not in split
        and producer is not None
        and any(i in split for i in graph.ops[producer].inputs)
    )


def _axes(spec: Spec) -> set[str]:
    out: set[str] = set()
    for e in spec:
        out.update([e] if isinstance(e, str) else (e or ()))
    return out


def _contracts_on(op, groups: Groups, assignment: Mapping[int, str], axis: str) -> bool:
    """The matmul sums over a group split on `axis`: its output holds partial sums."""
    (contract, _), _ = op.params["dimension_numbers"]
    return any(assignment.get(groups.of(op.inputs[0], d)) == axis for d in contract)


def _buffer(graph: Graph, t: int, spec: Spec, mesh: Mapping[str, int], float_bytes: int) -> float:
    """Per-device bytes of tensor t laid out by `spec` (whole on the sequence)."""
    tensor = graph.tensors[t]
    split = math.prod(mesh.get(a, 1) for a in _axes(spec))
    size = tensor.nbytes
    if float_bytes and "float" in tensor.dtype and tensor.itemsize < float_bytes:
        size = tensor.size * float_bytes
    return size / split
