"""Third-party training steps (Flax, Keras on JAX) plan and apply with equal numerics."""

import jax
import pytest

import automap as am
from automap._verify import compare_outputs

CPU8 = am.Cluster.preset("cpu", devices=8)


def _same(a, b):
    ok, err, worst = compare_outputs(a, b)
    assert ok, f"outputs differ: max abs error {err:.2e} at {worst}"


@pytest.mark.slow  # the examples planned, compiled and run
@pytest.mark.parametrize("module", ["examples.flax_mlp", "examples.keras_mlp"])
def test_third_party_steps_plan_and_apply(module):
    import importlib

    step_fn, args = importlib.import_module(module).make_step()
    experts = am.expert_plans(step_fn, *args, cluster=CPU8)
    assert {"data_parallel", "megatron"} <= set(experts)
    for name in ("data_parallel", "megatron_dp"):
        plan = experts[name]
        _same(am.apply(step_fn, plan)(*args), jax.jit(step_fn)(*args))


def test_roles_of_the_keras_step():
    from examples.keras_mlp import make_step

    step_fn, args = make_step()
    graph = am.capture(step_fn, *args)
    roles = {leaf.arg_index: leaf.role for leaf in graph.inputs}
    assert roles[0] == am.Role.PARAM
    assert roles[2] == am.Role.OPT_STATE
    assert roles[3] == am.Role.BATCH
