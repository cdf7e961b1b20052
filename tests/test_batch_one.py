"""A batch of one (long sequences, large models): one-stage plans are searched, priced and
run, recomputation included; pipelines and data parallelism, which need a batch to split,
are refused with one line (issue 28, item 4.1)."""

from __future__ import annotations

import jax
import pytest

import automap as am
from automap._zoo import get_model
from pipeline._models import assert_same

TINY = dict(layers=2, hidden=32, heads=4, batch=1, seq=16, vocab=64, dtype="float32")
ONE = am.Cluster.preset("cpu", devices=1)


@pytest.fixture(scope="module")
def gpt():
    return get_model("gpt-1.3b", **TINY)


@pytest.mark.parametrize("searcher", ["ilp", "exhaustive", "expert"])
def test_a_batch_of_one_is_planned_on_one_stage(gpt, searcher):
    plan = am.plan(gpt.step_fn, *gpt.abstract_args(), cluster=ONE, searcher=searcher, budget_s=5)
    assert not plan.pipelined and plan.predicted.feasible


def test_a_batch_of_one_recomputes_its_layers_and_runs(gpt):
    args = gpt.abstract_args()
    # Donating, as a training loop runs it: a step that donates nothing peaks at its update
    # (its new state beside the old), where recomputation saves nothing.
    step = jax.jit(gpt.step_fn, donate_argnums=(0, 1))
    plain, remat = (
        am.plan_recipe(step, *args, recipe=am.Recipe(remat=r), cluster=ONE)
        for r in ("none", "full")
    )
    # Recomputation finds the layers of a batch of one: the forward runs again, and less
    # stays alive between forward and backward.
    assert remat.remat and remat.predicted.compute_s > plain.predicted.compute_s
    assert remat.predicted.memory_bytes < plain.predicted.memory_bytes
    concrete = gpt.concrete_args(0)
    got = am.apply(gpt.step_fn, remat)(*concrete)
    assert_same(got, jax.jit(gpt.step_fn)(*concrete), gpt.config["learning_rate"])


@pytest.mark.parametrize(
    "fields",
    [dict(tp=1, pp=2, dp=1), dict(tp=1, pp=1, dp=2), dict(tp=2, pp=2, dp=1, microbatches=1)],
)
def test_a_batch_of_one_refuses_a_pipeline_or_data_split_in_one_line(gpt, fields):
    cluster = am.Cluster.preset("a100", devices=fields["tp"] * fields["pp"] * fields["dp"])
    with pytest.raises(am.PlanError, match=r"no batch dimension to split .*use dp=1 and pp=1"):
        am.plan_recipe(
            gpt.step_fn, *gpt.abstract_args(), recipe=am.Recipe(**fields), cluster=cluster
        )
