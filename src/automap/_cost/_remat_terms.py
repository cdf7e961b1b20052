"""Rematerialization's terms of a plan's price that are not per-set coefficients.

Under remat the backward runs the recomputed layers' forward ops again (what `am.apply`
runs, `_pipeline/_remat.py`). Their compute, their stored activations and the step's
candidate peaks under remat are coefficients of the tables (`Tables.remat_coef`,
`act_remat_coef`, `moments_remat`), which `_terms.py` picks by `Layout.remat`. Two terms
read the plan's collective rows instead, and are stated here:

- the recomputed ops' collectives (a row-parallel matmul's all-reduce, say), which the
  recompute runs a second time (`recomputed_collectives`);
- a recomputed layer's partial sums, which the recompute copies again while its layer's
  backward runs: bytes per candidate moment (`recompute_copies`, `_buffers.combined_copies`).
"""

from __future__ import annotations

import numpy as np

from .._lowering import Lowering
from . import _collectives as C
from . import _kernel as K
from ._rows import RowTable


def recomputed_collectives(
    rows: tuple[RowTable, RowTable], st: K.State, ac: C.AxisCosts, lowering: Lowering, slots: int
) -> np.ndarray:
    """Per-key sums like `st.sums` (`_kernel.sums`, `slots` combine slots) of the
    recomputed ops' collective `rows` (merged partial and reshard rows), which the
    backward's recompute runs a second time."""
    key, nbytes, count, grad, time = K.collective_rows(
        *rows, st.codes, st.P, st.inv, ac, st.microbatches, lowering
    )
    slot = K.combine_slots(*rows)
    return K.sums(key, nbytes, count, grad, time, len(C.KINDS) * ac.masks, slot, slots)


def recompute_copies(T, st: K.State, ac: C.AxisCosts, alone=None) -> np.ndarray | None:
    """[moments of `T.moments_remat`] bytes per device of the recomputed layers' partial
    sums copied at their recompute, by the moment they are alive at (`T.copies`); None
    where nothing is copied. `alone` (per row): reduced by a collective no other joins
    (sequence parallelism's, `_seqpar.SplitMemory.uncombined`), so not copied."""
    if T.copies is None:
        return None
    ops = K.partial_results(T.copies.rows, st.codes, st.P, ac.sizes, ac.bit, st.inv)
    if alone is not None:
        ops = np.where(alone, 0.0, ops)
    return np.bincount(T.copies.moment, ops, minlength=len(T.moments_remat.at))
