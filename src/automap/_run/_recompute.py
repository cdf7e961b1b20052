"""Run a captured program with Megatron's full recomputation: a backward op reading a
tensor of a recomputed layer reads its value made again from the layer's inputs
(`_remat/_recompute.py` says which layers, and why XLA keeps the recompute).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._graph import Graph, TensorKind
from .._groups import Groups
from .._plan import Plan
from .._remat import Recompute, made_in_forward
from ._fsdp import (
    GatheredReads,
    Layerwise,
    backward_anchors,
    layer_read,
    outputs,
    pinned_layouts,
    reduce_before,
    spec_axes,
)
from ._interpret import Constrain, run_op


def eval_recomputing(
    graph: Graph,
    rc: Recompute,
    ops: Sequence[int],
    env: Mapping[int, Any],
    wanted: Sequence[int],
    constrain: Constrain | None = None,
    consts: Mapping[int, Any] | None = None,
    bind: Mapping[int, Callable[..., Any]] | None = None,
    layerwise: Layerwise | None = None,
    layout: Callable[[int], tuple] | None = None,
) -> list[Any]:
    """`_interpret.eval_ops`, except that a backward op (after `rc.boundary`) reading a
    tensor of a recomputed layer reads its recomputed value, made just before the first
    such read from the layer's inputs (barriered with that op's backward inputs). `bind[i]`
    computes op i in place of its primitive, as in `eval_ops`. `layerwise` (ZeRO-3's
    layers and gather, `_fsdp.py`): the parameters gathered layer by layer, the recompute
    reading those gathered again for its layer's backward. `layout(t)`: tensor t's layout
    under the plan (`plan_layout`), so that a recomputed value is tied to a backward
    value laid out as it is (`_after`); None: any of its shape."""
    values: dict[int, Any] = dict(graph.const_values if consts is None else consts)
    values.update(env)
    literal = literal_made(graph)
    again: dict[int, Any] = {}
    done: set[int] = set()
    lg, reads = None, None
    if layerwise is not None:
        lg = layerwise.lg
        reads = GatheredReads(graph, lg, values, layerwise.gather, constrain, bind)

    def base(i: int) -> Callable[[int], Any] | None:
        return values.__getitem__ if reads is None else layer_read(graph, lg, reads, values, i)

    def fetch(t: int, pairs: list[tuple[int, Any]]) -> Any:
        return reads.backward(t, pairs) if reads is not None and t in lg.lazy else values[t]

    def run(i: int, read: Callable[[int], Any], into: dict[int, Any]) -> None:
        run_op(graph, i, read, into, constrain, bind)

    def recompute(k: int, pairs: list[tuple[int, Any]]) -> None:
        # what literals alone make is read as it is: fenced, XLA would write it whole
        live = [t for t in rc.inputs[k] if t not in literal]
        anchors = [v for _, v in pairs]
        fenced, _ = jax.lax.optimization_barrier(([fetch(t, pairs) for t in live], anchors))
        start = {**values, **dict(zip(live, fenced, strict=True))}
        laid = [(None if layout is None else layout(a), v) for a, v in pairs]
        # No backward value of the unit's shapes and layouts (an attention core reads Q as
        # [b, s, h, d] while its trigger reads dO as [b, h, d, s]): tie on one whose axes
        # are a permutation of them; none either (under sequence parallelism a layer's
        # trigger reads only the stream's cotangent, split on the sequence where the
        # queries are split by head): on one reduced to a flag. An untied attempt is dead
        # code XLA drops.
        for how in ("same", "permute", "scalar"):
            local, tied = _remade(graph, rc, k, dict(start), laid, how, layout, run, live)
            if tied:
                break
        again.update({t: local[t] for t, j in rc.owner.items() if j == k})
        done.add(k)

    pending: tuple[int, ...] = ()  # gradients whose tie waits for a later op
    for i in ops:
        op = graph.ops[i]
        if layerwise is not None and i > rc.boundary:
            # before the gathers and the recompute, which wait for what the op reads
            pending = reduce_before(graph, layerwise, values, i, pending)
        read = base(i)
        if read is None:
            continue  # made from the parameters alone: where a layer reads it (`_fsdp.py`)
        if i > rc.boundary:
            need = sorted({rc.owner[t] for t in op.inputs if t in rc.owner} - done, reverse=True)
            pairs = backward_anchors(graph, i, values, rc.boundary)
            for k in need:
                recompute(k, pairs)
            run(i, lambda t, r=read: again[t] if t in again else r(t), values)
        else:
            run(i, read, values)
    return outputs(graph, lg, reads, values, wanted)


def _remade(
    graph: Graph,
    rc: Recompute,
    k: int,
    local: dict[int, Any],
    laid: list[tuple[Any, Any]],
    how: str,
    layout: Callable[[int], tuple] | None,
    run: Callable[[int, Callable[[int], Any], dict[int, Any]], None],
    fenced: Sequence[int],
) -> tuple[dict[int, Any], bool]:
    """Recompute unit `k` into `local` (its `fenced` inputs fenced there), those made in
    the forward tied to a backward value of `laid` ((layout, value) pairs) as `how` says:
    "same" or "permute" (`_after`), "scalar" (`_scalar_after`); and whether one was."""

    def tie(t: int) -> bool:
        if how == "scalar":
            local[t], hit = _scalar_after(local[t], laid)
        else:
            want = None if layout is None else layout(t)
            local[t], hit = _after(local[t], laid, how == "permute", want)
        return hit

    tied = False
    for t in fenced:
        if made_in_forward(graph, t, rc.boundary):
            tied |= tie(t)
    for i in rc.layers[k]:
        run(i, local.__getitem__, local)
        # No input could be tied (an integer mask, say): tie the first value made that
        # can; only the ops before it may then merge with the forward's.
        for t in () if tied else graph.ops[i].outputs:
            tied |= tie(t)
    return local, tied


def literal_made(graph: Graph) -> frozenset[int]:
    """The tensors made from literals alone (iotas, a causal mask compared from them, a
    fill value broadcast): the same wherever they are made. A recompute reads them as
    they are, not through its barrier: fenced, XLA writes each whole and holds it from
    the forward to the last recompute (read on compile-only A100s: at a batch of one the
    masked softmax's fill, broadcast to the scores' shape in float32, and its mask; at
    hidden 6144 and 8 ways of tensor parallelism, 120 MiB a device), where unfenced it
    makes them inside the kernels that read them."""
    made: set[int] = set()
    for op in graph.ops:
        if all(graph.tensors[t].kind is TensorKind.CONST or t in made for t in op.inputs):
            made.update(op.outputs)
    return frozenset(made)


def plan_layout(graph: Graph, groups: Groups, plan: Plan) -> Callable[[int], tuple] | None:
    """Tensor t's layout under `plan` (per dim, the mesh axes splitting it: its pinned
    layout where the plan pins it, else its groups', `pinned_layouts`), for
    `eval_recomputing`'s ties; None where the plan records no assignment (a plan written
    by hand)."""
    if not plan.assignment:
        return None
    _, lay = pinned_layouts(graph, groups, plan, plan.assignment)

    def layout(t: int) -> tuple:
        spec, rank = lay[t], len(graph.tensors[t].shape)
        return tuple(spec_axes(spec[d]) if d < len(spec) else () for d in range(rank))

    return layout


def _after(
    x: Any, anchors: list[tuple[Any, Any]], permute: bool = False, want: Any = None
) -> tuple[Any, bool]:
    """`x`, made to depend on a backward value of its shape (or a scalar one): the same
    bits, but a value XLA can neither merge with the forward's `x` nor compute before
    that backward value; and whether such a value was there. `anchors`: (layout, value)
    pairs; `want`: x's layout (None: unknown).

    The optimization barrier alone does this on GPUs and TPUs, but XLA's CPU pipeline
    expands barriers away before CSE, which then folds the recompute back into the
    forward. `a == a | a != a` is true for every float (NaN included) yet XLA cannot
    fold it, so the select keeps `x` exactly; elementwise on one shape and one layout
    (or a scalar every device holds), it fuses and moves nothing between devices. An
    anchor of x's shape but laid out otherwise (under sequence parallelism a stream
    cotangent is split on the sequence where the recomputed queries are split by head)
    would have XLA move the mask between the two layouts (an all-to-all of the mask per
    recomputed layer, read in an A100 program), so only anchors laid out as x tie it."""
    for spec, a in anchors:
        same = a.shape == x.shape and (want is None or spec is None or spec == want)
        if (same or a.ndim == 0) and jnp.issubdtype(a.dtype, jnp.floating):
            return jnp.where((a == a) | (a != a), x, jnp.zeros_like(x)), True
    for spec, a in anchors if permute else ():
        order = _permutation(a.shape, x.shape)
        if order is None or not jnp.issubdtype(a.dtype, jnp.floating):
            continue
        if want is None or spec is None or tuple(spec[i] for i in order) == want:
            a = jnp.transpose(a, order)
            return jnp.where((a == a) | (a != a), x, jnp.zeros_like(x)), True
    return x, False


def _scalar_after(x: Any, anchors: list[tuple[Any, Any]]) -> tuple[Any, bool]:
    """`_after` on the first floating anchor reduced to one flag: an all-reduce of one
    byte over the devices holding it, where an elementwise tie across two layouts would
    move the whole mask (`_after`)."""
    for _, a in anchors:
        if a.ndim and jnp.issubdtype(a.dtype, jnp.floating):
            flag = jnp.all((a == a) | (a != a))
            return jnp.where(flag, x, jnp.zeros_like(x)), True
    return x, False


def _permutation(have: tuple[int, ...], want: tuple[int, ...]) -> tuple[int, ...] | None:
    """The axes order taking shape `have` to `want` when the sizes are distinct (so the
    order, and with it how each axis is split, is unambiguous); else None."""
    if len(set(have)) != len(have) or sorted(have) != sorted(want) or have == want:
        return None
    return tuple(have.index(n) for n in want)
