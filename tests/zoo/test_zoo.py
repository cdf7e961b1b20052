"""The model zoo: sizes of the full models, traceable steps of small variants, real training.

Full-size models are only ever shaped (jax.eval_shape of their init): tracing their whole
step would take minutes on the CPU, and their weights would not fit in its memory anyway.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import pytest

from automap import ModelError
from automap._zoo import ModelInfo, ModelSpec, get_model, list_models

# Exact counts of the default configurations: a change to any model shows up here first.
EXACT_PARAMS = {
    "bert-base": 109_512_762,
    "bert-large": 337_474_560,
    "gpt2-xl": 1_557_686_400,
    "gpt-1.3b": 1_311_625_216,
    "gpt-6.7b": 6_650_208_256,
    "t5-base": 221_670_144,
    "t5-large": 770_567_168,
    "vgg19": 143_667_240,
    "resnet50": 25_557_032,
    "moe-gpt": 1_864_955_904,
    # Meta's published counts exactly (Hugging Face's config of each).
    "llama": 8_030_261_248,
    "llama2-7b": 6_738_415_616,
    "llama3-70b": 70_553_706_496,
}

_LM = dict(layers=2, hidden=64, heads=4, seq=16, batch=2, vocab=128, dtype="float32")
SMALL = {
    "mlp": dict(layers=2, hidden=32, batch=4),
    "bert-base": _LM,
    "bert-large": _LM,
    "gpt2-xl": _LM,
    "gpt-1.3b": _LM,
    "gpt-6.7b": _LM,
    "t5-base": {**_LM, "seq": 32},
    "t5-large": {**_LM, "seq": 32},
    "vgg19": dict(hidden=8, ff=32, image=32, batch=2, dtype="float32"),
    "resnet50": dict(hidden=8, image=32, batch=2, dtype="float32"),
    "moe-gpt": {**_LM, "experts": 4},
    **{
        name: {**_LM, "kv_heads": 2, "head_dim": 16, "ffn": 96}
        for name in ("llama", "llama2-7b", "llama3-70b", "llama-32b", "llama-64b", "llama-128b")
    },
}


@functools.cache
def full_size(name: str) -> ModelSpec:
    """One spec per full-size model for the whole file: shaping a big init takes seconds."""
    return get_model(name)


def test_registry_lists_every_model():
    infos = list_models()
    assert [i.name for i in infos] == list(SMALL)
    assert all(isinstance(i, ModelInfo) for i in infos)
    with pytest.raises(dataclasses.FrozenInstanceError):
        infos[0].name = "x"  # type: ignore[misc]


@pytest.mark.parametrize(
    "info", [i for i in list_models() if i.nominal_params], ids=lambda i: i.name
)
def test_param_count_within_one_percent_of_the_published_size(info):
    spec = full_size(info.name)
    assert spec.param_count == EXACT_PARAMS[info.name]
    assert abs(spec.param_count - info.nominal_params) / info.nominal_params < 0.01


def test_abstract_args_are_shapes_only():
    spec = full_size("gpt-6.7b")
    params, opt_state, batch = spec.abstract_args()
    for leaf in jax.tree.leaves((params, opt_state, batch)):
        assert isinstance(leaf, jax.ShapeDtypeStruct)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params))
    assert batch["tokens"].shape == (32, 2048)
    assert spec.config["dtype"] == "bfloat16"
    # Layers are numbered modules, so every layer's parameters have their own path.
    assert {f"layer_{i}" for i in range(32)} <= set(params["params"])


def test_moe_gpt_count_matches_its_formula():
    cfg = full_size("moe-gpt").config
    h, f, e, v, s = cfg["hidden"], cfg["ff"], cfg["experts"], cfg["vocab"], cfg["seq"]
    attention = 4 * (h * h + h) + 4 * h  # Q, K, V, out with biases; two layer norms
    dense = h * f + f + f * h + h
    experts = e * (2 * h * f) + h * e  # stacked wi and wo, router
    n_moe = cfg["layers"] // cfg["moe_every"]
    total = (
        v * h + s * h + 2 * h
        + cfg["layers"] * attention + n_moe * experts + (cfg["layers"] - n_moe) * dense
    )  # fmt: skip
    assert full_size("moe-gpt").param_count == total


@pytest.mark.parametrize("name", list(SMALL))
def test_small_variant_step_traces_on_abstract_args(name):
    spec = get_model(name, **SMALL[name])
    assert isinstance(spec, ModelSpec)
    args = spec.abstract_args()
    jaxpr, out_shapes = jax.make_jaxpr(spec.step_fn, return_shape=True)(*args)
    loss, new_params, new_opt_state = out_shapes
    assert loss.shape == () and loss.dtype == jnp.float32
    assert jax.tree.structure(new_params) == jax.tree.structure(args[0])
    assert jax.tree.structure(new_opt_state) == jax.tree.structure(args[1])
    # Every leaf goes in: nothing is closed over as a constant the planners cannot see.
    assert len(jaxpr.jaxpr.invars) == len(jax.tree.leaves(args))


def test_step_argument_names_are_the_role_contract():
    spec = get_model("mlp")
    assert list(inspect.signature(spec.step_fn).parameters) == ["params", "opt_state", "batch"]


@pytest.mark.slow  # small zoo models trained
@pytest.mark.parametrize(
    "name, overrides",
    [
        ("mlp", {}),
        ("bert-base", dict(layers=1, hidden=32, heads=2, seq=16, batch=4, vocab=64)),
    ],
)
def test_loss_decreases_when_training_a_small_variant(name, overrides):
    spec = get_model(name, dtype="float32", learning_rate=3e-3, **overrides)
    params, opt_state, batch = spec.concrete_args(seed=0)
    # -O0: the step runs six times, so LLVM's optimisation would cost more than it saves.
    step = jax.jit(spec.step_fn).lower(params, opt_state, batch)
    step = step.compile({"xla_backend_optimization_level": 0})
    losses = []
    for _ in range(6):
        loss, params, opt_state = step(params, opt_state, batch)
        losses.append(float(loss))
    assert all(jnp.isfinite(jnp.array(losses)))
    assert losses[-1] < losses[0] * 0.9, losses


def test_moe_routing_respects_capacity():
    from automap._zoo import route

    probs = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(0), (2, 16, 4)), axis=-1)
    # jit: one compile instead of one per eager op.
    combine, aux = jax.jit(route, static_argnums=(1, 2))(probs, 2, 5)
    assert combine.shape == (2, 16, 4, 5)
    # Each expert slot holds at most one token; each token sits in at most two experts.
    assert float(jnp.max(jnp.sum(combine > 0, axis=1))) <= 1
    assert float(jnp.max(jnp.sum(combine > 0, axis=(2, 3)))) <= 2
    assert jnp.isfinite(aux)


def test_unknown_model_lists_the_names():
    with pytest.raises(ModelError, match="bert-large") as err:
        get_model("bert-huge")
    assert "unknown model 'bert-huge'" in str(err.value)


def test_unknown_override_lists_the_valid_ones():
    with pytest.raises(ModelError, match=r"valid overrides: .*layers.*hidden"):
        get_model("bert-base", experts=4)


@pytest.mark.parametrize(
    "name, overrides, message",
    [
        ("bert-base", dict(hidden=100), "not divisible by heads"),
        ("gpt2-xl", dict(layers=0), "positive"),
        ("gpt2-xl", dict(layers="two"), "not a valid int"),
        ("mlp", dict(dtype="int8"), "dtype"),
        ("vgg19", dict(depth=12), "11, 13, 16, 19"),
        ("resnet50", dict(layers=2), "valid overrides: depth"),
        ("resnet50", dict(image=100), "multiple of 32"),
        ("moe-gpt", dict(top_k=3), "top_k"),
    ],
)
def test_invalid_override_values_raise_model_error(name, overrides, message):
    with pytest.raises(ModelError, match=message):
        get_model(name, **overrides)


def test_string_overrides_from_a_command_line_are_converted():
    spec = get_model("t5-base", layers="2", hidden="64", heads="4", tie_head="false")
    assert spec.config["layers"] == 2 and spec.config["tie_head"] is False
    assert spec.config["target_seq"] == 128  # seq // 4
    assert dict(spec.overrides) == dict(layers=2, hidden=64, heads=4, tie_head=False)
