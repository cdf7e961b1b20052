"""Expert plans found from linkage groups, on the zoo and on plain programs."""

import pytest

import automap as am
from automap._capture import capture
from automap._expert import batch_groups, block_groups, expert_plans_for
from automap._linkage import build_groups
from automap._zoo import get_model


@pytest.fixture(scope="module")
def bert():
    spec = get_model("bert-base", layers=2, hidden=128, heads=8, seq=32, batch=8)
    graph = capture(spec.step_fn, *spec.abstract_args())
    return graph, build_groups(graph)


def _sharded(plan: am.Plan, needle: str) -> dict[str, tuple]:
    return {p: s for p, s in plan.specs.items() if needle in p and p.startswith("[0]")}


def test_megatron_splits_heads_and_mlp_of_every_layer(bert):
    graph, groups = bert
    plans = expert_plans_for(graph, groups, am.Cluster.preset("a100", devices=16))
    megatron = plans["megatron_dp"]
    for layer in ("layer_0", "layer_1"):
        for name in ("query", "key", "value"):
            spec = _sharded(megatron, f"['{layer}']['attention']['{name}']['kernel']")
            assert list(spec.values()) == [(None, "model")], (layer, name, spec)
        (wo,) = _sharded(megatron, f"['{layer}']['attention']['out']['kernel']").values()
        assert wo == ("model", None)  # row parallel after column parallel
        (wi,) = _sharded(megatron, f"['{layer}']['mlp']['wi']['kernel']").values()
        assert wi == (None, "model")
    # the residual stream (layer norms) stays whole
    for spec in _sharded(megatron, "norm").values():
        assert "model" not in spec


def test_batch_group_goes_on_data(bert):
    graph, groups = bert
    (batch,) = batch_groups(groups)
    plans = expert_plans_for(graph, groups, am.Cluster.preset("a100", devices=8))
    dp = plans["data_parallel"]
    batch_specs = {p: s for p, s in dp.specs.items() if p.startswith("[2]")}
    assert batch_specs and all(s[0] == "data" for s in batch_specs.values())
    assert all(not any(s) for p, s in dp.specs.items() if p.startswith("[0]"))
    assert batch.id not in {g.id for g in block_groups(groups)}


def test_no_expert_when_nothing_divides():
    spec = get_model("mlp", batch=3, hidden=7, features=5, classes=3, layers=2)
    graph = capture(spec.step_fn, *spec.abstract_args())
    plans = expert_plans_for(graph, build_groups(graph), am.Cluster.preset("a100", devices=8))
    assert "data_parallel" not in plans and "megatron" not in plans
