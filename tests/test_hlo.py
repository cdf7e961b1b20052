"""_hlo: collectives read from real compiled HLO and from each printed form."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from automap._verify import (
    axis_of,
    comm_bytes,
    parse_collectives,
    parse_replica_groups,
    shape_bytes,
)

MESH = {"data": 2, "model": 4}


def wrap(*lines, header="HloModule m, num_partitions=8"):
    body = "\n".join(f"  {line}" for line in lines)
    return f"{header}\n\nENTRY %main (p: f32[8]) -> f32[8] {{\n{body}\n}}\n"


# ---- literal strings: every form -----------------------------------------------------


@pytest.mark.parametrize(
    ("text", "groups"),
    [
        ("replica_groups={{0,1,2,3},{4,5,6,7}}", ((0, 1, 2, 3), (4, 5, 6, 7))),
        ("replica_groups={{0,4},{1,5},{2,6},{3,7}}", ((0, 4), (1, 5), (2, 6), (3, 7))),
        ("replica_groups={}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
        ("replica_groups=[2,4]<=[8]", ((0, 1, 2, 3), (4, 5, 6, 7))),
        ("replica_groups=[4,2]<=[2,4]T(1,0)", ((0, 4), (1, 5), (2, 6), (3, 7))),
        ("replica_groups=[1,8]<=[8]", ((0, 1, 2, 3, 4, 5, 6, 7),)),
        (
            "replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}",
            ((0, 4), (1, 5), (2, 6), (3, 7)),
        ),
        ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", ((0, 1, 2, 3), (4, 5, 6, 7))),
        (
            "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}",
            ((0, 1, 2, 3), (4, 5, 6, 7)),
        ),
        ("replica_groups=mesh['x'=8] {'x':(2)2}", ((0, 2), (1, 3), (4, 6), (5, 7))),
        ("replica_groups=mesh['x'=2,'y'=4] {'x', 'y'}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
        ("source_target_pairs={{0,4},{4,0},{1,1}}", ((0, 4), (4, 0), (1, 1))),
    ],
)
def test_replica_group_forms(text, groups):
    got = parse_replica_groups(f"%x = f32[8] all-reduce(%p), {text}, to_apply=%add", 8)
    assert sorted(map(sorted, got)) == sorted(map(sorted, groups))


def test_groups_to_mesh_axes():
    assert axis_of("all-reduce", ((0, 4), (1, 5), (2, 6), (3, 7)), MESH) == "data"
    assert axis_of("all-reduce", ((0, 1, 2, 3), (4, 5, 6, 7)), MESH) == "model"
    assert axis_of("all-gather", (tuple(range(8)),), MESH) == "data+model"
    assert axis_of("all-reduce", ((0,), (1,)), MESH) == ""  # nobody talks: a no-op
    pairs = ((0, 0), (1, 4), (2, 1), (3, 5))
    assert axis_of("collective-permute", pairs, MESH) == "data+model"
    assert axis_of("collective-permute", ((0, 4), (5, 1), (2, 2)), MESH) == "data"
    with pytest.raises(ValueError, match="exceed the mesh"):
        axis_of("all-reduce", ((0, 9),), MESH)


def test_shape_bytes_dtypes_and_tuples():
    assert shape_bytes("f32[128,64]{1,0}") == 128 * 64 * 4
    assert shape_bytes("bf16[8,8]") == 128 and shape_bytes("f16[8]") == 16
    assert shape_bytes("pred[10]") == 10 and shape_bytes("s8[4]") == 4 and shape_bytes("s32[]") == 4
    assert shape_bytes("f64[2]") == 16 and shape_bytes("c64[1]") == 8 and shape_bytes("s4[4]") == 2
    assert shape_bytes("f8e4m3fn[16]") == 16
    assert (
        shape_bytes("(f32[], f32[4096,1024]{1,0}, /*index=2*/bf16[2,2])") == 4 + 4096 * 1024 * 4 + 8
    )


def test_bytes_convention_per_kind():
    text = wrap(
        "%ar = (f32[], f32[32,128]{1,0}) all-reduce(%a, %b), replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add",
        "%ag = f32[16,128]{1,0} all-gather(%c), replica_groups=[2,4]<=[8], dimensions={0}",
        "%rs = bf16[4,128]{1,0} reduce-scatter(%d), replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add",
        "%a2a = (f32[2,1,8]{2,1,0}, f32[2,1,8]{2,1,0}) all-to-all(%e, %f), replica_groups={{0,4},{1,5},{2,6},{3,7}}",
        "%cp = f32[16,16]{1,0} collective-permute(%g), source_target_pairs={{0,1},{1,0},{4,4}}",
        "%id = f32[16,16]{1,0} collective-permute(%g), source_target_pairs={{0,0},{1,1}}",
    )
    assert comm_bytes(parse_collectives(text), MESH) == {
        "all-reduce@data": 4 + 32 * 128 * 4,  # a tuple: the sum of its parts, once
        "all-gather@model": 16 * 128 * 4,  # the gathered result
        "reduce-scatter@model": 4 * 128 * 2 * 4,  # the operand: result times group size
        "all-to-all@data": 2 * 2 * 8 * 4,
        "collective-permute@model": 16 * 16 * 4,  # the identity permute moved nothing
    }


def test_a_tpu_all_reduce_scatter_fusion_is_a_reduce_scatter():
    # XLA's TPU compiler writes a reduce-scatter as a fusion of an all-reduce and the
    # slice each device keeps (libtpu 0.0.42.1): counted as a reduce-scatter of the whole
    # buffer, once; an all-reduce elsewhere stays one.
    text = """HloModule m, num_partitions=4

%all-reduce-scatter.3 (input: f32[256,256]) -> f32[256,64] {
  %input = f32[256,256]{0,1:T(8,128)} parameter(0)
  %all-reduce.7 = f32[256,256]{0,1:T(8,128)} all-reduce(%input), channel_id=9, replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %slice = f32[256,64]{0,1} dynamic-slice(%all-reduce.7, %z, %o), dynamic_slice_sizes={256,64}
}

ENTRY %main (p: f32[256,256]) -> f32[256,64] {
  %p = f32[256,256]{1,0} parameter(0)
  %fusion.1 = f32[256,64]{0,1} fusion(%p), kind=kCustom, calls=%all-reduce-scatter.3, backend_config={"collective_algorithm_config":{"emitter":"SingleInputAllReduceScatterFusion"}}
  ROOT %all-reduce.8 = f32[256,64]{1,0} all-reduce(%fusion.1), replica_groups={{0,1,2,3}}, to_apply=%add
}
"""
    assert comm_bytes(parse_collectives(text), {"data": 4}) == {
        "reduce-scatter@data": 256 * 256 * 4,
        "all-reduce@data": 256 * 64 * 4,
    }


def test_async_pairs_count_once_and_while_loops_multiply():
    text = "HloModule m, num_partitions=8\n\n" + "\n".join(
        [
            "%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {",
            "  %s = f32[64]{0} all-gather-start(%x), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}",
            "  %d = f32[64]{0} all-gather-done(%s)",
            "  ROOT %t = (s32[], f32[8]) tuple(%i, %d)",
            "}",
            "",
            "%cond (p: (s32[], f32[8])) -> pred[] {",
            "  ROOT %lt = pred[] compare(%a, %b), direction=LT",
            "}",
            "",
            "ENTRY %main (p: f32[8]) -> f32[8] {",
            "  %ars = f32[8]{0} all-reduce-start(%p), replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add",
            "  %ard = f32[8]{0} all-reduce-done(%ars)",
            '  %w = (s32[], f32[8]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}',
            "  %cps = (f32[8], f32[8], u32[], u32[]) collective-permute-start(%p), source_target_pairs={{0,4},{4,0}}",
            "  ROOT %cpd = f32[8]{0} collective-permute-done(%cps)",
            "}",
        ]
    )
    found = {c.name: c for c in parse_collectives(text)}
    assert set(found) == {"d", "ard", "cpd"}
    assert found["d"].count == 5 and found["d"].bytes == 256
    assert comm_bytes(list(found.values()), MESH) == {
        "all-gather@data+model": 5 * 256,
        "all-reduce@data": 32,
        "collective-permute@data": 32,
    }


def test_a_windowed_einsums_permutes_are_its_reduce_scatter_counted_by_its_counter():
    # XLA's TPU writes a matmul whose result it reduce-scatters as a windowed einsum
    # (libtpu 0.0.42.1, a ZeRO gradient of a model-sharded kernel on v5p 4x4x4): a loop
    # with no known trip count, its counter from 0 by 2 while under 8, whose permutes pass
    # blocks of partial sums round the ring. Read as 4 turns of two 64-byte blocks, one
    # reduce-scatter of 512 bytes over the ring's axis; a permute outside stays one.
    text = "HloModule m, num_partitions=8\n\n" + "\n".join(
        [
            "%windowed_dot_general_body_rs.3.clone (p: (f32[16], u32[])) -> (f32[16], u32[]) {",
            "  %p = (f32[16], u32[]) parameter(0)",
            "  %i = u32[] get-tuple-element(%p), index=1",
            "  %x = f32[16] get-tuple-element(%p), index=0",
            "  %a = (f32[16], f32[16], u32[], u32[]) collective-permute-start(%x), source_target_pairs={{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}}",
            "  %b = f32[16]{0} collective-permute-done(%a)",
            "  %c = (f32[16], f32[16], u32[], u32[]) collective-permute-start(%b), source_target_pairs={{1,0},{2,1},{3,2},{0,3},{5,4},{6,5},{7,6},{4,7}}",
            "  %d = f32[16]{0} collective-permute-done(%c)",
            "  %two..sunk = u32[] constant(2)",
            "  %next = u32[] add(%i, %two..sunk)",
            "  ROOT %t = (f32[16], u32[]) tuple(%d, %next)",
            "}",
            "",
            "%windowed_dot_general_cond_rs.3 (p: (f32[16], u32[])) -> pred[] {",
            "  %p = (f32[16], u32[]) parameter(0)",
            "  %eight = u32[] constant(8)",
            "  %i = u32[] get-tuple-element(%p), index=1",
            "  ROOT %lt = pred[] compare(%i, %eight), direction=LT",
            "}",
            "",
            "ENTRY %main (x: f32[16]) -> f32[16] {",
            "  %x = f32[16] parameter(0)",
            "  %zero = u32[] constant(0)",
            "  %z = u32[] copy(%zero)",
            "  %init = (f32[16], u32[]) tuple(%x, %z)",
            "  %w = (f32[16], u32[]) while(%init), condition=%windowed_dot_general_cond_rs.3, body=%windowed_dot_general_body_rs.3.clone",
            "  %y = f32[16] get-tuple-element(%w), index=0",
            "  %e = (f32[16], f32[16], u32[], u32[]) collective-permute-start(%y), source_target_pairs={{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}}",
            "  ROOT %f = f32[16]{0} collective-permute-done(%e)",
            "}",
        ]
    )
    found = {c.name: c for c in parse_collectives(text)}
    assert found["b"].count == found["d"].count == 4
    assert comm_bytes(list(found.values()), {"data": 2, "model": 4}) == {
        "reduce-scatter@model": 4 * 2 * 64,
        "collective-permute@model": 64,
    }


# ---- real compiled HLO from jax on 8 CPU devices ----------------------------------------


def loss(p, x):
    h = jnp.tanh(x @ p["w1"])
    return jnp.mean((h @ p["w2"]) ** 2)


def step(p, x):
    value, g = jax.value_and_grad(loss)(p, x)
    return value, jax.tree.map(lambda a, b: a - 0.1 * b, p, g)


def compiled(w1, w2, x):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    shard = {k: NamedSharding(mesh, P(*v)) for k, v in {"w1": w1, "w2": w2}.items()}
    abstract = (
        {
            "w1": jax.ShapeDtypeStruct((64, 128), jnp.float32),
            "w2": jax.ShapeDtypeStruct((128, 32), jnp.float32),
        },
        jax.ShapeDtypeStruct((16, 64), jnp.float32),
    )
    fn = jax.jit(step, in_shardings=(shard, NamedSharding(mesh, P(*x))))
    return fn.lower(*abstract).compile().as_text()


def test_real_data_parallel_one_tuple_all_reduce():
    text = compiled((), (), ("data", None))
    assert "replica_groups=mesh[" in text  # the mesh form, as XLA prints it here
    (c,) = parse_collectives(text)
    assert c.kind == "all-reduce" and c.count == 1 and "dot_general" in c.op_name
    # XLA combined the loss scalar and both gradients into one tuple all-reduce.
    assert comm_bytes([c], MESH) == {"all-reduce@data": 4 + (64 * 128 + 128 * 32) * 4}


def test_real_megatron_dp():
    text = compiled((None, "model"), ("model", None), ("data", None))
    assert "replica_groups={{" in text  # the explicit form
    assert comm_bytes(parse_collectives(text), MESH) == {
        "all-reduce@model": 8 * 32 * 4,  # the row-parallel layer's partial sums
        "all-reduce@data": 4 + (64 * 32 + 32 * 32) * 4,  # gradients of the local shards
    }


def test_real_iota_and_device_ids_forms():
    text = compiled((None, "data"), (), ("model", None))
    assert "<=[2,4]T(1,0)" in text  # the iota form with a transpose
    got = comm_bytes(parse_collectives(text), MESH)
    assert got == {"all-reduce@data": 4 * 32 * 4, "all-reduce@model": 4 + (64 * 64 + 32 * 64) * 4}
    text = compiled((None, ("data", "model")), ("model", None), ())
    assert "device_ids=([2,4]T(1,0))" in text and "collective-permute" in text
    got = comm_bytes(parse_collectives(text), MESH)
    assert got["all-gather@model"] == 128 * 32 * 4  # w2 gathered along its "model" split
    assert "collective-permute@data+model" in got


def test_real_scan_counts_trip_count():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))

    def f(x):
        body = lambda c, w: (jnp.tanh(c @ w), None)  # noqa: E731
        return jax.lax.scan(body, x, jnp.ones((3, 64, 64)))[0].sum()

    fn = jax.jit(jax.grad(f), in_shardings=NamedSharding(mesh, P("data", "model")))
    text = fn.lower(jax.ShapeDtypeStruct((64, 64), jnp.float32)).compile().as_text()
    cs = parse_collectives(text)
    assert cs and all(c.count == 3 for c in cs)  # inside the loop bodies, 3 trips each
    assert comm_bytes(cs, MESH) == {"all-gather@model": 2 * 3 * 32 * 64 * 4}
