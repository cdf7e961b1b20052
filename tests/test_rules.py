"""Sharding rules per primitive: ties and reduced dims on small cases, and the collectives
they imply held against what XLA compiles on an 8-device CPU mesh."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from automap._capture import capture
from automap._cluster import Cluster
from automap._cost import CostModel
from automap._groups import (
    KNOWN_PRIMITIVES,
    build_groups,
    dim_ties,
    plan_from_assignment,
    reduced_dims,
    reshape_ties,
    rule,
)

f32 = jnp.float32


def sds(*shape, dtype=f32):
    return jax.ShapeDtypeStruct(shape, dtype)


def only_op(fn, *args, primitive):
    graph = capture(fn, *args)
    ops = [op for op in graph.ops if op.primitive == primitive]
    assert ops, [op.primitive for op in graph.ops]
    return graph, ops[0]


def tied(graph, op):
    """Ties as {(input position, dim): (output position, dim)} for readable asserts."""
    pos = {t: ("in", i) for i, t in enumerate(op.inputs)}
    pos.update({t: ("out", i) for i, t in enumerate(op.outputs)})
    return {(pos[a[0]], a[1], pos[b[0]], b[1]) for a, b in dim_ties(op, graph)}


def test_dot_general_ties_batch_free_and_contracting_dims():
    g, op = only_op(
        lambda x, w: jnp.einsum("bsh,hn->bsn", x, w),
        sds(2, 4, 8),
        sds(8, 16),
        primitive="dot_general",
    )
    t = tied(g, op)
    x, w, out = ("in", 0), ("in", 1), ("out", 0)
    assert {(x, 0, out, 0), (x, 1, out, 1), (w, 1, out, 2), (x, 2, w, 0)} <= t
    assert reduced_dims(op, g) == [(op.inputs[0], 2), (op.inputs[1], 0)]
    assert rule(op, g).compute == "matmul"


def test_batched_dot_ties_batch_dims_to_the_output():
    g, op = only_op(
        lambda q, k: jnp.einsum("bqhd,bkhd->bhqk", q, k),
        sds(2, 4, 3, 8),
        sds(2, 4, 3, 8),
        primitive="dot_general",
    )
    t = tied(g, op)
    q, k, out = ("in", 0), ("in", 1), ("out", 0)
    assert {(q, 0, out, 0), (k, 0, out, 0), (q, 2, out, 1), (k, 2, out, 1), (q, 3, k, 3)} <= t


def test_elementwise_ties_every_dim_and_broadcasts_size_one_dims():
    g, op = only_op(lambda a, b: a * b, sds(4, 8), sds(4, 8), primitive="mul")
    assert len(dim_ties(op, g)) == 4 and not reduced_dims(op, g)
    g, op = only_op(lambda a: a + 1.0, sds(4, 8), primitive="add")
    assert len(dim_ties(op, g)) == 2  # the scalar ties nothing


def test_reduce_ties_kept_dims_and_reduces_the_axes():
    g, op = only_op(lambda x: x.sum(1), sds(4, 8, 6), primitive="reduce_sum")
    assert tied(g, op) == {(("in", 0), 0, ("out", 0), 0), (("in", 0), 2, ("out", 0), 1)}
    assert reduced_dims(op, g) == [(op.inputs[0], 1)]
    g, op = only_op(lambda x: x.max(0), sds(4, 8), primitive="reduce_max")
    assert reduced_dims(op, g) == [(op.inputs[0], 0)]


def test_argmax_and_cumsum_need_their_axis_whole():
    g, op = only_op(lambda x: jnp.argmax(x, 1), sds(4, 8), primitive="argmax")
    assert not reduced_dims(op, g) and tied(g, op) == {(("in", 0), 0, ("out", 0), 0)}
    g, op = only_op(lambda x: lax.cumsum(x, 0), sds(4, 8), primitive="cumsum")
    assert tied(g, op) == {(("in", 0), 1, ("out", 0), 1)}


def test_reshape_ties_the_major_factor():
    assert reshape_ties((2, 16, 64), (2, 16, 4, 16)) == [(0, 0), (1, 1), (2, 2)]  # hidden ~ heads
    assert reshape_ties((2, 16, 4, 16), (2, 16, 64)) == [(0, 0), (1, 1), (2, 2)]
    assert reshape_ties((8, 16), (128,)) == [(0, 0)]  # batch x seq -> tokens: batch-major
    assert reshape_ties((8, 1, 16), (8, 16, 1)) == [(0, 0), (2, 1)]  # size-1 dims are free
    assert reshape_ties((6, 4), (4, 6)) == [(0, 0)]  # a mixed block ties its leading dims
    g, op = only_op(lambda x: x.reshape(2, 16, 4, 16), sds(2, 16, 64), primitive="reshape")
    assert (("in", 0), 2, ("out", 0), 2) in tied(g, op)


def test_layout_primitives():
    g, op = only_op(lambda x: x.T, sds(4, 8), primitive="transpose")
    assert tied(g, op) == {(("in", 0), 1, ("out", 0), 0), (("in", 0), 0, ("out", 0), 1)}
    g, op = only_op(lambda x: x[:, None, :], sds(4, 8), primitive="broadcast_in_dim")
    assert tied(g, op) == {(("in", 0), 0, ("out", 0), 0), (("in", 0), 1, ("out", 0), 2)}
    g, op = only_op(lambda x: jnp.squeeze(x, 1), sds(4, 1, 8), primitive="squeeze")
    assert tied(g, op) == {(("in", 0), 0, ("out", 0), 0), (("in", 0), 2, ("out", 0), 1)}
    g, op = only_op(
        lambda a, b: jnp.concatenate([a, b], 1), sds(4, 8), sds(4, 2), primitive="concatenate"
    )
    assert tied(g, op) == {(("in", 0), 0, ("out", 0), 0), (("in", 1), 0, ("out", 0), 0)}
    g, op = only_op(lambda x: x[:, 1:3], sds(4, 8), primitive="slice")
    assert tied(g, op) == {(("in", 0), 0, ("out", 0), 0)}
    g, op = only_op(lambda x: jnp.pad(x, ((0, 0), (1, 1))), sds(4, 8), primitive="pad")
    assert tied(g, op) == {(("in", 0), 0, ("out", 0), 0)}
    g, op = only_op(
        lambda x, i: lax.dynamic_slice_in_dim(x, i, 2, 1),
        sds(4, 8),
        sds(dtype=jnp.int32),
        primitive="dynamic_slice",
    )
    assert tied(g, op) == {(("in", 0), 0, ("out", 0), 0)}
    g, op = only_op(
        lambda x, u: lax.dynamic_update_slice_in_dim(x, u, 0, 1),
        sds(4, 8),
        sds(4, 2),
        primitive="dynamic_update_slice",
    )
    assert {(("in", 0), 1, ("out", 0), 1), (("in", 1), 0, ("out", 0), 0)} <= tied(g, op)
    g, op = only_op(lambda x: lax.iota(jnp.int32, 4) + x, sds(4, dtype=jnp.int32), primitive="iota")
    assert not dim_ties(op, g)


def test_embedding_gather_and_scatter_add():
    g, op = only_op(
        lambda e, ids: e[ids], sds(32, 8), sds(4, 6, dtype=jnp.int32), primitive="gather"
    )
    t = tied(g, op)
    assert (("in", 0), 1, ("out", 0), 2) in t  # the embedding width passes through
    assert {(("in", 1), 0, ("out", 0), 0), (("in", 1), 1, ("out", 0), 1)} <= t
    assert reduced_dims(op, g) == [(op.inputs[0], 0)]  # a split vocabulary: partial rows
    grad = jax.grad(lambda e, ids: e[ids].sum())
    g, op = only_op(grad, sds(32, 8), sds(4, 6, dtype=jnp.int32), primitive="scatter-add")
    upd = op.inputs[2]
    assert {(upd, 0), (upd, 1)} == set(reduced_dims(op, g))  # rows from a split batch add up


def test_take_along_axis_ties_batch_dims():
    g, op = only_op(
        lambda x, i: jnp.take_along_axis(x, i, axis=1),
        sds(4, 8),
        sds(4, 1, dtype=jnp.int32),
        primitive="gather",
    )
    assert (("in", 0), 0, ("in", 1), 0) in tied(g, op)


def test_conv_ties_batch_and_features_and_keeps_spatial_whole():
    def conv(x, w):
        return lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    g, op = only_op(conv, sds(2, 8, 8, 3), sds(3, 3, 3, 4), primitive="conv_general_dilated")
    t = tied(g, op)
    x, w, out = ("in", 0), ("in", 1), ("out", 0)
    assert {(x, 0, out, 0), (w, 3, out, 3), (x, 3, w, 2)} <= t
    assert set(reduced_dims(op, g)) == {(op.inputs[0], 3), (op.inputs[1], 2)}
    assert (op.inputs[0], 1) in rule(op, g).whole
    # The weight gradient contracts over the batch: data parallelism's all-reduce.
    g = capture(jax.grad(lambda w, x: conv(x, w).sum()), sds(3, 3, 3, 4), sds(2, 8, 8, 3))
    wgrad = [op for op in g.ops if op.primitive == "conv_general_dilated"][-1]
    assert any(g.tensors[t].shape == (2, 8, 8, 3) and d == 0 for t, d in reduced_dims(wgrad, g))


def test_pooling_ties_batch_and_channels():
    g, op = only_op(
        lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"),
        sds(2, 8, 8, 3),
        primitive="reduce_window_max",
    )
    assert tied(g, op) == {(("in", 0), 0, ("out", 0), 0), (("in", 0), 3, ("out", 0), 3)}


def test_select_n_convert_integer_pow_are_elementwise():
    g = capture(lambda x: jnp.where(x > 0, x, 0.0).astype(jnp.bfloat16) ** 2, sds(4, 8))
    for op in g.ops:
        if (
            op.primitive in ("select_n", "convert_element_type", "integer_pow")
            and g.tensors[op.outputs[0]].ndim
        ):
            assert len(dim_ties(op, g)) >= 2, op.primitive


def test_unknown_primitives_are_conservative():
    g = capture(lambda x: jnp.sort(x, 0), sds(4, 8))
    op = next(op for op in g.ops if op.primitive == "sort")
    assert tied(g, op) == {(("in", 0), 1, ("out", 0), 1)}
    fake = type(op)(op.index, "my_custom_call", op.inputs, op.outputs, {}, 0.0, 0, 0, known=False)
    r = rule(fake, g)
    assert not r.known and not r.ties and not r.reduced


def test_zoo_primitives_all_have_rules():
    for p in (
        "dot_general",
        "conv_general_dilated",
        "reduce_sum",
        "argmax",
        "cumsum",
        "gather",
        "scatter-add",
        "select_n",
        "iota",
        "integer_pow",
        "stop_gradient",
        "split",
    ):
        assert p in KNOWN_PRIMITIVES


# ---- against XLA ---------------------------------------------------------------------

_COLL = re.compile(
    r"= (\(.*?\)|\S+) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)\("
)


def xla_kinds(fn, args, mesh_shape, in_specs, out_spec):
    """The collective kinds XLA puts in the partitioned HLO of fn under these shardings."""
    mesh = jax.make_mesh(tuple(mesh_shape.values()), tuple(mesh_shape))
    shard = lambda s: NamedSharding(mesh, PartitionSpec(*s))  # noqa: E731
    jitted = jax.jit(
        fn, in_shardings=tuple(shard(s) for s in in_specs), out_shardings=shard(out_spec)
    )
    text = jitted.lower(*args).compile().as_text()
    return sorted({m.group(2) for m in _COLL.finditer(text)})


def predicted_kinds(fn, args, mesh, in_specs):
    """The cost model's kinds for the plan whose input specs are given (groups by propagation)."""
    g = capture(fn, *args, roles={0: "batch", 1: "param"} if len(args) > 1 else {0: "batch"})
    groups = build_groups(g)
    assignment = {}
    for leaf, spec in zip(g.inputs, in_specs, strict=True):
        for d, axis in enumerate(spec):
            if axis is not None:
                assignment[groups.of(leaf.tensor, d)] = axis
    plan = plan_from_assignment(g, groups, mesh, assignment)
    cost = CostModel(g, Cluster.preset("cpu", devices=8), groups).estimate(plan)
    out_spec = plan.out_specs[g.outputs[0].path]
    return sorted({c.kind for c in cost.collectives}), out_spec


CASES = {
    "contracting split: all-reduce": (
        lambda x, w: x @ w,
        (sds(16, 32), sds(32, 8)),
        [(None, "model"), ("model", None)],
    ),
    "batch split: no collective": (
        lambda x, w: x @ w,
        (sds(16, 32), sds(32, 8)),
        [("model", None), (None, None)],
    ),
    "column parallel: no collective": (
        lambda x, w: x @ w,
        (sds(16, 32), sds(32, 8)),
        [(None, None), (None, "model")],
    ),
    "reduce over a split axis: all-reduce": (lambda x: x.sum(0), (sds(16, 32),), [("model", None)]),
    "reshape hidden to heads: no collective": (
        lambda x: x.reshape(16, 8, 4) * 2,
        (sds(16, 32),),
        [(None, "model")],
    ),
    "cumsum along a split axis: all-gather": (
        lambda x: lax.cumsum(x, 0),
        (sds(16, 32),),
        [("model", None)],
    ),
    "argmax along a split axis: all-gather": (
        lambda x: jnp.argmax(x, 1),
        (sds(16, 32),),
        [(None, "model")],
    ),
    "vocabulary-split embedding: all-reduce": (
        lambda ids, e: e[ids],
        (sds(4, 8, dtype=jnp.int32), sds(32, 16)),
        [(None, None), ("model", None)],
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_predicted_collectives_match_xla(name):
    fn, args, specs = CASES[name]
    mesh = {"model": 8}
    predicted, out_spec = predicted_kinds(fn, args, mesh, specs)
    assert predicted == xla_kinds(fn, args, mesh, specs, out_spec), name


def test_reduce_scatter_when_the_output_is_split_on_the_reduced_axis():
    # Contracting dim and the output's columns both on "model": GPUs reduce-scatter the
    # product; XLA's CPU pipeline all-reduces the whole product and slices it.
    args = (sds(16, 32), sds(32, 64))
    mesh = {"model": 8}
    g = capture(lambda x, w: x @ w, *args, roles={0: "batch", 1: "param"})
    groups = build_groups(g)
    x, w = (leaf.tensor for leaf in g.inputs)
    assignment = {groups.of(x, 1): "model", groups.of(w, 1): "model"}
    plan = plan_from_assignment(g, groups, mesh, assignment)
    assert plan.specs[g.inputs[1].path] == ("model", None)  # the smaller group id keeps it
    out = plan.out_specs[g.outputs[0].path]
    assert out == (None, "model")
    on_cpu = CostModel(g, Cluster.preset("cpu", devices=8), groups).estimate(plan)
    specs = [plan.specs[leaf.path] for leaf in g.inputs]
    assert [c.kind for c in on_cpu.collectives] == xla_kinds(
        lambda a, b: a @ b, args, mesh, specs, out
    )
    on_gpu = CostModel(g, Cluster.preset("a100", devices=8), groups).estimate(plan)
    (rs,) = on_gpu.collectives
    (ar,) = on_cpu.collectives
    assert (rs.kind, ar.kind) == ("reduce-scatter", "all-reduce")
    assert rs.bytes == ar.bytes == 16 * 64 * 4  # the whole unscattered product
    assert rs.time_s < ar.time_s


def test_gradient_bytes_of_a_linear_layer():
    g = capture(jax.grad(lambda w, x: (x @ w).sum()), sds(32, 8), sds(16, 32))
    groups = build_groups(g)
    x = g.inputs[1].tensor
    plan = plan_from_assignment(g, groups, {"data": 8}, {groups.of(x, 0): "data"})
    cost = CostModel(g, Cluster.preset("cpu", devices=8), groups).estimate(plan)
    (ar,) = cost.collectives
    assert (ar.kind, ar.axis, ar.bytes) == ("all-reduce", "data", 32 * 8 * 4)
    assert np.isclose(sum(c for _, c, _ in cost.per_op), cost.compute_s)


def test_loops_tie_what_their_body_ties():
    """A scan's carry enters and leaves with one layout (XLA gives a while loop's state
    one sharding): its dims are tied in to out, and nothing is reduced at the loop."""

    def fn(c):
        return lax.scan(lambda c, _: (c * 2.0, None), c, None, length=3)[0]

    g, op = only_op(fn, sds(4, 8), primitive="scan")
    r = rule(op, g)
    (c,), (out,) = op.inputs, op.outputs
    assert r.known and not r.reduced and r.compute == "loop"
    assert set(r.ties) == {((c, 0), (out, 0)), ((c, 1), (out, 1))}
