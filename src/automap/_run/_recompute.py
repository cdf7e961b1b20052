"""Run a captured program with Megatron's full recomputation: a backward op reading a
tensor of a recomputed layer reads its value made again from the layer's inputs
(`_remat/_recompute.py` says which layers, and why XLA keeps the recompute).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._graph import Graph
from .._remat import Recompute, made_in_forward
from ._fsdp import GatheredReads, Layerwise, backward_anchors, layer_read, outputs, reduce_before
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
) -> list[Any]:
    """`_interpret.eval_ops`, except that a backward op (after `rc.boundary`) reading a
    tensor of a recomputed layer reads its recomputed value, made just before the first
    such read from the layer's inputs (barriered with that op's backward inputs). `bind[i]`
    computes op i in place of its primitive, as in `eval_ops`. `layerwise` (ZeRO-3's
    layers and gather, `_fsdp.py`): the parameters gathered layer by layer, the recompute
    reading those gathered again for its layer's backward."""
    values: dict[int, Any] = dict(graph.const_values if consts is None else consts)
    values.update(env)
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

    def attempt(k: int, pairs: list[tuple[int, Any]], permute: bool) -> tuple[dict, bool]:
        live, anchors = rc.inputs[k], [v for _, v in pairs]
        fenced, _ = jax.lax.optimization_barrier(([fetch(t, pairs) for t in live], anchors))
        local = {**values, **dict(zip(live, fenced, strict=True))}
        tied = False
        for t in live:
            if made_in_forward(graph, t, rc.boundary):
                local[t], hit = _after(local[t], anchors, permute)
                tied |= hit
        for i in rc.layers[k]:
            run(i, local.__getitem__, local)
            # No input could be tied (an integer mask, say): tie the first value made that
            # can; only the ops before it may then merge with the forward's.
            for t in () if tied else graph.ops[i].outputs:
                local[t], hit = _after(local[t], anchors, permute)
                tied |= hit
        return local, tied

    def recompute(k: int, pairs: list[tuple[int, Any]]) -> None:
        local, tied = attempt(k, pairs, permute=False)
        if not tied:
            # No backward value of any shape the unit holds (an attention core reads Q as
            # [b, s, h, d] while its trigger reads dO as [b, h, d, s]): tie on one whose
            # axes are a permutation of them. The untied attempt is dead code XLA drops.
            local, _ = attempt(k, pairs, permute=True)
        again.update({t: local[t] for t, j in rc.owner.items() if j == k})
        done.add(k)

    for i in ops:
        op = graph.ops[i]
        if layerwise is not None and i > rc.boundary:
            # before the gathers and the recompute, which wait for what the op reads
            reduce_before(graph, layerwise, values, i)
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


def _after(x: Any, anchors: list[Any], permute: bool = False) -> tuple[Any, bool]:
    """`x`, made to depend on a backward value of its shape (or a scalar one): the same
    bits, but a value XLA can neither merge with the forward's `x` nor compute before
    that backward value; and whether such a value was there.

    The optimization barrier alone does this on GPUs and TPUs, but XLA's CPU pipeline
    expands barriers away before CSE, which then folds the recompute back into the
    forward. `a == a | a != a` is true for every float (NaN included) yet XLA cannot
    fold it, so the select keeps `x` exactly; elementwise on one shape (or a scalar every
    device holds), it fuses and moves nothing between devices."""
    for a in anchors:
        if (a.shape == x.shape or a.ndim == 0) and jnp.issubdtype(a.dtype, jnp.floating):
            return jnp.where((a == a) | (a != a), x, jnp.zeros_like(x)), True
    for a in anchors if permute else ():
        order = _permutation(a.shape, x.shape)
        if order is not None and jnp.issubdtype(a.dtype, jnp.floating):
            a = jnp.transpose(a, order)
            return jnp.where((a == a) | (a != a), x, jnp.zeros_like(x)), True
    return x, False


def _permutation(have: tuple[int, ...], want: tuple[int, ...]) -> tuple[int, ...] | None:
    """The axes order taking shape `have` to `want` when the sizes are distinct (so the
    order, and with it how each axis is split, is unambiguous); else None."""
    if len(set(have)) != len(have) or sorted(have) != sorted(want) or have == want:
        return None
    return tuple(have.index(n) for n in want)
