"""The per-op breakdown of a plan's step time (`Cost.per_op`, with `detail`): each op's
compute and the collectives it waits for, a combined gradient collective's time shared
among the ops whose partial sums it completes, by bytes."""

from __future__ import annotations

import numpy as np

from . import _collectives as C
from . import _kernel as K
from ._beside import less_split
from ._compute import op_compute


def per_op(
    T, st: K.State, ac: C.AxisCosts, zero=None, split=None
) -> tuple[tuple[int, float, float], ...]:
    """(op, compute s, comm s) per op of the tables `T` under the evaluated state `st` on
    the mesh's axis costs `ac` (`zero`: ZeRO's (P, data code, data size), its shards;
    `split`: `_beside.Split`, XLA's split beside data)."""
    comp = less_split(op_compute(T, st.inv, zero=zero), split)
    pf, rf = T.partial_full, T.reshard_full
    ops = np.concatenate([K.per_slot(pf, pf.op), rf.op])
    slot = K.combine_slots(pf, rf)
    grad = np.concatenate([K.per_slot(pf, pf.grad), rf.grad]) | (slot > 0)
    g_time, g_bytes, _ = K.combined_times(st.sums, ac, T.combine_trips)
    g_time, g_bytes = g_time.ravel(), g_bytes.ravel()
    gkey = slot * len(ac.keys) + st.key
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(grad, st.nbytes / g_bytes[gkey] * g_time[gkey], 0.0)
    own = np.where(grad, 0.0, st.time)
    comm = np.bincount(ops, own + np.nan_to_num(share), minlength=len(comp))
    return tuple((i, float(comp[i]), float(comm[i])) for i in range(len(comp)))
