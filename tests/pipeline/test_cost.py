"""The pipeline cost model: the textbook bubble, microbatches and schedules, memory per
stage, conservation of the per-op costs, and the schedule it times against the runtime's."""

import dataclasses
import functools
import itertools
import math

import jax
import numpy as np
import pytest

import automap as am
from automap._capture import capture
from automap._cluster import Cluster
from automap._cost import (
    CostModel,
    estimate_pipeline,
    op_costs,
    pipeline_decisions,
    plan_op_costs,
    stage_costs,
    zero_leaves,
)
from automap._groups import build_groups, plan_from_assignment
from automap._pipeline import Phase, forward_ops, partition, pipeline_schedule
from automap._plan import Plan, Stage
from automap._report import stage_times
from automap._run import apply_pipeline
from automap._solvers import pipeline_step_time
from automap._space import expert_assignments
from automap._zoo import get_model

A100 = Cluster.preset("a100", devices=16)
#: Sends cost nothing: the schedule alone makes the bubble.
FREE_LINKS = Cluster.preset("a100", devices=16, intra_bandwidth=math.inf, inter_bandwidth=math.inf)
FREE_LINKS = dataclasses.replace(FREE_LINKS, intra_latency=0.0, inter_latency=0.0)


@functools.cache
def zoo(name: str, dtype: str | None = None):
    dtypes = {"dtype": dtype} if dtype else {}
    spec = get_model(name, layers=4, hidden=64, heads=4, batch=8, seq=16, **dtypes)
    args = spec.abstract_args()
    graph = capture(spec.step_fn, *args)
    return spec, args, graph, build_groups(graph)


@functools.cache
def model(name: str, cluster: Cluster = A100, dtype: str | None = None) -> CostModel:
    _, _, graph, groups = zoo(name, dtype)
    return CostModel(graph, cluster, groups)


@functools.cache
def donating(name: str, cluster: Cluster = A100) -> CostModel:
    """The zoo step jitted with its state donated: its update writes over the old state."""
    spec, args, _, _ = zoo(name)
    graph = capture(jax.jit(spec.step_fn, donate_argnums=(0, 1)), *args)
    return CostModel(graph, cluster, build_groups(graph))


def stage_plan(
    name, stages, microbatches=1, schedule="1f1b", kind="megatron_dp_tp2", zero=0, dtype=None
):
    """`stages` equal ranges of the forward ops, each on a 2 x 2 (data x model) mesh."""
    _, _, graph, groups = zoo(name, dtype)
    mesh, assignment, _ = expert_assignments(graph, groups, A100.with_devices(4))[kind]
    inner = plan_from_assignment(graph, groups, mesh, assignment, zero_stage=zero)
    fwd = forward_ops(graph, groups)
    cuts = [fwd[i * len(fwd) // stages] for i in range(1, stages)]
    per = math.prod(mesh.values())
    bounds = list(zip([0, *cuts], [*cuts, fwd[-1] + 1], strict=True))
    return dataclasses.replace(
        inner,
        mesh={"pipe": stages, **mesh} if stages > 1 else mesh,
        stages=tuple(
            Stage(a, b, tuple(range(s * per, (s + 1) * per)), mesh)
            for s, (a, b) in enumerate(bounds)
        ),
        microbatches=microbatches,
        schedule=schedule,
        assignment=dict(assignment),
    )


def bounds_of(plan: Plan):
    return [(s.op_start, s.op_stop) for s in plan.stages]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("m", [1, 4, 8])
def test_equal_stages_bubble_is_the_textbook_fraction(schedule, m):
    S = 4
    cm = model("gpt2-xl", FREE_LINKS)
    plan = stage_plan("gpt2-xl", S, m, schedule)
    part = partition(cm.graph, cm.groups, bounds_of(plan), m)
    oc = op_costs(cm, {}, {"data": 2, "model": 2})
    # Every stage's forward costs 1 ms and its backward 2 ms per microbatch; nothing else.
    compute = np.zeros(len(cm.graph.ops))
    for s in range(S):
        for phase, ms in ((Phase.FWD, 1e-3), (Phase.BWD, 2e-3)):
            ops = part.ops(s, phase)
            compute[list(ops)] = ms * m / len(ops)
    zero = np.zeros_like(compute)
    oc = dataclasses.replace(oc, compute=compute, remat_compute=zero, row_count=oc.row_count * 0.0)
    pc = stage_costs(cm, part, oc, m, pipeline_schedule(schedule))
    assert np.array(pc.stage_times) == pytest.approx(np.array([(1e-3, 2e-3)] * S))
    assert pc.cost.bubble_s / pc.cost.step_time_s == pytest.approx((S - 1) / (m + S - 1))
    assert pc.cost.bubble_s / pc.cost.step_time_s == pytest.approx(pc.schedule.bubble(S, m))
    # The exact stage DP's formula agrees on equal stages.
    assert pc.cost.step_time_s == pytest.approx(pipeline_step_time([3e-3] * S, m))


def test_more_microbatches_make_a_smaller_bubble():
    cm = model("gpt2-xl")
    fractions = []
    for m in (1, 2, 4, 8):
        cost = estimate_pipeline(cm, stage_plan("gpt2-xl", 4, m)).cost
        assert cost.feasible
        assert cost.step_time_s == pytest.approx(cost.compute_s + cost.comm_s + cost.bubble_s)
        fractions.append(cost.bubble_s / cost.step_time_s)
    assert all(a > b for a, b in itertools.pairwise(fractions)), fractions


@pytest.mark.parametrize("name", ["gpt2-xl", "bert-base"])
def test_gpipe_holds_more_activations_than_1f1b(name):
    # Donating, every stage peaks in its backward, where the schedules differ; a step that
    # donates nothing may peak at its update on the last stages, alike in both.
    cm = donating(name)
    gpipe = estimate_pipeline(cm, stage_plan(name, 4, 4, "gpipe"))
    ofob = estimate_pipeline(cm, stage_plan(name, 4, 4, "1f1b"))
    assert gpipe.in_flight == (4, 4, 4, 4) and ofob.in_flight == (4, 3, 2, 1)
    g_act = [d["activations"] for d in gpipe.stage_memory]
    o_act = [d["activations"] for d in ofob.stage_memory]
    assert g_act[0] == pytest.approx(o_act[0])  # the first stage holds S = m in both
    assert all(g > o for g, o in zip(g_act[1:], o_act[1:], strict=True))
    assert gpipe.cost.memory_bytes >= ofob.cost.memory_bytes
    # Same work either way; only the order (and so the memory) differs.
    assert np.array(gpipe.stage_times) == pytest.approx(np.array(ofob.stage_times))


def test_a_stage_over_the_memory_limit_is_infeasible_and_named():
    plan = stage_plan("gpt2-xl", 4, 4)
    pc = estimate_pipeline(model("gpt2-xl"), plan)
    worst = int(np.argmax(pc.stage_memory_bytes))
    limit = 0.99 * max(pc.stage_memory_bytes)
    tight = dataclasses.replace(A100, hbm_bytes=limit / (1 - A100.memory_reserve))
    cost = model("gpt2-xl", tight).estimate(plan)
    assert not cost.feasible
    assert f"pipeline stage {worst} needs" in cost.reason
    roomy = dataclasses.replace(A100, hbm_bytes=1.02 * limit / (1 - A100.memory_reserve))
    assert model("gpt2-xl", roomy).estimate(plan).feasible


def test_a_single_stage_is_one_program_or_gradient_accumulation():
    cm = model("gpt2-xl")
    plan = stage_plan("gpt2-xl", 1, 1)
    before = cm.evaluate(cm.plan_assignment(plan), plan.mesh, detail=True)
    assert cm.estimate(plan) == before
    assert cm.estimate(dataclasses.replace(plan, stages=())) == before
    # With microbatches, one stage runs through the staged runtime (gradient
    # accumulation): the same work, no bubble, and the activations of one microbatch
    # (with what runs once per step on the whole batch), against the staged runtime's own
    # at one microbatch (which also prices the backward's temporaries). Not quite half:
    # a microbatch's weight gradients are buffers of their own until added into the sums.
    # (The reduce program's buffers, which outgrow a microbatch's activations on a model
    # this small where a step's peak is its busiest moment, are left out here:
    # `test_verify_gpu.py` holds them against XLA.) Donating: a step that donates nothing
    # may peak at its update, when no activation is alive.
    cm = donating("gpt2-xl", A100.with_lowering(frees_at_last_use=False))
    accum = cm.estimate(stage_plan("gpt2-xl", 1, 2))
    assert accum.bubble_s == pytest.approx(0.0, abs=1e-12)
    assert accum.compute_s == pytest.approx(before.compute_s, rel=0.02)
    acts = lambda c: c.memory_breakdown["activations"]  # noqa: E731
    whole = estimate_pipeline(cm, stage_plan("gpt2-xl", 1, 1)).cost
    # Since a stage's B remakes the cheap residuals (`_remat.remake_residuals`) what halves
    # is a smaller part (7.0 MB of 10.3 here, was 17.3 of 20.6), and the microbatch's own
    # gradient buffers (1.6 MB) take back most of what halving it saves.
    assert acts(whole) / 2 <= acts(accum) < acts(whole)


@pytest.mark.parametrize(("zero", "remat"), [(0, False), (1, False), (3, True), (3, False)])
def test_per_op_costs_add_up_to_the_whole_step(zero, remat):
    # ZeRO-3 in float32: a mixed-precision stage gathers its weights' bf16 casts (made in
    # its pre program), where one program under remat gathers the float32 parameters
    # (`tests/test_verify_gpu.py`), so their sums differ there by design.
    dtype = "float32" if zero == 3 else None
    cm = model("gpt2-xl", A100, dtype)
    _, _, graph, groups = zoo("gpt2-xl", dtype)
    mesh, assignment, _ = expert_assignments(graph, groups, A100.with_devices(4))["megatron_dp_tp2"]
    whole = cm.evaluate(assignment, mesh, zero_stage=zero, remat=remat)
    # One program adds the tied embedding's two partial sums before reducing them, where
    # two stages reduce each (`staged`): held against one stage's cost, one program's.
    oc = op_costs(cm, assignment, mesh, zero_stage=zero, remat=remat, staged=False)
    assert (oc.compute + oc.remat_compute).sum() == pytest.approx(whole.compute_s)
    # With ZeRO, as for one stage: the gradients reduce-scattered (ZeRO-3: layer by
    # layer), each parameter gathered once (ZeRO-3: per forward layer and again in the
    # backward, `_fsdp.program_gathers`, as a pipeline stage's F and B do; tests/test_zero.py).
    assert (oc.comm + oc.grad_comm + oc.zero_comm).sum() == pytest.approx(whole.comm_s)
    # Cut in stages at one microbatch, every op still runs once: compute is conserved.
    plan = stage_plan("gpt2-xl", 4, 1, dtype=dtype)
    part = partition(graph, groups, bounds_of(plan), 1)
    pc = stage_costs(cm, part, oc, 1, pipeline_schedule("1f1b"))
    assert sum(c for _, c, _ in pc.cost.per_op) == pytest.approx(oc.compute.sum())
    assert pc.op_run_s.sum() >= (oc.compute + oc.comm).sum()


def test_simulated_order_is_each_stages_schedule():
    cm = model("gpt2-xl")
    for schedule in ("gpipe", "1f1b"):
        pc = estimate_pipeline(cm, stage_plan("gpt2-xl", 4, 6, schedule))
        tasks = pipeline_schedule(schedule).stage_tasks(4, 6)
        for s in range(4):
            mine = sorted((start, k, m) for st, k, m, start, _ in pc.ops if st == s)
            assert [(k, m) for _, k, m in mine] == [(t.phase, t.microbatch) for t in tasks[s]]


def test_public_estimate_and_report_decisions():
    spec, args, _, _ = zoo("gpt2-xl")
    plan = stage_plan("gpt2-xl", 2, 4)
    pc = estimate_pipeline(model("gpt2-xl"), plan)
    assert am.estimate(spec.step_fn, *args, plan=plan, cluster=A100) == pc.cost
    assert pc.cost.bubble_s > 0 and pc.cost.mfu > 0
    noted = dataclasses.replace(plan, decisions={**plan.decisions, **pipeline_decisions(pc)})
    times, unit = stage_times(noted)
    assert unit == "ms" and np.array(times) == pytest.approx(np.array(pc.stage_times))


@pytest.mark.slow  # pipelines compiled and run
def test_the_runtime_runs_the_order_the_model_times():
    spec, _, _, _ = zoo("gpt2-xl")
    plan = stage_plan("gpt2-xl", 2, 4, "1f1b")  # 2 stages x 4 devices: the 8 CPU devices
    run = apply_pipeline(spec.step_fn, plan)
    run(*spec.concrete_args())
    pc = estimate_pipeline(model("gpt2-xl"), plan)
    for s in range(2):
        executed = [(k, m) for st, k, m in run.trace if st == s]
        timed = sorted((start, k, m) for st, k, m, start, _ in pc.ops if st == s)
        assert executed == [(k, m) for _, k, m in timed]


def test_stage_collectives_are_each_stages_own():
    # The step's collectives are the busiest stage's, per device, with its sends on the
    # pipe axis; `stage_collectives` are every stage's, sends left out (what verify reads).
    pc = estimate_pipeline(model("gpt2-xl"), stage_plan("gpt2-xl", 2, 4))
    busiest = int(np.argmax(pc.stage_work_s))
    sends = [c for c in pc.cost.collectives if c.axis == "pipe"]
    assert [c.kind for c in sends] == ["collective-permute"]
    assert pc.cost.collectives == (*pc.stage_collectives[busiest], *sends)
    # A data-parallel gradient is all-reduced once per step on its stage: each has its own.
    for own in pc.stage_collectives:
        assert {c.axis for c in own if c.kind == "all-reduce"} >= {"data", "model"}
    assert pc.stage_collectives[0] != pc.stage_collectives[1]


def test_zero_gathers_are_charged_where_each_parameter_is_updated():
    # gpt2's token embedding is tied: read on the first stage (the lookup) and the last
    # (the logits), updated on one. Each parameter is gathered once per step after its
    # sharded update, there (as XLA does: tests/pipeline/test_zero.py).
    cm = model("gpt2-xl")
    plan = stage_plan("gpt2-xl", 2, 2, zero=1)
    pc = estimate_pipeline(cm, plan)
    params = sum(b for _, b, _ in zero_leaves(cm.graph, plan_op_costs(cm, plan).layouts))
    gathered = sum(c.bytes for own in pc.stage_collectives for c in own if c.kind == "all-gather")
    assert gathered == pytest.approx(params)
    # Where reduce-scatter exists, the gradients' data reduction is one, once per step.
    for own in pc.stage_collectives:
        data = {c.kind for c in own if c.axis == "data"}
        assert "reduce-scatter" in data, own
