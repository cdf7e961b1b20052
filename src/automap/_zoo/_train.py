"""What every zoo model shares: the training step, the loss, and the `ModelSpec` around them.

A model module only says how to initialise parameters, how to draw a batch and how to
compute the loss; the step (forward, loss, backward, Adam) is built here once, so every
model's program has the same shape: the planners see one kind of training step.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from .._errors import ModelError

#: Compute dtypes a model accepts as its `dtype` override. Parameters are always float32
#: (mixed precision: float32 master weights and Adam moments, compute in `dtype`).
DTYPES: Mapping[str, Any] = types.MappingProxyType(
    {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
)


class ModelParts(NamedTuple):
    """The three functions a model module provides; the step is built from them."""

    init_params: Callable[[jax.Array], Any]
    """key -> parameter pytree (float32)."""
    make_batch: Callable[[jax.Array], Any]
    """key -> one global batch of random inputs and targets."""
    loss_fn: Callable[[Any, Any], jax.Array]
    """(params, batch) -> scalar float32 loss."""


def make_step(loss_fn: Callable[[Any, Any], jax.Array], optimizer: optax.GradientTransformation):
    """The training step: forward + loss, backward, one optimizer update.

    The argument names `params, opt_state, batch` are part of the contract: capture infers
    each input leaf's role from them.
    """

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        return loss, new_params, new_opt_state

    return step


def clipped_adam(learning_rate: float, clip_norm: float | None = None):
    """Adam, after scaling the gradients down to a global L2 norm of `clip_norm` where one
    is given (None: Adam alone).

    Clipping is what Megatron-LM's optimizer does before every Adam step (`--clip-grad`,
    1.0 by default): it reads every gradient once for the norm and, where the gradients are
    split over a tensor-parallel axis, all-reduces the partial sums of squares. Built from
    optax's transformations, so the step's program holds that reduction and the planners
    price it as they price any other op.
    """
    adam = optax.adam(learning_rate)
    if clip_norm is None:
        return adam
    return optax.chain(optax.clip_by_global_norm(clip_norm), adam)


def cross_entropy(logits: jax.Array, labels: jax.Array, weights: jax.Array | None = None):
    """Mean softmax cross-entropy of integer `labels`, computed in float32.

    The labels are turned into a one-hot mask rather than gathered: an elementwise product
    along the class (vocab) dimension partitions cleanly when that dimension is sharded
    (Megatron's vocab-parallel loss), where a gather would force XLA to gather the logits.
    """
    logits = logits.astype(jnp.float32)  # [..., classes]
    logp = jax.nn.log_softmax(logits, axis=-1)
    onehot = jax.nn.one_hot(labels, logits.shape[-1], dtype=jnp.float32)
    nll = -jnp.sum(logp * onehot, axis=-1)  # [...]
    if weights is None:
        return jnp.mean(nll)
    weights = weights.astype(jnp.float32)
    return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def resolve_ff(ff: int | None, hidden: int) -> int:
    """The feed-forward width: explicit, or 4 × hidden (so `hidden=64` scales it too)."""
    return 4 * hidden if ff is None else ff


def check_config(name: str, cfg: Any) -> None:
    """Raise ModelError for a non-positive size, an unknown dtype or heads not dividing hidden."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, int) and not isinstance(value, bool) and value <= 0:
            raise ModelError(f"{name}: override {f.name}={value} must be a positive integer")
        if isinstance(value, float) and value <= 0:
            raise ModelError(f"{name}: override {f.name}={value} must be positive")
    dtype = getattr(cfg, "dtype", "float32")
    if dtype not in DTYPES:
        raise ModelError(f"{name}: dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    hidden, heads = getattr(cfg, "hidden", None), getattr(cfg, "heads", None)
    # A model with its own head width (llama's head_dim) need not split hidden into heads.
    if heads is not None and getattr(cfg, "head_dim", None) is None and hidden % heads:
        raise ModelError(
            f"{name}: hidden={hidden} is not divisible by heads={heads}; "
            "override both (e.g. hidden=64, heads=4)"
        )


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A built-in model at one configuration: its training step and how to feed it.

    `abstract_args()` is what planning uses: shapes and dtypes only, so a 6.7B-parameter
    model is planned without allocating its weights. `concrete_args()` draws real arrays,
    for small variants in numeric checks.
    """

    name: str
    """Registry name, e.g. "bert-large"."""
    description: str
    """One line for `automap models`."""
    config: Mapping[str, Any]
    """The effective configuration after overrides (read-only)."""
    step_fn: Callable[..., tuple[Any, Any, Any]]
    """step(params, opt_state, batch) -> (loss, new_params, new_opt_state); pure."""
    init_params: Callable[[jax.Array], Any] = dataclasses.field(repr=False, compare=False)
    """key -> parameters (float32)."""
    make_batch: Callable[[jax.Array], Any] = dataclasses.field(repr=False, compare=False)
    """key -> one global batch of random data."""
    optimizer: optax.GradientTransformation = dataclasses.field(repr=False, compare=False)
    """The transformation the step applies (`clipped_adam`: Adam, clipped or not);
    `optimizer.init(params)` gives opt_state."""
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The overrides given to get_model: `get_model(name, **overrides)` rebuilds this spec."""

    @functools.cached_property
    def _abstract(self) -> tuple[Any, Any, Any]:
        # Tracing the init of a full-size model takes seconds; callers (capture, plan,
        # apply) ask repeatedly, so the shapes are computed once per spec.
        key = jax.random.PRNGKey(0)
        params = jax.eval_shape(self.init_params, key)
        opt_state = jax.eval_shape(self.optimizer.init, params)
        batch = jax.eval_shape(self.make_batch, key)
        return params, opt_state, batch

    def abstract_args(self) -> tuple[Any, Any, Any]:
        """(params, opt_state, batch) as pytrees of jax.ShapeDtypeStruct; allocates nothing."""
        # A fresh copy of the containers, so a caller editing one cannot corrupt the cache.
        return jax.tree.map(lambda leaf: leaf, self._abstract)

    def concrete_args(self, seed: int = 0) -> tuple[Any, Any, Any]:
        """(params, opt_state, batch) as real random arrays; only sensible for small variants."""

        def draw(key):
            init_key, batch_key = jax.random.split(key)
            params = self.init_params(init_key)
            return params, self.optimizer.init(params), self.make_batch(batch_key)

        # One program rather than three, compiled without LLVM optimisation: it runs once,
        # and for small variants compiling is most of the time (half of it at -O0).
        key = jax.random.PRNGKey(seed)
        compiled = jax.jit(draw).lower(key).compile({"xla_backend_optimization_level": 0})
        return compiled(key)

    @functools.cached_property
    def param_count(self) -> int:
        """Number of trainable parameters, from the abstract shapes."""
        leaves = jax.tree.leaves(self._abstract[0])
        return sum(int(leaf.size) for leaf in leaves)


def build_spec(
    name: str, description: str, cfg: Any, parts: ModelParts, overrides: Mapping[str, Any]
) -> ModelSpec:
    """Wrap a model's parts into a ModelSpec with the shared Adam step (clipped to the
    gradients' global norm where the configuration has a `clip_norm` set)."""
    optimizer = clipped_adam(cfg.learning_rate, getattr(cfg, "clip_norm", None))
    return ModelSpec(
        name=name,
        description=description,
        config=types.MappingProxyType(dataclasses.asdict(cfg)),
        step_fn=make_step(parts.loss_fn, optimizer),
        init_params=parts.init_params,
        make_batch=parts.make_batch,
        optimizer=optimizer,
        overrides=types.MappingProxyType(dict(overrides)),
    )
