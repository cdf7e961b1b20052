"""ZeRO-1/2/3 as XLA compiles it: gradients reduce-scattered (on the CPU: all-reduced and
sliced), the Adam update on shards, parameters all-gathered once; the cost model prices
that program's collectives and memory, and the step computes what the plain step does."""

import functools
import re

import pytest

from automap._capture import capture
from automap._cluster import Cluster
from automap._cost import CostModel
from automap._graph import Role
from automap._groups import build_groups, plan_from_assignment
from automap._verify import comm_bytes, compile_plan, parse_collectives, verify
from automap._zoo import get_model
from pipeline._models import flax_args, flax_step

MESH = {"data": 8}


@functools.cache
def gpt(dtype: str = "bfloat16"):
    spec = get_model("gpt-1.3b", layers=2, hidden=64, heads=4, seq=32, batch=16, vocab=128,
                     dtype=dtype)  # fmt: skip
    args = spec.concrete_args() if dtype == "float32" else spec.abstract_args()
    g = capture(spec.step_fn, *args)
    return spec, args, g, build_groups(g)


def zero_plan(stage: int, dtype: str = "bfloat16"):
    _, _, g, groups = gpt(dtype)
    return plan_from_assignment(g, groups, MESH, {groups.batch_groups[0]: "data"}, zero_stage=stage)


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_compiles_reduce_scatter_sharded_update_and_one_gather(stage):
    spec, args, g, groups = gpt()
    plan = zero_plan(stage)
    text = compile_plan(spec.step_fn, plan, args, graph=g)[1].as_text()
    xla = comm_bytes(parse_collectives(text), MESH)
    cpu = Cluster.preset("cpu", devices=8)
    dp = CostModel(g, cpu, groups).evaluate({groups.batch_groups[0]: "data"}, MESH)
    # The gradients' reduction moves what data parallel's does (the CPU lowers a
    # reduce-scatter as an all-reduce of the same buffer and a slice of it) ...
    assert xla["all-reduce@data"] == pytest.approx(dp.collectives[0].bytes, rel=0.01)
    assert "dynamic-slice" in text
    # ... and the parameters are gathered once (not the Adam moments as well).
    assert xla["all-gather@data"] == pytest.approx(g.role_bytes(Role.PARAM), rel=0.01)
    assert set(xla) == {"all-reduce@data", "all-gather@data"}
    # The update runs on shards: its Adam arithmetic reads 1/8 of a kernel's moments.
    assert re.search(r"sqrt[^\n]*f32\[8,256\]", text)
    assert not re.search(r"sqrt[^\n]*f32\[64,256\]", text)
    # The cost model prices that program: collectives and peak memory.
    report = verify(spec.step_fn, plan, *args)
    assert report.collectives_match, report.summary()
    assert report.predicted_memory_bytes == pytest.approx(report.xla_memory_bytes, rel=0.15)


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_plans_compute_what_the_plain_step_does(stage):
    spec, args, _, _ = gpt("float32")  # bf16 sums differ with their order, ZeRO or not
    report = verify(spec.step_fn, zero_plan(stage, "float32"), *args)
    assert report.collectives_match, report.summary()
    assert report.numerics_ok, report.summary()


def test_zero_moves_data_parallels_bytes_on_a_gpu_cluster():
    # Where reduce-scatter exists: gradients reduce-scattered, parameters gathered; the
    # two together take the time of data parallel's all-reduce (float32 gradients and
    # parameters: with 16-bit gradients the float32 gather moves twice their bytes).
    _, _, g, groups = gpt("float32")
    model = CostModel(g, Cluster.preset("a100", devices=8), groups)
    batch = {groups.batch_groups[0]: "data"}
    dp = model.evaluate(batch, MESH)
    grads = max(c.bytes for c in dp.collectives if c.kind == "all-reduce")
    for stage in (1, 2, 3):
        z = model.evaluate(batch, MESH, zero_stage=stage)
        kinds = {(c.kind, c.axis): c.bytes for c in z.collectives}
        assert kinds[("reduce-scatter", "data")] == pytest.approx(grads, rel=0.01)
        assert kinds[("all-gather", "data")] == g.role_bytes(Role.PARAM)
        assert kinds.get(("all-reduce", "data"), 0.0) < 0.01 * grads  # the loss, no gradient
        assert z.comm_s == pytest.approx(dp.comm_s, rel=0.05)
        assert z.memory_breakdown["opt_state"] == pytest.approx(
            dp.memory_breakdown["opt_state"] / 8, rel=0.01
        )


def test_zero3_on_a_flax_model():
    # A third-party model (Flax modules, optax's Adam): the paths of its new parameters and
    # moments are matched to its inputs', and the pattern holds.
    args = flax_args(batch=64)
    g = capture(flax_step, *args)
    groups = build_groups(g)
    plan = plan_from_assignment(g, groups, MESH, {groups.batch_groups[0]: "data"}, zero_stage=3)
    assert all("data" in str(s) for p, s in plan.out_specs.items() if "kernel" in p)
    report = verify(flax_step, plan, *args)
    assert report.collectives_match, report.summary()
    assert report.xla_comm_bytes["all-gather@data"] == pytest.approx(g.role_bytes(Role.PARAM))
    assert report.numerics_ok, report.summary()
