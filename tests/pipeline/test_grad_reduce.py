"""Gradients reduced once per step: a pipeline stage's data-parallel gradient all-reduce
runs in one "reduce" program after its last backward, not in every B call.

Read from the programs the runtime compiles (`run.compile`: XLA's partitioned HLO) on a
2-stage, 4-microbatch plan on the 8 CPU devices of conftest, and held against the
pipeline cost model, which charges the same reduction once per step per stage, after the
stage's last backward in the schedule simulation.
"""

import dataclasses

import jax
import pytest

import automap as am
from automap._capture import capture
from automap._cluster import Cluster
from automap._cost import CostModel, estimate_pipeline
from automap._pipeline import Phase, pipeline_schedule
from automap._verify import axis_of, parse_collectives, verify

from ._models import assert_same, flax_args, flax_graph, flax_step
from .test_runtime import _plan

M = 4


def _data_reductions(prog) -> list:
    """The all-reduces over the data axis in one compiled program."""
    return [
        c
        for c in parse_collectives(prog.compiled.as_text())
        if c.kind == "all-reduce" and axis_of(c.kind, c.groups, prog.mesh) == "data"
    ]


@pytest.fixture(scope="module", params=["1f1b", "gpipe"])
def dp_plan(request):
    graph, groups = flax_graph()
    return _plan(graph, groups, 2, {"data": 2}, M, request.param)


def test_one_gradient_reduction_per_stage_per_step(dp_plan):
    run = am.apply(flax_step, dp_plan)
    programs = run.compile(*flax_args())
    per_stage = {0: 0, 1: 0}
    for prog in programs:
        found = _data_reductions(prog)
        if prog.kind in (Phase.FWD, Phase.BWD):
            assert not found, f"stage {prog.stage}'s {prog.kind} program reduces over data"
        per_stage[prog.stage] += len(found) * prog.runs
    assert per_stage == {0: 1, 1: 1}
    reducers = [p for p in programs if p.kind is Phase.REDUCE]
    assert sorted(p.stage for p in reducers) == [0, 1] and all(p.runs == 1 for p in reducers)
    # All of a stage's parameters move once: its gradients, plus the loss sum on the last.
    moved = sum(c.bytes for p in reducers for c in _data_reductions(p))
    params = sum(x.size for x in jax.tree_util.tree_leaves(flax_args()[0])) * 4
    assert moved == params + 4


def test_numerics_equal_the_unsharded_step_and_the_schedule_order_holds(dp_plan):
    args = flax_args()
    run = am.apply(flax_step, dp_plan)
    assert_same(run(*args), jax.jit(flax_step)(*args), 1e-2)
    assert list(run.trace) == pipeline_schedule(dp_plan.schedule).global_order(2, M)


def test_the_model_predicts_what_xla_compiles(dp_plan):
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), flax_args())
    report = verify(flax_step, dp_plan, *abstract)
    assert report.collectives_match is True, report.summary()
    assert not any("reduce" in n for n in report.notes[1:])  # not an unpriced extra program
    graph, _ = flax_graph()
    pc = estimate_pipeline(CostModel(graph, Cluster.preset("cpu", devices=8)), dp_plan)
    for own in pc.stage_collectives:
        (data,) = [c for c in own if c.axis == "data"]
        assert (data.kind, data.count) == ("all-reduce", 1)


def test_the_reduction_runs_after_each_stages_last_backward(dp_plan):
    graph, _ = flax_graph()
    model = CostModel(graph, Cluster.preset("a100", devices=4))
    pc = estimate_pipeline(model, dp_plan)
    tasks = pipeline_schedule(dp_plan.schedule).stage_tasks(2, M)
    assert [s for s, *_ in pc.reduce_ops] == [0, 1]
    for s, kind, mb, start, end in pc.reduce_ops:
        assert (kind, mb) == (Phase.REDUCE, -1) and end > start
        last = max(e for st, _, _, _, e in pc.ops if st == s)
        assert start == pytest.approx(last)
        # The F and B units keep the stage's own schedule.
        mine = sorted((st_, k, m) for st, k, m, st_, _ in pc.ops if st == s)
        assert [(k, m) for _, k, m in mine] == [(t.phase, t.microbatch) for t in tasks[s]]
    assert pc.cost.step_time_s >= max(end for *_, end in pc.reduce_ops)
    # Once per step: its bytes do not grow with the microbatches.
    few = estimate_pipeline(model, dataclasses.replace(dp_plan, microbatches=2))
    for a, b in zip(pc.stage_collectives, few.stage_collectives, strict=True):
        assert [c.bytes for c in a if c.axis == "data"] == [c.bytes for c in b if c.axis == "data"]


def test_one_microbatch_keeps_the_reduction_in_its_only_backward():
    graph, groups = flax_graph()
    plan = _plan(graph, groups, 2, {"data": 2}, 1, "1f1b")
    programs = am.apply(flax_step, plan).compile(*flax_args())
    assert not [p for p in programs if p.kind is Phase.REDUCE]
    assert all(len(_data_reductions(p)) >= 1 for p in programs if p.kind is Phase.BWD)
    pc = estimate_pipeline(CostModel(graph, Cluster.preset("cpu", devices=8)), plan)
    assert pc.reduce_ops == ()


@pytest.mark.slow  # a donated pipeline compiled and its memory read
def test_later_microbatches_add_into_the_donated_running_sums(dp_plan):
    # The first microbatch's program makes each stage's running sums; every later one
    # takes them donated and writes its own into the same buffers: XLA aliases them.
    run = am.apply(flax_step, dp_plan)
    programs = run.compile(*flax_args())
    adding = [
        p
        for p in programs
        if p.kind in (Phase.FWD, Phase.BWD) and p.compiled.memory_analysis().alias_size_in_bytes
    ]
    assert sorted(p.runs for p in adding) == [M - 1] * len(adding)
    # Per device, each partial sum is the reduced tensor's size: every parameter's
    # gradient and the loss sum, once.
    params = sum(x.size for x in jax.tree_util.tree_leaves(flax_args()[0])) * 4
    assert sum(p.compiled.memory_analysis().alias_size_in_bytes for p in adding) == params + 4
    # So a stage holds one copy of its running sums (a parameter read on both stages: a
    # sum of its own part on each), as the cost model charges.
    graph, _ = flax_graph()
    pc = estimate_pipeline(CostModel(graph, Cluster.preset("cpu", devices=8)), dp_plan)
    for s, own in enumerate(pc.stage_memory):
        sums = [p.compiled.memory_analysis().alias_size_in_bytes for p in adding if p.stage == s]
        assert own["grads"] == sum(sums)
    # Each stage's peak is what its compiled programs and the values the runtime holds
    # then make, with the old state donated (a training loop's step) or not (the new
    # state beside the old until the step returns).
    for step in (flax_step, jax.jit(flax_step, donate_argnums=(0, 1))):
        model = CostModel(capture(step, *flax_args()), Cluster.preset("cpu", devices=8))
        pc = estimate_pipeline(model, dp_plan)
        held = am.apply(step, dp_plan).memory(*flax_args())
        for predicted, measured in zip(pc.stage_memory_bytes, held, strict=True):
            assert predicted == pytest.approx(measured, rel=0.15)
