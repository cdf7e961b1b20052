"""Steps a user may write that automap must refuse at capture with one line, or handle:
a per-device program (pmap, shard_map), a step that returns or computes nothing, a typed
PRNG key among the arguments (issue 28, items 4.3-4.5)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import automap as am
from automap._groups import build_groups
from automap._pipeline import pipeline_plan, uniform_cuts
from automap._zoo import get_model

CPU2 = am.Cluster.preset("cpu", devices=2)
W, X = {"w": jnp.ones((16, 8))}, jnp.ones((8, 16))


def _pmapped(params, batch):
    y = jax.pmap(lambda x: x * 2)(batch.reshape(1, *batch.shape))[0]
    return jnp.sum(y @ params["w"])


def _shard_mapped(params, batch):
    mesh = jax.make_mesh((1,), ("d",))
    y = jax.shard_map(lambda x: x * 2, mesh=mesh, in_specs=P(), out_specs=P())(batch)
    return jnp.sum(y @ params["w"])


@pytest.mark.parametrize("step", [_pmapped, _shard_mapped])
def test_a_per_device_program_is_refused_at_capture(step):
    with pytest.raises(am.CaptureError, match=r"shard_map .*without jax.pmap / jax.shard_map") as e:
        am.capture(step, W, X)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("step", "what"),
    [(lambda params, batch: None, "returns nothing"), (lambda params, batch: params, "computes")],
)
def test_a_step_without_work_is_one_line(step, what):
    with pytest.raises(am.CaptureError, match=what) as e:
        am.plan(step, W, X, cluster=CPU2, searcher="ilp")
    assert "\n" not in str(e.value)


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
