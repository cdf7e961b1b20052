"""Llama: a pre-norm decoder with RMSNorm, a SwiGLU MLP, rotary positions, grouped-query
attention and an output head untied from the input embedding (Llama 2 and 3, MaxText's
decoder). No projection has a bias.

Grouped-query attention is written as JAX's own XLA attention writes it: the query heads
are reshaped to [kv_heads, heads / kv_heads] and contracted with the key and value heads
they share, so keys and values are never repeated in memory and a `model` axis splitting
the key/value heads splits the query heads with them. `attention="dot_product"` calls
`jax.nn.dot_product_attention` instead; without a cuDNN on the tracing machine it is
that same XLA program (its bf16 products accumulated in float32), captured and priced
as it runs.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from .._errors import ModelError
from ._train import DTYPES, ModelParts, check_config
from ._transformer import causal_lm_parts, causal_mask, dense, rotary

_F32 = jnp.float32

ATTENTION = ("xla", "dot_product")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Llama 3 8B's shapes by default (Meta's model card and params.json)."""

    layers: int = 32
    """Decoder layers."""
    hidden: int = 4096
    """Model width (the residual stream)."""
    heads: int = 32
    """Query heads."""
    kv_heads: int | None = 8
    """Key/value heads (grouped-query attention); must divide heads. None: as many as
    heads (multi-head attention, Llama 2 7B and MaxText's v5p models)."""
    head_dim: int | None = None
    """Width of one head; None means hidden / heads. MaxText's 128B has 128 heads of 128
    on a width of 8,192, so heads × head_dim need not equal hidden."""
    ffn: int = 14336
    """SwiGLU inner width (the gate and up projections' outputs)."""
    vocab: int = 128256
    """Vocabulary: rows of the input embedding and columns of the untied output head."""
    seq: int = 8192
    """Sequence length."""
    batch: int = 512
    """Global batch size in sequences (512 × 8,192 = 4M tokens, Llama 3's first batch)."""
    rope_theta: float = 500000.0
    """Base of the rotary angles (10,000 in Llama 2, 500,000 in Llama 3)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    attention: str = "xla"
    """"xla" (the attention written out: einsums, a float32 causal softmax) or
    "dot_product" (`jax.nn.dot_product_attention`, is_causal=True)."""
    dtype: str = "bfloat16"
    """Compute dtype; parameters and Adam moments stay float32."""
    learning_rate: float = 3e-4
    """Adam step size."""

    def resolved(self) -> LlamaConfig:
        check_config("llama", self)
        if self.attention not in ATTENTION:
            raise ModelError(f"llama: attention={self.attention!r}; use 'xla' or 'dot_product'")
        kv = self.heads if self.kv_heads is None else self.kv_heads
        if self.heads % kv:
            raise ModelError(
                f"llama: heads={self.heads} is not divisible by kv_heads={kv}; "
                "choose kv_heads dividing heads (e.g. heads=8, kv_heads=2)"
            )
        head_dim = self.hidden // self.heads if self.head_dim is None else self.head_dim
        if head_dim % 2:
            raise ModelError(f"llama: rotary positions need an even head_dim, not {head_dim}")
        return dataclasses.replace(self, kv_heads=kv, head_dim=head_dim)


def rms_norm(cfg: LlamaConfig, name: str) -> nn.RMSNorm:
    # Flax computes the mean square in float32 and scales in the compute dtype, as Llama.
    return nn.RMSNorm(epsilon=cfg.norm_eps, dtype=DTYPES[cfg.dtype], param_dtype=_F32, name=name)


class GqaAttention(nn.Module):
    """Causal grouped-query self-attention with rotary positions, no biases."""

    cfg: LlamaConfig

    @nn.compact
    def __call__(self, x):  # x: [B, S, H]
        cfg, dtype = self.cfg, DTYPES[self.cfg.dtype]
        (b, s, hidden), d, kv = x.shape, cfg.head_dim, cfg.kv_heads
        q = dense(cfg.heads * d, dtype, "query", False)(x).reshape(b, s, cfg.heads, d)
        k = dense(kv * d, dtype, "key", False)(x).reshape(b, s, kv, d)  # [B, S, kv, d]
        v = dense(kv * d, dtype, "value", False)(x).reshape(b, s, kv, d)  # [B, S, kv, d]
        q, k = rotary(q, cfg.rope_theta), rotary(k, cfg.rope_theta)
        if cfg.attention == "dot_product":
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True)  # [B, S, heads, d]
        else:
            out = _written_attention(q, k, v, dtype)
        out = out.reshape(b, s, cfg.heads * d)
        return dense(hidden, dtype, "out", False)(out)  # [B, S, H]


def _written_attention(q, k, v, dtype):
    """softmax(q·k / sqrt(d), causal) · v with each group of query heads sharing one key
    and value head. q: [B, S, heads, d]; k, v: [B, S, kv, d] -> [B, S, heads, d]."""
    b, s, heads, d = q.shape
    kv = k.shape[2]
    q = q.reshape(b, s, kv, heads // kv, d)  # [B, S, kv, g, d]
    scores = jnp.einsum("bqkgd,btkd->bkgqt", q, k) / math.sqrt(d)  # [B, kv, g, S, S]
    # Softmax in float32: bf16 logits lose the small differences attention needs.
    scores = jnp.where(causal_mask(s, s)[None, None, None], scores.astype(_F32), -1e9)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    out = jnp.einsum("bkgqt,btkd->bqkgd", probs, v)  # [B, S, kv, g, d]
    return out.reshape(b, s, heads, d)


class SwiGlu(nn.Module):
    """down(silu(gate(x)) * up(x)): gate, up [H, ffn], down [ffn, H]."""

    cfg: LlamaConfig

    @nn.compact
    def __call__(self, x):
        cfg, dtype = self.cfg, DTYPES[self.cfg.dtype]
        gate = dense(cfg.ffn, dtype, "gate", False)(x)  # [B, S, ffn]
        up = dense(cfg.ffn, dtype, "up", False)(x)  # [B, S, ffn]
        return dense(x.shape[-1], dtype, "down", False)(nn.silu(gate) * up)  # [B, S, H]


class LlamaLayer(nn.Module):
    cfg: LlamaConfig

    @nn.compact
    def __call__(self, x):
        x = x + GqaAttention(self.cfg, name="attention")(rms_norm(self.cfg, "attention_norm")(x))
        return x + SwiGlu(self.cfg, name="mlp")(rms_norm(self.cfg, "mlp_norm")(x))


class Llama(nn.Module):
    cfg: LlamaConfig

    @nn.compact
    def __call__(self, tokens):  # tokens: int32[B, S]
        cfg, dtype = self.cfg, DTYPES[self.cfg.dtype]
        embed = nn.Embed(cfg.vocab, cfg.hidden, dtype=dtype, param_dtype=_F32, name="token_embed")
        x = embed(tokens)  # [B, S, H]
        for i in range(cfg.layers):
            x = LlamaLayer(cfg, name=f"layer_{i}")(x)
        x = rms_norm(cfg, "final_norm")(x)
        return dense(cfg.vocab, dtype, "lm_head", False)(x)  # untied: [B, S, vocab]


def build_llama(cfg: LlamaConfig) -> ModelParts:
    return causal_lm_parts(Llama(cfg), cfg.batch, cfg.seq, cfg.vocab)
