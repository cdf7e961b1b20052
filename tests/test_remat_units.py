"""Full recomputation at the program's repeating unit: a transformer layer (its attention
and MLP blocks), found from the program's structure, keeps one input a layer where block
granularity kept two. XLA's compiled program holds less (buffer assignment) for the one
matmul more a layer (the attention's output projection, which now makes the MLP's input
again); the cost model reads the same units; a pipeline stage cut inside a layer splits it,
and sharded and pipelined steps compute what the unsharded step computes."""

import dataclasses
import functools
import json

import jax
import pytest
from typer.testing import CliRunner

import automap as am
from automap._capture import capture
from automap._cli import app
from automap._cluster import Cluster
from automap._cost import CostModel
from automap._groups import build_groups, plan_from_assignment
from automap._pipeline import cut_candidates, pipeline_plan
from automap._plan import Plan
from automap._remat import (
    block_ops,
    layer_ops,
    layer_spans,
    period,
    plan_recompute,
    recompute_plan,
    recompute_units,
    remat_key,
)
from automap._run import eval_recomputing
from automap._search import Problem, search_dp
from automap._space import batch_groups, block_groups
from automap._zoo import get_model
from pipeline._models import assert_same

CONFIG = dict(layers=4, hidden=64, heads=2, batch=8, seq=64, vocab=128, dtype="float32")


@functools.cache
def gpt():
    spec = get_model("gpt2-xl", **CONFIG)
    graph = capture(spec.step_fn, *spec.abstract_args())
    return spec, graph, build_groups(graph)


def test_the_unit_is_a_transformer_layer_found_by_its_period_not_names():
    _, graph, groups = gpt()
    blocks, layers = block_ops(graph, groups), layer_ops(graph, groups)
    # Blocks: attention and MLP halves; units: one attention block and its MLP block.
    assert len(blocks) == 2 * len(layers) == 2 * CONFIG["layers"]
    assert layers == tuple(blocks[k] + blocks[k + 1] for k in range(0, len(blocks), 2))
    nameless = dataclasses.replace(
        graph, ops=tuple(dataclasses.replace(op, name_stack="") for op in graph.ops)
    )
    assert layer_ops(nameless, groups) == layers
    # The period ignores the first and the last block (the embedding's tail, the head's
    # start); a sequence that does not repeat keeps blocks as units.
    assert period(["embed+A", "M", "A", "M", "A", "M+head"]) == 2
    assert period(["A", "A", "A", "A"]) == 1
    assert period(["x", "y", "z", "w", "v"]) == 1
    # A program of one repeated block (an MLP stack) groups nothing.
    mlp_spec = get_model("mlp")
    mlp = capture(mlp_spec.step_fn, *mlp_spec.abstract_args())
    assert layer_ops(mlp, build_groups(mlp)) == block_ops(mlp, build_groups(mlp))


def _compiled_recomputing(spec, graph, rc):
    """The step re-run with `rc` recomputed, as `am.apply` runs a remat plan, compiled."""
    wanted = [leaf.tensor for leaf in graph.outputs]

    def step(*args):
        leaves = jax.tree_util.tree_leaves(args)
        env = {leaf.tensor: x for leaf, x in zip(graph.inputs, leaves, strict=True)}
        outs = eval_recomputing(graph, rc, range(len(graph.ops)), env, wanted)
        return jax.tree_util.tree_unflatten(graph.out_tree, list(outs))

    return jax.jit(step).lower(*spec.abstract_args()).compile()


def _flops(compiled) -> float:
    ca = compiled.cost_analysis()
    return float((ca[0] if isinstance(ca, list) else ca)["flops"])


@pytest.mark.slow  # two recompute granularities compiled
def test_layer_units_recompute_one_matmul_more_and_are_priced_as_xla_holds_them():
    spec, graph, groups = gpt()
    by_block = recompute_units(graph, block_ops(graph, groups))
    by_layer = recompute_plan(graph, groups)
    flat = jax.tree_util.tree_flatten_with_path(spec.abstract_args())[0]
    plan = Plan(mesh={}, specs={jax.tree_util.keystr(p): () for p, _ in flat}, remat=True)
    assert plan_recompute(graph, groups, plan) == by_layer  # what am.apply runs
    assert len(by_layer.inputs) == len(by_block.inputs) // 2  # one input kept a layer
    units = (("block", by_block), ("layer", by_layer))
    compiled = {k: _compiled_recomputing(spec, graph, rc) for k, rc in units}
    # Recomputed once more: each layer's attention output projection (and the residual
    # add after it), whose output is the MLP block's input, no longer kept.
    more = sorted(by_layer.ops - by_block.ops)
    dots = [i for i in more if graph.ops[i].primitive == "dot_general"]
    assert len(dots) == CONFIG["layers"] and by_block.ops <= by_layer.ops
    grown = _flops(compiled["layer"]) - _flops(compiled["block"])
    assert grown == pytest.approx(sum(graph.ops[i].flops for i in more), rel=0.05)
    # The cost model reads the same units and charges exactly those ops more.
    cluster = Cluster.preset("cpu", devices=1)
    model = {k: CostModel(graph, cluster, groups, rc) for k, rc in units}
    cost = {k: m.evaluate({}, {}, remat=True) for k, m in model.items()}
    first = model["layer"].tables.remat_op_coef
    charged = cost["layer"].compute_s - cost["block"].compute_s
    assert charged == pytest.approx(sum(first[i] for i in more))
    # What each holds: a layer's input less, but a whole layer's residuals alive during
    # its backward. At this size (4 layers, a sequence of 64: the attention scores are
    # as large as the residual stream) the latter wins, in XLA's buffer assignment and in
    # the cost model alike; with more layers, or microbatches in flight, the former does.
    temp = {k: c.memory_analysis().temp_size_in_bytes for k, c in compiled.items()}
    acts = {k: c.memory_breakdown["activations"] for k, c in cost.items()}
    assert (temp["layer"] > temp["block"]) == (acts["layer"] > acts["block"]), (temp, acts)
    grew = (temp["layer"] - temp["block"], acts["layer"] - acts["block"])
    assert grew[1] == pytest.approx(grew[0], rel=0.5), (temp, acts)


def test_a_stage_cut_inside_a_layer_splits_it_for_the_runtime_and_the_cost_model():
    _, graph, groups = gpt()
    layers = layer_ops(graph, groups)
    mid = block_ops(graph, groups)[3][0]  # layer 1's MLP block
    assert mid in cut_candidates(graph, groups)
    mesh, assignment = {"data": 2}, {g.id: "data" for g in batch_groups(groups)}
    staged = pipeline_plan(graph, groups, (mid,), mesh, assignment, 2)
    plan = dataclasses.replace(staged, remat=True)
    rc = plan_recompute(graph, groups, plan)
    # Layer 1 in two units, one a stage: each recomputed from its own part's input.
    assert len(rc.layers) == len(layers) + 1
    assert all(layer[-1] < mid or layer[0] >= mid for layer in rc.layers)
    spans = layer_spans(graph, groups)
    assert remat_key(plan, spans) is not None  # priced on that split `Recompute`
    aligned = pipeline_plan(graph, groups, (layers[2][0],), mesh, assignment, 2)
    assert remat_key(dataclasses.replace(aligned, remat=True), spans) is None
    model = CostModel(graph, Cluster.preset("cpu", devices=4), groups)
    assert model.for_plan(plan).residuals.recomputed == tuple(sorted(rc.ops))
    assert model.estimate(plan).feasible


@pytest.mark.slow  # full recompute by layers on 8 devices, one stage and two
def test_layer_units_compute_the_step_on_8_devices():
    spec, graph, groups = gpt()
    assignment = {g.id: "data" for g in batch_groups(groups)}
    assignment.update({g.id: "model" for g in block_groups(groups)})
    args = spec.concrete_args(0)
    want = jax.jit(spec.step_fn)(*args)
    mid = block_ops(graph, groups)[3][0]  # a stage starting inside layer 1
    plans = [
        plan_from_assignment(graph, groups, {"data": 4, "model": 2}, assignment),
        pipeline_plan(graph, groups, (mid,), {"data": 2, "model": 2}, assignment, 2),
    ]
    for plan in plans:
        got = am.apply(spec.step_fn, dataclasses.replace(plan, remat=True))(*args)
        assert_same(got, want, spec.config["learning_rate"])


def test_recipe_and_estimate_count_remat_layers_in_transformer_layers():
    sets = [a for k, v in CONFIG.items() for a in ("--set", f"{k}={v}")]
    common = ["estimate", "--model", "gpt2-xl", *sets, "--devices", "8", "--tp", "2"]
    common += ["--pp", "2", "--dp", "2", "--microbatch-size", "1", "--json"]
    priced = {}
    for k in (None, 1, 2):
        more = ["--remat-layers", str(k)] if k else []
        result = CliRunner().invoke(app, [*common, "--remat", "full", *more])
        assert result.exit_code == 0, result.output
        priced[k] = json.loads(result.output)
        assert priced[k]["plan"]["remat_layers"] == k
    # Two layers a stage: recomputing both is recomputing all; one recomputes less.
    compute = {k: d["compute_s"] for k, d in priced.items()}
    memory = {k: d["memory_bytes"] for k, d in priced.items()}
    assert compute[1] < compute[2] == pytest.approx(compute[None])
    assert memory[1] > memory[2] == pytest.approx(memory[None])
    for remat, k, says in [
        ("full", "3", "remat_layers=3, but a stage holds 2 layer(s): use at most 2"),
        ("full", "0", "remat_layers must be a whole number >= 1"),
        ("selective", "1", "use remat='full' (--remat full) with it"),
    ]:
        bad = CliRunner().invoke(app, [*common, "--remat", remat, "--remat-layers", k])
        assert bad.exit_code == 2 and "Traceback" not in bad.output, bad.output
        assert says in bad.output, bad.output
        assert len(bad.output.strip().splitlines()) == 1, bad.output
    assert am.Recipe(remat="full", remat_layers=2).remat_layers == 2


def test_the_stage_dp_cuts_remat_pipelines_between_layers():
    """Megatron's cuts: under remat every stage the DP places starts between layers, so
    that no plan it prices splits a recompute unit (nor needs a cost model of its own)."""
    spec = get_model("gpt2-xl", layers=4, hidden=64, heads=4, batch=16, seq=16)
    a100 = Cluster.preset("a100", 8)
    plain, _ = search_dp(Problem.build(spec.step_fn, spec.abstract_args(), a100), budget_s=60)
    # Under 60% of the best plan's memory the plain points stop fitting: savers are tried.
    limit = 0.6 * plain.predicted.memory_bytes
    tight = dataclasses.replace(a100, hbm_bytes=limit / (1.0 - a100.memory_reserve))
    pb = Problem.build(spec.step_fn, spec.abstract_args(), tight)
    spans = layer_spans(pb.graph, pb.groups)
    seen: list[Plan] = []
    best, _ = search_dp(pb, budget_s=60, on_point=lambda p, _: seen.append(p))
    remat = [p for p in seen if p is not None and p.remat]
    assert remat and best.predicted.memory_bytes <= limit
    for p in [*remat, best]:
        assert not any(a < c <= z for c in p.decisions["cuts"] for a, z in spans), p.name
        assert remat_key(p, spans) is None
