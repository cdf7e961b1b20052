"""The Q-network: an MLP torso and a dueling head, in plain JAX, with optional NoisyNet layers.

Parameters are a plain pytree (dicts and lists of arrays) so that they serialize with
`flax.serialization` and transfer between models: the observation and action sizes are fixed
by the decision process, never by the model being planned.

A noisy layer (Fortunato et al., 2018, factorized Gaussian) keeps the mean weights in
"w"/"b" exactly like a plain layer and adds "w_sigma"/"b_sigma"; a network is noisy when its
layers carry sigmas, so the same forward function serves both kinds.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

Params = dict[str, Any]

# Invalid actions get a large finite negative value rather than -inf: a masked value that is
# multiplied by a zero discount must stay 0, and -inf * 0 is nan.
MASKED_Q = -1e9


def _init_linear(key: jax.Array, n_in: int, n_out: int, *, noisy: bool, sigma0: float) -> Params:
    # The NoisyNet paper's initialization, used for plain layers too: uniform in ±1/sqrt(fan-in).
    bound = 1.0 / jnp.sqrt(n_in)
    k_w, k_b = jax.random.split(key)
    layer = {
        "w": jax.random.uniform(k_w, (n_in, n_out), jnp.float32, -bound, bound),
        "b": jax.random.uniform(k_b, (n_out,), jnp.float32, -bound, bound),
    }
    if noisy:
        layer["w_sigma"] = jnp.full((n_in, n_out), sigma0 * bound, jnp.float32)
        layer["b_sigma"] = jnp.full((n_out,), sigma0 * bound, jnp.float32)
    return layer


def init_params(
    key: jax.Array,
    obs_dim: int,
    n_actions: int,
    hidden: tuple[int, ...],
    *,
    noisy: bool,
    sigma0: float = 0.5,
) -> Params:
    """Initial parameters: a torso of `hidden` layers, a value head and an advantage head."""
    keys = jax.random.split(key, len(hidden) + 2)
    sizes = (obs_dim, *hidden)
    # The torso stays deterministic: noise in the heads is enough to drive exploration, and
    # a plain torso learns the features of the decision faster on short budgets.
    torso = [
        _init_linear(keys[i], sizes[i], sizes[i + 1], noisy=False, sigma0=sigma0)
        for i in range(len(hidden))
    ]
    return {
        "torso": torso,
        "value": _init_linear(keys[-2], sizes[-1], 1, noisy=noisy, sigma0=sigma0),
        "advantage": _init_linear(keys[-1], sizes[-1], n_actions, noisy=noisy, sigma0=sigma0),
    }


def _scaled_noise(key: jax.Array, size: int) -> jax.Array:
    # f(x) = sign(x) sqrt(|x|): the factorized-noise transform of the NoisyNet paper.
    x = jax.random.normal(key, (size,), jnp.float32)
    return jnp.sign(x) * jnp.sqrt(jnp.abs(x))


def linear(layer: Params, x: jax.Array, key: jax.Array | None) -> jax.Array:
    """x [B, in] -> [B, out]; noisy layers draw fresh factorized noise from `key`."""
    w, b = layer["w"], layer["b"]  # [in, out], [out]
    if key is not None and "w_sigma" in layer:
        k_in, k_out = jax.random.split(key)
        eps_in = _scaled_noise(k_in, w.shape[0])  # [in]
        eps_out = _scaled_noise(k_out, w.shape[1])  # [out]
        w = w + layer["w_sigma"] * (eps_in[:, None] * eps_out[None, :])  # [in, out]
        b = b + layer["b_sigma"] * eps_out  # [out]
    return x @ w + b


def dueling(value: jax.Array, advantage: jax.Array, mask: jax.Array) -> jax.Array:
    """Q = V + A - mean(A over the valid actions): value [B, 1], advantage/mask [B, A] -> [B, A].

    The mean runs over valid actions only, so that the advantages of actions that can never be
    taken do not shift the value of the ones that can.
    """
    valid = mask.astype(jnp.float32)  # [B, A]
    count = jnp.maximum(valid.sum(axis=-1, keepdims=True), 1.0)  # [B, 1]
    mean_adv = (advantage * valid).sum(axis=-1, keepdims=True) / count  # [B, 1]
    return value + advantage - mean_adv  # [B, A]


def q_values(
    params: Params, obs: jax.Array, mask: jax.Array, key: jax.Array | None = None
) -> jax.Array:
    """Unmasked Q-values obs [B, D], mask [B, A] -> [B, A]; `key=None` uses the mean weights."""
    keys = [None, None] if key is None else list(jax.random.split(key))
    h = obs
    for layer in params["torso"]:
        h = jax.nn.relu(linear(layer, h, None))  # [B, H]
    value = linear(params["value"], h, keys[0])  # [B, 1]
    advantage = linear(params["advantage"], h, keys[1])  # [B, A]
    return dueling(value, advantage, mask)


def masked(q: jax.Array, mask: jax.Array) -> jax.Array:
    """Q-values with invalid actions pushed to MASKED_Q, so no max or argmax ever picks them."""
    return jnp.where(mask, q, MASKED_Q)


def noise_scale(params: Params) -> float:
    """Mean |sigma| of the noisy layers' weights (0 for a plain network): how much it explores."""
    sigmas = [
        jnp.abs(params[head]["w_sigma"]).mean()
        for head in ("value", "advantage")
        if "w_sigma" in params[head]
    ]
    return float(sum(sigmas) / len(sigmas)) if sigmas else 0.0
