"""Run a captured program with ZeRO-3's parameters gathered layer by layer (FSDP): each
forward layer reads its own gathered copies, made once the previous layer's input has
arrived, and the backward (with the recomputation, under remat) gathers them once more
after its layer's gradient arrives; each backward layer's gradients are reduce-scattered
before the next backward layer starts. `_remat/_fsdp.py` says where the layers are and
why XLA needs the ties; `plan_layerwise` makes a plan's gather and tie on a mesh (one
program's, or a pipeline stage's).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._axes import DATA
from .._graph import Graph, Role, TensorKind
from .._groups import Groups, assignment_from_specs, layouts, unzero_spec
from .._plan import Plan, Spec
from .._remat import LayerGathers, layer_gathers, made_after
from ._interpret import Constrain, run_op

# gather(parameter, its sharded value, anchors as (tensor, value) pairs) -> whole value
Gather = Callable[[int, Any, Sequence[tuple[int, Any]]], Any]
# tie(sharded gradients, anchors, both as (tensor, value) pairs) -> the anchors' values,
# made to wait for the gradients' reductions
Tie = Callable[[Sequence[tuple[int, Any]], Sequence[tuple[int, Any]]], list[Any]]


class Layerwise(NamedTuple):
    """ZeRO-3 as FSDP runs it: where its layers are, its gather, and its gradients' tie."""

    lg: LayerGathers
    gather: Gather
    tie: Tie
    # tensors the plan pins split where their groups leave them whole (the stream under
    # sequence parallelism): a matmul reading one whole gathers it
    split: frozenset[int] = frozenset()


class GatheredReads:
    """The gathered values of the parameters (and of what is made from them alone) that
    the program's ops read: per forward layer, for the backward, or on the shards (the
    update, an output)."""

    def __init__(
        self,
        graph: Graph,
        lg: LayerGathers,
        values: Mapping[int, Any],
        gather: Gather,
        constrain: Constrain | None = None,
        bind: Mapping[int, Callable[..., Any]] | None = None,
    ) -> None:
        self.graph, self.lg, self.values, self._gather = graph, lg, values, gather
        self.constrain, self.bind = constrain, bind
        self._made: dict[tuple[Any, int], Any] = {}

    def forward(self, t: int, layer: int) -> Any:
        """`t` as forward layer `layer` reads it: gathered after the previous layer's input."""
        a = self.lg.anchor[layer]
        anchors = [] if a is None or a not in self.values else [(a, self.values[a])]
        return self._value(("fwd", layer), t, anchors)

    def backward(self, t: int, anchors: Sequence[tuple[int, Any]]) -> Any:
        """`t` as the backward reads it: gathered again after `anchors` (the reading op's
        backward inputs), once (the layer's recompute and its gradients share it)."""
        return self._value("bwd", t, anchors)

    def sharded(self, t: int) -> Any:
        """`t` on the device's shard (what the update reads, or an output)."""
        return self._value("shard", t, None)

    def _value(self, key: Any, t: int, anchors: Sequence[tuple[int, Any]] | None) -> Any:
        graph = self.graph
        if graph.tensors[t].kind is TensorKind.CONST:
            return self.values[t]
        if (key, t) not in self._made:
            p = graph.tensors[t].producer
            if p in self.lg.remake:  # else a program's input (a pipeline's pre cast)
                made: dict[int, Any] = {}

                def read(s: int) -> Any:
                    return self._value(key, s, anchors) if s in self.lg.lazy else self.values[s]

                run_op(graph, p, read, made, self.constrain, self.bind)
                self._made.update(((key, s), v) for s, v in made.items())
            elif anchors is None:
                self._made[(key, t)] = self.values[t]
            else:
                self._made[(key, t)] = self._gather(t, self.values[t], anchors)
        return self._made[(key, t)]


def within(layerwise: Layerwise, ops: Sequence[int]) -> Layerwise:
    """`layerwise` for a program that runs `ops` only (a pipeline stage's F or B): a value
    made from parameters alone outside them (a weight's cast in the stage's pre program)
    is one of its inputs, gathered where its layer reads it as a parameter is."""
    return layerwise._replace(
        lg=dataclasses.replace(layerwise.lg, remake=layerwise.lg.remake & set(ops))
    )


def backward_anchors(graph: Graph, op: int, values: Mapping[int, Any], boundary: int):
    """The (tensor, value) pairs op `op` reads that the backward made: what its gathers wait
    for."""
    return [(t, values[t]) for t in graph.ops[op].inputs if made_after(graph, t, boundary)]


def reduce_before(
    graph: Graph,
    layerwise: Layerwise,
    values: dict[int, Any],
    i: int,
    pending: tuple[int, ...] = (),
) -> tuple[int, ...]:
    """Before op `i`: where a backward layer's gradients are due (`_remat.Reduction`), the
    op's floating inputs the backward made, in `values`, are replaced by the same values
    made to wait for the layer's sharded gradients (`Layerwise.tie`): the reduce-scatters
    run before the next backward layer, each layer's alone. Returns the gradients still
    to tie (`pending`, which the caller hands to the next op).

    A split input (`Layerwise.split`) an earlier op read too is not tied: the tied copy
    would be a second value, which XLA gathers apart from the first (under sequence
    parallelism the cotangent a weight gradient and then the input gradient read whole
    was gathered twice). Where op `i` has no other floating input, the gradients wait for
    the next op that has (the input gradient's result's reader, one op later)."""
    r = layerwise.lg.reduction(i)
    tied = (*pending, *(r.tied if r is not None else ()))
    if not tied:
        return ()
    anchors = backward_anchors(graph, i, values, layerwise.lg.regather.boundary)
    anchors = [(t, a) for t, a in anchors if t not in layerwise.lg.lazy]
    users = graph.consumers()
    shared = {t for t, _ in anchors if t in layerwise.split and users[t][0] < i}
    if shared:
        anchors = [(t, a) for t, a in anchors if t not in shared]
        if not any(jnp.issubdtype(a.dtype, jnp.floating) and a.size for _, a in anchors):
            return tied  # no input of op i can carry it alone
    out = layerwise.tie([(t, values[t]) for t in tied if t in values], anchors)
    values.update(zip((t for t, _ in anchors), out, strict=True))
    return ()


def eval_layerwise(
    graph: Graph,
    layerwise: Layerwise,
    env: Mapping[int, Any],
    wanted: Sequence[int],
    constrain: Constrain | None = None,
    bind: Mapping[int, Callable[..., Any]] | None = None,
    ops: Sequence[int] | None = None,
    consts: Mapping[int, Any] | None = None,
) -> list[Any]:
    """The program (or its `ops` only: a pipeline stage's, `within`) with ZeRO-3's gathers
    layer by layer (`LayerGathers`): forward ops read their layer's gathered copies,
    backward ops the second gather, the update the shards; each backward layer's gradients
    are reduced before the next one runs (`reduce_before`). `bind[i]` computes op i in
    place of its primitive and `consts` are the constants, as in `eval_ops`."""
    lg = layerwise.lg
    values: dict[int, Any] = dict(graph.const_values if consts is None else consts)
    values.update(env)
    reads = GatheredReads(graph, lg, values, layerwise.gather, constrain, bind)
    pending: tuple[int, ...] = ()
    for i in range(len(graph.ops)) if ops is None else ops:
        pending = reduce_before(graph, layerwise, values, i, pending)
        read = layer_read(graph, lg, reads, values, i)
        if read is None:
            continue  # made where it is read, from the gathered parameters
        run_op(graph, i, read, values, constrain, bind)
    return outputs(graph, lg, reads, values, wanted)


def outputs(
    graph: Graph, lg: LayerGathers, reads: GatheredReads | None, values, wanted: Sequence[int]
) -> list[Any]:
    """The `wanted` values (one made from the parameters alone, on the shards)."""
    out = []
    for t in wanted:
        if reads is not None and t in lg.lazy and t not in values:
            out.append(reads.sharded(t))
        elif graph.tensors[t].kind is TensorKind.CONST:
            # A literal returned as is would leave as a jaxpr literal type, not an array.
            out.append(jnp.asarray(values[t]))
        else:
            out.append(values[t])
    return out


def layer_read(
    graph: Graph, lg: LayerGathers, reads: GatheredReads, values: Mapping[int, Any], i: int
) -> Callable[[int], Any] | None:
    """How op `i` reads its inputs under layer-by-layer gathers; None for an op made from
    the parameters alone in the forward (each reader makes it again from its own gather)."""
    rg = lg.regather
    if i <= rg.boundary:
        if i in lg.remake:
            return None
        layer = lg.layer(i)
        return lambda t: reads.forward(t, layer) if t in lg.lazy else values[t]
    if i in rg.backward:
        anchors = backward_anchors(graph, i, values, rg.boundary)
        return lambda t: reads.backward(t, anchors) if t in lg.lazy else values[t]
    return lambda t: reads.sharded(t) if t in lg.lazy else values[t]


# ---- the gather and the tie of a plan on a mesh (one program, or a pipeline stage's) ----


def plan_layerwise(graph: Graph, groups: Groups, plan: Plan, mesh: Mesh) -> Layerwise:
    """ZeRO-3's layers (`_remat.layer_gathers`), its gather: a sharded parameter made
    whole over data after its anchors (`_tied`), so that XLA gathers it where the layer
    needs it, not all at the start of the step; and its gradients' tie (`_after_shards`),
    so that it reduces them layer by layer, not all at the end."""
    # The anchors' layouts: the plan's assignment, or for a plan that records none (from
    # specs alone) the one the cost model prices it by, read back from its specs.
    assignment = plan.assignment
    if assignment is None:
        assignment = assignment_from_specs(graph, groups, plan)
    # A tensor the plan pins is laid as pinned: under sequence parallelism a stream
    # cotangent is split on the sequence, where its groups leave it whole; constrained to
    # the groups' layout, each tie gathered it (a float32 stream tensor a layer, read in
    # an A100 program of a ZeRO-3 Llama at tp 2: tests/test_seqpar.py).
    plain, lay = pinned_layouts(graph, groups, plan, assignment)
    split = frozenset(t for t, spec in plan.constraints.items() if _splits_more(spec, plain[t]))
    spec_of = {leaf.tensor: plan.specs[leaf.path] for leaf in graph.leaves(Role.PARAM)}

    def gather(t: int, x: Any, anchors: Sequence[tuple[int, Any]]) -> Any:
        # a parameter's spec, or a pipeline stage's input made from one (a cast) as pinned
        spec = spec_of.get(t, plan.constraints.get(t))
        whole = None if spec is None else unzero_spec(spec, DATA)
        if whole == spec:  # not sharded by ZeRO (no dim divides): nothing to gather
            return x
        if anchors:  # else a first layer's: nothing to wait for (and a select's mask
            x = _tied(x, spec, anchors, lay, mesh)  # would be gathered beside it)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*whole)))

    def tie(grads: Sequence[tuple[int, Any]], anchors: Sequence[tuple[int, Any]]) -> list[Any]:
        return _after_shards(grads, anchors, plan.constraints, lay, mesh)

    return Layerwise(layer_gathers(graph, groups), gather, tie, split)


def pinned_layouts(
    graph: Graph, groups: Groups, plan: Plan, assignment: Mapping[int, str | None]
) -> tuple[tuple[Spec, ...], tuple[Spec, ...]]:
    """Per tensor, its layout as the groups lay it under `assignment`, and as `plan` runs
    it: its constraint where the plan pins it (the split stream), else the same."""
    plain = layouts(graph, groups, assignment)
    return plain, tuple(plan.constraints.get(t, s) for t, s in enumerate(plain))


def spec_axes(entry: Any) -> tuple[str, ...]:
    """A spec entry's mesh axes: None, one name, or a tuple of names."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _splits_more(pinned: Spec, plain: Spec) -> bool:
    """Whether `pinned` splits a dim over an axis `plain` leaves it whole on."""
    pairs = itertools.zip_longest(pinned, plain)
    return any(set(spec_axes(p)) - set(spec_axes(q)) for p, q in pairs)


def _tied(x: Any, spec: Spec, anchors: Sequence[tuple[int, Any]], lay, mesh: Mesh) -> Any:
    """The sharded parameter `x`, made to depend on a backward value (the same bits): its
    second gather can then neither merge with the forward's (CSE) nor run before the
    backward reaches its layer (XLA's CPU pipeline expands optimization barriers before
    scheduling). Each device selects on an element of its own block of the anchor, so the
    tie moves nothing between devices; `a == a | a != a` holds for every float (NaN too),
    and XLA cannot fold it."""
    floats = [(t, a) for t, a in anchors if jnp.issubdtype(a.dtype, jnp.floating) and a.size]
    if not floats:
        return jnp.where((x == x) | (x != x), x, jnp.zeros_like(x))  # apart, if not after
    t, a = floats[0]
    a = jax.lax.with_sharding_constraint(
        a, NamedSharding(mesh, PartitionSpec(*lay[t]))
    )  # as the plan lays it

    def local(xs: Any, block: Any) -> Any:
        s = block.reshape(-1)[0]
        return jnp.where((s == s) | (s != s), xs, jnp.zeros_like(xs))

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(PartitionSpec(*spec), PartitionSpec(*lay[t])),
        out_specs=PartitionSpec(*spec),
        check_vma=False,
    )(x, a)


def _after_shards(
    grads: Sequence[tuple[int, Any]], anchors: Sequence[tuple[int, Any]], constraints, lay, mesh
) -> list[Any]:
    """The `anchors`' values, made to depend on the sharded `grads` (the same bits): what
    reads them waits for the gradients' reduce-scatters, and no later gradient's can be
    combined with those. As `_tied`, each device selects on an element of its own block
    of each gradient's shard, so the tie moves nothing between devices. Left as they are
    where no gradient or anchor can carry a tie."""
    grads = [(t, g) for t, g in grads if t in constraints and g.ndim and g.size]
    floats = [
        k for k, (_, a) in enumerate(anchors) if jnp.issubdtype(a.dtype, jnp.floating) and a.size
    ]
    out = [a for _, a in anchors]
    if not grads or not floats:
        return out

    def local(*blocks: Any) -> list[Any]:
        firsts = [b.reshape(-1)[0] for b in blocks[: len(grads)]]
        keep = functools.reduce(jnp.logical_and, [(s == s) | (s != s) for s in firsts])
        return [jnp.where(keep, a, jnp.zeros_like(a)) for a in blocks[len(grads) :]]

    specs = [PartitionSpec(*lay[anchors[k][0]]) for k in floats]
    values = [
        jax.lax.with_sharding_constraint(anchors[k][1], NamedSharding(mesh, spec))
        for k, spec in zip(floats, specs, strict=True)
    ]
    tied = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(*(PartitionSpec(*constraints[t]) for t, _ in grads), *specs),
        out_specs=specs,
        check_vma=False,
    )(*(g for _, g in grads), *values)
    for k, value in zip(floats, tied, strict=True):
        out[k] = value
    return out
