"""ZeRO-3's prefetch: a layer's gather in flight while the previous layer computes.

The runtime ties forward layer L's gathers to layer L-1's input (`_run/_fsdp.py`), so the
gather may start when layer L-1 does and must end when layer L reads. Where the backend's
scheduler runs it asynchronously with layer L-1's compute inside (`Lowering.overlaps_prefetch`),
the pair costs max(gather, compute), not the sum: the step saves min(gather, compute) per
pair (`_terms.hidden_time`; the shard ILP's `FactorProblem.overlaps`). Only the gather's
bandwidth term hides: its latency (alpha, the ring's steps) stays on the path, and so do
the first two layers' gathers (no anchor: they go first, with nothing before them) and
the backward's second gathers (tied to the very op that reads them).

What XLA does with the window (jax 0.10.2, a 2- and a 4-layer GPT at hidden 256, ZeRO-3
over 8 compile-only A100s, `_verify/_schedule.py`; tests/test_schedule.py):

- every collective is a start/done pair, but the default scheduler (a memory scheduler)
  puts each forward gather's start just before its done: inside, a few elementwise ops
  (0-4), one matmul in one pair of the step (0.13 of 2.85 GFLOP per device). Pairs with
  compute inside held 56% of the gathers' bytes, which reads as much overlap and is not:
  the compute inside, at the model's rates, is 0.8% of the step (5 us: broadcasts at the
  step's start, a select of the logits' gradient), where this price would hide 12 us. At
  hidden 1024, 4 layers: 145 us of a 4.08 ms step, where this price would hide 272 us.
- its all-gather combiner joins the gathers no data path links, two layers' into one
  (a 4-layer GPT's nine gathering layers in five collectives), which then waits for the
  later layer's anchor: that closes the earlier layer's window altogether.
- the latency-hiding scheduler (`xla_gpu_enable_latency_hiding_scheduler`, with or
  without `xla_gpu_enable_analytical_latency_estimator`) and tying each layer's gathers to
  the previous layer's (which stops the combiner) left the windows as empty.

XLA's GPU thus hides about half of what this price takes off, and no preset prices it
(`Lowering.overlaps_prefetch` is False on every backend): charging each collective in full
is an upper bound a few percent over on a comm-bound FSDP step. The price is here, exact in
the estimate and the shard ILP alike, for a backend whose scheduler fills the window.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import numpy as np

from .._capture import loss_boundary
from .._graph import Graph
from .._groups import Groups
from .._remat import LayerGathers, layer_gathers
from ._collectives import AG
from ._fsdp import forward_reads
from ._zero import tensor_sets


@dataclasses.dataclass(frozen=True)
class Prefetch:
    """Per prefetched pair (an anchored forward layer L with something to gather, and
    layer L-1), by group set as `Tables.param_coef`: what the gather moves and what the
    previous layer computes."""

    gather: np.ndarray  # [pairs, sets] bytes layer L's gathers move whole (`Tables.gathered`)
    compute: np.ndarray  # [pairs, sets] unsharded seconds of layer L-1's forward ops
    # [pairs, sets] the same under remat: a recomputed op's first forward (`remat_op_coef`)
    compute_remat: np.ndarray

    def sub(self, sets: np.ndarray) -> Prefetch:
        """The coefficients of some sets only (a scope's own, `_search/_mesh_terms.py`)."""
        return Prefetch(self.gather[:, sets], self.compute[:, sets], self.compute_remat[:, sets])

    @property
    def pairs(self) -> int:
        return len(self.gather)


def step_prefetch(graph: Graph, groups: Groups, T) -> Prefetch | None:
    """`Prefetch` of a step's ZeRO-3 layers (`_remat.layer_gathers`), None without a loss
    (no layers: ZeRO-3 gathers once for use)."""
    if loss_boundary(graph) is None:
        return None
    return prefetch_coefs(
        graph, layer_gathers(graph, groups), T, T.gathered, tensor_sets(groups, T)
    )


def prefetch_coefs(
    graph: Graph,
    lg: LayerGathers,
    T,
    gathered: Mapping[int, float],
    set_of: Callable[[int], int],
) -> Prefetch:
    """`Prefetch` of `graph` (`T`: its `Tables`; `set_of`: a tensor's set)."""
    n_sets = len(T.sets)
    gather_rows: dict[int, np.ndarray] = {}
    for (layer, p), _ in sorted(forward_reads(graph, lg).items()):
        if layer >= 1 and lg.anchor[layer] is not None and graph.tensors[p].ndim:
            row = gather_rows.setdefault(layer, np.zeros(n_sets))
            row[set_of(p)] += gathered.get(p, graph.tensors[p].nbytes)
    layers = sorted(gather_rows)
    forward = np.arange(min(len(graph.ops), lg.regather.boundary + 1))
    forward = forward[~np.isin(forward, list(lg.remake))]
    layer_of = np.array([lg.layer(int(i)) for i in forward], dtype=np.int64)
    first = np.where(T.remat_op_coef > 0, T.remat_op_coef, T.op_coef)
    compute, compute_remat = np.zeros((len(layers), n_sets)), np.zeros((len(layers), n_sets))
    body_first = np.where(T.body_remat_coef > 0, T.body_remat_coef, T.body_coef)
    for k, layer in enumerate(layers):
        ops = forward[layer_of == layer - 1]
        ops = ops[~T.zero_op[ops]]  # what ZeRO pins is gradients and updates, never these
        np.add.at(compute[k], T.op_set[ops], T.op_coef[ops])
        np.add.at(compute_remat[k], T.op_set[ops], first[ops])
        body = np.isin(T.body_op, ops)  # a loop's bodies, where its op is in the layer
        np.add.at(compute[k], T.body_set[body], T.body_coef[body])
        np.add.at(compute_remat[k], T.body_set[body], body_first[body])
    gather = np.array([gather_rows[layer] for layer in layers]).reshape(len(layers), n_sets)
    return Prefetch(gather, compute, compute_remat)


def gather_beta(ac, mask: int) -> float:
    """Seconds per byte of a gather over the axes `mask` (`AxisCosts`): the faster of its
    variants' bandwidth terms, the one a large gather runs at."""
    return float(ac.beta[AG, :, mask].min())
