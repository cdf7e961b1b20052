"""Stage cuts of a post-LN encoder (BERT): the layer ends with its norm, so the cheap cut
between layers is after the norm, not the residual add before it (issue 28, item 4.6)."""

from __future__ import annotations

import jax
import pytest

import automap as am
from automap._groups import build_groups
from automap._pipeline import cut_runs
from automap._space import layer_boundaries, layer_cuts
from automap._zoo import get_model
from pipeline._models import assert_same

SMALL = dict(layers=4, hidden=32, heads=4, batch=4, seq=16, vocab=64, dtype="float32")


@pytest.fixture(scope="module")
def bert():
    spec = get_model("bert-base", **SMALL)
    graph = am.capture(spec.step_fn, *spec.abstract_args())
    return spec, graph, build_groups(graph)


def test_every_bert_layer_has_a_boundary(bert):
    _, graph, groups = bert
    bounds = layer_boundaries(graph, groups)
    cands = {run.candidate for run in cut_runs(graph, groups)}
    # After each layer a boundary that is not the run's own candidate (that one, before
    # the layer's trailing norm, is inside the layer), as cheap within the band.
    ends = [b for b in bounds if b not in cands]
    assert len(ends) == SMALL["layers"]
    assert len(layer_cuts(graph, groups, 2)) == 1 and len(layer_cuts(graph, groups, 4)) == 3


def test_a_bert_pipeline_recipe_is_priced_and_runs(bert):
    spec = bert[0]
    recipe = am.Recipe(pp=2, microbatches=2)
    cluster = am.Cluster.preset("cpu", devices=2)
    plan = am.plan_recipe(spec.step_fn, *spec.abstract_args(), recipe=recipe, cluster=cluster)
    assert plan.pipelined and len(plan.stages) == 2 and plan.predicted.feasible
    args = spec.concrete_args(0)
    got = am.apply(spec.step_fn, plan)(*args)
    assert_same(got, jax.jit(spec.step_fn)(*args), spec.config["learning_rate"])
