"""The stage DP and the DQN choose ZB-H1 (issue 26 item 3): the DP's tables time F, B and
W apart and its objective reads the schedule's bubble, so it cuts stages for ZB-H1 and
weighs it against 1F1B at every point; the DQN's pipeline task has ZB-H1 as an action of
its chunks decision (recomputation none). Priced only, on the bubble-bound GPT of
test_search_techniques (eight wide layers, a batch of 8 on 8 A100s); the schedules'
runtime checks are test_zero_bubble's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import automap as am
from automap._cost import CostModel, deferred_weight_bytes, estimate_pipeline, op_costs
from automap._pipeline import (
    Phase,
    cut_candidates,
    partition,
    pipeline_plan,
    pipeline_schedule,
    schedule_names,
    split_backward,
)
from automap._search import (
    SPLIT_ACTION,
    PipelinePricer,
    PipelineProcess,
    Problem,
    baseline_time,
    fill_weight,
    make_pipeline_process,
    optimal_cuts,
    search_dp,
    segment_tables,
)
from automap._space import Point, ShardSpace, axis_assignment, block_groups
from automap._zoo import get_model

A100 = am.Cluster.preset("a100", 8)
BUBBLE = dict(layers=8, hidden=2048, heads=16, batch=8, seq=1024)
ZB, ONE = pipeline_schedule("zb-h1"), pipeline_schedule("1f1b")


@pytest.fixture(scope="module")
def bubble():
    spec = get_model("gpt2-xl", **BUBBLE)
    return spec, Problem.build(spec.step_fn, spec.abstract_args(), A100)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
def test_the_fill_weight_makes_equal_stages_cost_the_schedules_simulated_step(name):
    # (M - 1) tau + kappa S tau with tau one unit per phase: the step `simulate` runs.
    schedule = pipeline_schedule(name)
    assert name in schedule_names()
    for S in (2, 3, 4, 6):
        for m in (1, 2, S, 2 * S, 4 * S):
            P = len(schedule.phases)
            units = schedule.simulate(S, m, [(1.0,) * P] * S)
            step = max(u.end for u in units)
            assert (m - 1) * P + fill_weight(schedule, S, m) * S * P == pytest.approx(step)


def _point(pb, S: int, tp: int, m: int):
    """(fine partition, candidates, op costs, Point, assignment) of S stages of tp-way
    Megatron on the stage's devices."""
    graph, groups = pb.graph, pb.groups
    cands = cut_candidates(graph, groups)
    bounds = list(zip((0, *cands), (*cands, len(graph.ops)), strict=True))
    fine = partition(graph, groups, bounds, 1)
    mesh = {"model": tp}
    assignment = axis_assignment(block_groups(groups), "model", tp)
    oc = op_costs(pb.cost_model, assignment, mesh)
    return fine, cands, oc, Point(S, mesh, m, "test"), assignment


def test_the_tables_split_each_backward_as_the_runtime_does(bubble):
    """Per segment, ZB-H1's F + B + W is 1F1B's F + whole backward (the same work, split),
    the layers' segments hold both B and W (the first layer's sends its gradient to the
    embedding only, which has no B), and in a stage table the first stage's B is nothing:
    it sends no gradient upstream (`split_backward`)."""
    _, pb = bubble
    fine, _, oc, _, _ = _point(pb, 4, 2, 8)
    whole = segment_tables(pb.cost_model, fine, oc, 8, ONE, 4)
    split = segment_tables(pb.cost_model, fine, oc, 8, ZB, 4)
    assert whole.phases == (Phase.FWD, Phase.BWD)
    assert split.phases == (Phase.FWD, Phase.BWD, Phase.WGT)
    np.testing.assert_allclose(split.phase_s[:, 0], whole.phase_s[:, 0])
    np.testing.assert_allclose(split.time, whole.time, rtol=1e-6)
    assert (split.phase_s[1:-1, 2] > 0).all() and (split.phase_s[2:-1, 1] > 0).all()
    stage = split.stage_phase_s(4)
    placed = np.triu(np.ones(stage.shape[1:3], dtype=bool))  # j >= i
    assert (stage[0][placed][:, 1] == 0).all() and (stage[:, placed] >= 0).all()
    np.testing.assert_allclose(stage.sum(-1), whole.stage_phase_s(4).sum(-1), rtol=1e-6)


def test_the_dp_cuts_stages_for_zb_h1(bubble):
    """Four stages of tp 2, 8 microbatches: the DP's cuts for ZB-H1 run ZB-H1 faster
    than 1F1B's cuts run it (whole pipeline model; measured 39.9 ms against 40.3)."""
    _, pb = bubble
    fine, cands, oc, point, assignment = _point(pb, 4, 2, 8)

    def priced(cuts):
        plan = pipeline_plan(pb.graph, pb.groups, cuts, point.stage_mesh, assignment, 8, "zb-h1")
        return estimate_pipeline(pb.cost_model, plan).cost

    for_zb = optimal_cuts(pb.cost_model, fine, cands, oc, point, ZB)
    for_one = optimal_cuts(pb.cost_model, fine, cands, oc, point, ONE)
    assert for_zb is not None and for_one is not None and len(for_zb) == 3
    assert priced(for_zb).feasible
    assert priced(for_zb).step_time_s <= priced(for_one).step_time_s


def _ranges(cuts, n_segments: int):
    """(first, last) segment of each stage of candidate-index `cuts`."""
    return list(zip((0, *(c + 1 for c in cuts)), (*cuts, n_segments - 1), strict=True))


@pytest.mark.parametrize(
    "S, m, cuts",
    # (0, ...): the embedding alone on the first stage, whose gradient the next stage
    # makes: the second stage then sends nothing upstream and runs no B, all W.
    [(4, 8, (0, 9, 13)), (4, 8, (2, 7, 12)), (4, 2, (5, 10, 15)), (3, 5, (1, 10))],
)
def test_the_tables_hold_and_time_each_stage_as_the_pipeline_model_does(bubble, S, m, cuts):
    """On a ZB-H1 stage of any layer range the DP's tables hold, beyond the in-flight
    microbatches, what its deferred W's hold as the whole model counts it on that stage
    (`deferred_weight_bytes`: they once held nothing there, so the DP could keep a
    partition that does not fit as its best), and time F, B and W as it times them (a
    stage after the embedding alone was timed with a B it does not run)."""
    _, pb = bubble
    fine, cands, oc, _, assignment = _point(pb, S, 2, m)
    tables = segment_tables(pb.cost_model, fine, oc, m, ZB, S)
    extra, per_phase = tables.deferred_memory(S), tables.stage_phase_s(S)
    plan = pipeline_plan(
        pb.graph, pb.groups, tuple(cands[c] for c in cuts), {"model": 2}, assignment, m, "zb-h1"
    )
    bounds = [(st.op_start, st.op_stop) for st in plan.stages]
    split = split_backward(pb.graph, partition(pb.graph, pb.groups, bounds, m))
    held = deferred_weight_bytes(pb.graph, split, oc.layouts.inv, pb.cost_model.residuals, ZB, m)
    priced = estimate_pipeline(pb.cost_model, plan)
    assert max(held) > 0
    for s, (i, j) in enumerate(_ranges(cuts, fine.n_stages)):
        assert extra[s, i, j] == pytest.approx(held[s], rel=1e-9, abs=1.0)
        np.testing.assert_allclose(per_phase[s, i, j], priced.stage_times[s], rtol=1e-6)


def test_the_dps_zb_h1_partition_fits_where_the_whole_model_says_one_does(bubble):
    """Two stages of tp 4, 8 microbatches: under device limits from just below the
    leanest ZB-H1 partition's memory (by the whole model) to well above it, the DP finds
    a partition exactly where one fits, and the one it finds fits. Without the deferred
    W's in its tables it kept a partition 8% over the limit where none fits."""
    _, pb = bubble
    fine, cands, oc, point, assignment = _point(pb, 2, 4, 8)
    memory = {}
    for c in range(len(cands)):
        plan = pipeline_plan(pb.graph, pb.groups, (cands[c],), {"model": 4}, assignment, 8, "zb-h1")
        memory[cands[c]] = estimate_pipeline(pb.cost_model, plan).cost.memory_bytes
    least = min(memory.values())
    for scale in (0.97, 1.25, 2.0):
        limit = least * scale
        device = dataclasses.replace(A100, hbm_bytes=limit / (1.0 - A100.memory_reserve))
        model = CostModel(pb.graph, device, pb.groups)
        cuts = optimal_cuts(model, fine, cands, oc, point, ZB)
        assert (cuts is None) == (scale < 1), scale
        assert cuts is None or memory[cuts[0]] <= limit


def _without_polish(monkeypatch):
    monkeypatch.setattr(
        "automap._search._dp.polish_techniques", lambda model, plan, aligned, work=None: plan
    )


def test_the_stage_dp_chooses_zb_h1_where_the_bubble_matters(bubble, monkeypatch):
    """The DP alone (no techniques polish): its plan is ZB-H1, priced exactly as
    `am.estimate` prices the same plan, and faster than the best 1F1B plan of the same
    search with ZB-H1 taken away."""
    spec, pb = bubble
    _without_polish(monkeypatch)
    plan, stats = search_dp(pb, budget_s=60)
    assert stats["complete"] and plan.schedule == "zb-h1" and not plan.remat
    assert plan.virtual_stages == 1 and len(plan.stages) == plan.mesh["pipe"] >= 2
    assert len(plan.decisions["stage_times"][0]) == 3  # (F, B, W) per stage, for the report
    again = am.estimate(spec.step_fn, *spec.abstract_args(), plan=plan, cluster=A100)
    assert again.feasible and again.step_time_s == pytest.approx(
        plan.predicted.step_time_s, rel=1e-9
    )
    assert again.memory_bytes == pytest.approx(plan.predicted.memory_bytes, rel=1e-9)
    monkeypatch.setattr(type(pipeline_schedule("1f1b")), "split_as", None)  # no ZB-H1
    one, _ = search_dp(pb, budget_s=60)
    assert one.schedule == "1f1b"
    assert plan.predicted.step_time_s < one.predicted.step_time_s


def test_a_zb_h1_search_cuts_for_zb_h1_only(bubble, monkeypatch):
    # Asked for ZB-H1, the DP cuts every point for it (no recomputation to fall back on).
    _, pb = bubble
    _without_polish(monkeypatch)
    plan, stats = search_dp(pb, budget_s=60, schedule="zb-h1")
    assert stats["points"] > 0 and plan.schedule == "zb-h1" and not plan.remat


def _pipeline_process(pb) -> PipelineProcess:
    space = ShardSpace(pb.graph, pb.groups, pb.cluster, pb.cost_model)
    return PipelineProcess(PipelinePricer(pb.cost_model), baseline_time(space), (2, 4))


def _play_to_chunks(process, remat: int) -> None:
    """Four stages, the most microbatches, `remat`; sequence parallelism off, up to the
    chunks decision."""
    process.reset()
    process.step(1)  # S = 4
    process.step(int(np.flatnonzero(process.action_mask())[-1]))
    while process.phase_name() != "chunks":
        process.step(remat if process.phase_name() == "remat" else 0)


def test_the_dqn_reaches_zb_h1_as_an_action_priced_as_its_plan(bubble):
    """The pipeline task's chunks decision offers ZB-H1 where recomputation is none (and
    masks it otherwise); the agent then cuts as for one chunk, and the episode's price is
    the plan's, which runs ZB-H1 and beats the same decisions in 1F1B."""
    _, pb = bubble
    process = _pipeline_process(pb)
    _play_to_chunks(process, remat=1)  # selective recomputation: no split backward
    assert not process.action_mask()[SPLIT_ACTION]
    prices = {}
    for action in (0, SPLIT_ACTION):
        _play_to_chunks(process, remat=0)
        assert process.action_mask()[SPLIT_ACTION]
        process.step(action)
        assert process.phase_name() == "cut"
        while not process.done():
            process.step(2)  # the balanced cut
        time_s, fits, _ = process.result()
        plan = process.to_plan(process.decisions())
        assert plan.schedule == ("zb-h1" if action else "1f1b") and fits
        assert plan.predicted.step_time_s == pytest.approx(time_s, rel=1e-9)
        again = estimate_pipeline(pb.cost_model, dataclasses.replace(plan, predicted=None))
        assert again.cost.step_time_s == pytest.approx(time_s, rel=1e-9)
        prices[action] = time_s
    assert prices[SPLIT_ACTION] < prices[0]


def test_the_hybrid_task_reaches_zb_h1_with_the_dps_cuts_for_it(bubble):
    """The hybrid task's chunks decision offers ZB-H1 too; its cuts are then the stage
    DP's for ZB-H1, and the plan it hands back (those cuts polished against the whole
    model) runs ZB-H1 at most the episode's price, priced as `estimate` prices it."""
    _, pb = bubble
    space = ShardSpace(pb.graph, pb.groups, pb.cluster, pb.cost_model)
    hybrid = make_pipeline_process(space, "hybrid", baseline_time(space))
    assignment = axis_assignment(block_groups(pb.groups), "model", 2)
    inner = hybrid.sub(4).decisions_for({"model": 2}, assignment, 0)
    assert inner is not None
    hybrid.reset()
    for a in (hybrid.stage_choices.index(4), *inner):
        hybrid.step(a)
    hybrid.step(int(np.flatnonzero(hybrid.action_mask())[-1]))  # the most microbatches
    while not hybrid.done():
        chunks = hybrid.phase_name() == "chunks"
        assert not chunks or hybrid.action_mask()[SPLIT_ACTION]
        hybrid.step(SPLIT_ACTION if chunks else 0)
    time_s, fits, _ = hybrid.result()
    plan = hybrid.to_plan(hybrid.decisions())
    assert fits and plan.schedule == "zb-h1" and len(plan.stages) == 4
    assert plan.predicted.step_time_s <= time_s * (1 + 1e-9)
    again = estimate_pipeline(pb.cost_model, dataclasses.replace(plan, predicted=None))
    assert again.cost.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
