"""ZeRO-1/2/3 as XLA compiles it: gradients reduce-scattered (on the CPU: all-reduced and
sliced), the Adam update on shards, parameters all-gathered once; the cost model prices
that program's collectives and memory, and the step computes what the plain step does."""

import functools
import re

import jax
import pytest

from automap._capture import capture
from automap._cluster import Cluster
from automap._cost import CostModel
from automap._graph import Role
from automap._groups import build_groups, plan_from_assignment
from automap._verify import comm_bytes, compile_plan, parse_collectives, verify
from automap._zoo import get_model

MESH = {"data": 8}


@functools.cache
def gpt():
    spec = get_model("gpt-1.3b", layers=2, hidden=64, heads=4, seq=32, batch=16, vocab=128,
                     dtype="float32")  # fmt: skip
    args = spec.concrete_args()
    g = capture(spec.step_fn, *args)
    return spec, args, g, build_groups(g)


def zero_plan(stage: int):
    _, _, g, groups = gpt()
    return plan_from_assignment(g, groups, MESH, {groups.batch_groups[0]: "data"}, zero_stage=stage)


@functools.cache
def compiled(stage: int) -> str:
    spec, args, g, _ = gpt()
    return compile_plan(spec.step_fn, zero_plan(stage), args, graph=g)[1].as_text()


def param_bytes() -> int:
    return gpt()[2].role_bytes(Role.PARAM)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_compiles_reduce_scatter_sharded_update_and_one_gather(stage):
    text = compiled(stage)
    xla = comm_bytes(parse_collectives(text), MESH)
    dp = comm_bytes(parse_collectives(compiled(0)), MESH)
    # The gradients' reduction moves what data parallel's does (the CPU lowers a
    # reduce-scatter as an all-reduce of the same buffer and a slice of it) ...
    assert xla["all-reduce@data"] == pytest.approx(dp["all-reduce@data"], rel=0.01)
    assert "dynamic-slice" in text
    # ... and the parameters are gathered once (not the Adam moments as well).
    assert xla["all-gather@data"] == pytest.approx(param_bytes(), rel=0.01)
    assert set(xla) == {"all-reduce@data", "all-gather@data"}
    # The update runs on shards: its Adam arithmetic reads 1/8 of a kernel's moments.
    assert re.search(r"f32\[8,256\]", text) and not re.search(r"sqrt[^\n]*f32\[64,256\]", text)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_plans_priced_as_compiled_and_compute_the_same(stage):
    spec, args, _, _ = gpt()
    report = verify(spec.step_fn, zero_plan(stage), *args)
    assert report.collectives_match, report.summary()
    assert report.numerics_ok, report.summary()
    assert report.predicted_memory_bytes == pytest.approx(report.xla_memory_bytes, rel=0.15)


def test_zero_moves_data_parallels_bytes_on_a_gpu_cluster():
    # Where reduce-scatter exists: gradients reduce-scattered, parameters gathered; the
    # two together take the time of data parallel's all-reduce.
    _, _, g, groups = gpt()
    model = CostModel(g, Cluster.preset("a100", devices=8), groups)
    batch = {groups.batch_groups[0]: "data"}
    dp = model.evaluate(batch, MESH)
    for stage in (1, 2, 3):
        z = model.evaluate(batch, MESH, zero_stage=stage)
        kinds = {(c.kind, c.axis): c.bytes for c in z.collectives}
        assert set(kinds) == {("reduce-scatter", "data"), ("all-gather", "data")}
        assert kinds[("reduce-scatter", "data")] == dp.collectives[0].bytes
        assert z.comm_s == pytest.approx(dp.comm_s, rel=0.05)
        assert z.memory_breakdown["opt_state"] == pytest.approx(
            dp.memory_breakdown["opt_state"] / 8, rel=0.01
        )
