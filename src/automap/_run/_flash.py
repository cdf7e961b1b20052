"""Flash attention in place of a written attention core (a plan's `attention="flash"`):
each core `_remat/_flash.py` matched, forward and backward, run as one call to the Pallas
flash kernel (`jax.experimental.pallas.ops.tpu.flash_attention`) and its VJP through the
runtime's `bind` hook (`_interpret.run_op`), so that every evaluator (plain, recomputing,
ZeRO-3's layer-wise gathers) runs the kernel without knowing.

The core's inner tensors (scores, probabilities) are bound to zeros nobody reads, which
XLA removes; the dot that makes the core's output runs the kernel's forward (again, when
the plan recomputes the core: the last forward's VJP is the one the backward uses, as
MaxText's scanned layer under `remat_policy=minimal` recomputes its flash call); the
first backward op that needs the gradients runs the kernel's backward on dO.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._errors import PlanError
from .._graph import Graph
from .._remat import FlashCore, flash_cores
from ._recompute import plan_layout


def _to_bhsd(x, labels: Sequence[str], order: Sequence[str], sizes: Mapping[str, int]):
    """x (dims labelled) broadcast to `order` + (seq, d) and flattened to [N, 1, S, D]."""
    seq = "q" if "q" in labels else "t"
    want = [*order, seq, "d" if "d" in labels else "e"]
    have = [x_ for x_ in want if x_ in labels]
    x = jnp.transpose(x, [labels.index(x_) for x_ in have])
    shape = [sizes[x_] for x_ in want]
    x = jax.lax.broadcast_in_dim(x, shape, [want.index(x_) for x_ in have])
    return x.reshape(-1, 1, shape[-2], shape[-1])


def flash_function(fc: FlashCore, shapes: Mapping[int, tuple[int, ...]]) -> Callable:
    """(q, k, v) in their captured layouts -> the core's output in d2's layout, by the
    Pallas flash kernel (causal, the core's scale)."""
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    sizes: dict[str, int] = {}
    for t, lab in ((fc.q, fc.q_labels), (fc.k, fc.k_labels), (fc.v, fc.v_labels)):
        sizes.update({x: n for x, n in zip(lab, shapes[t], strict=True)})
    order = [x for x in fc.q_labels if x not in ("q", "d")]

    def run(q, k, v):
        local = dict(sizes)
        for x, lab in ((q, fc.q_labels), (k, fc.k_labels), (v, fc.v_labels)):
            local.update({n: s for n, s in zip(lab, x.shape, strict=True)})
        qs, ks, vs = (_to_bhsd(x, lab, order, local) for x, lab in (
            (q, fc.q_labels), (k, fc.k_labels), (v, fc.v_labels)))  # fmt: skip
        o = fa.flash_attention(qs, ks, vs, causal=True, sm_scale=fc.scale)
        o = o.reshape([local[x] for x in order] + [local["q"], local["e"]])
        have = [*order, "q", "e"]
        return jnp.transpose(o, [have.index(x) for x in fc.out_labels])

    return run


def flash_binds(
    graph: Graph,
    cores: Sequence[FlashCore],
    wrap: Callable[[FlashCore, Callable], Callable],
    interpret: bool = False,
) -> dict[int, Callable]:
    """`bind` entries (`_interpret.run_op`) that run each core by the flash kernel.
    `wrap(fc, forward, backward)`: the kernel, (q, k, v) -> (its output, its VJP), from
    the two halves of its VJP (`_halves`), put under the plan's mesh (shard_map) or as
    they are on one device."""
    out: dict[int, Callable] = {}
    for fc in cores:
        shapes = {t: graph.tensors[t].shape for t in (fc.q, fc.k, fc.v)}
        kernel = wrap(fc, *_halves(flash_function(fc, shapes), interpret))
        state: dict[str, Any] = {}
        for i in fc.forward:
            out[i] = _zeros(graph, i, _keep_qk(graph, fc, state) if i == fc.d1 else None)
        out[fc.d2] = _forward(graph.ops[fc.d2].inputs.index(fc.v), kernel, state)
        sinks = {graph.tensors[t].producer: t for t in fc.grads}
        for j in fc.backward:
            out[j] = _backward_bind(graph, fc, j, sinks.get(j), state)
    return out


class _Interpreting:
    """The `pallas` module as the flash kernel's module sees it, its `pallas_call` in
    interpret mode: the kernel lowered to plain XLA loops that run on CPU. (Pallas's TPU
    interpret mode, `force_tpu_interpret_mode`, simulates the chips' memories through
    host callbacks, which hung a recomputing 8-device step on two cores.)"""

    def __init__(self, pl: Any) -> None:
        self._pl = pl
        self.pallas_call = functools.partial(pl.pallas_call, interpret=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pl, name)


@contextlib.contextmanager
def _interpret_mode():
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    real = fa.pl
    fa.pl = _Interpreting(real)
    try:
        yield
    finally:
        fa.pl = real


def _halves(f: Callable, interpret: bool) -> tuple[Callable, Callable]:
    """f's VJP in two functions of arrays: forward(q, k, v) -> (out, residuals), and
    backward(residuals, d_out) -> (dq, dk, dv); the Pallas calls traced in interpret mode
    (on CPU) when `interpret`. Apart, each runs under its own shard_map, which is never
    transposed: the transpose of one shard_map around the whole kernel all-reduces the
    cotangent of an input over each mesh axis its spec does not split, and a core whole
    over an axis was all-reduced there though every chip computed the same gradients."""
    mode = _interpret_mode if interpret else contextlib.nullcontext
    tree: dict[str, Any] = {}

    def forward(q, k, v):
        with mode():
            out, vjp = jax.vjp(f, q, k, v)
        residuals, tree["def"] = jax.tree.flatten(vjp)
        return out, tuple(residuals)

    def backward(residuals, d_out):
        with mode():
            return jax.tree.unflatten(tree["def"], residuals)(d_out)

    return forward, backward


def _unsplit(forward: Callable, backward: Callable) -> Callable:
    """The kernel on one device: (q, k, v) -> (out, its VJP)."""

    def kernel(q, k, v):
        out, residuals = forward(q, k, v)
        return out, functools.partial(backward, residuals)

    return kernel


def _keep_qk(graph: Graph, fc: FlashCore, state: dict) -> Callable:
    """What QKᵀ's bound op does beside making zeros: keeps Q and K for the kernel."""
    q_first = graph.ops[fc.d1].inputs[0] == fc.q

    def keep(a, b):
        state["qk"] = (a, b) if q_first else (b, a)

    return keep


def _zeros(graph: Graph, i: int, also: Callable | None = None) -> Callable:
    """Op i bound to zeros of its outputs' shapes (read by no live op: XLA drops them)."""
    outs = [graph.tensors[t] for t in graph.ops[i].outputs]
    multiple = graph.eqns[i].primitive.multiple_results

    def bound(*invals):
        if also is not None:
            also(*invals)
        z = [jnp.zeros(t.shape, t.dtype) for t in outs]
        return z if multiple else z[0]

    return bound


def _forward(v_at: int, kernel: Callable, state: dict) -> Callable:
    """The product with V bound to the kernel on the kept Q, K and its V operand."""

    def bound(*invals):
        q, k = state["qk"]
        o, state["vjp"] = kernel(q, k, invals[v_at])
        state.pop("grads", None)  # a recompute's VJP replaces the forward's
        return o

    return bound


def _backward_bind(graph: Graph, fc: FlashCore, j: int, sink: int | None, state: dict):
    """A backward op of the core: keeps dO where it reads it; a sink (the cotangent of
    Q, K or V in its layout) takes the kernel's VJP of dO, the others zeros."""
    reads_dout = fc.d_out in graph.ops[j].inputs
    pos = graph.ops[j].inputs.index(fc.d_out) if reads_dout else None
    zeros = _zeros(graph, j)

    def bound(*invals):
        if pos is not None:
            state["d_out"] = invals[pos]
        if sink is None:
            return zeros(*invals)
        if "grads" not in state:
            state["grads"] = dict(
                zip((fc.q, fc.k, fc.v), state["vjp"](state["d_out"]), strict=True)
            )
        return state["grads"][fc.grads[sink]]

    return bound


# ---- under a plan -------------------------------------------------------------------

_SEQ = ("q", "t", "d", "e")  # a core's dims the kernel reads whole on each device


def plan_flash(graph: Graph, groups: Any, plan: Any, mesh: Any) -> dict[int, Callable]:
    """The `bind` entries that run every attention core of the program by the flash
    kernel inside `shard_map` over the plan's mesh (the axes splitting the core's batch,
    heads or groups; a sequence or head dim split there is gathered first), or a one-line
    PlanError where the program or the target cannot."""
    platform = mesh.devices.flat[0].platform
    if platform not in ("tpu", "cpu"):
        raise PlanError(
            f"flash attention runs on TPU targets and the CPU's interpret mode, not on "
            f"{platform}; use attention='written'."
        )
    matched = flash_cores(graph, groups)
    layout = plan_layout(graph, groups, plan)

    def wrap(fc: FlashCore, forward: Callable, backward: Callable) -> Callable:
        if mesh.size == 1:
            return _unsplit(forward, backward)
        # A plan written by hand records no layouts: the kernel then reads the core whole.
        split = layout(fc.q) if layout is not None else ((),) * len(fc.q_labels)
        axes = {x: a for x, a in zip(fc.q_labels, split, strict=True) if x not in _SEQ}
        return _sharded(fc, forward, backward, mesh, axes)

    return flash_binds(graph, matched, wrap, interpret=platform == "cpu")


def _sharded(fc: FlashCore, forward: Callable, backward: Callable, mesh: Any, axes: dict):
    """The kernel's halves each under shard_map over the whole mesh (check_vma=False, which
    Pallas kernels need; manual over fewer axes, XLA cannot partition a Mosaic kernel). The
    core's dims split as `axes` says; over an axis that splits none of them every chip
    runs the core whole, and its dq, dk and dv are declared replicated there, as they are,
    not summed. The residuals cross between the two per chip: a leading dim of one a chip,
    split over every axis."""
    from jax.sharding import PartitionSpec as P

    def spec(labels):
        return P(*[None if x in _SEQ or not axes.get(x) else axes[x] for x in labels])

    ins = tuple(spec(lab) for lab in (fc.q_labels, fc.k_labels, fc.v_labels))
    out, per_chip = spec(fc.out_labels), P(tuple(mesh.axis_names))

    def local_forward(q, k, v):
        o, residuals = forward(q, k, v)
        return o, tuple(r[None] for r in residuals)

    def local_backward(residuals, d_out):
        return backward(tuple(r[0] for r in residuals), d_out)

    sharded_forward = jax.shard_map(
        local_forward, mesh=mesh, in_specs=ins, out_specs=(out, per_chip), check_vma=False
    )
    sharded_backward = jax.shard_map(
        local_backward, mesh=mesh, in_specs=(per_chip, out), out_specs=ins, check_vma=False
    )

    def kernel(q, k, v):
        o, residuals = sharded_forward(q, k, v)
        return o, functools.partial(sharded_backward, residuals)

    return kernel
