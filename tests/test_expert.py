"""Expert plans found from linkage groups, on the zoo and on plain programs."""

import pytest

import automap as am
from automap._capture import capture
from automap._groups import build_groups
from automap._space import batch_groups, block_groups, expert_plans_for
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


@pytest.mark.slow  # a CNN compiled and run
def test_one_weird_trick_splits_the_convs_batch_and_the_dense_weights_and_runs():
    spec = get_model(
        "vgg19", depth=11, hidden=8, ff=64, image=32, classes=16, batch=16, dtype="float32"
    )
    cluster = am.Cluster.preset("v100", devices=8)
    owt = am.expert_plans(spec.step_fn, *spec.abstract_args(), cluster=cluster)["owt"]
    assert owt.mesh == {"data": 8}
    specs = {p: s for p, s in owt.specs.items() if p.startswith(("[0]", "[2]"))}
    assert specs["[2]['images']"] == ("data", None, None, None)
    assert specs["[2]['labels']"] == (None,)  # the dense layers see the whole batch
    kernels = {p.split("'")[3]: s for p, s in specs.items() if p.endswith("['kernel']")}
    assert all(not any(s) for s in kernels.values() if len(s) == 4)  # convs replicated
    # Dense layers column, row, column parallel (the last one over the classes).
    column, row = (None, "data"), ("data", None)
    assert [kernels[f"layer_{i}"] for i in (8, 9, 10)] == [column, row, column]
    report = am.verify(spec.step_fn, owt, *spec.concrete_args(0), cluster=cluster)
    assert report.numerics_ok, report.summary()
    assert report.collectives_match, report.summary()  # the flatten's gather included
    assert "all-gather@data" in report.xla_comm_bytes


def test_no_one_weird_trick_without_convolutions(bert):
    graph, groups = bert
    assert "owt" not in expert_plans_for(graph, groups, am.Cluster.preset("a100", devices=8))
