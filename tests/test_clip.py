"""Gradient clipping by global norm (`clip_norm`, as Megatron-LM's `--clip-grad`): the step
runs it, XLA compiles its norm as one combined all-reduce over a tensor-parallel axis, and
the cost model prices that all-reduce once, not once per split parameter."""

from __future__ import annotations

import re

import jax
import numpy as np
import optax
import pytest

import automap as am
from automap import ModelError
from automap._verify import compile_plan, parse_collectives
from automap._zoo import get_model

TINY = dict(layers=2, hidden=64, heads=8, seq=32, batch=16, vocab=128, dtype="float32")


def test_the_step_clips_the_gradients_to_their_global_norm_before_adam():
    # A bound far under the gradients' norm: Adam's first moment is (1 - b1) times the
    # clipped gradients, so its norm is (1 - b1) x the bound (unclipped, it is far more).
    clip = 1e-3
    spec = get_model("gpt2-xl", **{**TINY, "layers": 1, "seq": 8, "batch": 2}, clip_norm=clip)
    params, opt_state, batch = spec.concrete_args()
    _, _, new_state = jax.jit(spec.step_fn)(params, opt_state, batch)
    mu = optax.tree.get(new_state, "mu")
    norm = float(optax.tree.norm(mu))
    assert norm == pytest.approx(0.1 * clip, rel=1e-4)
    unclipped = get_model("gpt2-xl", **{**TINY, "layers": 1, "seq": 8, "batch": 2})
    _, _, plain_state = jax.jit(unclipped.step_fn)(params, unclipped.optimizer.init(params), batch)
    plain_mu = optax.tree.get(plain_state, "mu")
    assert float(optax.tree.norm(plain_mu)) > 100 * norm
    # The same direction: clipping scales every gradient by one factor.
    scale = norm / float(optax.tree.norm(plain_mu))
    for a, b in zip(jax.tree.leaves(mu), jax.tree.leaves(plain_mu), strict=True):
        np.testing.assert_allclose(a, b * scale, rtol=1e-3, atol=1e-12)


@pytest.mark.parametrize("bad", [0, -1.0, "0"])
def test_a_clip_norm_that_is_not_positive_is_refused(bad):
    with pytest.raises(ModelError, match="clip_norm"):
        get_model("gpt2-xl", **TINY, clip_norm=bad)


def test_the_norms_partial_sums_are_one_all_reduce_compiled_and_priced():
    # At tp 8 every split parameter's sum of squares is a partial sum: XLA's combiner
    # joins them into one all-reduce of scalars; priced one by one, each would pay the
    # all-reduce's latency (21 here, 481 on a 22B GPT).
    cluster = am.Cluster.preset("a100", devices=8)
    priced = {}
    for clip in (None, 1.0):
        spec = get_model("gpt2-xl", **TINY, clip_norm=clip)
        step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
        plan = am.plan_recipe(step, *args, recipe=am.Recipe(tp=8), cluster=cluster)
        priced[clip] = sum(c.count for c in plan.predicted.collectives if c.kind == "all-reduce")
    text = compile_plan(step, plan, args)[1].as_text()
    scalars = [
        c
        for c in parse_collectives(text, 8)
        if c.kind == "all-reduce"
        and re.fullmatch(r"\((f32\[\](, )?(/\*index=\d+\*/)?)+\)", c.shape)
    ]
    assert len(scalars) == 1
    assert priced[1.0] - priced[None] == len(scalars)
