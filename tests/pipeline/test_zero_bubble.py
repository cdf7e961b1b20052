"""ZB-H1 (Qi et al., ICLR 2024; issue 26): each backward split into B (what the stage sends
upstream) and W (its weight gradients), W deferred into 1F1B's bubble. The schedule's
task lists and counts, the split read off the captured step, the runtime running B and
W as programs of their own with the unsharded step's numerics in the schedule's order,
and the cost model's bubble, split backward and memory per stage against `run.memory`."""

import dataclasses
import json
import math
import re

import jax
import pytest
from typer.testing import CliRunner

import automap as am
from automap._cli import app
from automap._cluster import Cluster
from automap._cost import CostModel, estimate_pipeline
from automap._pipeline import (
    Phase,
    partition,
    pipeline_plan,
    pipeline_schedule,
    split_backward,
    uniform_cuts,
)
from automap._search import PipelinePricer
from automap._space import batch_groups
from automap._verify import verify

from ._models import SMALL, assert_same, flax_args, flax_graph, flax_step, small
from ._models import gpt4 as gpt

ZB, ONE = pipeline_schedule("zb-h1"), pipeline_schedule("1f1b")
CPU = Cluster.preset("cpu", devices=8)
FREE_LINKS = Cluster.preset("a100", devices=16, intra_bandwidth=math.inf, inter_bandwidth=math.inf)
FREE_LINKS = dataclasses.replace(FREE_LINKS, intra_latency=0.0, inter_latency=0.0)


def _plan(graph, groups, S, m, schedule="zb-h1", data=2):
    batch = {g.id: "data" for g in batch_groups(groups)}
    cuts = uniform_cuts(graph, groups, S)
    return pipeline_plan(graph, groups, cuts, {"data": data}, batch, m, schedule)


# ---- the schedule ------------------------------------------------------------------------


@pytest.mark.parametrize(("S", "m"), [(2, 4), (4, 4), (4, 8), (8, 16), (5, 7)])
def test_its_bubble_is_a_third_of_1f1bs_with_equal_f_b_and_w(S, m):
    # F, B and W of one time each: 1F1B runs B + W as its backward.
    span = max(u.end for u in ZB.simulate(S, m, [(1.0, 1.0, 1.0)] * S))
    assert span == 3 * m + S - 1  # (S - 1)(T_F + T_B - T_W) idle per stage
    one = max(u.end for u in ONE.simulate(S, m, [(1.0, 1.0, 1.0)] * S))
    assert one - 3 * m == 3 * (S - 1)
    assert ZB.idle_slots(S, m) == pytest.approx(ONE.idle_slots(S, m) / 3)


def test_with_fewer_microbatches_than_stages_the_drain_stays():
    # The last stage's B's cannot come before its forwards: S - m more thirds idle.
    for S, m in ((4, 1), (4, 2), (6, 3)):
        span = max(u.end for u in ZB.simulate(S, m, [(1.0, 1.0, 1.0)] * S))
        assert span == 3 * m + S - 1 + S - m
        assert ZB.idle_slots(S, m) < ONE.idle_slots(S, m)


@pytest.mark.parametrize(("S", "m"), [(4, 8), (4, 2), (3, 3), (6, 12)])
def test_it_holds_1f1bs_microbatches_between_forward_and_b(S, m):
    assert ZB.in_flight(S, m) == ONE.in_flight(S, m)
    for s, counts in enumerate(ZB.live_counts(S, m)):
        assert max(f for f, _ in counts) == min(m, S - s)
        # ... and no stage more than 1F1B's first stage, deferred W's included.
        assert max(f + w for f, w in counts) == min(m, S)
        # Stage s defers its W's by s microbatches: s + 1 live just after a B.
        assert max(w for _, w in counts) == min(m, s + 1)
    # 1F1B defers nothing.
    assert all(w == 0 for counts in ONE.live_counts(S, m) for _, w in counts)


def test_each_stage_runs_a_microbatchs_w_after_its_b_deferred_by_its_index():
    tasks = ZB.stage_tasks(3, 4)
    first, last = tasks[0], tasks[2]
    assert first[:5] == tuple(
        (ph, k, 0)
        for ph, k in [
            (Phase.FWD, 0),
            (Phase.FWD, 1),
            (Phase.FWD, 2),
            (Phase.BWD, 0),
            (Phase.WGT, 0),
        ]
    )
    w = [t.microbatch for t in last if t.phase is Phase.WGT]
    b = [t.microbatch for t in last if t.phase is Phase.BWD]
    assert w == b == [0, 1, 2, 3]
    # On the last stage two B's pass before the first W.
    assert [t.phase for t in last[:5]] == [Phase.FWD, Phase.BWD, Phase.FWD, Phase.BWD, Phase.FWD]


# ---- the split ---------------------------------------------------------------------------


def test_the_split_keeps_what_goes_upstream_in_b_and_weight_gradients_in_w():
    _, graph, groups = gpt()
    S, m = 2, 4
    plan = _plan(graph, groups, S, m)
    part = partition(graph, groups, [(st.op_start, st.op_stop) for st in plan.stages], m)
    split = split_backward(graph, part)
    assert split_backward(graph, split) == split  # once split, nothing more moves
    consumers = graph.consumers()
    accumulated = set(part.accumulated)
    for i, (before, after) in enumerate(zip(part.op_phase, split.op_phase, strict=True)):
        assert after is before or (before is Phase.BWD and after is Phase.WGT)
        s = split.op_stage[i]
        for t in graph.ops[i].outputs:
            readers = [c for c in consumers[t] if split.op_phase[c].per_microbatch]
            if after is Phase.WGT:  # W's values stay in its stage's W, or are weight gradients
                assert t in accumulated or all(
                    split.op_stage[c] == s and split.op_phase[c] is Phase.WGT for c in readers
                )
            if any(split.op_stage[c] != s for c in readers) and before is Phase.BWD:
                assert after is Phase.BWD  # the gradient sent upstream is B's
    # The last stage's B sends upstream and leaves its weight gradients' matmuls to W.
    last_w = [graph.ops[i].primitive for i in split.ops(S - 1, Phase.WGT)]
    assert split.ops(S - 1, Phase.BWD) and "dot_general" in last_w
    grads = [
        t for t in accumulated if graph.ops[graph.tensors[t].producer].primitive == "dot_general"
    ]
    assert grads and all(split.op_phase[graph.tensors[t].producer] is Phase.WGT for t in grads)
    # Nothing goes upstream of the first stage: its whole backward is W.
    assert not split.ops(0, Phase.BWD) and split.ops(0, Phase.WGT)


# ---- the runtime -------------------------------------------------------------------------


@pytest.mark.parametrize(("S", "m"), [(2, 2), (2, 4), (3, 4)])
def test_flax_model_zero_bubble_pipelines_compute_the_step(S, m):
    graph, groups = flax_graph()
    plan = _plan(graph, groups, S, m)
    args = flax_args()
    run = am.apply(flax_step, plan)
    assert_same(run(*args), jax.jit(flax_step)(*args), 1e-2)
    assert list(run.trace) == ZB.global_order(S, m)
    # B and W are programs of their own: every stage but the first runs both.
    kinds = {(p.stage, p.kind) for p in run.compile(*args)}
    assert {(s, Phase.WGT) for s in range(S)} <= kinds
    assert {(s, Phase.BWD) for s in range(1, S)} <= kinds


def test_the_model_times_the_runtimes_order_and_its_memory_is_what_the_runtime_holds():
    spec, graph, groups = gpt()
    S, m = 4, 4
    plan = _plan(graph, groups, S, m)
    args = spec.concrete_args(0)
    run = am.apply(spec.step_fn, plan)
    assert_same(run(*args), jax.jit(spec.step_fn)(*args), spec.config["learning_rate"])
    pc = estimate_pipeline(CostModel(graph, CPU), plan)
    for s in range(S):
        executed = [(u.phase, u.microbatch) for u in run.trace if u.stage == s]
        timed = sorted((t.start, t.phase, t.microbatch) for t in pc.ops if t.stage == s)
        assert executed == [x[1:] for x in timed]
    held = run.memory(*spec.abstract_args())
    for predicted, xla in zip(pc.stage_memory_bytes, held, strict=True):
        assert predicted == pytest.approx(xla, rel=0.15)
    # The same cuts under 1F1B: the first stage holds at least as much (W reads F's
    # residuals as they are, where 1F1B's B makes the cheap ones again: `_remat/_remake.py`);
    # later ones less, as their W's are not deferred; the split backward's B and W add up
    # to 1F1B's backward.
    one = estimate_pipeline(CostModel(graph, CPU), _plan(graph, groups, S, m, "1f1b"))
    assert pc.stage_memory_bytes[0] >= one.stage_memory_bytes[0]
    assert all(
        z > o for z, o in zip(pc.stage_memory_bytes[1:], one.stage_memory_bytes[1:], strict=True)
    )
    for (f, b, w), (f1, b1) in zip(pc.stage_times, one.stage_times, strict=True):
        assert f == pytest.approx(f1) and b + w == pytest.approx(b1) and w > 0


def test_deferring_w_shrinks_the_bubble_for_the_same_work():
    _, graph, groups = gpt()
    cm = CostModel(graph, FREE_LINKS)
    zb = estimate_pipeline(cm, _plan(graph, groups, 4, 8)).cost
    one = estimate_pipeline(cm, _plan(graph, groups, 4, 8, "1f1b")).cost
    assert zb.compute_s == pytest.approx(one.compute_s)
    assert zb.bubble_s < one.bubble_s and zb.step_time_s < one.step_time_s


def test_verify_holds_a_zero_bubble_plan_against_its_compiled_stages():
    graph, groups = flax_graph()
    plan = _plan(graph, groups, 2, 2)
    report = verify(flax_step, plan, *flax_args())
    assert report.collectives_match is True, report.summary()
    assert report.numerics_ok, report.summary()
    for predicted, xla in report.stage_memory_bytes:
        assert predicted == pytest.approx(xla, rel=0.15), report.summary()


# ---- recipes and the command line --------------------------------------------------------

A100_8 = Cluster.preset("a100", devices=8)


def test_a_recipe_runs_zb_h1():
    spec, _ = small()
    args = spec.abstract_args()
    recipe = am.Recipe(pp=4, dp=2, microbatches=4, schedule="zb-h1")
    plan = am.plan_recipe(spec.step_fn, *args, recipe=recipe, cluster=A100_8)
    assert plan.schedule == "zb-h1" and plan.predicted.feasible
    one = am.plan_recipe(
        spec.step_fn, *args, recipe=dataclasses.replace(recipe, schedule="1f1b"), cluster=A100_8
    )
    assert plan.predicted.bubble_s < one.predicted.bubble_s


ZB_BAD = [
    (dict(remat="full"), "pipeline schedule 'zb-h1' splits each backward into B and W programs"),
    (dict(remat="selective"), "which recomputation does not run yet; use remat none with it"),
    (dict(virtual_stages=2), "pipeline schedule 'zb-h1' runs one model chunk per device, not 2"),
]


@pytest.mark.parametrize(("fields", "message"), ZB_BAD)
def test_a_recipe_zb_h1_cannot_run_is_one_line(fields, message):
    spec, _ = small()
    recipe = am.Recipe(**{**dict(pp=4, dp=2, microbatches=4, schedule="zb-h1"), **fields})
    with pytest.raises(am.PlanError, match=re.escape(message)) as err:
        am.plan_recipe(spec.step_fn, *spec.abstract_args(), recipe=recipe, cluster=A100_8)
    assert "\n" not in str(err.value)


def test_the_dqn_pricer_refuses_a_split_backward_base_in_one_line():
    # The DQN reaches ZB-H1 as an action of a 1F1B search (its remat actions assume 1F1B).
    _, graph = small()
    with pytest.raises(am.PlanError, match=r"^the DQN's pipeline search chooses schedule") as e:
        PipelinePricer(CostModel(graph, A100_8), "zb-h1")
    assert "\n" not in str(e.value)


def test_estimate_takes_the_zero_bubble_schedule():
    sets = [arg for k, v in SMALL.items() for arg in ("--set", f"{k}={v}")]
    base = ["estimate", "--model", "gpt-1.3b", *sets, "--devices", "8", "--pp", "4", "--dp", "2"]
    base += ["--microbatches", "4", "--schedule", "zb-h1"]
    result = CliRunner().invoke(app, [*base, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["plan"]["schedule"] == "zb-h1" and data["feasible"] and data["bubble_s"] > 0
    bad = CliRunner().invoke(app, [*base, "--remat", "full"])
    assert bad.exit_code == 2 and "splits each backward into B and W" in bad.output
    assert "Traceback" not in bad.output
