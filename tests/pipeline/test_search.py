"""The dp searcher (hybrid space, exact stage cuts) and the pipeline expert plans."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import pytest

import automap as am
from automap._cost import estimate_pipeline, op_costs
from automap._errors import AutomapError
from automap._pipeline import cut_candidates, partition, pipeline_plan, pipeline_schedule
from automap._search import Problem, optimal_cuts, polish_cuts, search_dp
from automap._space import (
    Point,
    megatron_stage_counts,
    microbatch_counts,
    pipeline_experts,
    recipe_plan,
    stage_counts,
)
from automap._zoo import get_model
from test_auto import SMALL as SMALL_VOCAB
from test_auto import leanest_one_stage

from ._models import assert_same

SMALL = dict(layers=4, hidden=64, heads=4, batch=16, seq=16)


@pytest.fixture(scope="module")
def gpt():
    spec = get_model("gpt2-xl", **SMALL)
    return spec, Problem.build(spec.step_fn, spec.abstract_args(), am.Cluster.preset("a100", 8))


def test_microbatch_counts_divide_the_batch_over_data():
    assert microbatch_counts(16, 2, 2, True) == [2, 4, 8]
    assert microbatch_counts(16, 2, 4, False) == [1]
    assert microbatch_counts(8, 8, 4, True) == [1]  # nothing >= S divides: the largest


def test_stages_fill_whole_nodes_or_divide_one():
    # 280 GPUs in nodes of 8 (Korthikanti's 530B row): 2 or 4 stages would split a node;
    # 5 stages of 7 nodes or 35 of one node do not. A single partial node splits freely.
    assert stage_counts(280, 300, 8) == [5, 7, 35, 70, 140, 280]
    assert stage_counts(6, 10, 8) == [2, 3, 6]


def test_the_dp_plans_a_cluster_whose_halves_split_a_node():
    # 24 A100s (3 nodes): 2 stages of 12 devices would each hold a node and a half. The
    # search skips that stage count instead of failing on it ("12 devices do not fill
    # whole nodes of 8").
    spec = get_model("gpt2-xl", **SMALL)
    pb = Problem.build(spec.step_fn, spec.abstract_args(), am.Cluster.preset("a100", 24))
    plan, stats = search_dp(pb, budget_s=30)
    assert stats["points"] > 0 and plan is not None and plan.predicted.feasible
    assert all(len(s.devices) % 8 == 0 or 8 % len(s.devices) == 0 for s in plan.stages)


def test_dp_cuts_are_the_best_of_every_cut_set(gpt):
    """For one outer point, the DP's cuts, polished against the whole pipeline model, are
    as good as the best of every cut set, within 3% (the DP alone misses the once-per-step
    sends of the tied embedding, which dominate a model this narrow: its stage times tie
    between a nearly empty first stage and a nearly empty last one, and only those sends
    tell them apart, a ridge of worse cuts between them. Since gradients are reduced once
    per step the step is 2.4 times shorter and that blind spot 2.4% of it)."""
    _, pb = gpt
    graph, groups, model = pb.graph, pb.groups, pb.cost_model
    cands = cut_candidates(graph, groups)
    bounds = list(zip((0, *cands), (*cands, len(graph.ops)), strict=True))
    fine = partition(graph, groups, bounds, 1)
    mesh, assignment = {"data": 4}, {groups.batch_groups[0]: "data"}
    oc = op_costs(model, assignment, mesh)
    point = Point(stages=2, stage_mesh=mesh, microbatches=4, intra="test")
    cuts = optimal_cuts(model, fine, cands, oc, point, pipeline_schedule("1f1b"))

    def priced(cut_set):
        plan = pipeline_plan(graph, groups, cut_set, mesh, assignment, 4, "1f1b")
        return estimate_pipeline(model, plan).cost.step_time_s

    brute = min(priced(c) for c in itertools.combinations(cands, 1))
    assert cuts is not None and cuts[0] in cands
    plan = pipeline_plan(graph, groups, cuts, mesh, assignment, 4, "1f1b")
    plan = dataclasses.replace(plan, predicted=estimate_pipeline(model, plan).cost)
    polished = polish_cuts(model, plan, cands)
    assert polished.predicted.step_time_s <= plan.predicted.step_time_s
    assert priced(tuple(polished.decisions["cuts"])) == pytest.approx(
        polished.predicted.step_time_s
    )
    assert polished.predicted.step_time_s <= brute * 1.03


def test_search_dp_returns_a_priced_feasible_pipeline(gpt):
    _, pb = gpt
    plan, stats = search_dp(pb, budget_s=120)
    assert stats["complete"] and stats["points"] > 0
    assert plan is not None and len(plan.stages) >= 2 and plan.predicted.feasible
    again = estimate_pipeline(pb.cost_model, plan).cost
    assert again.step_time_s == pytest.approx(plan.predicted.step_time_s)
    assert plan.decisions["stage_times"] and set(plan.decisions["cuts"]) <= set(
        cut_candidates(pb.graph, pb.groups)
    )


def test_pipelines_make_a_model_fit_that_one_stage_cannot(gpt):
    """Under a memory limit below every one-stage plan without recomputation, the dp
    searcher's pipelines fit, and the expert pipelines are there too."""
    _, pb = gpt
    spec = get_model("gpt2-xl", **SMALL_VOCAB)
    # A training loop's step, donating its state: a step that donates nothing also holds
    # its new state at the update, on one stage and on each stage alike.
    step = jax.jit(spec.step_fn, donate_argnums=(0, 1))
    dp = am.expert_plans(step, *spec.abstract_args(), cluster=pb.cluster)
    piped = [p for p in dp.values() if len(p.stages) > 1]
    assert {"gpipe_uniform"} <= set(dp) and piped
    # Under the leanest one-stage plan as the ILP searches them (no recomputation:
    # megatron_3d's one-stage recipe recomputes, which only pipelines of the dp search do).
    limit = leanest_one_stage(step, spec.abstract_args(), pb.cluster) * 0.9
    tight = dataclasses.replace(pb.cluster, hbm_bytes=limit / (1.0 - pb.cluster.memory_reserve))
    assert tight.memory_limit == pytest.approx(limit)
    args = spec.abstract_args()
    piped = am.plan(step, *args, cluster=tight, searcher="dp", tasks=("pipeline",), budget_s=60)
    assert len(piped.stages) >= 2 and piped.predicted.feasible
    assert piped.predicted.memory_bytes <= limit
    # The hybrid search also tries one stage with recomputation (`_search/_one_stage.py`),
    # which here fits too and is faster: either way its answer fits.
    plan = am.plan(step, *args, cluster=tight, searcher="dp", budget_s=60)
    assert plan.predicted.feasible and plan.predicted.memory_bytes <= limit
    assert plan.pipelined or plan.remat


def test_megatron_3d_puts_tensor_parallel_inside_the_node():
    spec = get_model("gpt2-xl", **{**SMALL, "batch": 32})
    pb = Problem.build(spec.step_fn, spec.abstract_args(), am.Cluster.preset("a100", 16))
    plans = pipeline_experts(pb.graph, pb.groups, pb.cluster, pb.estimate)
    p = plans["megatron_3d"]
    # Megatron's recipe: tensor parallel inside the node (2 or 4: the powers of two up to
    # the node's 8 that divide the 4 heads, the faster), full recomputation, the fewest
    # stages that fit, microbatches of one sequence when staged.
    assert p.mesh["model"] in (2, 4) and p.remat and p.predicted.feasible
    assert p.sequence_parallel == "model"  # Megatron's 2022 recipe
    for tp in (2, 4):
        other = _megatron_3d_with(pb, tp)
        assert other is None or p.predicted.step_time_s <= other.predicted.step_time_s
    assert p.mesh.get("pipe", 1) == max(1, len(p.stages))
    if p.pipelined:
        assert p.microbatches == 32 // p.mesh.get("data", 1)


def test_megatron_3d_tries_the_node_aligned_stage_counts_not_only_powers_of_two():
    # Korthikanti's 530B row: 280 A100s at tp 8 leave 35 tp groups, which no power of two
    # but 1 divides; the recipe's stage counts are the pipelined space's that do.
    assert megatron_stage_counts(280, 8, 8, 104) == [1, 5, 7, 35]
    assert megatron_stage_counts(280, 4, 8, 104) == [1, 5, 7, 35, 70]
    assert megatron_stage_counts(24, 8, 8, 5) == [1, 3]
    assert megatron_stage_counts(12, 8, 8, 5) == []  # 8 does not divide 12


def test_megatron_3d_pipelines_a_cluster_whose_tp_groups_are_no_power_of_two():
    # 24 A100s (3 nodes of 8), six layers, memory for about a twelfth of the stored state:
    # one stage does not fit at any tp, and the node-aligned pipelines are 3, 6, 12 or
    # 24 stages. Powers of two alone gave none that fits (2 stages of a node and a half).
    spec = get_model("gpt2-xl", layers=6, hidden=128, heads=8, batch=24, seq=16, vocab=128)
    pb = Problem.build(spec.step_fn, spec.abstract_args(), am.Cluster.preset("a100", 24))
    state = 2 * pb.graph.role_bytes(am.Role.PARAM) + pb.graph.role_bytes(am.Role.OPT_STATE)
    limit = 0.08 * state
    tight = dataclasses.replace(pb.cluster, hbm_bytes=limit / (1.0 - pb.cluster.memory_reserve))
    estimate = Problem.build(spec.step_fn, spec.abstract_args(), tight).estimate
    plan = pipeline_experts(pb.graph, pb.groups, tight, estimate)["megatron_3d"]
    assert plan.predicted.feasible and plan.predicted.memory_bytes <= tight.memory_limit
    pipe = plan.mesh["pipe"]
    assert pipe in (3, 6, 12) and len(plan.stages) == pipe
    assert all(8 % len(s.devices) == 0 or len(s.devices) % 8 == 0 for s in plan.stages)


def test_gpipe_prices_only_the_stage_counts_whose_state_may_fit(gpt):
    # GPipe splits the stored state over its stages alone (data parallel inside): a count
    # whose share of it is over the memory limit cannot fit and is not priced; where no
    # count may fit, only the most stages are priced, the leanest by that floor.
    spec, pb = gpt
    state = 2 * pb.graph.role_bytes(am.Role.PARAM) + pb.graph.role_bytes(am.Role.OPT_STATE)
    priced = []

    def counting(cluster):
        estimate = Problem.build(spec.step_fn, spec.abstract_args(), cluster).estimate

        def price(plan):
            if plan.name == "gpipe_uniform":  # the megatron_3d expert is priced too
                priced.append(len(plan.stages))
            return estimate(plan)

        return price

    def limited(limit):
        return dataclasses.replace(pb.cluster, hbm_bytes=limit / (1.0 - pb.cluster.memory_reserve))

    counts = [
        s for s in stage_counts(8, len(cut_candidates(pb.graph, pb.groups)), 8) if s in (2, 4, 8)
    ]
    assert len(counts) >= 2
    none_may = limited(0.9 * state / counts[-1])
    plan = pipeline_experts(pb.graph, pb.groups, none_may, counting(none_may))["gpipe_uniform"]
    assert priced == [counts[-1]] and not plan.predicted.feasible
    priced.clear()
    # Room for the state over the last two counts: the first is not priced.
    some_may = limited(1.01 * state / counts[-2])
    pipeline_experts(pb.graph, pb.groups, some_may, counting(some_may))
    assert counts[0] not in priced and priced[0] == counts[-2]


def test_one_stage_searchers_refuse_the_pipeline_task(gpt):
    spec, pb = gpt
    with pytest.raises(AutomapError, match="searcher='dp'"):
        am.plan(
            spec.step_fn,
            *spec.abstract_args(),
            cluster=pb.cluster,
            searcher="random",
            tasks=("pipeline",),
        )


@pytest.mark.slow  # a searched pipeline compiled and run
def test_a_dp_plan_runs_and_computes_the_same_numbers():
    """Plans that really run: the dp searcher's pipeline on the 8 CPU devices."""
    spec = get_model("gpt2-xl", layers=2, hidden=32, heads=4, batch=8, seq=8, dtype="float32")
    cluster = am.Cluster.preset("cpu", 8)
    plan = am.plan(
        spec.step_fn, *spec.abstract_args(), cluster=cluster, searcher="dp", tasks=("pipeline",)
    )
    assert len(plan.stages) >= 2
    args = spec.concrete_args(0)
    got = am.apply(spec.step_fn, plan)(*args)
    want = spec.step_fn(*args)
    assert_same(got, want, spec.config["learning_rate"])


def test_ctrl_c_keeps_the_best_pipeline_so_far(gpt, monkeypatch):
    """Deterministic Ctrl-C: the third outer point raises KeyboardInterrupt."""
    import automap._search._dp as search_module

    spec, pb = gpt
    real, calls = search_module._solve_point, [0]

    def solve_point(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(search_module, "_solve_point", solve_point)
    plan = am.plan(
        spec.step_fn,
        *spec.abstract_args(),
        cluster=pb.cluster,
        searcher="dp",
        tasks=("pipeline",),
        budget_s=60,
    )
    assert plan.decisions["interrupted"] and len(plan.stages) >= 2
    assert plan.predicted.feasible
    calls[0] = 0
    monkeypatch.setattr(
        search_module, "_solve_point", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt)
    )
    with pytest.raises(KeyboardInterrupt):  # nothing found yet: Ctrl-C goes through
        search_dp(pb, budget_s=60)


def test_ctrl_c_during_the_ilp_keeps_its_best_point(monkeypatch):
    import automap._search._shard_ilp as ilp_module
    from automap._search import search_ilp
    from automap._space import ShardSpace

    spec = get_model("gpt2-xl", **SMALL)
    pb = Problem.build(spec.step_fn, spec.abstract_args(), am.Cluster.preset("a100", 8))
    space = ShardSpace(pb.graph, pb.groups, pb.cluster, pb.cost_model)
    real, calls = ilp_module.solve_ilp, [0]

    def solve(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(ilp_module, "solve_ilp", solve)
    point, stats = search_ilp(space)
    assert point is not None and stats["interrupted"] and not stats["optimal"]


@pytest.mark.slow  # expert pipelines compiled and run
def test_the_pipeline_experts_apply_with_the_same_numbers():
    """Every expert plan applies through am.apply and passes the numerics check:
    gpipe_uniform too, now that pipelines run."""
    spec = get_model("gpt2-xl", layers=2, hidden=32, heads=4, batch=8, seq=8, dtype="float32")
    cluster = am.Cluster.preset("cpu", 8)
    plans = am.expert_plans(spec.step_fn, *spec.abstract_args(), cluster=cluster)
    plan = plans["gpipe_uniform"]
    assert len(plan.stages) >= 2
    args = spec.concrete_args(0)
    got = am.apply(spec.step_fn, plan)(*args)
    assert_same(got, spec.step_fn(*args), spec.config["learning_rate"])


def test_a_dp_plan_survives_a_round_trip_through_json(gpt, tmp_path):
    _, pb = gpt
    plan, _ = search_dp(pb, budget_s=30)
    loaded = am.Plan.load(plan.save(tmp_path / "plan.json"))
    assert loaded.stages == plan.stages and loaded.mesh == plan.mesh
    assert loaded.predicted.feasible is True
    assert loaded.predicted.step_time_s == pytest.approx(plan.predicted.step_time_s)
    assert estimate_pipeline(pb.cost_model, loaded).cost.step_time_s == pytest.approx(
        plan.predicted.step_time_s
    )


def _megatron_3d_with(pb, tp):
    """Megatron's recipe at one tensor parallel size: the fewest stages that fit."""
    for pp in (1, 2, 4, 8):
        dp = pb.cluster.devices // (tp * pp)
        recipe = am.Recipe(
            tp=tp, pp=pp, dp=dp, microbatch_size=1, remat="full", sequence_parallel=True
        )
        try:
            plan = pb.priced(recipe_plan(pb.graph, pb.groups, pb.cluster, recipe))
        except am.PlanError:
            continue
        if plan.predicted.feasible:
            return plan
    return None
