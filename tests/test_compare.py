"""`compare` on reduced benchmark models: the sanity of the whole. The exact optimum and
the expert plans, priced by one cost model, stand as the literature says they should."""

import functools

import pytest

import automap as am
from automap._bench import Row, compare
from automap._groups import unzero_spec
from automap._zoo import get_model


@functools.cache
def rows(model: str, preset: str, devices: int, searchers: str, **overrides) -> dict:
    """Rows by expert plan name, or by searcher for the others."""
    spec = get_model(model, **overrides)
    found = compare(
        spec.step_fn,
        *spec.abstract_args(),
        cluster=am.Cluster.preset(preset, devices),
        searchers=searchers.split(","),
        budget_s=10,
    )
    return {r.plan_name if r.searcher == "expert" else r.searcher: r for r in found}


def test_bert_large_optimum_is_no_worse_than_the_textbook_plans():
    found = rows("bert-large", "a100", 16, "expert,ilp", layers=2)
    optimum = found["ilp"]
    assert optimum.feasible
    for name in ("megatron_dp", "data_parallel"):
        assert optimum.step_time_s <= found[name].step_time_s * (1 + 1e-9), name


def test_vgg_optimum_is_the_one_weird_trick():
    # Batch 32 on 8 V100s: convolutions data parallel, the FC layers' weights split.
    found = rows("vgg19", "v100", 8, "expert,ilp", depth=11, batch=32)
    optimum, owt = found["ilp"], found["owt"]
    # OWT's layout, with the Adam update on ZeRO-2's shards (the FC layers' moments are
    # most of the update's memory traffic): 6% faster than OWT as published.
    assert optimum.plan.zero_stage == 2
    assert 0.9 * owt.step_time_s < optimum.step_time_s < owt.step_time_s
    assert owt.step_time_s < 0.5 * found["data_parallel"].step_time_s
    assert owt.step_time_s < found["megatron_dp"].step_time_s
    specs = optimum.plan.specs
    (images,) = [s for p, s in specs.items() if p.endswith("['images']")]
    (labels,) = [s for p, s in specs.items() if p.endswith("['labels']")]
    assert images[0] == "data" and labels == (None,)
    params = {p: s for p, s in specs.items() if p.startswith("[0]") and p.endswith("['kernel']")}
    convs = {p: s for p, s in params.items() if len(s) == 4}
    dense = {p: s for p, s in params.items() if len(s) == 2}
    # The convolutions' float32 masters sit on ZeRO-2's data shards (a bf16 VGG: they are
    # read only through their casts), their layout splits nothing.
    assert convs and not any(any(unzero_spec(s, "data")) for s in convs.values())
    assert len(dense) == 3 and all("data" in s for s in dense.values())


@pytest.mark.slow  # resnet50 searched
def test_resnet_the_optimum_is_data_parallel_with_its_update_on_zero_shards():
    found = rows("resnet50", "v100", 8, "expert,ilp")
    assert found["zero2"].step_time_s == pytest.approx(found["ilp"].step_time_s, rel=1e-9)
    # A bf16 resnet: ZeRO-2 runs the update on shards and gathers the bf16 casts, half
    # the float32 parameters' bytes (`_groups/_mixed.py`), so it beats plain data parallel.
    assert found["ilp"].step_time_s < found["data_parallel"].step_time_s


@pytest.mark.slow  # gpt-6.7b captured and searched
def test_gpt_6_7b_does_not_fit_data_parallel_and_the_searchers_find_plans_that_do():
    found = rows("gpt-6.7b", "a100", 16, "expert,ilp,dp")
    assert not found["data_parallel"].feasible
    # The shard space's best fits with ZeRO-3: data 16, priced 63.9 GiB a device (XLA's A100
    # buffer assignment of that plan: 58.8 GiB; `am.verify(..., target="a100")`, 2026-12-05).
    # Until the norms' backward kernels were priced as an A100 runs them (a796fe2) it was
    # priced over the limit, and the ILP's plan was data 8 x model 2 with ZeRO-3; until
    # 0ed7b9b priced attention's scaled scores as float32 no plan of the shard space fitted.
    ilp = found["ilp"]
    assert ilp.feasible and (ilp.plan.zero_stage >= 1 or ilp.plan.mesh.get("model", 1) > 1)
    assert ilp.memory_bytes <= am.Cluster.preset("a100", 16).memory_limit
    # The stage DP's pipelines are in its space too, and faster here.
    assert found["dp"].feasible and found["dp"].plan.stages
    assert found["dp"].step_time_s <= ilp.step_time_s


def test_a_one_stage_plan_with_microbatches_is_described_without_a_pipe_axis():
    # A recipe with pp=1 and several microbatches keeps a pipe axis of 1 in its mesh: the
    # row says what runs (gradient accumulation on the data × model mesh), not "pipe 1".
    spec = get_model("gpt2-xl", layers=2, hidden=128, heads=4, seq=64, batch=16, vocab=512)
    recipe = am.Recipe(tp=2, pp=1, dp=4, microbatch_size=2)
    found = am.plan_recipe(
        spec.step_fn, *spec.abstract_args(), recipe=recipe, cluster=am.Cluster.preset("a100", 8)
    )
    assert found.microbatches == 2
    row = Row("expert", "megatron_3d", 1.0, 1.0, True, 0.0, None, found)
    assert "pipe" not in row.shape
    assert row.shape.endswith("2 mb accumulated")
    assert "data 4" in row.shape and "model 2" in row.shape
