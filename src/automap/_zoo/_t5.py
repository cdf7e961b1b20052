"""T5: an encoder-decoder with RMS norms, no biases and a relative position bias.

The relative bias table is read through a one-hot einsum instead of a gather, so its
gradient is a dot_general like every other weight's (and it is tiny: buckets × heads).
Attention is scaled by 1/sqrt(head size) as in the other models; T5 folds that factor into
its initialisation instead, which changes no shape and no cost.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from ._train import DTYPES, ModelParts, check_config, cross_entropy, resolve_ff
from ._transformer import Attention, Mlp, dense

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class T5Config:
    """T5 v1.0 shapes (ReLU feed-forward, d_kv × heads = hidden)."""

    layers: int = 24
    """Layers in each stack: the encoder and the decoder both have this many."""
    hidden: int = 1024
    """Model width (d_model)."""
    heads: int = 16
    """Attention heads; must divide hidden."""
    ff: int | None = None
    """Feed-forward width (d_ff); None means 4 × hidden."""
    vocab: int = 32128
    """Vocabulary size (T5's 32k SentencePiece vocabulary padded to 32,128)."""
    tie_head: bool = False
    """Share the output projection with the input embedding (T5 v1.0) or not (v1.1)."""
    seq: int = 512
    """Encoder (input) length."""
    target_seq: int | None = None
    """Decoder (target) length; None means seq // 4 (span-corruption targets are about a
    quarter of the inputs: 512 -> 128)."""
    buckets: int = 32
    """Relative position buckets."""
    max_distance: int = 128
    """Distance beyond which relative positions share the last bucket."""
    batch: int = 64
    """Global batch size in sequence pairs."""
    dtype: str = "bfloat16"
    """Compute dtype; parameters and Adam moments stay float32."""
    learning_rate: float = 1e-4
    """Adam step size."""

    def resolved(self) -> T5Config:
        check_config("t5", self)
        target = max(1, self.seq // 4) if self.target_seq is None else self.target_seq
        return dataclasses.replace(self, ff=resolve_ff(self.ff, self.hidden), target_seq=target)


def relative_buckets(
    q_len: int, k_len: int, bidirectional: bool, buckets: int, max_distance: int
) -> jax.Array:
    """int32[q_len, k_len]: T5's bucket of each (query, key) offset, exact for small offsets
    and logarithmic up to max_distance (Raffel et al., mesh-tensorflow's formula)."""
    ctx = lax.broadcasted_iota(jnp.int32, (q_len, k_len), 0)
    mem = lax.broadcasted_iota(jnp.int32, (q_len, k_len), 1)
    n = ctx - mem  # positive: the key is behind the query
    ret = jnp.zeros_like(n)
    if bidirectional:
        buckets //= 2
        ret = ret + (n < 0).astype(jnp.int32) * buckets
        n = jnp.abs(n)
    else:
        n = jnp.maximum(n, 0)
    exact = buckets // 2
    # eps keeps log finite at n = 0 (that offset takes the exact branch anyway).
    scaled = jnp.log(n.astype(_F32) / exact + jnp.finfo(_F32).eps) / math.log(max_distance / exact)
    large = exact + (scaled * (buckets - exact)).astype(jnp.int32)
    large = jnp.minimum(large, buckets - 1)
    return ret + jnp.where(n < exact, n, large)


class T5Stack(nn.Module):
    """An encoder stack (`memory` None) or a decoder stack (causal, cross-attending)."""

    cfg: T5Config
    decoder: bool

    @nn.compact
    def __call__(self, x, memory=None):  # x: [B, S, H]
        cfg, dtype = self.cfg, DTYPES[self.cfg.dtype]
        s = x.shape[1]
        table = self.param(
            "relative_bias", nn.initializers.normal(0.02), (cfg.buckets, cfg.heads), _F32
        )
        onehot = jax.nn.one_hot(
            relative_buckets(s, s, not self.decoder, cfg.buckets, cfg.max_distance),
            cfg.buckets,
            dtype=_F32,
        )  # [S, S, buckets]
        # One bias, computed once and shared by every layer of the stack (as in T5).
        bias = jnp.einsum("qkn,nh->hqk", onehot, table)[None]  # [1, h, S, S]
        for i in range(cfg.layers):
            x = T5Layer(cfg, self.decoder, name=f"layer_{i}")(x, bias, memory)
        return rms_norm(dtype, "final_norm")(x)


def rms_norm(dtype, name: str) -> nn.RMSNorm:
    return nn.RMSNorm(epsilon=1e-6, dtype=dtype, param_dtype=_F32, name=name)


class T5Layer(nn.Module):
    """Pre-norm layer: self-attention, cross-attention (decoder only), ReLU feed-forward."""

    cfg: T5Config
    decoder: bool

    @nn.compact
    def __call__(self, x, bias, memory):
        cfg, dtype = self.cfg, DTYPES[self.cfg.dtype]
        attn = Attention(
            cfg.heads, cfg.dtype, causal=self.decoder, use_bias=False, name="self_attention"
        )
        x = x + attn(rms_norm(dtype, "attention_norm")(x), bias=bias)
        if self.decoder:
            cross = Attention(cfg.heads, cfg.dtype, use_bias=False, name="cross_attention")
            x = x + cross(rms_norm(dtype, "cross_norm")(x), kv=memory)
        mlp = Mlp(cfg.ff, cfg.dtype, activation="relu", use_bias=False, name="mlp")
        return x + mlp(rms_norm(dtype, "mlp_norm")(x))


class T5(nn.Module):
    cfg: T5Config

    @nn.compact
    def __call__(self, inputs, decoder_inputs):  # int32[B, S], int32[B, T]
        cfg, dtype = self.cfg, DTYPES[self.cfg.dtype]
        embed = nn.Embed(cfg.vocab, cfg.hidden, dtype=dtype, param_dtype=_F32, name="shared")
        memory = T5Stack(cfg, decoder=False, name="encoder")(embed(inputs))  # [B, S, H]
        y = T5Stack(cfg, decoder=True, name="decoder")(embed(decoder_inputs), memory)
        if cfg.tie_head:
            # T5 v1.0 rescales before the tied projection to keep logits at unit scale.
            return embed.attend(y * cfg.hidden**-0.5)  # [B, T, vocab]
        return dense(cfg.vocab, dtype, "lm_head", use_bias=False)(y)


def build_t5(cfg: T5Config) -> ModelParts:
    model = T5(cfg)

    def init_params(key):
        return model.init(
            key, jnp.zeros((1, cfg.seq), jnp.int32), jnp.zeros((1, cfg.target_seq), jnp.int32)
        )

    def make_batch(key):
        ki, kd, kt = jax.random.split(key, 3)
        draw = jax.random.randint
        return {
            "inputs": draw(ki, (cfg.batch, cfg.seq), 0, cfg.vocab, jnp.int32),
            "decoder_inputs": draw(kd, (cfg.batch, cfg.target_seq), 0, cfg.vocab, jnp.int32),
            "targets": draw(kt, (cfg.batch, cfg.target_seq), 0, cfg.vocab, jnp.int32),
        }

    def loss_fn(params, batch):
        logits = model.apply(params, batch["inputs"], batch["decoder_inputs"])
        return cross_entropy(logits, batch["targets"])

    return ModelParts(init_params, make_batch, loss_fn)
