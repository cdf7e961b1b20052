"""am.apply on pipeline plans: the same step results as one device, in the schedule's order.

On the 8 CPU devices of conftest: two stages on 2×2 sub-meshes and four stages on two
devices each, with 1, 2 and 4 microbatches, GPipe and 1F1B, on zoo transformers and on a
Flax model written as a user would.
"""

import jax
import pytest

import automap as am
from automap import ApplyError, PlanError
from automap._expert import batch_groups, block_groups
from automap._pipeline._plans import pipeline_plan, uniform_cuts
from automap._pipeline._schedule import global_order
from automap._verify import verify

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


@pytest.mark.parametrize(("model", "stages", "mesh", "m", "schedule"), ZOO_CASES)
def test_zoo_pipelines_compute_the_step(model, stages, mesh, m, schedule):
    spec, graph, groups = zoo(model)
    plan = _plan(graph, groups, stages, mesh, m, schedule)
    args = spec.concrete_args(0)
    run = am.apply(spec.step_fn, plan)
    got = run(*args)
    assert_same(got, jax.jit(spec.step_fn)(*args), spec.config["learning_rate"])
    assert list(run.trace) == global_order(stages, m, schedule)
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
    assert list(run.trace) == global_order(stages, m, schedule)
    run(*args)  # a second step reuses the compiled segments
    assert len(run.trace) == 2 * stages * m


def test_verify_checks_pipeline_numerics():
    graph, groups = flax_graph()
    plan = _plan(graph, groups, 2, {"data": 2}, 2, "1f1b")
    report = verify(flax_step, plan, *flax_args())
    assert report.numerics_ok and report.collectives_match is None
    assert any("pipeline" in n for n in report.notes)


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
