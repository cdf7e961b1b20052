"""The attention cores a plan's `attention="flash"` runs by the flash kernel, matched.

The captured step is already differentiated, so the core is written out twice: its
forward (`_remat.attention_cores`: QKᵀ, scale, causal mask, softmax, attention over V)
and its backward (the transposes of those ops, from the cotangent of the core's output
dO to those of Q, K and V). Both are found from the program's structure here and run as
one call to the Pallas flash kernel (`jax.experimental.pallas.ops.tpu.flash_attention`)
and its VJP, through the runtime's `bind` hook (`_interpret.run_op`): every evaluator
(plain, recomputing, ZeRO-3's layer-wise gathers) then runs the kernel without knowing.

The core's inner tensors (scores, probabilities) are bound to zeros nobody reads, which
XLA removes; the dot that makes the core's output runs the kernel's forward (again, when
the plan recomputes the core: the last forward's VJP is the one the backward uses, as
MaxText's scanned layer under `remat_policy=minimal` recomputes its flash call); the
first backward op that needs the gradients runs the kernel's backward on dO.

Layouts are read from the two matmuls' dimension numbers (batch, group, query, key and
head dimensions), the key dimension by following the scores to the dot over V, the query
dimension and the causal mask by evaluating the mask (made from iota, no data), the
scale from the scalar constants the scores are divided or multiplied by before the mask.
A core that is not this pattern is refused with a one-line error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._capture import find_residuals
from .._errors import PlanError
from .._graph import Graph, TensorKind
from ._selective import attention_cores
from ._units import layer_ops

DOT = "dot_general"
# The primitives a written causal softmax attention is made of, between its two matmuls.
_SOFTMAX_OPS = frozenset(
    {
        "transpose",
        "div",
        "mul",
        "convert_element_type",
        "select_n",
        "broadcast_in_dim",
        "reduce_max",
        "max",
        "stop_gradient",
        "sub",
        "exp",
        "reduce_sum",
        "reshape",
    }
)
_MASKED = -1e4  # a fill value at most this is a mask (the zoo writes -1e9)
BLOCK = 128  # the Pallas TPU kernel's default query and key block (`BlockSizes.get_default`)


@dataclasses.dataclass(frozen=True)
class FlashCore:
    """One attention core matched to the flash kernel."""

    d1: int  # QKᵀ
    d2: int  # the attention over V (makes the core's output)
    q: int  # d1's operand holding the queries
    k: int  # d1's operand holding the keys
    v: int  # d2's operand holding the values
    out: int  # d2's output
    q_labels: tuple[str, ...]  # per dim of q: a batch label, "G*" (group), "q" or "d"
    k_labels: tuple[str, ...]
    v_labels: tuple[str, ...]
    out_labels: tuple[str, ...]
    scale: float
    forward: tuple[int, ...]  # ops of the forward core (bound to zeros but d2)
    backward: tuple[int, ...]  # ops of the backward core (bound to zeros but the sinks)
    grads: Mapping[int, int]  # backward tensor -> the operand (q, k or v) it is the cotangent of
    d_out: int  # the cotangent of `out` the backward reads


def _labels_from_dot(graph: Graph, i: int) -> tuple[list[str], list[str], list[str]]:
    """Labels for d1's two operands and its output: batch pairs "B0".., the contracted
    pair "c", each operand's free dims "L0".. and "R0".."""
    (lc, rc), (lb, rb) = graph.eqns[i].params["dimension_numbers"]
    a, b = (len(graph.tensors[t].shape) for t in graph.ops[i].inputs)
    la, lr = [""] * a, [""] * b
    for n, (x, y) in enumerate(zip(lb, rb, strict=True)):
        la[x] = lr[y] = f"B{n}"
    for x, y in zip(lc, rc, strict=True):
        la[x] = lr[y] = "c"
    free_l = [d for d in range(a) if not la[d]]
    free_r = [d for d in range(b) if not lr[d]]
    for n, d in enumerate(free_l):
        la[d] = f"L{n}"
    for n, d in enumerate(free_r):
        lr[d] = f"R{n}"
    out = [la[d] for d in lb] + [la[d] for d in free_l] + [lr[d] for d in free_r]
    return la, lr, out


def match_core(graph: Graph, core: Sequence[int], boundary: int) -> FlashCore:
    """The core's flash form, or a one-line PlanError saying what did not match."""
    dots = [i for i in core if graph.ops[i].primitive == DOT]
    if len(dots) != 2:
        raise PlanError(
            f"flash attention: the attention core at op {core[0]} has {len(dots)} matmuls, "
            "not QKᵀ and the product with V; run it with attention='written'."
        )
    d1, d2 = dots
    between = [i for i in core if i not in (d1, d2)]
    odd = sorted({graph.ops[i].primitive for i in between} - _SOFTMAX_OPS)
    if odd:
        raise PlanError(
            f"flash attention: the attention core at op {d1} holds {', '.join(odd)}, which "
            "the flash kernel does not compute (a bias, dropout?); use attention='written'."
        )
    _check_softmax(graph, d1, between)
    la, lr, lout = _labels_from_dot(graph, d1)
    if la.count("c") != 1:
        raise PlanError(
            f"flash attention: QKᵀ at op {d1} contracts {la.count('c')} dimensions, not one "
            "head dimension; use attention='written'."
        )
    labels = _propagate(graph, graph.ops[d1].outputs[0], lout, between)
    v, p = _value_operand(graph, d2, labels)
    (c2v, c2p), (b2v, b2p) = graph.eqns[d2].params["dimension_numbers"]
    if len(c2p) != 1:
        raise PlanError(f"flash attention: the product with V at op {d2} is not over one key dim.")
    key = labels[p][c2p[0]]
    # The keys are the operand whose free dim the product with V contracts.
    q_t, k_t = graph.ops[d1].inputs
    q_lab, k_lab = la, lr
    if not key.startswith("R"):
        q_t, k_t, q_lab, k_lab = k_t, q_t, lr, la
    if sum(not x.startswith(("B", "c")) for x in k_lab) != 1:
        raise PlanError(
            f"flash attention: the keys at op {d1} have more than one free dimension; use "
            "attention='written'."
        )
    mask_q = _causal_query(graph, between, labels, key)
    seq = graph.tensors[k_t].shape[k_lab.index(key)]
    if seq % BLOCK:
        raise PlanError(
            f"flash attention: the sequence ({seq}) is not a multiple of the kernel's "
            f"{BLOCK}-row blocks; use attention='written' or a sequence of {BLOCK}k."
        )
    q_labels = tuple("q" if x == mask_q else "d" if x == "c" else x for x in q_lab)
    k_labels = tuple("t" if x == key else "d" if x == "c" else x for x in k_lab)
    # d2: V's contracted dim is the key; its batch dims carry P's labels; its free one "e".
    v_lab = ["e"] * len(graph.tensors[v].shape)
    v_lab[c2v[0]] = "t"
    for x, y in zip(b2v, b2p, strict=True):
        v_lab[x] = labels[p][y]
    p_free = [labels[p][d] for d in range(len(labels[p])) if d not in b2p and d not in c2p]
    v_first = graph.ops[d2].inputs[0] == v
    batch = [labels[p][d] for d in b2p]
    out_labels = tuple(batch + (["e", *p_free] if v_first else [*p_free, "e"]))
    out_labels = tuple("q" if x == mask_q else x for x in out_labels)
    v_labels = tuple("q" if x == mask_q else x for x in v_lab)
    if v_labels.count("e") != 1 or sorted(x for x in out_labels if x != "e") != sorted(
        x for x in q_labels if x != "d"
    ):
        raise PlanError(f"flash attention: the product with V at op {d2} is not laid out as Q.")
    scale = _scale(graph, between)
    backward, grads, d_out = _backward(graph, boundary, core, d2, (q_t, k_t, v), p)
    _check_sealed(graph, (*core, *backward), {graph.ops[d2].outputs[0], *grads}, d1)
    return FlashCore(
        d1, d2, q_t, k_t, v, graph.ops[d2].outputs[0], q_labels, k_labels, v_labels,
        out_labels, scale, tuple(i for i in core if i != d2), backward, grads, d_out,
    )  # fmt: skip


def _check_softmax(graph: Graph, d1: int, between: Sequence[int]) -> None:
    """Refuse a core whose ops between the matmuls are not scale, mask and softmax: one
    exp and one row sum; a product only by a scalar constant (the scale); a difference
    only less the row maximum, a quotient only by a scalar constant or the row sum."""
    prims = [graph.ops[i].primitive for i in between]
    producer = {t: i for i in between for t in graph.ops[i].outputs}

    def made_by(t: int, prim: str) -> bool:
        todo, seen = [t], set()
        while todo:
            i = producer.get(todo.pop())
            if i is None or i in seen:
                continue
            if graph.ops[i].primitive == prim:
                return True
            seen.add(i)
            todo.extend(graph.ops[i].inputs)
        return False

    def scalar(t: int) -> bool:
        return not graph.tensors[t].shape and graph.tensors[t].kind is TensorKind.CONST

    fine = prims.count("exp") == 1 and prims.count("reduce_sum") == 1
    for i in between:
        op = graph.ops[i]
        if op.primitive == "mul":
            fine &= any(scalar(t) for t in op.inputs)
        elif op.primitive == "div":
            fine &= scalar(op.inputs[1]) or made_by(op.inputs[1], "reduce_sum")
        elif op.primitive == "sub":
            fine &= made_by(op.inputs[1], "reduce_max")
    if not fine:
        raise PlanError(
            f"flash attention: the ops between the attention core's matmuls at op {d1} are "
            "not a scaled, masked softmax; use attention='written'."
        )


def _check_sealed(graph: Graph, bound: Sequence[int], real: set[int], d1: int) -> None:
    """Refuse a core whose inner values (zeros under flash: all the bound ops make but
    the output and the cotangents) reach the step's outputs through other ops."""
    inside = set(bound)
    zeros = {t for i in bound for t in graph.ops[i].outputs} - real
    for i, op in enumerate(graph.ops):
        if i not in inside and any(t in zeros for t in op.inputs):
            zeros.update(op.outputs)
    if any(leaf.tensor in zeros for leaf in graph.outputs):
        raise PlanError(
            f"flash attention: the attention core at op {d1} has values the step returns "
            "or uses outside the core (the scores, the probabilities); use attention='written'."
        )


def _value_operand(graph: Graph, d2: int, labels: Mapping[int, list[str]]) -> tuple[int, int]:
    a, b = graph.ops[d2].inputs
    if b in labels and a not in labels:
        return a, b
    if a in labels and b not in labels:
        return b, a
    raise PlanError(f"flash attention: op {d2} does not read the probabilities once.")


def _propagate(graph: Graph, start: int, lab: list[str], ops: Sequence[int]) -> dict:
    """Per score-shaped tensor on the core's path, its dims' labels (transposes permute
    them; elementwise ops keep them)."""
    labels = {start: lab}
    for i in ops:
        op = graph.ops[i]
        src = [t for t in op.inputs if t in labels]
        if not src:
            continue
        if op.primitive == "transpose":
            perm = graph.eqns[i].params["permutation"]
            labels[op.outputs[0]] = [labels[src[0]][d] for d in perm]
            continue
        shape = graph.tensors[op.outputs[0]].shape
        same = [t for t in src if graph.tensors[t].shape == shape]
        if same and op.primitive not in ("reshape", "broadcast_in_dim"):
            labels[op.outputs[0]] = list(labels[same[0]])
    return labels


def _const_value(graph: Graph, t: int) -> Any:
    """The value of a tensor made from constants and iota alone (the causal mask), or None."""
    need: list[int] = []
    todo, seen = [t], set()
    while todo:
        x = todo.pop()
        if x in seen:
            continue
        seen.add(x)
        tensor = graph.tensors[x]
        if tensor.kind is TensorKind.CONST:
            continue
        if tensor.kind is not TensorKind.INTERMEDIATE or tensor.producer is None:
            return None
        need.append(tensor.producer)
        todo.extend(graph.ops[tensor.producer].inputs)
    values: dict[int, Any] = dict(graph.const_values)
    for i in sorted(set(need)):
        eqn = graph.eqns[i]
        outs = eqn.primitive.bind(*[values[x] for x in graph.ops[i].inputs], **eqn.params)
        outs = outs if eqn.primitive.multiple_results else [outs]
        values.update(zip(graph.ops[i].outputs, outs, strict=True))
    return np.asarray(values[t])


def _causal_query(graph: Graph, between: Sequence[int], labels: Mapping, key: str) -> str:
    """The query dim's label, read off the causal mask: the one select in the core keeps
    the scores where a bool made from iota alone is True (query i sees keys j <= i) and
    fills very negative elsewhere."""
    selects = [i for i in between if graph.ops[i].primitive == "select_n"]
    if len(selects) != 1:
        raise PlanError(
            "flash attention: the attention core is not causal (no single mask select); "
            "the flash kernel here runs causal attention only; use attention='written'."
        )
    pred, fill, scores = graph.ops[selects[0]].inputs
    (mask, at), (filled, _) = _unbroadcast(graph, pred), _unbroadcast(graph, fill)
    if mask is None or filled is None or scores not in labels or filled.max() > _MASKED:
        raise PlanError("flash attention: the core's mask is not a constant causal mask.")
    lab = labels[scores]
    # Axes of the (un-broadcast) mask along which it varies, as the scores' dims.
    varying = [at[a] for a in range(mask.ndim) if not (mask == mask.take([0], axis=a)).all()]
    kd = lab.index(key)
    qd = [d for d in varying if d != kd]
    if len(qd) != 1 or kd not in varying:
        raise PlanError("flash attention: the core's mask is not causal over query and key.")
    plane = np.moveaxis(mask, (at.index(qd[0]), at.index(kd)), (-2, -1))
    plane = plane.reshape(-1, *plane.shape[-2:])[0]
    n_q, n_k = plane.shape
    if n_q != n_k or not (plane == np.tril(np.ones((n_q, n_k), bool))).all():
        raise PlanError("flash attention: the core's mask is not the causal (lower) triangle.")
    return lab[qd[0]]


def _unbroadcast(graph: Graph, t: int) -> tuple[Any, list[int]]:
    """(the value of the tensor `t` is broadcast from, made from constants and iota alone,
    or None; per axis of it, t's axis): a causal mask broadcast over batch and heads is
    evaluated at its own size."""
    dims = list(range(len(graph.tensors[t].shape)))
    while True:
        p = graph.tensors[t].producer
        if p is None or graph.ops[p].primitive != "broadcast_in_dim":
            break
        dims = [dims[d] for d in graph.eqns[p].params["broadcast_dimensions"]]
        t = graph.ops[p].inputs[0]
    return _const_value(graph, t), dims


def _scale(graph: Graph, between: Sequence[int]) -> float:
    """The product of the scalar constants the scores are multiplied or divided by."""
    scale = 1.0
    for i in between:
        op = graph.ops[i]
        if op.primitive not in ("mul", "div") or len(op.inputs) != 2:
            continue
        a, b = op.inputs
        if not graph.tensors[b].shape and graph.tensors[b].kind is TensorKind.CONST:
            c = float(np.asarray(graph.const_values[b]))
            scale = scale / c if op.primitive == "div" else scale * c
        elif not graph.tensors[a].shape and graph.tensors[a].kind is TensorKind.CONST:
            if op.primitive == "div":
                raise PlanError(f"flash attention: op {i} divides a constant by the scores.")
            scale *= float(np.asarray(graph.const_values[a]))
    return scale


def _backward(graph, boundary, core, d2, operands, p):
    """The backward core: the ops after `boundary` on the paths from dO (the cotangent
    the backward's dots read beside the probabilities) to the cotangents of Q, K and V
    (the dots reading those operands and a tensor of the path, and the transposes that
    put each in its operand's layout)."""
    inner = {t for i in core for t in graph.ops[i].outputs} - {graph.ops[d2].outputs[0]}
    readers = graph.consumers()  # each tensor's, in program order
    dv_dots = [j for j in readers[p] if j > boundary and graph.ops[j].primitive == DOT]
    if len(dv_dots) != 1:
        raise PlanError("flash attention: the backward does not read the probabilities once.")
    d_out = next(t for t in graph.ops[dv_dots[0]].inputs if t != p)
    # The walk starts at the backward's first reader of dO or of a core value: no op before
    # it reads the path (a cheap prefix skip; each core's walk ran the whole backward).
    first = min(
        (j for t in (d_out, *inner) for j in readers[t] if j > boundary), default=len(graph.ops)
    )
    path, grads, ops = {d_out}, {}, []
    for j in range(first, len(graph.ops)):
        op = graph.ops[j]
        if not any(t in path or t in inner for t in op.inputs):
            continue
        ops.append(j)
        target = _target(op, operands, p) if op.primitive == DOT else None
        if target is not None:
            grads[_layout_out(graph, j, target, readers, ops)] = target
            continue
        path.update(op.outputs)
    if sorted(grads.values()) != sorted(operands):
        raise PlanError("flash attention: the backward core's gradients of Q, K, V were not found.")
    return tuple(ops), grads, d_out


def _target(op, operands, p):
    """The operand whose cotangent a backward dot of the core makes, or None (dP = dO·Vᵀ,
    which the softmax's backward reads on)."""
    q, k, v = operands
    if p in op.inputs:
        return v
    if q in op.inputs:
        return k
    if k in op.inputs:
        return q
    return None


def _layout_out(graph, j, operand, readers, ops):
    """The dot's output, or the transpose of it that has `operand`'s shape."""
    t = graph.ops[j].outputs[0]
    want = graph.tensors[operand].shape
    nxt = readers[t]
    if len(nxt) == 1 and graph.ops[nxt[0]].primitive == "transpose":
        ops.append(nxt[0])
        t = graph.ops[nxt[0]].outputs[0]
    if graph.tensors[t].shape != want:
        raise PlanError(f"flash attention: op {j}'s gradient is not laid out as its operand.")
    return t


def flash_cores(graph: Graph, groups: Any) -> tuple[FlashCore, ...]:
    """Every attention core of the program, matched (the runtime binds them to the kernel,
    `_run/_flash.py`; the cost model prices them so, `_cost/_flash.py`), or a one-line
    PlanError: a program without one, or a core that is not a causal softmax attention."""
    cores = [c for c in attention_cores(graph, layer_ops(graph, groups)) if c]
    if not cores:
        raise PlanError(
            "attention='flash', but the program has no attention core (two activation "
            "matmuls with a softmax between); use attention='written'."
        )
    boundary = find_residuals(graph).boundary
    return tuple(match_core(graph, c, boundary) for c in cores)
