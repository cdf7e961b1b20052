"""moe-gpt: a GPT decoder whose every other MLP is a GShard-style mixture of experts.

The experts are one stacked weight per matrix, wi [experts, hidden, ff] and
wo [experts, ff, hidden], and tokens reach them through dense dispatch / combine tensors
[groups, tokens, experts, capacity] contracted with einsum (Lepikhin et al., GShard):
the expert dimension is then an ordinary tensor dimension that a mesh axis can split,
and XLA turns the dispatch einsum into an all-to-all when it is split (expert parallelism).
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from .._errors import ModelError
from ._train import DTYPES, ModelParts, check_config, cross_entropy, resolve_ff
from ._transformer import Attention, GptConfig, GptLayer, layer_norm, token_batch

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class MoeGptConfig:
    """GPT-2 medium shapes with 16 experts in every other layer (GShard's layout)."""

    layers: int = 24
    """Decoder layers; layers moe_every-1, 2·moe_every-1, ... are expert layers."""
    hidden: int = 1024
    """Model width."""
    heads: int = 16
    """Attention heads; must divide hidden."""
    ff: int | None = None
    """Feed-forward width of each expert and of the dense MLPs; None means 4 × hidden."""
    experts: int = 16
    """Experts per MoE layer (the dimension expert parallelism splits)."""
    top_k: int = 2
    """Experts each token is sent to: 1 (Switch) or 2 (GShard)."""
    moe_every: int = 2
    """Every moe_every-th layer is an expert layer (GShard: every other one)."""
    capacity_factor: float = 1.25
    """Expert buffer size relative to an even split of the routed tokens."""
    aux_weight: float = 0.01
    """Weight of the load-balancing loss added to the LM loss."""
    vocab: int = 50304
    """Vocabulary (GPT-2's, padded to 128 × 393 so a model axis can split it)."""
    seq: int = 1024
    """Sequence length; one sequence is one routing group."""
    batch: int = 32
    """Global batch size in sequences."""
    dtype: str = "bfloat16"
    """Compute dtype; parameters, router and Adam moments stay float32."""
    learning_rate: float = 1e-4
    """Adam step size."""

    def resolved(self) -> MoeGptConfig:
        check_config("moe-gpt", self)
        if self.top_k not in (1, 2) or self.top_k > self.experts:
            raise ModelError(f"moe-gpt: top_k={self.top_k}; use 1 or 2 (and at most experts)")
        return dataclasses.replace(self, ff=resolve_ff(self.ff, self.hidden))

    def capacity(self) -> int:
        """Tokens each expert takes per group: capacity_factor × an even share of the routes."""
        return max(1, math.ceil(self.capacity_factor * self.top_k * self.seq / self.experts))


def route(probs: jax.Array, top_k: int, capacity: int) -> tuple[jax.Array, jax.Array]:
    """GShard top-k gating with a fixed expert capacity.

    probs: float32[G, S, E] router probabilities. Returns combine weights float32[G, S, E, C]
    (nonzero where a token sits in slot C of expert E; tokens past capacity are dropped) and
    the load-balancing loss (E × Σ_e mean routed fraction × mean probability).
    """
    g, s, e = probs.shape
    # Position of each token in its expert's buffer = a running count over the tokens. The
    # count is a matmul with a triangular matrix (as mesh-tensorflow does on TPUs) rather
    # than cumsum, so every op here is one the planners already partition.
    before = (
        lax.broadcasted_iota(jnp.int32, (s, s), 0) <= lax.broadcasted_iota(jnp.int32, (s, s), 1)
    ).astype(_F32)  # [S, S]: token t counts every t' <= t
    remaining, masks, gates = probs, [], []
    for _ in range(top_k):
        mask = jax.nn.one_hot(jnp.argmax(remaining, axis=-1), e, dtype=_F32)  # [G, S, E]
        masks.append(mask)
        gates.append(jnp.sum(probs * mask, axis=-1))  # [G, S]
        remaining = remaining * (1.0 - mask)
    aux = e * jnp.mean(jnp.sum(jnp.mean(masks[0], axis=1) * jnp.mean(probs, axis=1), axis=-1))
    # Top-2 renormalises the two gates (GShard); top-1 keeps the raw probability (Switch).
    denom = sum(gates) if top_k > 1 else jnp.ones_like(gates[0])
    filled = jnp.zeros((g, 1, e), _F32)  # slots taken by earlier choices
    combine = jnp.zeros((g, s, e, capacity), _F32)
    for mask, gate in zip(masks, gates, strict=True):
        pos = jnp.einsum("gte,ts->gse", mask, before) - 1.0 + filled  # [G, S, E]
        mask = mask * (pos < capacity)
        filled = filled + jnp.sum(mask, axis=1, keepdims=True)
        slot = jax.nn.one_hot(jnp.sum(pos * mask, axis=-1).astype(jnp.int32), capacity)
        weight = (gate / denom)[..., None, None]  # [G, S, 1, 1]
        combine = combine + weight * mask[..., None] * slot[:, :, None, :]
    return combine, aux


class MoeMlp(nn.Module):
    """Mixture-of-experts feed-forward; returns (output [G, S, H], load-balancing loss)."""

    cfg: MoeGptConfig

    @nn.compact
    def __call__(self, x):  # x: [G, S, H], one group per sequence
        cfg, dtype = self.cfg, DTYPES[self.cfg.dtype]
        init = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        wi = self.param("wi", init, (cfg.experts, x.shape[-1], cfg.ff), _F32)
        wo = self.param("wo", init, (cfg.experts, cfg.ff, x.shape[-1]), _F32)
        # The router runs in float32: bf16 logits make the top-k choice noisy (Switch, §2.4).
        logits = nn.Dense(cfg.experts, use_bias=False, param_dtype=_F32, name="router")(
            x.astype(_F32)
        )  # [G, S, E]
        combine, aux = route(jax.nn.softmax(logits, axis=-1), cfg.top_k, cfg.capacity())
        dispatch = (combine > 0).astype(dtype)  # [G, S, E, C]
        xe = jnp.einsum("gsec,gsm->egcm", dispatch, x.astype(dtype))  # [E, G, C, H]
        h = nn.gelu(jnp.einsum("egcm,emf->egcf", xe, wi.astype(dtype)), approximate=True)
        ye = jnp.einsum("egcf,efm->egcm", h, wo.astype(dtype))  # [E, G, C, H]
        return jnp.einsum("gsec,egcm->gsm", combine.astype(dtype), ye), aux


class MoeLayer(nn.Module):
    """Pre-LN decoder layer with the expert MLP in place of the dense one."""

    cfg: MoeGptConfig

    @nn.compact
    def __call__(self, x):
        cfg, dtype = self.cfg, DTYPES[self.cfg.dtype]
        x = x + Attention(cfg.heads, cfg.dtype, causal=True, name="attention")(
            layer_norm(dtype, "attention_norm")(x)
        )
        y, aux = MoeMlp(cfg, name="moe")(layer_norm(dtype, "mlp_norm")(x))
        return x + y, aux


def _dense_config(cfg: MoeGptConfig) -> GptConfig:
    """The GptConfig the dense layers share with gpt2-xl's code."""
    return GptConfig(
        layers=cfg.layers, hidden=cfg.hidden, heads=cfg.heads, ff=cfg.ff, vocab=cfg.vocab,
        seq=cfg.seq, batch=cfg.batch, dtype=cfg.dtype, learning_rate=cfg.learning_rate,
    )  # fmt: skip


class MoeGpt(nn.Module):
    cfg: MoeGptConfig

    @nn.compact
    def __call__(self, tokens):  # tokens: int32[B, S]
        cfg, dtype = self.cfg, DTYPES[self.cfg.dtype]
        embed = nn.Embed(cfg.vocab, cfg.hidden, dtype=dtype, param_dtype=_F32, name="token_embed")
        pos = self.param(
            "position_embed", nn.initializers.normal(0.02), (cfg.seq, cfg.hidden), _F32
        )
        x = embed(tokens) + pos.astype(dtype)[None, : tokens.shape[1]]  # [B, S, H]
        aux = []
        for i in range(cfg.layers):
            if i % cfg.moe_every == cfg.moe_every - 1:
                x, layer_aux = MoeLayer(cfg, name=f"layer_{i}")(x)
                aux.append(layer_aux)
            else:
                x = GptLayer(_dense_config(cfg), name=f"layer_{i}")(x)
        x = layer_norm(dtype, "final_norm")(x)
        aux_loss = sum(aux) / len(aux) if aux else jnp.zeros((), _F32)
        return embed.attend(x), aux_loss  # [B, S, vocab], scalar


def build_moe_gpt(cfg: MoeGptConfig) -> ModelParts:
    model = MoeGpt(cfg)

    def init_params(key):
        return model.init(key, jnp.zeros((1, cfg.seq), jnp.int32))

    def make_batch(key):
        return token_batch(key, cfg.batch, cfg.seq, cfg.vocab)

    def loss_fn(params, batch):
        logits, aux = model.apply(params, batch["tokens"])
        return cross_entropy(logits, batch["targets"]) + cfg.aux_weight * aux

    return ModelParts(init_params, make_batch, loss_fn)
