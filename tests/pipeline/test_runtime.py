"""am.apply on pipeline plans: the same step results as one device, in the schedule's order.

On the 8 CPU devices of conftest: two stages on 2×2 sub-meshes and four stages on two
devices each, with 1, 2 and 4 microbatches, GPipe and 1F1B, on zoo transformers and on a
Flax model written as a user would.
"""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import automap as am
from automap import ApplyError, PlanError
from automap._pipeline import pipeline_plan, pipeline_schedule, uniform_cuts
from automap._run import send, send_program
from automap._space import batch_groups, block_groups
from automap._verify import as_on_cpu, compare_collectives, parse_collectives, verify

from ._models import assert_same, flax_args, flax_graph, flax_step, zoo

DP_TP = {"data": 2, "model": 2}


def _assignment(groups, mesh):
    out = {g.id: "data" for g in batch_groups(groups)}
    if "model" in mesh:
        out.update({g.id: "model" for g in block_groups(groups)})
    return out


def _plan(graph, groups, stages, mesh, microbatches, schedule):
    cuts = uniform_cuts(graph, groups, stages)
    return pipeline_plan(
        graph, groups, cuts, mesh, _assignment(groups, mesh), microbatches, schedule
    )


ZOO_CASES = [
    # model, stages, stage mesh, microbatches, schedule
    ("gpt2-xl", 2, DP_TP, 2, "1f1b"),
    ("gpt2-xl", 2, DP_TP, 4, "gpipe"),
    ("gpt2-xl", 4, {"data": 2}, 1, "gpipe"),
    ("bert-base", 4, {"data": 2}, 4, "1f1b"),
    ("bert-base", 2, DP_TP, 1, "1f1b"),
]


@pytest.mark.slow  # zoo pipelines compiled and run (5-9 s each loaded)
@pytest.mark.parametrize(("model", "stages", "mesh", "m", "schedule"), ZOO_CASES)
def test_zoo_pipelines_compute_the_step(model, stages, mesh, m, schedule):
    spec, graph, groups = zoo(model)
    plan = _plan(graph, groups, stages, mesh, m, schedule)
    args = spec.concrete_args(0)
    run = am.apply(spec.step_fn, plan)
    got = run(*args)
    assert_same(got, jax.jit(spec.step_fn)(*args), spec.config["learning_rate"])
    assert list(run.trace) == pipeline_schedule(schedule).global_order(stages, m)
    # Each stage's new parameters stay on that stage's devices.
    assert {d.id for d in run.meshes[0].devices.flat} == set(plan.stages[0].devices)


@pytest.mark.parametrize(
    ("stages", "mesh", "m", "schedule"), [(2, DP_TP, 2, "gpipe"), (4, {"data": 2}, 4, "1f1b")]
)
def test_flax_model_pipelines_compute_the_step(stages, mesh, m, schedule):
    graph, groups = flax_graph()
    plan = _plan(graph, groups, stages, mesh, m, schedule)
    args = flax_args()
    run = am.apply(flax_step, plan)
    assert_same(run(*args), jax.jit(flax_step)(*args), 1e-2)
    assert list(run.trace) == pipeline_schedule(schedule).global_order(stages, m)
    run(*args)  # a second step reuses the compiled segments
    assert len(run.trace) == 2 * stages * m


def test_verify_checks_pipeline_numerics_and_collectives():
    graph, groups = flax_graph()
    m = 2
    plan = _plan(graph, groups, 2, {"data": 2}, m, "1f1b")
    args = flax_args()
    report = verify(flax_step, plan, *args)
    assert report.numerics_ok
    assert report.collectives_match is True, report.summary()
    assert set(report.xla_comm_bytes) == {"all-reduce@data (stage 0)", "all-reduce@data (stage 1)"}
    # XLA's side on its own: each stage all-reduces its weight gradients (f32) and the
    # loss sum (a scalar) once per step, after its microbatches: all the parameters once.
    params = sum(x.size for x in jax.tree_util.tree_leaves(args[0])) * 4
    assert sum(report.xla_comm_bytes.values()) == params + 4
    assert any("device_put" in n for n in report.notes)


def test_verify_compares_a_pipeline_with_a_model_axis_and_zero3_compiled_only():
    graph, groups = flax_graph()
    cuts = uniform_cuts(graph, groups, 2)
    plan = pipeline_plan(
        graph, groups, cuts, DP_TP, _assignment(groups, DP_TP), 2, "gpipe", zero_stage=3
    )
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), flax_args())
    report = verify(flax_step, plan, *abstract)
    assert report.numerics_ok is None  # compiled, not run
    assert report.collectives_match is True, report.summary()
    # In both stages: partial sums over "model", gradients over "data", and ZeRO-3's
    # gathers of the parameters in every program that reads them for use (pre, F, B).
    for s in (0, 1):
        for kind in ("all-reduce@model", "all-reduce@data", "all-gather@data"):
            assert report.xla_comm_bytes[f"{kind} (stage {s})"] > 0
    # The check can fail: a model that all-reduced gradients in every B call (once per
    # microbatch) instead of once per step predicts twice the data traffic.
    every = {
        k: v * 2 if k.startswith("all-reduce@data") else v
        for k, v in report.predicted_comm_bytes.items()
    }
    ok, why = compare_collectives(as_on_cpu(every), report.xla_comm_bytes)
    assert not ok and len(why) == 2 and all("all-reduce over data (stage" in w for w in why)
    # ... and one that charged stage 1's ZeRO gathers to stage 0 (the same total).
    moved = dict(report.predicted_comm_bytes)
    moved["all-gather@data (stage 0)"] += moved.pop("all-gather@data (stage 1)")
    ok, why = compare_collectives(as_on_cpu(moved), report.xla_comm_bytes)
    assert not ok and len(why) == 2
    assert why[0].startswith("all-gather over data (stage 0): predicted")
    assert why[1].startswith("XLA inserts all-gather over data (stage 1)")


def test_a_send_across_processes_is_one_collective_permute_of_each_shard():
    """Under jax.distributed a value crosses stages by `send` (tests/test_distributed.py
    runs it between processes); here on one process's devices, the same program."""
    devices = np.array(jax.devices())
    a = Mesh(devices[:4].reshape(2, 2), ("data", "model"))
    b = Mesh(devices[4:].reshape(2, 2), ("data", "model"))
    x = jax.device_put(
        np.arange(64, dtype=np.float32).reshape(8, 8), NamedSharding(a, PartitionSpec("data"))
    )
    target = NamedSharding(b, PartitionSpec(None, "model"))  # resharded once arrived
    y = send(x, target)
    assert y.sharding == target and np.array_equal(np.asarray(y), np.asarray(x))
    found = parse_collectives(send_program(x.sharding, b, x.shape, x.dtype).as_text(), 8)
    # Each device of the sending stage sends its shard (4 rows of 8 float32) to its
    # partner, the device at the same place of the receiving stage: nothing else moves.
    assert [c.kind for c in found] == ["collective-permute"]
    assert found[0].bytes == 4 * 8 * 4
    assert sorted(found[0].groups) == [(0, 4), (1, 5), (2, 6), (3, 7)]


# ---- refusals ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def flax_plan():
    graph, groups = flax_graph()
    return _plan(graph, groups, 2, DP_TP, 2, "1f1b")


def test_batch_not_divisible_by_microbatches(flax_plan):
    import dataclasses

    plan = dataclasses.replace(flax_plan, microbatches=3)
    with pytest.raises(PlanError, match="3 microbatches do not divide"):
        am.apply(flax_step, plan)(*flax_args())


def test_too_few_devices(flax_plan):
    with pytest.raises(ApplyError, match="needs 8 devices"):
        am.apply(flax_step, flax_plan, devices=jax.devices()[:4])


def test_stage_mesh_must_divide_the_microbatch():
    graph, groups = flax_graph()
    # 4 microbatches of 2 examples: a data axis of 4 splits the batch but not them.
    plan = _plan(graph, groups, 2, {"data": 4}, 4, "1f1b")
    with pytest.raises(ApplyError, match="microbatch"):
        am.apply(flax_step, plan)(*flax_args())


def test_step_that_traces_differently_per_microbatch_refused(flax_plan):
    import dataclasses

    # Microbatches of one example: jax traces size-1 dimensions differently.
    plan = dataclasses.replace(flax_plan, microbatches=8)
    with pytest.raises(PlanError, match="traces differently at the microbatch size"):
        am.apply(flax_step, plan)(*flax_args())


def test_spec_axes_are_the_stage_mesh(flax_plan):
    import dataclasses

    path = next(iter(flax_plan.specs))
    bad = dict(flax_plan.specs)
    bad[path] = ("pipe", *bad[path][1:])
    with pytest.raises(PlanError, match="pipeline stage's mesh"):
        am.apply(flax_step, dataclasses.replace(flax_plan, specs=bad))


def test_partition_refusals_pass_through(flax_plan):
    import dataclasses

    s0, s1 = flax_plan.stages
    stages = (s0, dataclasses.replace(s1, op_start=s0.op_stop + 1))
    with pytest.raises(PlanError, match="should start at op"):
        am.apply(flax_step, dataclasses.replace(flax_plan, stages=stages))(*flax_args())


def test_other_program_refused(flax_plan):
    import dataclasses

    plan = dataclasses.replace(
        flax_plan, provenance=dataclasses.replace(flax_plan.provenance, fingerprint="0" * 64)
    )
    with pytest.raises(PlanError, match="another program"):
        am.apply(flax_step, plan)(*flax_args())
