"""Steps a user may write that automap must refuse at capture with one line, or handle:
a per-device program (pmap, shard_map), a step that returns or computes nothing, a typed
PRNG key among the arguments (issue 28, items 4.3-4.5)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import automap as am
from automap._groups import build_groups
from automap._pipeline import pipeline_plan, uniform_cuts
from automap._zoo import get_model

CPU2 = am.Cluster.preset("cpu", devices=2)
W, X = {"w": jnp.ones((16, 8))}, jnp.ones((8, 16))


def _noisy(params, batch, key):
    noise = jax.random.normal(key, batch.shape)
    loss, grads = jax.value_and_grad(lambda p: jnp.mean((batch + noise) @ p["w"]))(params)
    return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def test_verify_takes_a_typed_key():
    args = (W, X, jax.random.key(0))
    plan = am.plan(_noisy, *args, cluster=CPU2, searcher="expert")
    assert am.verify(_noisy, plan, *args).numerics_ok


def test_a_pipeline_verifies_with_a_typed_key():
    spec = get_model("gpt-1.3b", layers=4, hidden=32, heads=4, batch=4, seq=16, vocab=64)

    def step(params, opt_state, batch, key):
        loss, params, opt_state = spec.step_fn(params, opt_state, batch)
        return loss + 0.0 * jax.random.normal(key, ()), params, opt_state

    args = (*spec.concrete_args(0), jax.random.key(0))
    graph = am.capture(step, *args)
    groups = build_groups(graph)
    cuts = uniform_cuts(graph, groups, 2)
    plan = pipeline_plan(graph, groups, cuts, {"data": 1}, {}, 2, "1f1b", name="pp")
    report = am.verify(step, plan, *args)
    assert report.numerics_ok and len(report.stage_memory_bytes) == 2
