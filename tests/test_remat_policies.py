"""Recomputation policies run as they are priced: selective (each layer's attention core,
found from the program's structure), projections (all of each layer but its projections,
MaxText's `minimal`), full, and full over the first k layers of each stage.
XLA's compiled programs show the recompute (FLOPs) and what it frees (buffer assignment),
the cost model charges exactly the ops each policy recomputes, and sharded and pipelined
steps compute what the unsharded step computes."""

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
from automap._errors import PlanError
from automap._groups import build_groups, plan_from_assignment
from automap._pipeline import pipeline_plan, uniform_cuts
from automap._plan import Plan
from automap._remat import attention_cores, block_ops, plan_recompute, remat_residuals
from automap._space import batch_groups, block_groups
from automap._zoo import get_model
from pipeline._models import assert_same

CONFIG = dict(layers=4, hidden=64, heads=2, batch=8, seq=64, vocab=128, dtype="float32")


@functools.cache
def gpt():
    spec = get_model("gpt2-xl", **CONFIG)
    graph = capture(spec.step_fn, *spec.abstract_args())
    return spec, graph, build_groups(graph)


def _one_device(spec, **remat) -> Plan:
    flat = jax.tree_util.tree_flatten_with_path(spec.abstract_args())[0]
    return Plan(mesh={}, specs={jax.tree_util.keystr(p): () for p, _ in flat}, **remat)


def _compiled(spec, plan):
    run = am.apply(spec.step_fn, plan, devices=jax.devices()[:1])
    args = spec.abstract_args()
    prepared = run.prepare(*args)
    return prepared.compile(args)


def _flops(compiled) -> float:
    ca = compiled.cost_analysis()
    return float((ca[0] if isinstance(ca, list) else ca)["flops"])


POLICIES = {
    "none": {},
    "selective": dict(remat=True, remat_policy="selective"),
    "projections": dict(remat=True, remat_policy="projections"),
    "first 2": dict(remat=True, remat_layers=2),
    "full": dict(remat=True),
}


def test_selective_finds_each_attention_core_by_structure_not_names():
    spec, graph, groups = gpt()
    units = block_ops(graph, groups)
    cores = attention_cores(graph, units)
    found = [c for c in cores if c]
    assert len(found) == CONFIG["layers"]  # the attention halves; the MLP halves have none
    for core in found:
        prims = [graph.ops[i].primitive for i in core]
        # QKᵀ and the attention over V, and the softmax between them.
        assert prims.count("dot_general") == 2 and prims[0] == prims[-1] == "dot_general"
        assert {"exp", "reduce_max", "reduce_sum"} <= set(prims)
    # Names play no part: the same program with its name stacks wiped finds the same.
    nameless = dataclasses.replace(
        graph, ops=tuple(dataclasses.replace(op, name_stack="") for op in graph.ops)
    )
    assert attention_cores(nameless, units) == cores
    # A program without attention has no core: selective recomputes nothing there.
    spec = get_model("mlp")
    mlp = capture(spec.step_fn, *spec.abstract_args())
    assert block_ops(mlp, build_groups(mlp))
    assert not any(attention_cores(mlp, block_ops(mlp, build_groups(mlp))))


def _made_from_params(graph) -> set[int]:
    """Tensors made from the parameters alone (the weights and their casts)."""
    out = {leaf.tensor for leaf in graph.leaves(am.Role.PARAM)}
    for op in graph.ops:
        if op.inputs and all(t in out for t in op.inputs):
            out.update(op.outputs)
    return out


def test_projections_keeps_each_layers_input_and_its_projections_outputs():
    # MaxText's `minimal` on the zoo's Llama: of the activations (batch x sequence x
    # width), what stays alive for the backward is each layer's input and the outputs of
    # its matmuls with a weight (query, key, value, attention out, gate, up), nothing the
    # norms, rotary, attention core or SwiGLU product make; no projection runs twice.
    spec = get_model("llama", layers=3, hidden=64, heads=4, kv_heads=2, ffn=128, seq=32,
                     batch=4, vocab=128)  # fmt: skip
    graph = capture(spec.step_fn, *spec.abstract_args())
    groups = build_groups(graph)
    rc = plan_recompute(graph, groups, _one_device(spec, remat=True, remat_policy="projections"))
    weights = _made_from_params(graph)

    def projection(i: int) -> bool:
        op = graph.ops[i]
        return op.primitive == "dot_general" and any(t in weights for t in op.inputs)

    assert not [i for i in rc.ops if projection(i)]
    # Each layer's attention products are made again (the first carries the embedding).
    dots = [[i for i in layer if graph.ops[i].primitive == "dot_general"] for layer in rc.layers]
    assert [len(d) for d in dots] == [2, 2, 2]
    res = remat_residuals(graph, groups, rc)
    again = {t for ts in res.layer_saved for t in ts}  # the largest layer's, in its backward
    rows = [t for t in res.saved_remat if t not in again and graph.tensors[t].shape[:1] == (4,)
            and graph.tensors[t].ndim >= 3]  # fmt: skip
    made = {t: graph.ops[graph.tensors[t].producer] for t in rows}
    kinds = sorted({"projection" if projection(op.index) else op.primitive for op in made.values()})
    # Past the last recomputed layer the head keeps its own (not recomputed: its backward
    # comes next); inside the layers, only projections and the residual stream's adds.
    last = max(rc.ops)
    inside = sorted({op.primitive for t, op in made.items() if op.index < last
                     and not projection(op.index)})  # fmt: skip
    assert inside == ["add"], (inside, kinds)
    assert sum(projection(op.index) for op in made.values() if op.index < last) == 6 * 3


def test_the_first_k_layers_of_each_stage_are_recomputed():
    spec, graph, groups = gpt()
    full = plan_recompute(graph, groups, _one_device(spec, remat=True))
    two = plan_recompute(graph, groups, _one_device(spec, remat=True, remat_layers=2))
    assert two.layers == full.layers[:2]
    mesh, assignment = {"data": 2}, {g.id: "data" for g in batch_groups(groups)}
    staged = pipeline_plan(graph, groups, uniform_cuts(graph, groups, 2), mesh, assignment, 2)
    one = plan_recompute(graph, groups, dataclasses.replace(staged, remat=True, remat_layers=1))
    bounds = [(s.op_start, s.op_stop) for s in staged.stages]
    # One layer in each stage, the first of it.
    assert len(one.layers) == 2
    assert [bounds[s][0] <= layer[0] for s, layer in enumerate(one.layers)] == [True, True]
    assert one.layers[0] == full.layers[0]


@pytest.mark.slow  # four policies compiled
def test_each_policy_compiles_the_recompute_it_is_priced_for():
    spec, graph, groups = gpt()
    model = CostModel(graph, Cluster.preset("cpu", devices=1), groups)
    flops, temp, acts = {}, {}, {}
    for name, remat in POLICIES.items():
        plan = _one_device(spec, **remat)
        compiled = _compiled(spec, plan)
        flops[name], temp[name] = _flops(compiled), compiled.memory_analysis().temp_size_in_bytes
        cost = model.estimate(plan)
        acts[name] = cost.memory_breakdown["activations"]
        if not remat:
            plain = cost
            continue
        rc = plan_recompute(graph, groups, plan)
        again = sum(graph.ops[i].flops for i in rc.ops)
        # XLA's program runs every recomputed op once more (selective: plus the select
        # that ties the core's inputs to the backward, elementwise on Q and K).
        assert flops[name] - flops["none"] == pytest.approx(again, rel=0.1), name
        # The cost model charges exactly those ops (`remat_op_coef`), nothing else.
        first = model.for_plan(plan).tables.remat_op_coef
        charged = sum(first[i] for i in rc.ops)
        assert cost.compute_s - plain.compute_s == pytest.approx(charged), name
        assert charged > 0, name
    assert flops["none"] < flops["selective"] < flops["first 2"] < flops["full"]
    # Projections recomputes the attention core and more, never a projection.
    assert flops["selective"] < flops["projections"] < flops["full"]
    # What each keeps: full the least, selective less than nothing recomputed, projections
    # less than selective, in XLA's buffer assignment and in the cost model alike.
    for order in (temp, acts):
        assert order["full"] < order["first 2"] < order["none"], order
        assert order["full"] < order["projections"] < order["selective"] < order["none"], order


@pytest.mark.slow  # policies compiled and run on 8 devices
@pytest.mark.parametrize("remat", ["selective", "projections", "first 1"])
def test_policies_compute_the_step_on_8_devices(remat):
    spec, graph, groups = gpt()
    fields = dict(remat=True, remat_policy=remat) if remat != "first 1" else {}
    fields = fields or dict(remat=True, remat_layers=1)
    assignment = {g.id: "data" for g in batch_groups(groups)}
    assignment.update({g.id: "model" for g in block_groups(groups)})
    args = spec.concrete_args(0)
    want = jax.jit(spec.step_fn)(*args)
    one = plan_from_assignment(graph, groups, {"data": 4, "model": 2}, assignment)
    staged = pipeline_plan(
        graph, groups, uniform_cuts(graph, groups, 2), {"data": 2, "model": 2}, assignment, 2
    )
    for plan in (one, staged):
        got = am.apply(spec.step_fn, dataclasses.replace(plan, **fields))(*args)
        assert_same(got, want, spec.config["learning_rate"])


def test_plan_files_keep_the_policy_and_old_ones_load_as_full(tmp_path):
    spec, _, _ = gpt()
    plan = _one_device(spec, remat=True, remat_policy="selective")
    path = plan.save(tmp_path / "p.json")
    assert Plan.load(path).remat_policy == "selective"
    old = json.loads(path.read_text())
    del old["remat_policy"], old["remat_layers"]
    path.write_text(json.dumps(old))
    loaded = Plan.load(path)
    assert (loaded.remat, loaded.remat_policy, loaded.remat_layers) == (True, "full", None)
    assert loaded.remat_label == "full"
    for field, value, says in [
        ("remat_policy", "attention", "must be one of selective, projections, full"),
        ("remat_layers", 0, "remat_layers must be a whole number >= 1"),
        ("remat_layers", "2", "remat_layers must be a whole number >= 1"),
    ]:
        path.write_text(json.dumps({**old, field: value}))
        with pytest.raises(PlanError, match=says) as e:
            Plan.load(path)
        assert "\n" not in str(e.value)
    with pytest.raises(PlanError, match="set remat_policy to full"):
        _one_device(spec, remat=True, remat_policy="selective", remat_layers=2)


def test_estimate_prices_each_policy_and_refuses_a_bad_one_in_one_line():
    sets = [a for k, v in CONFIG.items() for a in ("--set", f"{k}={v}")]
    common = ["estimate", "--model", "gpt2-xl", *sets, "--devices", "8", "--tp", "2"]
    common += ["--pp", "2", "--dp", "2", "--microbatch-size", "1", "--json"]
    priced = {}
    for remat in ("none", "selective", "projections", "full"):
        result = CliRunner().invoke(app, [*common, "--remat", remat])
        assert result.exit_code == 0, result.output
        data = json.loads(result.output)
        assert data["plan"]["remat"] is (remat != "none")
        priced[remat] = data
    assert priced["selective"]["plan"]["remat_policy"] == "selective"
    # Selective recomputes less than full and keeps more than it; none recomputes nothing.
    compute = {k: d["compute_s"] for k, d in priced.items()}
    memory = {k: d["memory_bytes"] for k, d in priced.items()}
    assert compute["none"] < compute["selective"] < compute["projections"] < compute["full"]
    # Projections keeps the projections' outputs, full only the layers' inputs: on these
    # stages of two 64-wide layers their peaks come out equal (measured), never below.
    assert memory["full"] <= memory["projections"] < memory["selective"] < memory["none"]
    bad = CliRunner().invoke(app, [*common, "--remat", "attention"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output
    assert "remat 'attention': use one of none, selective, projections, full" in bad.output
    recipe = am.Recipe(tp=2, pp=2, dp=2, microbatch_size=1, remat="selective")
    assert (recipe.remat, am.Recipe().remat) == ("selective", "none")
