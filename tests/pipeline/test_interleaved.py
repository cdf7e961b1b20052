"""Interleaved 1F1B (issue 26): v model chunks per device group run by the runtime on the
8 CPU devices of conftest with the unsharded step's numerics, in the schedule's order, and
priced by the cost model: the bubble (S - 1) / v slots, more sends, and per stage the
memory its devices hold within 15% of what the runtime holds (`run.memory`)."""

import dataclasses
import json
import math
import re

import jax
import numpy as np
import pytest
from typer.testing import CliRunner

import automap as am
from automap._capture import capture
from automap._cli import app
from automap._cluster import Cluster
from automap._cost import CostModel, estimate_pipeline, op_costs, stage_costs
from automap._groups import build_groups
from automap._pipeline import (
    Phase,
    forward_ops,
    partition,
    pipeline_plan,
    plan_schedule,
    uniform_cuts,
)
from automap._search import PipelinePricer
from automap._space import batch_groups, layer_cuts
from automap._verify import verify
from automap._zoo import get_model

from ._models import SMALL, TINY, assert_same, flax_args, flax_graph, flax_step, small
from ._models import gpt4 as gpt

CPU = Cluster.preset("cpu", devices=8)
FREE_LINKS = Cluster.preset("a100", devices=16, intra_bandwidth=math.inf, inter_bandwidth=math.inf)
FREE_LINKS = dataclasses.replace(FREE_LINKS, intra_latency=0.0, inter_latency=0.0)


def _plan(graph, groups, S, v, mesh, m, schedule="interleaved"):
    batch = {g.id: "data" for g in batch_groups(groups)} if "data" in mesh else {}
    cuts = uniform_cuts(graph, groups, S * v)
    return pipeline_plan(graph, groups, cuts, mesh, batch, m, schedule, virtual_stages=v)


def _check_trace(run, plan, S, m):
    schedule = plan_schedule(plan)
    assert list(run.trace) == schedule.global_order(S, m)
    # Each device group runs its own tasks in their order, chunk by chunk.
    for s, tasks in enumerate(schedule.stage_tasks(S, m)):
        mine = [(u.phase, u.microbatch, u.stage // S) for u in run.trace if u.stage % S == s]
        assert mine == [(t.phase, t.microbatch, t.chunk) for t in tasks]


@pytest.mark.parametrize(
    ("S", "v", "mesh", "m", "batch"),
    [(2, 2, {"data": 2}, 2, 8), (2, 3, {"data": 2}, 4, 8), (3, 2, {"data": 1}, 6, 12)],
)
def test_flax_model_interleaved_pipelines_compute_the_step(S, v, mesh, m, batch):
    graph, groups = flax_graph()  # its cuts: the same ops at any batch
    plan = _plan(graph, groups, S, v, mesh, m)
    assert len(plan.stages) == S * v and plan.mesh["pipe"] == S
    args = flax_args(batch)
    run = am.apply(flax_step, plan)
    assert_same(run(*args), jax.jit(flax_step)(*args), 1e-2)
    _check_trace(run, plan, S, m)
    # A chunk's stage runs on its device group's mesh.
    for p, stage in enumerate(plan.stages):
        assert {d.id for d in run.meshes[p].devices.flat} == set(plan.stages[p % S].devices)
        assert stage.devices == plan.stages[p % S].devices


@pytest.mark.slow  # 8 chunks of a zoo GPT compiled and run (about a minute on two cores)
def test_a_zoo_gpt_in_four_groups_of_two_chunks_computes_the_step():
    spec = get_model("gpt2-xl", **{**TINY, "layers": 4})
    graph = capture(spec.step_fn, *spec.abstract_args())
    plan = _plan(graph, build_groups(graph), 4, 2, {"data": 2}, 4)
    args = spec.concrete_args(0)
    run = am.apply(spec.step_fn, plan)
    assert_same(run(*args), jax.jit(spec.step_fn)(*args), spec.config["learning_rate"])
    _check_trace(run, plan, 4, 4)


def test_the_model_times_the_runtimes_order_and_its_memory_is_what_the_runtime_holds():
    spec, graph, groups = gpt()
    S, v, m = 2, 2, 4
    plan = _plan(graph, groups, S, v, {"data": 4}, m)
    args = spec.concrete_args(0)
    run = am.apply(spec.step_fn, plan)
    assert_same(run(*args), jax.jit(spec.step_fn)(*args), spec.config["learning_rate"])
    pc = estimate_pipeline(CostModel(graph, CPU), plan)
    # The cost model's simulated units, per device group, in the order the runtime ran.
    for s in range(S):
        executed = [(u.phase, u.microbatch, u.stage) for u in run.trace if u.stage % S == s]
        timed = sorted(
            (t.start, t.phase, t.microbatch, t.stage) for t in pc.ops if t.stage % S == s
        )
        assert executed == [x[1:] for x in timed]
    # Per stage, its device group's memory: XLA's programs and what the runtime holds.
    held = run.memory(*spec.abstract_args())
    assert len(held) == len(pc.stage_memory_bytes) == S * v
    for predicted, xla in zip(pc.stage_memory_bytes, held, strict=True):
        assert predicted == pytest.approx(xla, rel=0.15)
    assert held[:S] == held[S:]  # chunks of one group: one group's memory
    # The same cuts as two stages of 1F1B hold fewer activations: interleaving's price.
    one = estimate_pipeline(
        CostModel(graph, CPU), _plan(graph, groups, S, 1, {"data": 4}, m, "1f1b")
    )
    assert pc.in_flight == (3, 2, 2, 1) and one.in_flight == (2, 1)
    first = [d["activations"] for d in (pc.stage_memory[0], one.stage_memory[0])]
    assert first[0] > first[1]


@pytest.mark.parametrize("m", [2, 4, 8])
def test_equal_chunks_bubble_is_v_times_smaller_than_1f1bs(m):
    S, v = 2, 2
    spec = get_model("gpt2-xl", layers=4, hidden=64, heads=4, batch=8, seq=16)
    graph = capture(spec.step_fn, *spec.abstract_args())
    groups = build_groups(graph)
    cm = CostModel(graph, FREE_LINKS, groups)
    fwd = forward_ops(graph, groups)  # equal shares of the forward ops: none empty
    cuts = [fwd[i * len(fwd) // (S * v)] for i in range(1, S * v)]
    plan = pipeline_plan(graph, groups, cuts, {"data": 2}, {}, m, "interleaved", virtual_stages=v)
    part = partition(graph, groups, [(st.op_start, st.op_stop) for st in plan.stages], m)
    oc = op_costs(cm, {}, {"data": 2})
    # Every chunk's forward costs 0.5 ms and its backward 1 ms per microbatch; nothing else.
    compute = np.zeros(len(graph.ops))
    for p in range(S * v):
        for phase, ms in ((Phase.FWD, 0.5e-3), (Phase.BWD, 1e-3)):
            ops = part.ops(p, phase)
            compute[list(ops)] = ms * m / len(ops)
    zero = np.zeros_like(compute)
    oc = dataclasses.replace(oc, compute=compute, remat_compute=zero, row_count=oc.row_count * 0.0)
    pc = stage_costs(cm, part, oc, m, plan_schedule(plan))
    fraction = pc.cost.bubble_s / pc.cost.step_time_s
    assert fraction == pytest.approx(((S - 1) / v) / (m + (S - 1) / v))
    assert fraction == pytest.approx(pc.schedule.bubble(S, m))
    assert pc.stage_work_s == pytest.approx((m * 3e-3,) * (S * v))  # a group's, both chunks


def test_interleaving_trades_the_bubble_for_sends():
    _, graph, groups = gpt()

    def costs(cluster):
        cm = CostModel(graph, cluster)
        one = estimate_pipeline(cm, _plan(graph, groups, 2, 1, {"data": 4}, 4, "1f1b"))
        two = estimate_pipeline(cm, _plan(graph, groups, 2, 2, {"data": 4}, 4))
        return one.cost, two.cost

    # Free sends: the bubble shrinks, and the step with it (the same work per device).
    one, two = costs(FREE_LINKS)
    assert two.bubble_s < one.bubble_s and two.step_time_s < one.step_time_s
    assert two.compute_s == pytest.approx(one.compute_s)
    # Priced sends: a microbatch crosses each group twice; on this tiny model (latency
    # bound) they cost more than the bubble saves: the paper's trade, lost.
    one, two = costs(Cluster.preset("a100", devices=8))
    permute = [next(c for c in x.collectives if c.kind == "collective-permute") for x in (one, two)]
    assert permute[1].count > permute[0].count and permute[1].bytes > permute[0].bytes
    assert two.step_time_s > one.step_time_s


A100_8 = Cluster.preset("a100", devices=8)


def test_a_recipe_interleaves_equal_layers_over_repeating_device_groups():
    spec, graph = small()
    groups = build_groups(graph)
    recipe = am.Recipe(pp=2, dp=4, microbatches=2, schedule="interleaved", virtual_stages=2)
    plan = am.plan_recipe(spec.step_fn, *spec.abstract_args(), recipe=recipe, cluster=A100_8)
    # Four chunks of one layer each (Megatron's virtual pipeline), chunk k on group k % 2.
    assert [s.op_start for s in plan.stages[1:]] == list(layer_cuts(graph, groups, 4))
    assert plan.virtual_stages == 2 and plan.mesh == {"pipe": 2, "data": 4}
    assert [s.devices for s in plan.stages] == [(0, 1, 2, 3), (4, 5, 6, 7)] * 2
    assert plan.predicted.feasible and plan.predicted.bubble_s > 0


INTERLEAVED_BAD = [
    (dict(virtual_stages=3), "4 layers do not split into pp × virtual_stages = 2 × 3 = 6"),
    (dict(schedule="1f1b"), "pipeline schedule '1f1b' runs one model chunk per device, not 2"),
    (dict(virtual_stages=1), "interleaved 1F1B needs 2 or more virtual stages per device"),
    (dict(pp=1, dp=8), "virtual_stages=2 interleaves the stages of a pipeline, but pp=1"),
    (dict(microbatches=1), "1 microbatches do not divide into rounds of 2"),
    (dict(virtual_stages=0), "virtual_stages must be a positive integer, not 0"),
]


@pytest.mark.parametrize(("fields", "message"), INTERLEAVED_BAD)
def test_a_recipe_whose_virtual_stages_do_not_fit_is_one_line(fields, message):
    spec, _ = small()
    base = dict(pp=2, dp=4, microbatches=2, schedule="interleaved", virtual_stages=2)
    recipe = am.Recipe(**{**base, **fields})
    with pytest.raises(am.PlanError, match=re.escape(message)) as err:
        am.plan_recipe(spec.step_fn, *spec.abstract_args(), recipe=recipe, cluster=A100_8)
    assert "\n" not in str(err.value)


def test_estimate_takes_the_schedule_and_its_virtual_stages():
    sets = [arg for k, v in SMALL.items() for arg in ("--set", f"{k}={v}")]
    base = ["estimate", "--model", "gpt-1.3b", *sets, "--devices", "8", "--pp", "2", "--dp", "4"]
    base += ["--microbatches", "2", "--schedule", "interleaved"]
    result = CliRunner().invoke(app, [*base, "--virtual-stages", "2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert len(data["plan"]["stages"]) == 4 and data["plan"]["schedule"] == "interleaved"
    assert data["bubble_s"] > 0 and data["feasible"]
    bad = CliRunner().invoke(app, [*base, "--virtual-stages", "3"])
    assert bad.exit_code == 2 and "2 × 3 = 6 chunks" in bad.output
    assert "Traceback" not in bad.output


def test_the_stage_search_refuses_a_chunked_schedule_in_one_line():
    # The stage DP and the DQN's pricer cut one chunk per group (pricing chunks as stages
    # of their own would be wrong); the dp searcher interleaves after its DP.
    _, graph = small()
    with pytest.raises(am.PlanError, match=r"^the pipeline search's stage DP cuts one stage"):
        PipelinePricer(CostModel(graph, A100_8), "interleaved")
    assert PipelinePricer(CostModel(graph, A100_8), "1f1b").schedule.chunks == 1


def test_verify_holds_an_interleaved_plan_against_its_compiled_stages():
    # A step that donates nothing: each chunk's update keeps its new state beside the old
    # through its group's other chunks' updates; per stage, model against run.memory.
    graph, groups = flax_graph()
    plan = _plan(graph, groups, 2, 2, {"data": 2}, 2)
    report = verify(flax_step, plan, *flax_args())
    assert report.collectives_match is True, report.summary()
    assert report.numerics_ok, report.summary()
    assert len(report.stage_memory_bytes) == 4
    for predicted, xla in report.stage_memory_bytes:
        assert predicted == pytest.approx(xla, rel=0.15), report.summary()
