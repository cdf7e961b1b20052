"""The cost model's numpy kernel: one assignment's per-row collectives and their sums.

An evaluated assignment is a `State`: the axes each group set holds, each candidate
collective's contribution (a *virtual row*: partial-sum rows give `partial_slots`, one per
collective XLA may chain to complete the sum; reshard rows one) and the sums per (kind,
axis mask). A state is the base of an incremental evaluation: changing one group's axis
only touches the sets and rows that mention the group, so `delta` recomputes those rows
and patches the sums.

Rows of gradients (results with a parameter's layout) are summed by bytes and timed once
per (kind, axis) at the end, as XLA combines them into one tuple collective. A loop body's
gradient rows are combined the same way within the body, once per trip: XLA's all-reduce
combiner runs on the while body, which it cannot merge across trips (each *slot* of
`Tables.combine_trips` is one such combine; slot 0 the step's). Sums are keyed
slot * (kinds * masks) + kind * masks + axis mask.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from .._lowering import Lowering
from . import _collectives as C
from ._rows import RowTable
from ._tiles import ZeroScatter


@dataclasses.dataclass
class State:
    """One evaluated assignment (arrays are never modified once the state is made)."""

    codes: np.ndarray  # [n_groups + 1] axis code per group (0: none)
    mesh: Mapping[str, int]
    microbatches: int
    remat: bool
    P: np.ndarray  # [n_sets, k + 1] the set holds axis a
    inv: np.ndarray  # [n_sets] 1 / sharding divisor
    key: np.ndarray  # [virtual rows] kind * masks + axis mask
    nbytes: np.ndarray  # [virtual rows] bytes (0 when inactive)
    count: np.ndarray  # [virtual rows] occurrences (0 when inactive)
    time: np.ndarray  # [virtual rows] seconds of non-gradient rows
    # [5, slots * kinds * masks]: time, bytes, count (non-gradient, slot 0 only); bytes,
    # rows (gradients, by their combine slot)
    sums: np.ndarray
    partial: RowTable | None = None  # the partial-sum rows of `key`'s first rows


def set_axes(codes: np.ndarray, sets: np.ndarray, sizes: np.ndarray):
    """Which axes each set holds, and 1 / its sharding divisor."""
    k = len(sizes) - 1
    AS = codes[sets]  # [n_sets, K]
    P = np.zeros((len(sets), k + 1), dtype=bool)
    div = np.ones(len(sets))
    for a in range(1, k + 1):
        P[:, a] = (a == AS).any(axis=1)
        div *= np.where(P[:, a], sizes[a], 1.0)
    return P, 1.0 / div


def partial_slots(R: RowTable) -> int:
    """Virtual rows per partial-sum row: one per reduced-group column, then one more.
    Slot-major: slot j of row i is virtual row j * len(R.tset) + i."""
    return R.group.shape[1] + 1


def per_slot(R: RowTable, values: np.ndarray) -> np.ndarray:
    """A per-row array of partial-sum rows repeated for each of their virtual rows."""
    return np.tile(values, partial_slots(R))


def partial_rows(R: RowTable, A, P, S, bit, inv, m, lowering: Lowering):
    """Virtual rows (`partial_slots`) of partial-sum rows.

    A row's reduced groups split on axes R: the output is a partial sum over R. Its bytes:
    `base` the result as it is split, `whole` the result unsplit on the axes K of R that
    the output keeps. As XLA compiles it (HLO of jax 0.10, read by tests/test_cost.py):

    - the SPMD partitioner reduces one axis at a time: with K empty, a chain of one
      all-reduce of `base` per axis of R; otherwise one all-reduce of `whole` per axis of K,
      a slice, and one all-reduce of `base` over the rest of R's axes jointly (a dot's
      lowering). XLA's CPU backend runs exactly that (`lowering.reduce_scatter` False): a
      column's slot holds its axis' all-reduce, the last slot the joint one.
    - the GPU/TPU pipelines (`lowering.reduce_scatter`) fold an all-reduce feeding another
      into one over their joint axes (AllReduceFolder), and an all-reduce then sliced into a
      reduce-scatter (ReduceScatterCreator): one all-reduce of `base` over the rest (the
      first column's slot), one reduce-scatter of `whole` over K (the last slot).
    """
    a, act = split_reductions(R, A, P)  # [rows, KR]
    kept = act & P[R.tset[:, None], a]
    rest = np.bitwise_or.reduce(np.where(act & ~kept, bit[a], 0), axis=1)
    base = R.nbytes * inv[R.tset]
    whole = base * np.prod(np.where(kept, S[a], 1.0), axis=1)
    if lowering.reduce_scatter:
        chain = np.zeros_like(a)
        if a.shape[1]:
            chain[:, 0] = rest
        chain_bytes = base
        last = np.bitwise_or.reduce(np.where(kept, bit[a], 0), axis=1)
        last_kind, last_bytes = C.RS, whole
    else:
        any_kept = kept.any(axis=1)
        chain = np.where(np.where(any_kept[:, None], kept, act), bit[a], 0)
        chain_bytes = np.where(any_kept, whole, base)
        last, last_kind, last_bytes = np.where(any_kept, rest, 0), C.AR, base
    mask = np.concatenate([chain.T.ravel(), last])
    kind = np.full(len(mask), C.AR)
    kind[len(mask) - len(last) :] = last_kind
    nbytes = np.concatenate([np.tile(chain_bytes, a.shape[1]), last_bytes])
    if R.gathers.any():
        # A lookup at an iota: each device looks up its rows' positions; the result is
        # all-gathered over the axes it does not keep (one collective, the first slot).
        slots = (slice(None), R.gathers)
        kind, mask, nbytes = (x.reshape(-1, len(R.tset)) for x in (kind, mask, nbytes))
        mask[slots] = 0
        mask[0, R.gathers], kind[0, R.gathers] = rest[R.gathers], C.AG
        nbytes[0, R.gathers] = base[R.gathers]
        kind, mask, nbytes = kind.ravel(), mask.ravel(), nbytes.ravel()
    apart = np.zeros(len(mask), dtype=bool)
    if R.lookup.any():
        kind, mask, nbytes, apart = _moved_lookups(R, a, P, S, bit, inv, (kind, mask, nbytes))
    on = mask > 0
    count = per_slot(R, np.where(R.grad, R.count, R.count * m))
    return kind, mask, np.where(on, nbytes, 0.0), np.where(on, count, 0.0), apart


def _moved_lookups(R: RowTable, a, P, S, bit, inv, virtual):
    """`partial_rows`' (kind, mask, bytes), and which virtual rows are gradients reduced
    apart, with a table's lookup priced as XLA partitions it where its indices hold an
    axis X its table's rows do (the kept column of its row): by index passthrough
    (`PartitionGatherIndexPassthroughDimensions`), the result keeps X and each X group
    regroups the table onto its own devices, the axes Y the indices' side (`beside`)
    does not hold: the table's shard is moved by a collective-permute over X and Y, then
    gathered over X to rows split min(|X|, |Y|) ways where X is the larger; the lookup,
    masked, is all-reduced over Y. The backward scatter-adds into that layout, all-reduces
    it over X and permutes it back. Without Y, the table is gathered whole over X and its
    gradient all-reduced. Read on v5p 2x2x2, A100s and the CPU alike (tests/
    test_tpu_collectives.py: a Llama's token table and batch on data 4 x model 2; data 8 x
    model 8 on 4x4x4 moved 0.5 MiB each way, all-reducing 2 MiB over model)."""
    kind, mask, nbytes = (x.reshape(-1, len(R.tset)) for x in virtual)
    kept = (a > 0) & P[R.tset[:, None], a]  # X: on the table's rows and the indices
    hit = _regrouped(R, a, P)
    if not hit.any():
        return (*virtual, np.zeros(len(virtual[0]), dtype=bool))
    x = np.where(kept, a, 0).max(axis=1)
    codes = np.arange(1, P.shape[1])
    free = ~P[R.beside][:, 1:] & (S[codes] > 1)[None] & (codes[None] != x[:, None])
    y = np.bitwise_or.reduce(np.where(free, bit[codes][None], 0), axis=1)
    sx, sy = S[x], np.prod(np.where(free, S[codes][None], 1.0), axis=1)
    shard = R.table_bytes * inv[R.table]
    regrouped = shard * sx / np.minimum(sx, sy)  # the table as each X group holds it
    forward, moved = R.lookup == 1, sy > 1
    kind[:, hit], mask[:, hit], nbytes[:, hit] = C.AR, 0, 0.0
    first = np.where(forward, np.where(moved, y, 0), bit[x])
    kind[0, hit], mask[0, hit] = C.AR, first[hit]
    nbytes[0, hit] = np.where(forward, R.nbytes * inv[R.tset], regrouped)[hit]
    kind[1, hit], mask[1, hit] = C.CP, np.where(moved, bit[x] | y, 0)[hit]
    nbytes[1, hit] = shard[hit]
    gather = hit & forward & (sx > sy)
    kind[-1, gather], mask[-1, gather], nbytes[-1, gather] = C.AG, bit[x][gather], regrouped[gather]
    return kind.ravel(), mask.ravel(), nbytes.ravel(), gradients_apart(R, a, P)


def _regrouped(R: RowTable, a, P) -> np.ndarray:
    """[rows] the table lookups XLA regroups (`_moved_lookups`): an axis on a reduced
    group (the table's rows, or the indices' dims in the backward) that the result
    holds too (the indices' dims, or the table's rows)."""
    return (R.lookup > 0) & ((a > 0) & P[R.tset[:, None], a]).any(axis=1)


def gradients_apart(R: RowTable, a, P) -> np.ndarray:
    """[virtual rows] of partial-sum rows: a table's gradient XLA regroups
    (`_moved_lookups`), which is not ZeRO's split: under ZeRO it is all-reduced on its
    own (plan 10 of the TPU bench, ZeRO-1), not reduce-scattered with the gradients, nor
    combined with them. `a`: the axis of each row's reduced groups."""
    return per_slot(R, _regrouped(R, a, P) & (R.lookup == 2))


def split_reductions(R: RowTable, A, P) -> tuple[np.ndarray, np.ndarray]:
    """([rows, KR] the axis code of each partial-sum row's reduced groups under the plan's
    codes `A`, [rows, KR] whether that axis splits the group where the op makes a partial
    sum over it: an axis the op's `small` side does not hold (`P`, per set and axis))."""
    a = A[R.group]
    return a, (a > 0) & ~P[R.small, a]


def partial_results(R: RowTable, A, P, S, bit, inv) -> np.ndarray:
    """Per partial-sum row, the bytes per device it all-reduces under the plan (its result
    as split, per occurrence; `partial_rows`' `base`), 0 where no axis of its reduced groups
    makes it an all-reduce (none split, or only axes its output keeps: a reduce-scatter)."""
    a, act = split_reductions(R, A, P)
    reduced = (act & ~P[R.tset[:, None], a]).any(axis=1)
    return np.where(reduced, R.nbytes / np.maximum(R.count, 1) * inv[R.tset], 0.0)


def tied_bytes(R: RowTable, st: State, ac: C.AxisCosts, data: int, stage: int) -> float:
    """Bytes of the tied gradient parts ZeRO reduce-scatters apart (`tied_rows`)."""
    return float(tied_rows(R, st, ac, data, stage).sum())


def tied_rows(R: RowTable, st: State, ac: C.AxisCosts, data: int, stage: int) -> np.ndarray:
    """Per row of `R`, bytes of the tied gradient parts ZeRO reduce-scatters apart (`Tables.tied_partial`)
    over its data axis (code `data`): under ZeRO-3 every one; under ZeRO-1/2 those of a
    parameter another axis splits. A 2-layer float32 GPT at data 4 x model 2 under ZeRO-1,
    its tied token table's rows or hidden dim on model: the lookup's and the head's parts
    reduce-scattered apart, on v5p 2x2x2 (libtpu 0.0.42.1) and on A100s alike; with the
    table whole, their sum once (tests/test_verify_tpu.py)."""
    rows = partial_results(R, st.codes, st.P, ac.sizes, ac.bit, st.inv)
    if stage < 3:
        others = np.ones(st.P.shape[1], dtype=bool)
        others[[0, data]] = False
        rows = np.where(st.P[R.tset][:, others].any(axis=1), rows, 0.0)
    return rows


def reshard_rows(R: RowTable, A, P, S, bit, inv, m):
    """Virtual rows of reshard rows: all-gather, or all-to-all when the axis moves."""
    a = A[R.group[:, 0]]
    active = (a > 0) & ~P[R.tsmall, a] & ((R.untied & ~P[R.peer, a]) | P[R.small[:, 0], a])
    # a table lookup's indices and rows on one axis: priced on its partial-sum row
    active &= ~((R.lookup > 0) & P[R.table, a] & P[R.beside, a])
    a2a = P[R.other, a]
    base = R.nbytes * inv[R.tset]
    kind = np.where(a2a, C.A2A, C.AG)
    nbytes = np.where(active, np.where(a2a, base, base * S[a]), 0.0)
    return kind, np.where(active, bit[a], 0), nbytes, np.where(active, R.count * m, 0.0)


def collective_rows(
    partial: RowTable, reshard: RowTable, A, P, inv, ac: C.AxisCosts, m, lowering: Lowering
):
    """key, bytes, count, grad flag and time of every virtual row."""
    S, bit = ac.sizes, ac.bit
    pk, pm, pb, pc, apart = partial_rows(partial, A, P, S, bit, inv, m, lowering)
    rk, rm, rb, rc = reshard_rows(reshard, A, P, S, bit, inv, m)
    kind = np.concatenate([pk, rk])
    mask = np.concatenate([pm, rm])
    nbytes = np.concatenate([pb, rb])
    count = np.concatenate([pc, rc])
    grad = np.concatenate([per_slot(partial, partial.grad) & ~apart, reshard.grad])
    key = kind * ac.masks + mask
    return key, nbytes, count, grad, np.where(grad, 0.0, ac.by_key(key, nbytes, count))


def combine_slots(partial: RowTable, reshard: RowTable) -> np.ndarray:
    """Each virtual row's combine slot (`RowTable.combine`: 0 unless a body's gradient)."""
    return np.concatenate([per_slot(partial, partial.combine), np.zeros_like(reshard.combine)])


def sums(
    key, nbytes, count, grad, time, n: int, slot, slots: int, signed: bool = False
) -> np.ndarray:
    """Per key: time, bytes, count of non-gradient rows; bytes and active rows of gradient
    rows (a body's by its combine `slot`, of `slots`). `signed`: rows with negative
    counts are removals (an incremental update)."""
    combined = grad | (slot > 0)
    ng = ~combined
    g = combined & (count != 0)
    gkey = slot[g] * n + key[g]
    rows = np.sign(count[g]) if signed else None
    w = n * slots
    return np.stack(
        [
            np.bincount(key[ng], time[ng], minlength=w),
            np.bincount(key[ng], nbytes[ng], minlength=w),
            np.bincount(key[ng], count[ng], minlength=w),
            np.bincount(gkey, nbytes[g], minlength=w),
            np.bincount(gkey, rows, minlength=w).astype(float),
        ]
    )


def combined_times(s: np.ndarray, ac: C.AxisCosts, trips: np.ndarray):
    """Per slot and key [slots, keys]: time, bytes and occurrences of the combined gradient
    collectives (one per step for slot 0, one per trip for a body's)."""
    n = len(ac.keys)
    g_bytes, g_any = s[3].reshape(-1, n), s[4].reshape(-1, n) > 0
    calls = g_any * trips[:, None]
    g_time = np.where(g_any, ac.by_key(ac.keys[None, :], g_bytes, calls), 0.0)
    return g_time, g_bytes, calls


def totals(
    s: np.ndarray,
    ac: C.AxisCosts,
    zero_mask: int,
    zero_bytes: float,
    zero_count: int,
    lowering: Lowering,
    trips: np.ndarray | None = None,
    scatter: ZeroScatter | None = None,
    update_bytes: float = 0.0,
    tied_bytes: float = 0.0,
    split=None,
):
    """Per (kind, axis mask): time, bytes and count, gradient collectives combined (the
    step's once, each loop body's once per trip: `trips` per combine slot).

    ZeRO as the plan pins it (`_groups.plan_from_assignment`): the gradients' all-reduce
    over the data axis' `zero_mask` becomes a reduce-scatter of the same buffer (where the
    backend has one: XLA's CPU all-reduces and slices), and `zero_bytes`/`zero_count` are
    the parameters' all-gathers over it. Only the step's gradients (slot 0) meet the ZeRO
    layout: a body's are reduced inside the loop, per trip. `scatter`: where the backend
    departs from a plain reduce-scatter of those gradients (`_tiles.tpu_zero_scatter`):
    the bytes it all-reduces whole all the same, the rows it pads, the permutes after.
    `update_bytes`: what the update's own sums over ZeRO's split all-reduce over it
    (`_terms.update_reductions`), one more collective.
    `tied_bytes`: a tied parameter's gradient parts reassociation left out, which ZeRO
    reduce-scatters apart (`tied_bytes`, `Tables.tied_partial`). `split`: the gradients
    XLA splits beside data instead (`_beside.Split`), all-reduced in pieces and permuted."""
    n = len(ac.keys)
    s = s.copy()
    scattered = bool(zero_mask and lowering.reduce_scatter)
    scatter = scatter or ZeroScatter()
    if scattered:
        ar, rs = C.AR * ac.masks + zero_mask, C.RS * ac.masks + zero_mask
        s[3:, rs] += s[3:, ar]
        s[3:, ar] = 0.0
        s[3, rs] += tied_bytes
        if split is not None:
            s[3:, rs] -= (split.removed, split.removed_rows)
            s[3:, ar] += (split.pieces, split.piece_rows)
        kept = min(scatter.whole, s[3, rs])
        if kept > 0:
            s[3, [rs, ar]] += (-kept, kept)
            s[4, ar] = 1.0
            s[4, rs] = float(s[3, rs] > 0)
        s[3, rs] += scatter.padding if s[3, rs] > 0 else 0.0
    trips = np.ones(1) if trips is None else trips
    g_time, g_bytes, calls = combined_times(s, ac, trips)
    time = s[0, :n] + g_time.sum(axis=0)
    nbytes = s[1, :n] + g_bytes.sum(axis=0)
    count = s[2, :n] + calls.sum(axis=0)
    if zero_mask and zero_count:
        i = C.AG * ac.masks + zero_mask
        time[i] += ac.time1(C.AG, zero_mask, zero_bytes, zero_count)
        nbytes[i] += zero_bytes
        count[i] += zero_count
    if scattered and scatter.permutes:
        i = C.CP * ac.masks + zero_mask
        time[i] += ac.time1(C.CP, zero_mask, scatter.permute_bytes, scatter.permutes)
        nbytes[i] += scatter.permute_bytes
        count[i] += scatter.permutes
    for axis, piece, permutes in split.permutes if zero_mask and split is not None else ():
        i = C.CP * ac.masks + (zero_mask | int(ac.bit[axis]))
        time[i] += ac.time1(C.CP, zero_mask | int(ac.bit[axis]), piece, permutes)
        nbytes[i] += piece
        count[i] += permutes
    if zero_mask and update_bytes > 0:
        i = C.AR * ac.masks + zero_mask
        time[i] += ac.time1(C.AR, zero_mask, update_bytes, 1)
        nbytes[i] += update_bytes
        count[i] += 1
    least = lowering.gather_all_reduced_from
    if least and ac.slice_chips >= least:
        _gathers_reduced(time, nbytes, count, ac)
    return time, nbytes, count, ac.key_kind, ac.key_mask


def _gathers_reduced(time, nbytes, count, ac: C.AxisCosts) -> None:
    """All-gathers over a whole slice made all-reduces of the gathered buffer, as XLA's
    TPU compiles them (`Lowering.gather_all_reduced_from`): same bytes and occurrences,
    an all-reduce's time. In place."""
    for m in np.nonzero(ac.whole_slice)[0]:
        ag, ar = C.AG * ac.masks + m, C.AR * ac.masks + m
        if count[ag] <= 0:
            continue
        time[ar] += ac.time1(C.AR, int(m), float(nbytes[ag]), round(float(count[ag])))
        nbytes[ar] += nbytes[ag]
        count[ar] += count[ag]
        time[ag] = nbytes[ag] = count[ag] = 0.0
