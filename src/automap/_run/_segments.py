"""A partitioned training step cut into the pieces the pipeline runtime jits and runs.

`partition` says which stage and phase every op is in; this module turns that into
`Segment`s: a stage's forward ops of one microbatch ("F"), its backward ops ("B"), and the
once-per-step ops before ("pre") and after ("post") the microbatches. Pre and post ops may
read each other's values across stages (a global gradient norm reads every stage's
gradients), so they run as `_pipeline.once_programs` orders them: one program per stage
and round of cross-stage reads.

Per-microbatch ops run from a second capture of the step at the microbatch's shapes: their
eqns carry shape parameters (a broadcast to [B/m, S, H]) that the full capture would get
wrong. Scalar literals come from the full capture, though: the 1/B of a mean over the
batch must keep the whole batch's B, or every microbatch's gradient would be m times too
large.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax

from .._errors import PlanError
from .._graph import Graph, TensorKind
from .._groups import Groups
from .._pipeline import Partition, Phase, once_programs
from .._remat import generated, remake_residuals
from ._shared import leaf_dtype, leaf_shape


@dataclasses.dataclass(frozen=True)
class Segment:
    """Ops that run as one jitted program on one stage, and what crosses its border."""

    stage: int
    kind: Phase  # PRE, FWD, BWD or POST
    ops: tuple[int, ...]  # op indices, program order
    inputs: tuple[int, ...]  # tensor ids read from outside (no constants), first use order
    outputs: tuple[int, ...]  # tensor ids produced here that others read (or step outputs)
    # A "B" segment under rematerialization: the stage's layers it recomputes from their
    # inputs before their backward (`_remat.Recompute`, restricted to the stage).
    recompute: Any = None


def batch_dim(groups: Groups, tensor: int) -> int | None:
    """The dimension of `tensor` in a batch linkage group (at most one: the groups are
    splittable and the parts of one cut batch, so never two dims of one tensor)."""
    batch = groups.batch_groups
    return next((d for d, g in enumerate(groups.tensor_groups[tensor]) if g in batch), None)


def micro_args(graph: Graph, groups: Groups, part: Partition, args: tuple, m: int) -> tuple:
    """Abstract arguments for one microbatch: every input leaf that carries the batch has
    its batch dimension divided by `m` (a PlanError when it does not divide)."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    out = []
    for leaf, x in zip(graph.inputs, leaves, strict=True):
        shape = list(leaf_shape(x))
        d = batch_dim(groups, leaf.tensor) if leaf.tensor in part.batched else None
        if d is not None:
            if shape[d] % m:
                raise PlanError(
                    f"input {leaf.path} has batch size {shape[d]}, which {m} microbatches do "
                    f"not divide. Use a number of microbatches that divides {shape[d]}."
                )
            shape[d] //= m
        out.append(jax.ShapeDtypeStruct(tuple(shape), leaf_dtype(x)))
    return jax.tree_util.tree_unflatten(treedef, out)


def check_same_program(full: Graph, micro: Graph, groups: Groups, m: int) -> None:
    """The microbatch capture must be the full one with the batch dims divided by m."""
    fix = (
        "The step traces differently at the microbatch size (a Python branch on the batch "
        "size?); make it shape-independent, or use one microbatch."
    )
    if len(full.ops) != len(micro.ops) or len(full.tensors) != len(micro.tensors):
        raise PlanError(
            f"at the microbatch size the step has {len(micro.ops)} ops and "
            f"{len(micro.tensors)} tensors, at the full batch {len(full.ops)} and "
            f"{len(full.tensors)}. {fix}"
        )
    for a, b in zip(full.ops, micro.ops, strict=True):
        if a.primitive != b.primitive or a.inputs != b.inputs or a.outputs != b.outputs:
            raise PlanError(
                f"op {a.index} is {a.primitive} at the full batch but {b.primitive} at the "
                f"microbatch size (or reads other tensors). {fix}"
            )
    batch = groups.batch_groups
    consumers = full.consumers()
    outputs = {leaf.tensor for leaf in full.outputs}
    for t, u in zip(full.tensors, micro.tensors, strict=True):
        if not consumers[t.id] and t.id not in outputs:
            continue  # dead (a jvp's unused broadcast): no linkage tied it to the batch
        want = tuple(
            n // m if g in batch else n
            for n, g in zip(t.shape, groups.tensor_groups[t.id], strict=True)
        )
        if u.shape != want or u.dtype != t.dtype:
            raise PlanError(
                f"tensor {t.id} is {t.dtype}{list(t.shape)} at the full batch but "
                f"{u.dtype}{list(u.shape)} at the microbatch size (expected {list(want)}). {fix}"
            )


def micro_consts(full: Graph, micro: Graph) -> dict[int, Any]:
    """Constants for per-microbatch ops: scalars from the full capture (a mean's 1/B keeps
    the whole batch's B), arrays from the microbatch capture where their shape differs."""
    out = dict(full.const_values)
    for t, value in micro.const_values.items():
        if full.tensors[t].shape != micro.tensors[t].shape:
            out[t] = value
    return out


def segments(graph: Graph, part: Partition) -> tuple[list[Segment], list[Segment], list[Segment]]:
    """(pre runs, per-microbatch segments, post runs). The per-microbatch list holds an "F",
    a "B" and a "W" segment for every stage (possibly without ops: the schedule still runs
    them; W has ops only where `_pipeline.split_backward` split the partition)."""
    consumers = graph.consumers()
    step_outputs = {leaf.tensor for leaf in graph.outputs}

    def make(stage: int, kind: Phase, ops: list[int]) -> Segment:
        inside = set(ops)
        produced = [t for i in ops for t in graph.ops[i].outputs]
        reads = dict.fromkeys(
            t
            for i in ops
            for t in graph.ops[i].inputs
            if graph.tensors[t].kind is not TensorKind.CONST
            and graph.tensors[t].producer not in inside
        )
        needed = [
            t for t in produced if t in step_outputs or any(c not in inside for c in consumers[t])
        ]
        return Segment(stage, kind, tuple(ops), tuple(reads), tuple(needed))

    def runs(phase: Phase) -> list[Segment]:
        return [make(s, phase, list(ops)) for s, ops in once_programs(graph, part, phase)]

    micro = [
        make(s, phase, list(part.ops(s, phase)))
        for s in range(part.n_stages)
        for phase in (Phase.FWD, Phase.BWD, Phase.WGT)
    ]
    return runs(Phase.PRE), micro, runs(Phase.POST)


def recompute_segments(graph: Graph, micro: list[Segment], rc: Any) -> list[Segment]:
    """The per-microbatch segments under rematerialization (Megatron's full recompute):
    each "B" recomputes its stage's layers from their inputs, so its "F" hands it those
    inputs instead of the layers' residuals, which no longer outlive the forward."""
    step_outputs = {leaf.tensor for leaf in graph.outputs}
    consumers = graph.consumers()
    by_unit = {(seg.stage, seg.kind): seg for seg in micro}
    out = []
    for seg in micro:
        f, b = by_unit[(seg.stage, Phase.FWD)], by_unit[(seg.stage, Phase.BWD)]
        own = rc.restricted(f.ops)
        if not own.layers:
            out.append(seg)
            continue
        in_b = set(b.ops)
        b_inputs = tuple(
            dict.fromkeys(
                [t for t in b.inputs if t not in own.owner]
                + [t for ins in own.inputs for t in ins if graph.tensors[t].producer not in in_b]
            )
        )
        if seg.kind is Phase.BWD:
            out.append(dataclasses.replace(seg, inputs=b_inputs, recompute=own))
            continue
        if seg.kind is Phase.FWD:
            pair = set(f.ops) | set(b.ops)
            kept = [
                t
                for t in f.outputs
                if t in step_outputs or any(c not in pair for c in consumers[t])
            ]
            made = {t for i in f.ops for t in graph.ops[i].outputs}
            outputs = tuple(dict.fromkeys(kept + [t for t in b_inputs if t in made]))
            out.append(dataclasses.replace(seg, outputs=outputs))
        else:  # W: without ops, as the split backward is refused with recomputation
            out.append(seg)
    return out


def remake_segments(graph: Graph, part: Partition, micro: list[Segment]) -> list[Segment]:
    """The per-microbatch segments with each "B" making the cheap elementwise residuals
    again from the ones its "F" keeps (`_remat.remake_residuals`): its "F" hands it fewer
    outputs, each held per microbatch in flight. A "B" that recomputes layers
    (`recompute_segments`) reads the layers' inputs: those are what it sees as residuals."""
    consumers = graph.consumers()
    step_outputs = {leaf.tensor for leaf in graph.outputs}
    by_unit = {(seg.stage, seg.kind): seg for seg in micro}
    out = []
    for seg in micro:
        f, b = by_unit[(seg.stage, Phase.FWD)], by_unit[(seg.stage, Phase.BWD)]
        rm = remake_residuals(graph, part, seg.stage, b.inputs, consumers)
        if not rm.ops:
            out.append(seg)
            continue
        again = set(rm.remade)
        b_inputs = tuple(
            dict.fromkeys(
                [t for t in b.inputs if t not in again]
                + [t for t in rm.stored if t not in b.inputs]
            )
        )
        if seg.kind is Phase.BWD:
            ops = tuple(sorted({*rm.ops, *seg.ops}))
            out.append(dataclasses.replace(seg, ops=ops, inputs=b_inputs))
            continue
        if seg.kind is not Phase.FWD:  # W: empty where the backward is not split (and the
            out.append(seg)  # split one is not remade: `_run/_pipelined.py`)
            continue
        pair = {*f.ops, *b.ops, *(b.recompute.ops if b.recompute is not None else ())}
        kept = [
            t
            for t in f.outputs
            if t in b_inputs or t in step_outputs or any(c not in pair for c in consumers[t])
        ]
        made = {t for i in f.ops for t in graph.ops[i].outputs}
        outputs = tuple(dict.fromkeys(kept + [t for t in b_inputs if t in made]))
        out.append(dataclasses.replace(seg, outputs=outputs))
    return out


def generate_in_readers(
    graph: Graph, part: Partition, pre: list[Segment], micro: list[Segment], post: list[Segment]
) -> tuple[list[Segment], list[Segment]]:
    """(pre, micro) with each per-microbatch segment making the per-step values made from
    nothing the step reads (`_remat.generated`: a causal mask) itself, and the pre
    segments no longer handing out those no other segment reads: a mask per layer is not
    held all step for the backward."""
    gen = generated(graph, part)
    out = []
    for seg in micro:
        need = [t for t in seg.inputs if t in gen]
        if not need:
            out.append(seg)
            continue
        ops = tuple(sorted({*seg.ops, *(i for t in need for i in gen[t])}))
        inputs = tuple(t for t in seg.inputs if t not in gen)
        out.append(dataclasses.replace(seg, ops=ops, inputs=inputs))
    step_outputs = {leaf.tensor for leaf in graph.outputs}
    read = {t for seg in (*pre, *out, *post) for t in seg.inputs}
    pre = [
        dataclasses.replace(
            seg, outputs=tuple(t for t in seg.outputs if t in read or t in step_outputs)
        )
        for seg in pre
    ]
    return pre, out


def readers(micro: list[Segment]) -> Mapping[tuple[int, int], int]:
    """How many per-microbatch segments of each stage read each tensor, by (tensor,
    stage): a microbatch's copy of it on that stage can be dropped once that many have run
    (residuals die after their backward, a value sent on dies on its sender)."""
    count: dict[tuple[int, int], int] = {}
    for seg in micro:
        for t in seg.inputs:
            count[(t, seg.stage)] = count.get((t, seg.stage), 0) + 1
    return count
