"""The cost model's numpy kernel: one assignment's per-row collectives and their sums.

An evaluated assignment is a `State`: the axes each group set holds, each candidate
collective's contribution (a *virtual row*: partial-sum rows give two, an all-reduce slot
and a reduce-scatter slot; reshard rows one) and the sums per (kind, axis mask). A state is
the base of an incremental evaluation: changing one group's axis only touches the sets
and rows that mention the group, so `delta` recomputes those rows and patches the sums.

Rows of gradients (results with a parameter's layout) are summed by bytes and timed once
per (kind, axis) at the end, as XLA combines them into one tuple collective.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from . import _collectives as C
from ._tables import RowTable


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
    sums: np.ndarray  # [5, kinds * masks]: time, bytes, count (non-gradient); bytes, rows (grad)


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


def partial_rows(R: RowTable, A, P, S, bit, inv, m, reduce_scatter: bool):
    """Virtual rows (all-reduce slots then reduce-scatter slots) of partial-sum rows."""
    a = A[R.group]  # [rows, KR]
    act = (a > 0) & ~P[R.small, a]
    inout = act & P[R.tset[:, None], a]
    ar = np.bitwise_or.reduce(np.where(act & ~inout, bit[a], 0), axis=1)
    rs = np.bitwise_or.reduce(np.where(inout, bit[a], 0), axis=1)
    base = R.nbytes * inv[R.tset]
    # Split on axes the output keeps: reduce-scatter of the unsplit result over them;
    # split on the others: all-reduce over their joint axes. Without reduce-scatters
    # (XLA on the CPU) one all-reduce of the unsplit result over all of them.
    rs_bytes = base * np.prod(np.where(inout, S[a], 1.0), axis=1)
    if not reduce_scatter:
        ar, rs, base = ar | rs, np.zeros_like(rs), rs_bytes
    count = np.where(R.grad, R.count, R.count * m)
    mask = np.concatenate([ar, rs])
    kind = np.concatenate([np.full(len(ar), C.AR), np.full(len(rs), C.RS)])
    on = mask > 0
    nbytes = np.where(on, np.concatenate([base, rs_bytes]), 0.0)
    return kind, mask, nbytes, np.where(on, np.concatenate([count, count]), 0.0)


def reshard_rows(R: RowTable, A, P, S, bit, inv, m):
    """Virtual rows of reshard rows: all-gather, or all-to-all when the axis moves."""
    a = A[R.group[:, 0]]
    active = (a > 0) & ~P[R.tsmall, a] & ((R.untied & ~P[R.peer, a]) | P[R.small[:, 0], a])
    a2a = P[R.other, a]
    base = R.nbytes * inv[R.tset]
    kind = np.where(a2a, C.A2A, C.AG)
    nbytes = np.where(active, np.where(a2a, base, base * S[a]), 0.0)
    return kind, np.where(active, bit[a], 0), nbytes, np.where(active, R.count * m, 0.0)


def collective_rows(
    partial: RowTable, reshard: RowTable, A, P, inv, ac: C.AxisCosts, m, reduce_scatter
):
    """key, bytes, count, grad flag and time of every virtual row."""
    S, bit = ac.sizes, ac.bit
    pk, pm, pb, pc = partial_rows(partial, A, P, S, bit, inv, m, reduce_scatter)
    rk, rm, rb, rc = reshard_rows(reshard, A, P, S, bit, inv, m)
    kind = np.concatenate([pk, rk])
    mask = np.concatenate([pm, rm])
    nbytes = np.concatenate([pb, rb])
    count = np.concatenate([pc, rc])
    grad = np.concatenate([partial.grad, partial.grad, reshard.grad])
    key = kind * ac.masks + mask
    return key, nbytes, count, grad, np.where(grad, 0.0, ac.by_key(key, nbytes, count))


def sums(key, nbytes, count, grad, time, n: int, signed: bool = False) -> np.ndarray:
    """Per key: time, bytes, count of non-gradient rows; bytes and active rows of gradient
    rows. `signed`: rows with negative counts are removals (an incremental update)."""
    ng = ~grad
    g = grad & (count != 0)
    rows = np.sign(count[g]) if signed else None
    return np.stack(
        [
            np.bincount(key, time, minlength=n),
            np.bincount(key[ng], nbytes[ng], minlength=n),
            np.bincount(key[ng], count[ng], minlength=n),
            np.bincount(key[g], nbytes[g], minlength=n),
            np.bincount(key[g], rows, minlength=n).astype(float),
        ]
    )


def totals(
    s: np.ndarray,
    ac: C.AxisCosts,
    zero_mask: int,
    zero_bytes: float,
    zero_count: int,
    reduce_scatter: bool = True,
):
    """Per (kind, axis mask): time, bytes and count, gradient collectives combined.

    ZeRO as the plan pins it (`_groups.plan_from_assignment`): the gradients' all-reduce
    over the data axis' `zero_mask` becomes a reduce-scatter of the same buffer (where the
    backend has one: XLA's CPU all-reduces and slices), and `zero_bytes`/`zero_count` are
    the parameters' all-gathers over it."""
    g_bytes, g_count = s[3].copy(), s[4].copy()
    if zero_mask and reduce_scatter:
        ar, rs = C.AR * ac.masks + zero_mask, C.RS * ac.masks + zero_mask
        g_bytes[rs] += g_bytes[ar]
        g_count[rs] += g_count[ar]
        g_bytes[ar] = g_count[ar] = 0.0
    g_any = g_count > 0
    g_time = np.where(g_any, ac.by_key(ac.keys, g_bytes, g_any.astype(float)), 0.0)
    time, nbytes, count = s[0] + g_time, s[1] + g_bytes, s[2] + g_any
    if zero_mask and zero_count:
        i = C.AG * ac.masks + zero_mask
        time[i] += ac.time1(C.AG, zero_mask, zero_bytes, zero_count)
        nbytes[i] += zero_bytes
        count[i] += zero_count
    return time, nbytes, count, ac.key_kind, ac.key_mask
