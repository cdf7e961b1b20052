"""The default searcher ("auto"): the best feasible plan of the widest space, and an
infeasible answer that says what was proved."""

from __future__ import annotations

import dataclasses
import itertools
import math
import time

import jax
import pytest

import automap as am
import automap._search._classic as classic
from automap._graph import Role
from automap._groups import plan_from_assignment, sequence_parallel
from automap._search import (
    OPS_PER_SECOND,
    VARIANT_WORK,
    OneStagePolish,
    Problem,
    Work,
    leanest_point,
    one_stage_ilp,
    priced_experts,
    run_searcher,
    technique_options,
)
from automap._zoo import get_model

# A vocabulary small enough that the embedding does not outweigh the layers: there
# pipelines are leaner than any one-stage plan (with GPT-2's 50257 none is).
SMALL = dict(layers=4, hidden=64, heads=4, batch=16, seq=16, vocab=512)
A100x8 = am.Cluster.preset("a100", 8)


@pytest.fixture(scope="module")
def gpt():
    spec = get_model("gpt2-xl", **SMALL)
    return spec, am.expert_plans(spec.step_fn, *spec.abstract_args(), cluster=A100x8)


def _tight(spec, step=None) -> am.Cluster:
    """A device 10% under every one-stage plan the ILP searches (no recomputation)."""
    limit = leanest_one_stage(step or spec.step_fn, spec.abstract_args(), A100x8) * 0.9
    return dataclasses.replace(A100x8, hbm_bytes=limit / (1.0 - A100x8.memory_reserve))


def leanest_one_stage(step, args, cluster: am.Cluster) -> float:
    """The memory per device of the leanest one-stage plan without recomputation (the
    shard space), proved by the ILP on a device too small for any."""
    nothing = dataclasses.replace(cluster, hbm_bytes=1e3)
    leanest = leanest_point(Problem.build(step, args, nothing), "shard", 60.0, 60.0)
    assert leanest.complete and not leanest.fits
    return leanest.memory_bytes


def test_auto_is_the_default_and_no_worse_than_any_expert(gpt):
    spec, experts = gpt
    plan = am.plan(spec.step_fn, *spec.abstract_args(), cluster=A100x8, budget_s=20)
    assert plan.provenance.searcher == "auto" and plan.predicted.feasible
    best = min(p.predicted.step_time_s for p in experts.values() if p.predicted.feasible)
    assert plan.predicted.step_time_s <= best * (1 + 1e-9)


@pytest.mark.slow  # a 30 s-budget auto search and a DQN search
def test_auto_finds_pipelines_where_no_one_stage_plan_fits(gpt):
    spec, _ = gpt
    # A training loop's step, donating its state (one that donates nothing also holds its
    # new state at the update, on one stage and on each stage alike).
    step = jax.jit(spec.step_fn, donate_argnums=(0, 1))
    tight = _tight(spec, step)
    plan = am.plan(step, *spec.abstract_args(), cluster=tight, budget_s=30)
    assert plan.predicted.feasible and plan.predicted.memory_bytes <= tight.memory_limit
    assert plan.pipelined or plan.remat  # one stage as the ILP searches it cannot fit
    # The DQN on the shard task cannot help, and says so (proved by the ILP), instead of
    # asking for a larger budget.
    with pytest.raises(am.InfeasibleError, match="no one-stage plan fits") as e:
        am.plan(step, *spec.abstract_args(), cluster=tight, searcher="dqn", budget_s=2)
    assert e.value.proved and "larger budget" not in str(e.value)
    assert "--searcher auto" in str(e.value)


@pytest.mark.slow  # the widest search, to its proof
def test_nothing_fits_says_what_was_proved_and_the_leanest_need(gpt):
    spec, experts = gpt
    # Under a tenth of the leanest plan of all: no split, stage count or recomputation fits.
    least = min(p.predicted.memory_bytes for p in experts.values())
    tiny = dataclasses.replace(A100x8, hbm_bytes=least / 10 / (1.0 - A100x8.memory_reserve))
    # A budget whose pipeline half covers all 30 of the DP's points (750k of work; 60 s
    # covered 22 of them, and the search once said complete anyway).
    with pytest.raises(am.InfeasibleError) as e:
        am.plan(spec.step_fn, *spec.abstract_args(), cluster=tiny, budget_s=100)
    text = str(e.value)
    assert e.value.proved and "no plan of this space fits" in text
    assert "leanest plan" in text and " per device" in text and "larger budget" not in text
    # In the unit that shows it (a small model's megabytes read "0.0 GB" before).
    assert f"the limit is {tiny.memory_limit / 1e6:.1f} MB." in text


def test_a_budget_that_runs_out_says_so(gpt, monkeypatch):
    spec, _ = gpt
    # The sampling searcher sees every point as over memory (its evaluations patched), but
    # plans of the space do fit, as the ILP (which reads the cost tables) finds.
    real = classic.evaluate

    def over_memory(space, point):
        return dataclasses.replace(real(space, point), feasible=False)

    monkeypatch.setattr(classic, "evaluate", over_memory)
    with pytest.raises(am.InfeasibleError) as e:
        am.plan(spec.step_fn, *spec.abstract_args(), cluster=A100x8, searcher="random", budget_s=1)
    assert not e.value.proved and "the budget ran out" in str(e.value)
    assert "the ilp searcher finds one" in str(e.value)


def _dp_finds_nothing(monkeypatch):
    """The stage DP, complete, with no plan: what it answers when none of the points it
    tries fits (ZeRO and recomputation on the time-optimal and Megatron intra-stage
    plans), which is no proof that no pipeline does."""
    monkeypatch.setattr(
        "automap._search._registry.search_dp",
        lambda problem, budget, on_point=None: (None, {"complete": True, "points": 30}),
    )


def _with_limit(limit: float) -> am.Cluster:
    return dataclasses.replace(A100x8, hbm_bytes=limit / (1.0 - A100x8.memory_reserve))


def test_a_complete_dp_with_nothing_falls_back_to_the_experts(gpt, monkeypatch):
    """A pipeline search whose DP found nothing hands back the best pipelined expert plan
    that fits, named so, rather than saying no pipeline fits (it once did, as proved)."""
    spec, _ = gpt
    _dp_finds_nothing(monkeypatch)
    problem = Problem.build(spec.step_fn, spec.abstract_args(), A100x8)
    plan = run_searcher(problem, "dp", 10.0, 0, task="pipeline")
    pipelined = [p for p in priced_experts(problem, pipelines=True).values() if p.pipelined]
    best = min(p.predicted.step_time_s for p in pipelined if p.predicted.feasible)
    assert plan.pipelined and plan.predicted.feasible and plan.name.startswith("dp found none")
    assert plan.predicted.step_time_s == pytest.approx(best, rel=1e-12)
    assert "found no plan" in plan.decisions["fallback"]


def test_nothing_found_is_said_proved_only_where_the_state_alone_overflows(gpt, monkeypatch):
    """No expert pipeline fits either: under the memory of the parameters and optimizer
    state spread over every device, no plan can (proved); above it, with every expert
    over, the answer is that none was found, and a leaner pipeline may exist."""
    spec, _ = gpt
    _dp_finds_nothing(monkeypatch)
    graph = Problem.build(spec.step_fn, spec.abstract_args(), A100x8).graph
    state = (graph.role_bytes(Role.PARAM) + graph.role_bytes(Role.OPT_STATE)) / A100x8.devices
    for limit, proved in ((state * 0.9, True), (state * 2.0, False)):
        problem = Problem.build(spec.step_fn, spec.abstract_args(), _with_limit(limit))
        pipelined = priced_experts(problem, pipelines=True).values()
        assert not any(p.predicted.feasible for p in pipelined if p.pipelined)
        with pytest.raises(am.InfeasibleError) as e:
            run_searcher(problem, "dp", 10.0, 0, task="pipeline")
        assert e.value.proved == proved, str(e.value)
        text = str(e.value)
        assert ("no plan of this space fits" in text) == proved
        assert ("no plan found" in text) == (not proved) and "larger budget" not in text


# A Llama whose one-stage plans fit on `_tight`'s device only by recomputing: there the
# fastest plan is one stage, ZeRO over 8 with a recomputation policy (0.11 ms predicted,
# where the stage DP's best pipeline is 0.45 ms), which the ILP's space (no recomputation)
# does not hold: the planner returned a pipeline before the one-stage polish.
LLAMA = dict(layers=4, hidden=128, heads=4, kv_heads=4, ffn=256, seq=64, batch=16, vocab=128)


@pytest.fixture(scope="module")
def llama_tight():
    spec = get_model("llama", **LLAMA)
    tight = _tight(spec)  # 10% under every one-stage plan without recomputation
    plan = am.plan(spec.step_fn, *spec.abstract_args(), cluster=tight, budget_s=10)
    return spec, tight, plan


def test_one_stage_plans_recompute_where_that_is_fastest_and_fits(llama_tight):
    spec, tight, plan = llama_tight
    args = spec.abstract_args()
    assert not plan.pipelined and plan.remat and plan.decisions["one_stage_variants"] > 0
    assert plan.predicted.feasible and plan.predicted.memory_bytes <= tight.memory_limit
    # Priced as the cost model prices the plan itself.
    again = am.estimate(spec.step_fn, *args, plan=plan, cluster=tight)
    assert plan.predicted.step_time_s == pytest.approx(again.step_time_s, rel=1e-12)
    assert plan.predicted.memory_bytes == pytest.approx(again.memory_bytes, rel=1e-12)
    # No slower than any hand-written one-stage configuration that fits: data x tensor
    # parallel, ZeRO-2 or 3, each recomputation, the stream split where tp > 1.
    fitting = []
    for dp, tp, zero, remat in itertools.product(
        (8, 4), (1, 2), (2, 3), ("none", "selective", "projections", "full")
    ):
        for sp in {False, tp > 1}:
            if dp * tp != 8:
                continue
            recipe = am.Recipe(dp=dp, tp=tp, zero=zero, remat=remat, sequence_parallel=sp)
            priced = am.plan_recipe(spec.step_fn, *args, recipe=recipe, cluster=tight).predicted
            if priced.feasible:
                fitting.append(priced.step_time_s)
    assert fitting and plan.predicted.step_time_s <= min(fitting) * (1 + 1e-9)


@pytest.mark.slow  # compiled and run on 8 devices
def test_the_recomputing_one_stage_plan_runs_with_the_unsharded_numbers(llama_tight):
    spec, _, plan = llama_tight
    report = am.verify(spec.step_fn, plan, *spec.concrete_args(0))
    assert report.numerics_ok is True, report.summary()
    assert report.collectives_match is True, report.mismatches


def _every_variant(problem, points) -> tuple[float, int]:
    """The fastest feasible of every variant of every point (each ZeRO stage the walk
    tries, each of `technique_options`), priced one by one, and how many there are: what
    the one-stage walk's pruning must not lose."""
    graph, groups, model = problem.graph, problem.groups, problem.cost_model
    best, count = math.inf, 0
    for point in points:
        zeros = [point.zero_stage]
        if point.zero_stage == 2 and point.mesh.get("data", 1) > 1:
            zeros.append(3)  # ZeRO-3 on a ZeRO-2 point
        for zero in zeros:
            base = plan_from_assignment(
                graph, groups, dict(point.mesh), dict(point.assignment), zero_stage=zero
            )
            for sp, (remat, policy) in technique_options(model, base):
                count += 1
                plan = dataclasses.replace(base, remat=remat, remat_policy=policy)
                try:
                    plan = sequence_parallel(graph, groups, plan, "model") if sp else plan
                except am.PlanError:  # the sequence does not divide
                    continue
                cost = model.estimate(plan)
                if cost.feasible:
                    best = min(best, cost.step_time_s)
    return best, count


def test_the_one_stage_walk_loses_nothing_and_stops_where_its_work_ends(llama_tight, monkeypatch):
    spec, tight, plan = llama_tight
    problem = Problem.build(spec.step_fn, spec.abstract_args(), tight)
    _, _, points = one_stage_ilp(problem, 10.0)
    assert points and not any(p.cost.feasible for p in points)  # none fits as the ILP prices
    whole = OneStagePolish(problem.cost_model, Work(math.inf))
    best = whole.run(points)
    # Its pruning (the leanest variant's fit, the best so far) keeps the fastest that fits
    # of every variant of every point, in fewer variants priced.
    fastest, variants = _every_variant(problem, points)
    assert best.predicted.step_time_s == pytest.approx(fastest, rel=1e-12)
    assert 0 < whole.priced < variants
    assert plan.predicted.step_time_s == pytest.approx(best.predicted.step_time_s, rel=1e-12)
    # A budget that affords part of it stops after as many variants as it pays for, and
    # the same on a machine three times slower (the count, not the clock, stops it).
    each = VARIANT_WORK * len(problem.graph.ops) / OPS_PER_SECOND
    monkeypatch.setattr("automap._search._work.SAFETY", 1e6)

    def part():
        walk = OneStagePolish(problem.cost_model, Work(2.5 * each))
        found = walk.run(points)
        return walk.priced, found and found.to_dict()

    normal = part()
    real = time.perf_counter
    origin = real()
    monkeypatch.setattr(time, "perf_counter", lambda: origin + 3.0 * (real() - origin))
    assert part() == normal and normal[0] == 3
