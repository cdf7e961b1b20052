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
    `wrap(fc, f)`: f put under the plan's mesh (shard_map), or as is on one device."""
    out: dict[int, Callable] = {}
    for fc in cores:
        shapes = {t: graph.tensors[t].shape for t in (fc.q, fc.k, fc.v)}
        kernel = _vjp_of(wrap(fc, flash_function(fc, shapes)), interpret)
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


def _vjp_of(f: Callable, interpret: bool) -> Callable:
    """(q, k, v) -> (f's output, its VJP); f's Pallas calls traced in interpret mode (on
    CPU) when `interpret`, the VJP's too (its backward kernels are traced when called)."""
    if not interpret:
        return lambda *args: jax.vjp(f, *args)

    def run(*args):
        with _interpret_mode():
            out, vjp = jax.vjp(f, *args)

        def back(ct):
            with _interpret_mode():
                return vjp(ct)

        return out, back

    return run


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

    def wrap(fc: FlashCore, f: Callable) -> Callable:
        if mesh.size == 1:
            return f
        from jax.sharding import PartitionSpec as P

        # A plan written by hand records no layouts: the kernel then reads the core whole.
        split = layout(fc.q) if layout is not None else ((),) * len(fc.q_labels)
        axes = {x: a for x, a in zip(fc.q_labels, split, strict=True) if x not in _SEQ}

        def spec(labels):
            return P(*[None if x in _SEQ or not axes.get(x) else axes[x] for x in labels])

        specs = tuple(spec(lab) for lab in (fc.q_labels, fc.k_labels, fc.v_labels))
        # Over a mesh axis that splits none of the kernel's dims, every chip runs the core
        # whole, and the transpose of an input replicated over it all-reduces its equal
        # cotangents there (check_vma=False, which Pallas kernels need; manual over fewer
        # axes, XLA cannot partition a Mosaic kernel): dq, dk and dv, all-reduced over
        # the axes the core is not split on, which the cost model does not price yet
        # (read on v5p: docs/DESIGN.md, "Flash attention").
        return jax.shard_map(
            f, mesh=mesh, in_specs=specs, out_specs=spec(fc.out_labels), check_vma=False
        )

    return flash_binds(graph, matched, wrap, interpret=platform == "cpu")
