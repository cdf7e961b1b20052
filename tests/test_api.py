"""The public API end to end on small programs: plan, estimate, expert_plans, apply."""

import jax
import pytest

import automap as am
from automap._verify import compare_outputs
from automap._zoo import get_model

CPU8 = am.Cluster.preset("cpu", devices=8)


@pytest.fixture(scope="module")
def mlp():
    spec = get_model("mlp", batch=16, dtype="float32")
    return spec.step_fn, spec.concrete_args(0)


def _same(a, b):
    ok, err, worst = compare_outputs(a, b)
    assert ok, f"outputs differ: max abs error {err:.2e} at {worst}"


def test_expert_plans_cover_the_contract(mlp):
    step_fn, args = mlp
    plans = am.expert_plans(step_fn, *args, cluster=CPU8)
    assert {"data_parallel", "zero1", "zero2", "zero3", "megatron", "megatron_dp"} <= set(plans)
    for name, plan in plans.items():
        assert plan.name == name
        assert plan.predicted is not None and plan.predicted.step_time_s > 0
        assert plan.devices == 8
    assert plans["data_parallel"].mesh == {"data": 8}
    assert plans["megatron"].mesh == {"model": 8}
    assert set(plans["megatron_dp"].mesh) == {"data", "model"}
    assert plans["zero3"].zero_stage == 3


@pytest.mark.slow  # expert plans compiled and run
@pytest.mark.parametrize("name", ["data_parallel", "megatron", "megatron_dp", "zero3"])
def test_expert_plans_compute_what_the_unsharded_step_computes(mlp, name):
    step_fn, args = mlp
    plan = am.expert_plans(step_fn, *args, cluster=CPU8)[name]
    _same(am.apply(step_fn, plan)(*args), jax.jit(step_fn)(*args))


def test_plan_returns_the_best_feasible_expert_with_provenance(mlp):
    step_fn, args = mlp
    plan = am.plan(step_fn, *args, cluster=CPU8, searcher="expert")
    experts = am.expert_plans(step_fn, *args, cluster=CPU8)
    best = min(
        (p for p in experts.values() if p.predicted.feasible),
        key=lambda p: p.predicted.step_time_s,
    )
    assert plan.predicted.step_time_s == pytest.approx(best.predicted.step_time_s)
    assert plan.provenance.searcher == "expert"
    assert plan.provenance.fingerprint == am.capture(step_fn, *args).fingerprint
    # in_specs is a pytree matching the arguments
    assert jax.tree_util.tree_structure(
        plan.in_specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
    ) == jax.tree_util.tree_structure(args)


def test_estimate_matches_the_plans_prediction(mlp):
    step_fn, args = mlp
    plan = am.plan(step_fn, *args, cluster=CPU8, searcher="expert")
    cost = am.estimate(step_fn, *args, plan=plan, cluster=CPU8)
    assert cost.step_time_s == pytest.approx(plan.predicted.step_time_s)
    assert cost.memory_bytes == pytest.approx(plan.predicted.memory_bytes)


def test_estimate_refuses_a_plan_for_another_program(mlp):
    step_fn, args = mlp
    plan = am.plan(step_fn, *args, cluster=CPU8, searcher="expert")
    other = get_model("mlp", batch=32, dtype="float32")
    with pytest.raises(am.PlanError, match="another program"):
        am.estimate(other.step_fn, *other.abstract_args(), plan=plan, cluster=CPU8)


def test_unknown_and_unavailable_searchers_say_so(mlp):
    step_fn, args = mlp
    with pytest.raises(am.AutomapError, match="unknown searcher 'greedy'"):
        am.plan(step_fn, *args, cluster=CPU8, searcher="greedy")
    with pytest.raises(am.AutomapError, match="unknown task"):
        am.plan(step_fn, *args, cluster=CPU8, searcher="expert", tasks=("shard", "fly"))


@pytest.mark.slow  # captures gpt-6.7b (27 s loaded)
def test_a_model_that_cannot_fit_is_refused_with_the_figures():
    # 6.7B parameters with fp32 Adam state are 107 GB: over two 32 GB devices, whatever
    # the split (ZeRO-3, stages and recomputation included).
    spec = get_model("gpt-6.7b")
    tiny = am.Cluster.preset("v100", devices=2)
    with pytest.raises(am.InfeasibleError, match="GB per device"):
        am.plan(spec.step_fn, *spec.abstract_args(), cluster=tiny, searcher="expert")
