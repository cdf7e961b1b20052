"""A plan's price, term by term: the one statement of what a plan pays on a mesh.

Every term is a function of a `Layout`, which says per group set how the plan divides it
(1 / its sharding divisor, whether the data axis is on it) and which memory savers it
uses (ZeRO stage, rematerialization, microbatches). Each term is linear in the layout's
per-set arrays, which are [sets] for one plan or [sets, options] for every joint option
of a few decision units at once. So:

- the one-stage estimate (`CostModel._finish`) reads them on a plan's sets;
- the shard ILP (`_search/_mesh_terms.py`) reads them on each scope's own sets and every
  joint option of its units, and its factor sums are these terms by construction;
- the pipeline's stage costs (`_pipelined.py`) and the stage DP (`_search/_dp.py`) price
  per op and per tensor, from the same tables: `op_compute` splits `compute_time` by op,
  and the ZeRO terms they charge per program are ZeRO's (`_zero.py`).

A feature adds its terms in its own module: ZeRO's in `_zero.py` (its compute shares,
gathers and second gathers; ZeRO-3's layer by layer in `_fsdp.py`, its prefetch's overlap
with compute in `_overlap.py`: `hidden_time`, the one term not linear, a min of two linear
sums, which the ILP prices with `FactorProblem.overlaps`), and
rematerialization's in `_remat_terms.py` (the recompute's collectives and copies) and the tables' remat coefficients
(`Tables.remat_coef`, `act_remat_coef`, `moments_remat`), picked here by `Layout.remat`. The collectives' per-row terms are the kernel's (`_kernel.py`), which
both callers run; the busiest moment's per-moment bytes are `_peaks.moment_bytes`.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from ._liveness import Moments
from ._outputs import held_bytes
from ._overlap import Prefetch
from ._peaks import moment_bytes
from ._tiles import TileShares
from ._zero import Gathers, MasterCoefs, RegatherCoefs, UpdateReductions, zero_gathers


@dataclasses.dataclass(frozen=True)
class SetCoefs:
    """The tables' per-set coefficients of every term (`Tables`), for all sets or for a
    few (`sub`): what a plan's layout multiplies."""

    compute: np.ndarray  # [sets] seconds (`Tables.compute_coef`)
    remat: np.ndarray  # [sets] a recomputed layer's first forward (`Tables.remat_coef`)
    zero: np.ndarray  # [sets] the ops ZeRO pins (`Tables.zero_coef`)
    memory: np.ndarray  # [5, sets] params, opt, acts, remat acts, other
    param: np.ndarray  # [sets] parameter bytes
    gather: np.ndarray  # [sets] what ZeRO-3's gather moves (`Tables.gather_coef`)
    master: MasterCoefs  # masters ZeRO-1/2 may keep on shards (`Tables.master_coef`)
    param_leaves: np.ndarray  # [sets] parameter leaves of rank >= 1
    output: np.ndarray  # [4, sets] outputs held apart (`Tables.output_coef`)
    early_output: np.ndarray  # [4, sets] of those, the ones no update op makes
    regather: RegatherCoefs
    moments: Moments | None
    moments_remat: Moments | None
    # ZeRO-3's prefetched pairs (`_overlap.py`), where the backend overlaps them, else None
    prefetch: Prefetch | None = None
    # the update's sums over ZeRO's split, all-reduced over data (`_zero.UpdateReductions`)
    reductions: UpdateReductions | None = None

    @classmethod
    def of(
        cls,
        T,
        regather: RegatherCoefs,
        prefetch: Prefetch | None = None,
        reductions: UpdateReductions | None = None,
    ) -> SetCoefs:
        """The coefficients of every set of the tables `T`."""
        return cls(
            T.compute_coef,
            T.remat_coef,
            T.zero_coef,
            T.memory_coef,
            T.param_coef,
            T.gather_coef,
            T.master_coef,
            T.param_leaves,
            T.output_coef,
            T.early_output_coef,
            regather,
            T.moments,
            T.moments_remat,
            prefetch,
            reductions,
        )

    def sub(self, sets: np.ndarray) -> SetCoefs:
        """The coefficients of `sets` only (a scope's own sets)."""
        return SetCoefs(
            self.compute[sets],
            self.remat[sets],
            self.zero[sets],
            self.memory[:, sets],
            self.param[sets],
            self.gather[sets],
            self.master.sub(sets),
            self.param_leaves[sets],
            self.output[:, sets],
            self.early_output[:, sets],
            self.regather.sub(sets),
            _sub_moments(self.moments, sets),
            _sub_moments(self.moments_remat, sets),
            None if self.prefetch is None else self.prefetch.sub(sets),
            None if self.reductions is None else self.reductions.sub(sets),
        )


def _sub_moments(m: Moments | None, sets: np.ndarray) -> Moments | None:
    if m is None:
        return None
    return Moments(
        live=m.live[:, sets],
        held=m.held,
        gathered=m.gathered[:, sets],
        at=m.at,
        regathered=None if m.regathered is None else m.regathered[:, sets],
        outputs=None if m.outputs is None else m.outputs[:, :, sets],
        unreduced=m.unreduced,
        reduced=m.reduced,
        flash=None if m.flash is None else m.flash[:, sets],
    )


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a plan divides each group set, and the memory savers it uses."""

    inv: np.ndarray  # [sets, ...] 1 / the set's sharding divisor
    free: np.ndarray  # [sets, ...] bool: the data axis is not on the set
    data_size: float  # the data axis' size (1 without one)
    zero_stage: int = 0
    remat: bool = False
    microbatches: int = 1
    # Where the backend lays arrays in tiles (`Lowering.tile_padding`), the bytes each
    # set's arrays take per byte of their shards in this layout (`_tiles.tile_shares`).
    tiles: TileShares | None = None
    # ZeRO-1/2 gathers a mixed-precision step's compute-dtype copies, its float32 masters
    # on shards (`Plan.zero_gather` "compute", what plans are made with; `_groups/_mixed.py`)
    gathers_compute: bool = True
    # the attention cores run as the flash kernel (`Plan.attention`): none of their inner
    # values is a buffer (`Moments.flash`)
    flash: bool = False

    @property
    def zero(self) -> bool:
        """ZeRO shards over the data axis: stage >= 1 and a data axis of 2 or more."""
        return self.zero_stage >= 1 and self.data_size > 1

    @functools.cached_property
    def zinv(self) -> np.ndarray:
        """`inv` also divided by the data axis where it is not on the set (ZeRO's shard)."""
        return self.inv / np.where(self.free, self.data_size, 1.0)

    @property
    def made_inv(self) -> np.ndarray:
        """`inv` times what each set's buffers take in tiles (`TileShares.made`), if any."""
        return self.inv if self.tiles is None else self.inv * self.tiles.made

    @property
    def sharded_masters(self) -> bool:
        """ZeRO-1/2 keeps the masters of `SetCoefs.master` on shards."""
        return self.zero and self.zero_stage < 3 and self.gathers_compute

    @property
    def regathers(self) -> bool:
        """ZeRO-3 without remat: the backward gathers the parameters again and the
        forward's gathered copies are not saved for it (`_groups.regather_plan`)."""
        return self.zero and self.zero_stage >= 3 and not self.remat


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per device of a plan's memory parts before its peak is placed: numbers, or
    one per joint option."""

    params: float | np.ndarray
    grads: float | np.ndarray
    opt: float | np.ndarray
    acts: float | np.ndarray
    other: float | np.ndarray
    outputs: float | np.ndarray  # held apart from the arguments to the step's end


def compute_time(c: SetCoefs, L: Layout) -> float | np.ndarray:
    """Seconds of compute: every op by its iteration set, a recomputed layer's forward
    twice under remat, and ZeRO's pinned gradients and update ops on the device's data
    shard (`_zero.zero_shares`)."""
    t = c.compute @ L.inv
    if L.remat:
        t = t + c.remat @ L.inv
    if L.zero:
        t = t - (1 - 1 / L.data_size) * (c.zero @ (L.inv * L.free))
    return t


def layered(c: SetCoefs, L: Layout) -> bool:
    """Whether the plan's gradients are reduce-scattered layer by layer: ZeRO-3 over a data
    axis, in a step with a loss (FSDP as the runtime runs it, `_fsdp.py`)."""
    return L.zero and L.zero_stage >= 3 and c.regather.layers is not None


def reduction_shares(c: SetCoefs, L: Layout) -> tuple[float, float]:
    """(largest, last): the largest share of the gradients' bytes whose local copies one
    reduction reduces at once, and the share the step's last one does, at the end: all of
    them, for one combined reduction, or layer by layer one layer's (`_fsdp.py`)."""
    if not layered(c, L):
        return 1.0, 1.0
    return c.regather.layers.largest, c.regather.layers.tail


def gradient_trips(c: SetCoefs, L: Layout, trips: np.ndarray) -> np.ndarray:
    """Per combine slot, the collectives its gradients are reduced in (`Tables.combine_trips`:
    one for the step's, slot 0), but one per backward layer where ZeRO-3 reduces them layer
    by layer (`_fsdp.py`)."""
    if not layered(c, L) or not len(trips):
        return trips
    out = np.array(trips, dtype=float)
    out[0] = c.regather.layers.reductions
    return out


def prefetch_sides(c: SetCoefs, L: Layout, beta: float) -> tuple[np.ndarray, np.ndarray] | None:
    """([pairs, ...], [pairs, ...]): per pair of ZeRO-3's prefetch (`_overlap.py`), the
    seconds a matrix's gather moves its bytes in (`beta`: seconds per byte over the data
    axis, `_overlap.gather_beta`) and its window's forward ops compute; None where nothing
    overlaps (no prefetch priced, or ZeRO-3 not gathering layer by layer). Both linear in
    the layout: the shard ILP sums them over its scopes (`FactorProblem.overlaps`)."""
    p = c.prefetch
    if p is None or not p.pairs or not layered(c, L):
        return None
    gather = beta * (p.gather @ (L.inv * L.free))
    compute = (p.compute_remat if L.remat else p.compute) @ L.inv
    return gather, compute


def hidden_time(c: SetCoefs, L: Layout, beta: float) -> float | np.ndarray:
    """Seconds of ZeRO-3's forward gathers hidden behind the compute before their weights
    are read: a pair costs max(gather, compute), so the step saves min(gather, compute)."""
    sides = prefetch_sides(c, L, beta)
    return 0.0 if sides is None else np.minimum(*sides).sum(axis=0)


def memory_terms(c: SetCoefs, L: Layout) -> Memory:
    """The memory parts by their layouts: ZeRO shards the optimizer state (stage >= 1)
    and the stored parameters (stage 3); the local gradients are whole until their
    reduce-scatter, in every stage, as XLA compiles them (it combines the reductions into
    one at the end of the backward), but where ZeRO-3 reduces them layer by layer: then
    one layer's are whole at once, and the shards of the rest; the activations kept for the backward (under remat:
    the layers' inputs, the residuals made outside them, one layer's) per microbatch,
    less the forward's gathered copies ZeRO-3 makes again in the backward (or, under
    remat, in the recompute)."""
    tiled = c.memory if L.tiles is None else c.memory * L.tiles.memory
    plain = tiled @ L.inv
    zeroed = plain
    if L.zero:
        zeroed = (c.memory[:2] if L.tiles is None else c.memory[:2] * L.tiles.zero) @ L.zinv
    params = zeroed[0] if L.zero_stage >= 3 else plain[0]
    if L.sharded_masters:  # a mixed-precision step's masters on shards (`_mixed.py`)
        params = params - c.master.at(L.data_size)[0] @ (L.inv - L.zinv)
    acts = (plain[3] if L.remat else plain[2]) / L.microbatches
    if L.regathers:
        acts = acts - c.regather.act_coef @ (L.inv * L.free) / L.microbatches
    elif L.zero and L.zero_stage >= 3 and L.remat and c.regather.layers is not None:
        # ... and under remat, gathering layer by layer, the recompute makes a weight's
        # cast again from its own gather: remat's layers do not keep it (`_fsdp.py`).
        acts = acts - c.regather.layers.remat_kept @ (L.inv * L.free) / L.microbatches
    largest, _ = reduction_shares(c, L)
    return Memory(
        params=params,
        grads=plain[0] * (largest + 1 / L.data_size) if layered(c, L) else plain[0],
        opt=zeroed[1] if L.zero_stage >= 1 else plain[1],
        acts=acts,
        other=plain[4],
        # The outputs no donated input becomes (`_outputs.py`): made at the update.
        outputs=held_bytes(
            c.output, L.inv, L.zinv if L.zero else None, L.zero_stage, L.sharded_masters
        ),
    )


def gathers(c: SetCoefs, L: Layout) -> Gathers:
    """ZeRO's all-gathers of the parameters (`_zero.zero_gathers`); none without ZeRO."""
    if not L.zero:
        return Gathers(0.0, 0.0, 0.0)
    masters = None
    if L.sharded_masters:  # those the data axis shards, and the rest (whole: `MasterCoefs`)
        kept = c.master.at(L.data_size)
        masters = kept, c.master.at(1) - kept
    return zero_gathers(
        c.param, c.gather, c.param_leaves, c.regather, L.inv, L.free, L.zero_stage, L.remat,
        masters,
    )  # fmt: skip


def update_reductions(c: SetCoefs, L: Layout) -> float | np.ndarray:
    """Bytes per device ZeRO's update all-reduces over data: its sums over the dim ZeRO
    splits (`_zero.UpdateReductions`), each result as the plan splits it; none without
    ZeRO, or where the data axis is on the result already (a sum the plan's own rows
    price)."""
    if not L.zero or c.reductions is None:
        return 0.0
    return c.reductions.at(L.data_size) @ (L.inv * L.free)


def step_moments(c: SetCoefs, L: Layout) -> Moments | None:
    """The candidate peak moments the plan's step is priced at (with or without remat),
    None where the backend's buffers are not scheduled. Where the attention cores run as
    the flash kernel, what is alive at each is the kernel's (`Moments.flash`)."""
    m = c.moments_remat if L.remat else c.moments
    if L.flash and m is not None and m.flash is not None:
        return dataclasses.replace(m, live=m.flash)
    return m


def moments_held(c: SetCoefs, L: Layout, reduced, copies=None):
    """(gradients, all, outputs) bytes per device alive at each candidate moment
    ([moments, ...]): `_peaks.moment_bytes` with the plan's held outputs made by then and
    ZeRO-3's gathered parameters. `reduced`: the step's reduced gradients' bytes."""
    moments = step_moments(c, L)
    zinv = L.zinv if L.zero else None
    made = None
    if moments.outputs is not None:
        made = held_bytes(moments.outputs, L.inv, zinv, L.zero_stage, L.sharded_masters)
    gathered = L.inv * L.free if L.zero_stage >= 3 and L.zero else None
    shard = 1 / L.data_size if layered(c, L) else None  # reduced layer by layer
    return moment_bytes(moments, L.made_inv, reduced, gathered, L.microbatches, copies, made, shard)


def early_outputs(c: SetCoefs, L: Layout):
    """The held outputs no update op makes (a loss): alive at the gradients' reduction."""
    zinv = L.zinv if L.zero else None
    return held_bytes(c.early_output, L.inv, zinv, L.zero_stage, L.sharded_masters)
