"""Rematerialization runs as it is priced: a remat plan recomputes each layer's forward in
its backward, one-stage (`am.apply`) and pipelined (each B segment), with the same
results; XLA's compiled programs show the recompute (FLOPs, matmuls) and the memory it
frees; the cost model charges exactly the recomputed ops and keeps the tensors the runtime
keeps."""

import dataclasses
import functools
import re

import jax
import pytest

import automap as am
from automap._capture import capture
from automap._cluster import Cluster
from automap._cost import CostModel, estimate_pipeline, stage_residuals
from automap._groups import build_groups, plan_from_assignment
from automap._pipeline import Phase, pipeline_plan, uniform_cuts
from automap._plan import Plan
from automap._remat import generated, recompute_plan
from automap._remat import remat_residuals as residuals
from automap._space import batch_groups, block_groups
from automap._verify import comm_bytes, parse_collectives
from automap._zoo import get_model
from pipeline._models import assert_same

# Long enough a sequence that activations, not parameters, fill the temporaries.
CONFIG = dict(layers=4, hidden=64, heads=2, batch=8, seq=64, vocab=128, dtype="float32")


@functools.cache
def gpt():
    spec = get_model("gpt2-xl", **CONFIG)
    graph = capture(spec.step_fn, *spec.abstract_args())
    return spec, graph, build_groups(graph)


def _one_device_plan(spec, remat: bool) -> Plan:
    flat = jax.tree_util.tree_flatten_with_path(spec.abstract_args())[0]
    return Plan(mesh={}, specs={jax.tree_util.keystr(p): () for p, _ in flat}, remat=remat)


def _compiled(spec, plan):
    run = am.apply(spec.step_fn, plan, devices=jax.devices()[:1])
    args = spec.abstract_args()
    prepared = run.prepare(*args)
    return prepared.compile(args)


def _flops(compiled) -> float:
    ca = compiled.cost_analysis()
    return float((ca[0] if isinstance(ca, list) else ca)["flops"])


def _dots(compiled) -> int:
    return len(re.findall(r"= \S+ dot\(", compiled.as_text()))


@pytest.mark.slow  # remat plans compiled
def test_one_stage_remat_recomputes_the_layers_and_frees_their_activations():
    spec, graph, groups = gpt()
    rc = recompute_plan(graph, groups)
    assert len(rc.layers) == CONFIG["layers"]  # transformer layers, attention and MLP
    plain = _compiled(spec, _one_device_plan(spec, remat=False))
    remat = _compiled(spec, _one_device_plan(spec, remat=True))
    # The recompute is in the program: one more matmul per recomputed one, and the FLOPs
    # of every recomputed op (about a forward of the layers) on top of the plain step's.
    recomputed = [graph.ops[i] for i in sorted(rc.ops)]
    assert _dots(remat) - _dots(plain) == sum(op.primitive == "dot_general" for op in recomputed)
    extra = _flops(remat) - _flops(plain)
    assert extra == pytest.approx(sum(op.flops for op in recomputed), rel=0.02)
    assert extra > 0.15 * _flops(plain)
    # The layers' activations no longer wait for the backward in XLA's buffer assignment.
    saved = plain.memory_analysis().temp_size_in_bytes
    kept = remat.memory_analysis().temp_size_in_bytes
    assert kept < 0.5 * saved, (kept, saved)


@pytest.mark.slow  # remat plans compiled and run
def test_one_stage_remat_computes_the_step_data_parallel():
    spec, graph, groups = gpt()
    mesh = {"data": 2}
    dp = plan_from_assignment(graph, groups, mesh, {g.id: "data" for g in batch_groups(groups)})
    args = spec.concrete_args(0)
    got = am.apply(spec.step_fn, dataclasses.replace(dp, remat=True))(*args)
    assert_same(got, jax.jit(spec.step_fn)(*args), spec.config["learning_rate"])


@pytest.mark.slow  # remat plans compiled
def test_recomputed_collectives_are_priced_as_xla_compiles_them():
    """Megatron's split: a recomputed op with a partial sum on "model" all-reduces again."""
    spec, graph, groups = gpt()
    mesh = {"data": 2, "model": 2}
    assignment = {g.id: "data" for g in batch_groups(groups)}
    assignment.update({g.id: "model" for g in block_groups(groups)})
    plan = plan_from_assignment(graph, groups, mesh, assignment)
    model = CostModel(graph, Cluster.preset("cpu", devices=8), groups)
    args = spec.abstract_args()
    compiled, predicted = {}, {}
    for remat in (False, True):
        prepared = am.apply(spec.step_fn, dataclasses.replace(plan, remat=remat)).prepare(*args)
        hlo = prepared.compile(args).as_text()
        compiled[remat] = comm_bytes(parse_collectives(hlo, 4), mesh)
        cost = model.evaluate(assignment, mesh, remat=remat)
        predicted[remat] = {f"{c.kind}@{c.axis}": c.bytes for c in cost.collectives}
    assert compiled[True]["all-reduce@model"] > compiled[False]["all-reduce@model"]
    for key in compiled[True]:
        grown = compiled[True][key] - compiled[False].get(key, 0.0)
        priced = predicted[True].get(key, 0.0) - predicted[False].get(key, 0.0)
        assert priced == pytest.approx(grown), key


@pytest.mark.slow  # remat pipelines compiled
def test_pipeline_recomputed_collectives_are_priced_in_the_stage_that_runs_them():
    spec, graph, groups = gpt()
    mesh = {"data": 2, "model": 2}
    assignment = {g.id: "data" for g in batch_groups(groups)}
    assignment.update({g.id: "model" for g in block_groups(groups)})
    plan = pipeline_plan(graph, groups, uniform_cuts(graph, groups, 2), mesh, assignment, 2)
    model = CostModel(graph, Cluster.preset("cpu", devices=8), groups)
    compiled, predicted = {}, {}
    for remat in (False, True):
        p = dataclasses.replace(plan, remat=remat)
        for prog in am.apply(spec.step_fn, p).compile(*spec.abstract_args()):
            hlo = parse_collectives(prog.compiled.as_text(), 4)
            for key, b in comm_bytes(hlo, prog.mesh).items():
                at = (remat, prog.stage, key)
                compiled[at] = compiled.get(at, 0.0) + b * prog.runs
        for s, collectives in enumerate(estimate_pipeline(model, p).stage_collectives):
            predicted.update({(remat, s, f"{c.kind}@{c.axis}"): c.bytes for c in collectives})
    key = "all-reduce@model"
    grown = [compiled[(True, s, key)] - compiled[(False, s, key)] for s in range(2)]
    assert any(g > 0 for g in grown)
    for s in range(2):
        priced = predicted[(True, s, key)] - predicted[(False, s, key)]
        assert priced == pytest.approx(grown[s]), s


@pytest.mark.slow  # remat pipelines compiled and run
def test_pipeline_remat_hands_b_the_layer_inputs_and_b_recomputes():
    spec, graph, groups = gpt()
    mesh, m = {"data": 2}, 2
    assignment = {g.id: "data" for g in batch_groups(groups)}
    plan = pipeline_plan(graph, groups, uniform_cuts(graph, groups, 2), mesh, assignment, m)
    args = spec.concrete_args(0)
    want = jax.jit(spec.step_fn)(*args)
    programs = {}
    for remat in (False, True):
        run = am.apply(spec.step_fn, dataclasses.replace(plan, remat=remat))
        assert_same(run(*args), want, spec.config["learning_rate"])
        programs[remat] = {(p.stage, p.kind): p.compiled for p in run.compile(*args)}
    rc = recompute_plan(graph, groups)
    pipe = run.prepare(*args)
    for s in range(2):
        f_plain, f_remat = programs[False][(s, Phase.FWD)], programs[True][(s, Phase.FWD)]
        b_plain, b_remat = programs[False][(s, Phase.BWD)], programs[True][(s, Phase.BWD)]
        # What a microbatch in flight holds between its F and its B: F's outputs.
        held = f_remat.memory_analysis().output_size_in_bytes
        assert held < 0.2 * f_plain.memory_analysis().output_size_in_bytes
        # B runs the stage's recomputed ops again: their FLOPs per microbatch per device.
        own = rc.restricted(pipe.part.ops(s, Phase.FWD))
        again = sum(graph.ops[i].flops for i in own.ops) / (m * mesh["data"])
        assert _flops(b_remat) - _flops(b_plain) == pytest.approx(again, rel=0.05)


def test_cost_model_charges_every_recomputed_op_and_keeps_what_the_runtime_keeps():
    spec, graph, groups = gpt()
    model = CostModel(graph, Cluster.preset("a100", devices=1), groups)
    rc = recompute_plan(graph, groups)
    plain = model.evaluate({}, {}, remat=False)
    remat = model.evaluate({}, {}, remat=True)
    coef, first = model.tables.op_coef, model.tables.remat_op_coef
    # Each recomputed op runs twice: once as `op_coef` prices it (the recompute writes what
    # the backward reads), once in a first forward that keeps none of it (lighter).
    assert remat.compute_s - plain.compute_s == pytest.approx(sum(first[i] for i in rc.ops))
    assert 0 < sum(first[i] for i in rc.ops) < sum(coef[i] for i in rc.ops)
    dots = [i for i in rc.ops if graph.ops[i].primitive == "dot_general"]
    # Matmuls are recomputed and charged in full.
    assert dots and all(first[i] == coef[i] > 0 for i in dots)
    # Kept: every layer's input (the residual stream), so never nothing.
    stream = CONFIG["batch"] * CONFIG["seq"] * CONFIG["hidden"] * 4
    acts = remat.memory_breakdown["activations"]
    assert len(rc.layers) * stream <= acts < plain.memory_breakdown["activations"]
    # Exactly what the pipeline runtime's F segments hand to B segments (a stage's input
    # is held on both sides of its cut, as the pipeline's memory model counts it).
    mesh, assignment = {"data": 2}, {g.id: "data" for g in batch_groups(groups)}
    plan = pipeline_plan(graph, groups, uniform_cuts(graph, groups, 2), mesh, assignment, 2)
    pipe = am.apply(spec.step_fn, dataclasses.replace(plan, remat=True)).prepare(
        *spec.abstract_args()
    )
    made = {
        t
        for seg in pipe.micro
        if seg.kind is Phase.FWD
        for i in seg.ops
        for t in graph.ops[i].outputs
    }
    handed = {t for seg in pipe.micro if seg.kind is Phase.BWD for t in seg.inputs if t in made}
    # The jaxpr's residuals less the recomputed layers' own, the cheap ones B makes again
    # (`_remat/_remake.py`) swapped for what they are made from: as the stage price counts.
    res = residuals(graph, groups)
    kept = stage_residuals(
        graph, pipe.part, res, graph.consumers(), True, set(generated(graph, pipe.part))
    )
    assert handed == {t for ts in kept for t in ts if t in made}
