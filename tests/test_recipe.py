"""Hand-written configurations (`am.Recipe`): built, priced, refused with one line, run
with the unsharded step's numbers; `megatron_3d` is the same recipe with Megatron's
choices; `automap estimate` prints the price."""

from __future__ import annotations

import dataclasses
import json

import jax
import pytest
from typer.testing import CliRunner

import automap as am
from automap._cli import app
from automap._cost import CostModel
from automap._groups import build_groups
from automap._remat import stage_layer_counts
from automap._space import layer_boundaries, layer_cuts, layer_split, pipeline_experts
from automap._zoo import get_model
from pipeline._models import assert_same

SMALL = dict(layers=4, hidden=32, heads=4, batch=8, seq=16, vocab=64, dtype="float32")
CPU8 = am.Cluster.preset("a100", devices=8)
SETS = [arg for k, v in SMALL.items() for arg in ("--set", f"{k}={v}")]


@pytest.fixture(scope="module")
def gpt():
    spec = get_model("gpt-1.3b", **SMALL)
    graph = am.capture(spec.step_fn, *spec.abstract_args())
    return spec, graph, build_groups(graph)


def test_layer_cuts_give_every_stage_equal_layers(gpt):
    _, graph, groups = gpt
    bounds = layer_boundaries(graph, groups)
    # Four layers: a boundary before each, and one after the last (before the head).
    assert len(bounds) == SMALL["layers"] + 1
    two, four = layer_cuts(graph, groups, 2), layer_cuts(graph, groups, 4)
    assert two == (bounds[2],) and four == bounds[1:4]
    # Three stages do not divide four layers: the middle one holds two (1, 2, 1).
    assert layer_cuts(graph, groups, 3) == (bounds[1], bounds[3])
    with pytest.raises(am.PlanError, match="4 layers do not split into 5 stages"):
        layer_cuts(graph, groups, 5)


SPLITS = [
    ((8, 2), (4, 4)),  # divides: equal, as Megatron's
    ((5, 2), (3, 2)),  # the last stage (head and loss) gives up the layer
    ((30, 4), (7, 8, 8, 7)),
    ((10, 4), (2, 3, 3, 2)),
    ((9, 4), (2, 3, 2, 2)),  # a third short one: next to the last, inward
    ((126, 16), (7, *[8] * 14, 7)),  # Llama 3 405B's 126 layers over 16 stages
    ((7, 7), (1,) * 7),
]


@pytest.mark.parametrize(("sizes", "counts"), SPLITS)
def test_layer_split_gives_the_end_stages_fewer_layers(sizes, counts):
    assert layer_split(*sizes) == counts
    with pytest.raises(am.PlanError, match="3 layers do not split into 4 parts"):
        layer_split(3, 4)


BAD = [
    (dict(tp=2, pp=2, dp=1), "tp × pp × dp = 2 × 2 × 1 = 4, but the cluster has 8"),
    (dict(tp=8, pp=1, dp=1), "tp=8 does not divide what tensor parallelism splits"),
    (
        dict(tp=1, pp=8, dp=1),
        "4 layers do not split into 8 stages of a layer or more: use a pp of at most 4",
    ),
    (
        dict(tp=1, pp=4, dp=2, schedule="interleaved", virtual_stages=2, microbatches=4),
        "4 layers do not split into pp × virtual_stages = 4 × 2 = 8 chunks",
    ),
    (dict(tp=1, pp=1, dp=8, microbatch_size=3), "microbatch size 3 does not divide the 1"),
    (dict(tp=2, pp=2, dp=2, microbatches=3), "3 microbatches do not divide the 4"),
    (
        dict(tp=2, pp=2, dp=2, remat="some"),
        "remat 'some': use one of none, selective, projections, full",
    ),
    (dict(tp=2, pp=2, dp=2, schedule="zb"), "schedule 'zb'"),
    (dict(tp=2, pp=2, dp=2, remat="full", remat_layers=True), "a whole number >= 1"),
    (dict(tp=2, pp=2, dp=2, remat="none", remat_layers=1), "use remat='full'"),
    (dict(tp=2, pp=2, dp=2, remat="full", remat_layers=3), "a stage holds 2 layer"),
    (dict(tp=2, pp=2, dp=2, microbatches=2, microbatch_size=2), "not both"),
]


@pytest.mark.parametrize(("fields", "message"), BAD)
def test_a_recipe_that_does_not_divide_is_one_line(gpt, fields, message):
    spec = gpt[0]
    with pytest.raises(am.PlanError, match=message.replace("(", r"\(")):
        am.plan_recipe(
            spec.step_fn, *spec.abstract_args(), recipe=am.Recipe(**fields), cluster=CPU8
        )


@pytest.mark.slow  # recipes compiled and run
def test_recipe_plan_is_priced_and_runs_the_step(gpt):
    spec = gpt[0]
    recipe = am.Recipe(tp=2, pp=2, dp=2, microbatch_size=2)
    plan = am.plan_recipe(spec.step_fn, *spec.abstract_args(), recipe=recipe, cluster=CPU8)
    assert (
        plan.pipelined
        and plan.microbatches == 2
        and plan.mesh == {"pipe": 2, "data": 2, "model": 2}
    )
    assert plan.predicted.feasible and plan.predicted.bubble_s > 0
    assert "model" in plan.assignment.values() and "data" in plan.assignment.values()
    args = spec.concrete_args(0)
    got = am.apply(spec.step_fn, plan)(*args)
    assert_same(got, jax.jit(spec.step_fn)(*args), spec.config["learning_rate"])


@pytest.mark.slow  # compiled and run
@pytest.mark.parametrize(
    ("v", "counts"), [(1, [3, 2]), (2, [1, 2, 1, 1])], ids=["1f1b", "interleaved"]
)
def test_an_uneven_split_runs_the_step(v, counts):
    # Five layers over two stages (over four chunks, interleaved: 1,2,1,1, chunk k on
    # stage k mod 2): the stages hold unequal layers, the plan says how, and the
    # numbers are the unsharded step's.
    spec = get_model("gpt-1.3b", **{**SMALL, "layers": 5})
    recipe = am.Recipe(
        tp=2, pp=2, dp=2, microbatches=2, virtual_stages=v,
        schedule="interleaved" if v > 1 else "1f1b",
    )  # fmt: skip
    plan = am.plan_recipe(spec.step_fn, *spec.abstract_args(), recipe=recipe, cluster=CPU8)
    graph = am.capture(spec.step_fn, *spec.abstract_args())
    assert stage_layer_counts(graph, build_groups(graph), plan) == counts
    split = "3,2" if v == 1 else "1,2,1,1"
    assert any(f": {split} (" in note for note in plan.provenance.notes)
    args = spec.concrete_args(0)
    got = am.apply(spec.step_fn, plan)(*args)
    assert_same(got, jax.jit(spec.step_fn)(*args), spec.config["learning_rate"])


@pytest.mark.slow  # large models planned
def test_megatron_3d_skips_data_sizes_that_do_not_divide_the_batch():
    # Batch 6 on 8 devices: no data size but 1 and 2 divides it; never an IndexError.
    spec = get_model("gpt-1.3b", **{**SMALL, "batch": 6})
    graph = am.capture(spec.step_fn, *spec.abstract_args())
    groups = build_groups(graph)
    model = CostModel(graph, CPU8, groups)
    plans = pipeline_experts(graph, groups, CPU8, model.estimate)
    mega = plans["megatron_3d"]
    assert mega.remat and mega.predicted.feasible
    assert 6 % mega.mesh.get("data", 1) == 0


@pytest.mark.slow  # large models planned
def test_megatron_3d_prices_no_stage_count_whose_stored_state_cannot_fit():
    # The recipe's busiest stage holds at least its share of the parameters, their
    # gradients and the Adam moments, split tp ways over pp stages. With a limit under
    # that share at one stage, those counts are not priced, and the plan is still the one
    # pricing every count finds: per tensor parallel size the fewest stages that fit, the
    # fastest of those.
    spec = get_model("gpt-1.3b", **SMALL)
    args = spec.abstract_args()
    graph = am.capture(spec.step_fn, *args)
    groups = build_groups(graph)
    # Parameters, their gradients (at least half their bytes: 16-bit sums of float32
    # parameters) and the Adam moments (`StateBytes.floor`).
    state = 1.5 * graph.role_bytes(am.Role.PARAM) + graph.role_bytes(am.Role.OPT_STATE)
    cluster = dataclasses.replace(CPU8, hbm_bytes=0.45 * state / (1 - CPU8.memory_reserve))
    model, priced = CostModel(graph, cluster, groups), []

    def estimate(plan):
        priced.append((plan.mesh.get("model"), len(plan.stages) or 1))
        return model.estimate(plan)

    mega = pipeline_experts(graph, groups, cluster, estimate)["megatron_3d"]
    every = {}
    for tp in (2, 4):
        for pp in (p for p in (1, 2, 4) if tp * p <= 8):
            recipe = am.Recipe(
                tp=tp,
                pp=pp,
                dp=8 // (tp * pp),
                microbatch_size=1,
                remat="full",
                sequence_parallel=True,
            )
            every[tp, pp] = am.plan_recipe(spec.step_fn, *args, recipe=recipe, cluster=cluster)

    def fewest(tp: int) -> am.Plan:
        counts = sorted(pp for t, pp in every if t == tp)
        return next(every[tp, pp] for pp in counts if every[tp, pp].predicted.feasible)

    best = min((fewest(2), fewest(4)), key=lambda p: p.predicted.step_time_s)
    assert mega.predicted.feasible and (2, 1) not in priced
    # At those sizes, Megatron's 2022 recipe: selective recomputation (and interleaving
    # where the layers allow) where it still fits, no slower than full recomputation.
    assert mega.remat_policy == "selective"
    assert mega.predicted.step_time_s <= best.predicted.step_time_s
    assert (mega.mesh["model"], mega.mesh.get("pipe", 1)) == (
        best.mesh["model"],
        best.mesh.get("pipe", 1),
    )


def test_estimate_command_prints_the_price_as_json():
    result = CliRunner().invoke(
        app,
        ["estimate", "--model", "gpt-1.3b", *SETS,
         "--devices", "8", "--tp", "2", "--pp", "2", "--dp", "2", "--microbatch-size", "1",
         "--remat", "full", "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    for key in (
        "step_time_s",
        "memory_bytes",
        "feasible",
        "compute_s",
        "comm_s",
        "bubble_s",
        "mfu",
    ):
        assert key in data
    assert data["feasible"] and data["bubble_s"] > 0 and data["microbatches"] == 4
    bad = CliRunner().invoke(app, ["estimate", "--model", "mlp", "--devices", "8", "--tp", "3"])
    assert bad.exit_code == 2 and "tp × pp × dp" in bad.output and "Traceback" not in bad.output


def test_estimate_says_how_it_split_uneven_layers():
    sets = [*SETS[: SETS.index("layers=4")], "layers=5", *SETS[SETS.index("layers=4") + 1 :]]
    result = CliRunner().invoke(
        app,
        ["estimate", "--model", "gpt-1.3b", *sets,
         "--devices", "8", "--tp", "2", "--pp", "2", "--dp", "2", "--microbatches", "2"],
        terminal_width=200,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "note: layers per stage: 3,2 (2 does not divide 5 layers" in result.output


@pytest.mark.slow  # compiled and run
def test_one_stage_with_microbatches_accumulates_gradients(gpt):
    # Megatron's PP=1 rows: one stage fed one sequence at a time, gradients summed.
    spec = gpt[0]
    # A training loop's step, which donates its state: one that does not peaks at its
    # update (its new state beside the old), where no activation is alive.
    step = jax.jit(spec.step_fn, donate_argnums=(0, 1))
    whole = am.plan_recipe(step, *spec.abstract_args(), recipe=am.Recipe(tp=2, dp=4), cluster=CPU8)
    accum = am.plan_recipe(
        step,
        *spec.abstract_args(),
        recipe=am.Recipe(tp=2, dp=4, microbatch_size=1),
        cluster=CPU8,
    )
    assert not whole.pipelined and accum.pipelined
    assert len(accum.stages) == 1 and accum.microbatches == 2 and accum.mesh["pipe"] == 1
    acts = lambda p: p.predicted.memory_breakdown["activations"]  # noqa: E731
    assert acts(accum) < acts(whole)
    args = spec.concrete_args(0)
    got = am.apply(spec.step_fn, accum)(*args)
    assert_same(got, jax.jit(spec.step_fn)(*args), spec.config["learning_rate"])


@pytest.mark.slow  # compiled and run
def test_megatrons_fused_softmax_runs_as_the_float32_one_and_moves_the_same_bytes():
    # The Megatron table's GPT (softmax="fused": 16-bit in, out and saved, float32 inside)
    # under tensor parallelism with full recomputation: the same numbers as the float32
    # softmax step. On the GPU cluster the same time: XLA's GPU pipeline stores neither
    # softmax's float32 values (it makes them again from the 16-bit scores in their
    # readers, `_cost/_residuals.py`), and the A100 programs of the two GPTs below at tp 8
    # are the same kernels, each moving 2.61 GB outside the matmuls.
    def spec(softmax, dtype="float32"):
        return get_model("gpt-1.3b", **{**SMALL, "dtype": dtype, "softmax": softmax})

    fused, plain = spec("fused"), spec("float32")
    recipe = am.Recipe(tp=2, dp=4, remat="full")
    plan = am.plan_recipe(fused.step_fn, *fused.abstract_args(), recipe=recipe, cluster=CPU8)
    args = fused.concrete_args(0)
    got = am.apply(fused.step_fn, plan)(*args)
    assert_same(got, jax.jit(plain.step_fn)(*args), fused.config["learning_rate"])
    big = dict(layers=2, hidden=1024, heads=16, seq=1024, batch=8, vocab=1024)

    def compute_s(softmax: str) -> float:
        s = get_model("gpt-1.3b", **big, softmax=softmax)
        recipe = am.Recipe(tp=8)
        return am.plan_recipe(
            s.step_fn, *s.abstract_args(), recipe=recipe, cluster=CPU8
        ).predicted.compute_s

    assert compute_s("fused") == pytest.approx(compute_s("float32"), rel=0.01)
