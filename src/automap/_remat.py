"""Rematerialization as Megatron's full recomputation: keep each layer's input, recompute
the layer's forward inside the backward.

The captured step is already differentiated: its backward ops read forward tensors
directly, so `jax.checkpoint` around the user's function cannot apply any more. Instead the
program is re-run op by op (`_interpret`) with the backward's reads redirected: the first
backward op that reads a tensor a layer made triggers that layer's recomputation from its
inputs, and every later backward read of the layer's tensors takes the recomputed value.
The original forward values then have no reader after the forward, so XLA frees them as
it goes; only the layers' inputs (and the tensors made outside any layer) stay alive.

Two things keep XLA from undoing this, as `jax.checkpoint`'s own lowering does: the
layer's inputs pass through `optimization_barrier` before the recompute (so CSE cannot
merge the recomputed ops with the forward ones), and the barrier also carries the
triggering backward op's backward-made inputs (so the scheduler cannot hoist the recompute
back next to the forward: it depends on the gradient arriving at that layer).

A layer is the run of per-microbatch forward ops between two consecutive pipeline cut
candidates (`_pipeline._plans.cut_candidates`: where the crossing activation is the
residual stream). The embedding before the first candidate and the head after the last one
are not recomputed, as in Megatron (for a zoo transformer the candidates also fall inside
the embedding and before the loss, so those layers carry the embedding and the head). The same `Recompute` drives the one-stage runtime
(`_apply`), the pipeline's backward segments (`_pipeline._segments.recompute_segments`)
and the cost model (`residuals`: what stays in memory; `Residuals.recomputed`: what runs
twice), so that the prices are those of the program that runs.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ._graph import Graph, TensorKind
from ._linkage import Groups
from ._memory import Residuals, _loss_boundary, find_residuals

Constrain = Callable[[int, Any], Any]


@dataclasses.dataclass(frozen=True)
class Recompute:
    """The layers recomputed in the backward and what that leaves alive."""

    boundary: int  # the last forward op: ops after it are the backward
    layers: tuple[tuple[int, ...], ...]  # forward op indices of each recomputed layer
    inputs: tuple[tuple[int, ...], ...]  # per layer: tensors it reads from outside
    owner: Mapping[int, int]  # tensor -> layer, for the tensors a backward read recomputes

    @property
    def ops(self) -> frozenset[int]:
        return frozenset(i for layer in self.layers for i in layer)

    def restricted(self, ops: Iterable[int]) -> Recompute:
        """The layers that lie inside `ops` (a pipeline stage's forward)."""
        keep = set(ops)
        ks = [k for k, layer in enumerate(self.layers) if layer and set(layer) <= keep]
        owner = {t: ks.index(k) for t, k in self.owner.items() if k in ks}
        return Recompute(
            self.boundary,
            tuple(self.layers[k] for k in ks),
            tuple(self.inputs[k] for k in ks),
            owner,
        )


def layer_ops(graph: Graph, groups: Groups) -> tuple[tuple[int, ...], ...]:
    """Per-microbatch forward ops between consecutive cut candidates, one tuple a layer.
    None for a step without a loss (no forward pass to recompute): an empty tuple."""
    from ._pipeline._partition import forward_ops
    from ._pipeline._plans import cut_candidates

    if _loss_boundary(graph) is None:
        return ()
    fwd = forward_ops(graph, groups)
    cuts = cut_candidates(graph, groups)
    at = [bisect.bisect_left(fwd, c) for c in cuts]  # fwd is ascending
    layers = [fwd[a:b] for a, b in itertools.pairwise(at)]
    # The last layer's backward comes right after its forward: recomputing it would only
    # add work, its residuals are alive at the turn of the step either way.
    return tuple(layer for layer in layers[:-1] if layer)


def recompute_plan(graph: Graph, groups: Groups) -> Recompute:
    """The layers (each cut to the ops its backward's reads need: XLA drops the others,
    e.g. the projection whose output only feeds the residual add) and their inputs."""
    boundary = find_residuals(graph).boundary
    whole = layer_ops(graph, groups)
    borders = {t for layer in whole for t in _reads(graph, layer)}
    read_after = {t for op in graph.ops[boundary + 1 :] for t in op.inputs}
    layers = tuple(_needed(graph, layer, read_after - borders) for layer in whole)
    inputs = tuple(_reads(graph, layer) for layer in layers)
    kept = {t for ins in inputs for t in ins}
    owner = {
        t: k
        for k, layer in enumerate(layers)
        for i in layer
        for t in graph.ops[i].outputs
        if t not in kept
    }
    return Recompute(boundary, layers, inputs, owner)


def _needed(graph: Graph, layer: Sequence[int], wanted: set[int]) -> tuple[int, ...]:
    """The ops of `layer` that the `wanted` tensors depend on, in program order."""
    want, keep = set(wanted), []
    for i in reversed(layer):
        if any(t in want for t in graph.ops[i].outputs):
            keep.append(i)
            want.update(graph.ops[i].inputs)
    return tuple(reversed(keep))


def residuals(graph: Graph, groups: Groups) -> Residuals:
    """`find_residuals` with the rematerialized figures of the runtime's recomputation:
    `saved_remat` is what stays alive at the turn of the step (every saved tensor no layer
    recomputes, every layer's inputs, and the largest layer's recomputed residuals, alive
    while its backward runs); `recomputed` the ops that run a second time."""
    res = find_residuals(graph)
    rc = recompute_plan(graph, groups)
    saved = set(res.saved)
    per_layer = layer_residuals(graph, rc, saved)
    kept = {t for t in saved if t not in rc.owner}
    kept |= {t for ins in rc.inputs for t in ins if _made_in_forward(graph, t, rc.boundary)}
    largest = max(per_layer, key=lambda ts: sum(graph.tensors[t].nbytes for t in ts), default=())
    return dataclasses.replace(
        res,
        saved_remat=tuple(sorted(kept | set(largest))),
        recomputed=tuple(sorted(rc.ops)),
        layer_saved=tuple(per_layer),
    )


def layer_residuals(graph: Graph, rc: Recompute, saved: set[int]) -> list[tuple[int, ...]]:
    """Per layer, the residuals its recomputation makes again (alive during its backward)."""
    out: list[list[int]] = [[] for _ in rc.layers]
    for t, k in rc.owner.items():
        if t in saved:
            out[k].append(t)
    return [tuple(sorted(ts)) for ts in out]


def eval_recomputing(
    graph: Graph,
    rc: Recompute,
    ops: Sequence[int],
    env: Mapping[int, Any],
    wanted: Sequence[int],
    constrain: Constrain | None = None,
    consts: Mapping[int, Any] | None = None,
) -> list[Any]:
    """`_interpret.eval_ops`, except that a backward op (after `rc.boundary`) reading a
    tensor of a recomputed layer reads its recomputed value, made just before the first
    such read from the layer's inputs (barriered with that op's backward inputs)."""
    values: dict[int, Any] = dict(graph.const_values if consts is None else consts)
    values.update(env)
    again: dict[int, Any] = {}
    done: set[int] = set()

    def bind(i: int, read: Callable[[int], Any], into: dict[int, Any]) -> None:
        op, eqn = graph.ops[i], graph.eqns[i]
        outs = eqn.primitive.bind(*[read(t) for t in op.inputs], **eqn.params)
        outs = outs if eqn.primitive.multiple_results else [outs]
        for t, v in zip(op.outputs, outs, strict=True):
            into[t] = constrain(t, v) if constrain is not None else v

    def recompute(k: int, anchors: list[Any]) -> None:
        live = rc.inputs[k]
        fenced, _ = jax.lax.optimization_barrier(([values[t] for t in live], anchors))
        local = {**values, **dict(zip(live, fenced, strict=True))}
        tied = False
        for t in live:
            if _made_in_forward(graph, t, rc.boundary):
                local[t], hit = _after(local[t], anchors)
                tied |= hit
        for i in rc.layers[k]:
            bind(i, local.__getitem__, local)
            # No input could be tied (an integer mask, say): tie the first value made that
            # can; only the ops before it may then merge with the forward's.
            for t in () if tied else graph.ops[i].outputs:
                local[t], hit = _after(local[t], anchors)
                tied |= hit
        again.update({t: local[t] for t, j in rc.owner.items() if j == k})
        done.add(k)

    for i in ops:
        op = graph.ops[i]
        if i > rc.boundary:
            need = sorted({rc.owner[t] for t in op.inputs if t in rc.owner} - done, reverse=True)
            anchors = [
                values[t]
                for t in op.inputs
                if t not in rc.owner and _made_after(graph, t, rc.boundary)
            ]
            for k in need:
                recompute(k, anchors)
            bind(i, lambda t: again[t] if t in again else values[t], values)
        else:
            bind(i, values.__getitem__, values)
    return [
        jnp.asarray(values[t]) if graph.tensors[t].kind is TensorKind.CONST else values[t]
        for t in wanted
    ]


def _after(x: Any, anchors: list[Any]) -> tuple[Any, bool]:
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
    return x, False


def _reads(graph: Graph, ops: Sequence[int]) -> tuple[int, ...]:
    inside = set(ops)
    return tuple(
        dict.fromkeys(
            t
            for i in ops
            for t in graph.ops[i].inputs
            if graph.tensors[t].producer not in inside
            and graph.tensors[t].kind is not TensorKind.CONST
        )
    )


def _made_in_forward(graph: Graph, t: int, boundary: int) -> bool:
    p = graph.tensors[t].producer
    return graph.tensors[t].kind is TensorKind.INTERMEDIATE and p is not None and p <= boundary


def _made_after(graph: Graph, t: int, boundary: int) -> bool:
    p = graph.tensors[t].producer
    return p is not None and p > boundary
