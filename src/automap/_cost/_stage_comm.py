"""The collectives of a pipeline's stage programs: per (stage, phase, key) per run, and
per op, from the per-op rows of an intra-stage plan (`_pipelined.OpCosts`).

An op of a per-microbatch phase runs its rows on a microbatch's bytes where the tensor
carries the batch; the gradients of one program are combined per key (XLA's combiner),
shared among their ops by bytes; an accumulated tensor's reduction over the batch's axes
moves to its stage's once-per-step REDUCE program (`_run/_accumulate.py`); ZeRO's gathers
are charged per program (`_zero.add_zero_gathers`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from .._pipeline import Partition, Phase
from .._plan import Collective
from . import _collectives as C
from ._traffic import phase_codes
from ._zero import add_zero_gathers

if TYPE_CHECKING:
    from ._pipelined import OpCosts, StageModel

#: Per-(stage, phase) arrays have a column per phase: PRE, FWD, BWD, POST and REDUCE, a
#: stage's once-per-step reduction of its accumulated tensors' partial sums, run after its
#: last backward (the runtime's reduce program).
N_PHASES = len(Phase)


class PhaseComm(NamedTuple):
    """A pipeline's collectives per (stage, phase, key) per run, and per op."""

    time: np.ndarray  # [S, N_PHASES, keys] seconds
    nbytes: np.ndarray  # [S, N_PHASES, keys]
    count: np.ndarray  # [S, N_PHASES, keys]
    op: np.ndarray  # [n_ops] seconds per run of each op's collectives, in its own call
    op_reduce: np.ndarray  # [n_ops] its share of its stage's once-per-step REDUCE

    def per_step(self, ac: C.AxisCosts, mine, runs: np.ndarray) -> tuple[Collective, ...]:
        """The collectives per device per step of the stages `mine` (a boolean mask: one
        stage, or a device group's virtual stages); `runs`: runs per step of a phase."""
        t, nb, c = (a[mine].sum(axis=0) for a in (self.time, self.nbytes, self.count))
        return collectives_of(ac, runs @ t, runs @ nb, runs @ c)


def phase_collectives(model: StageModel, part: Partition, oc: OpCosts, per_mb, m: int):
    """Collectives per run of each (stage, phase): one bucket per key, the gradients of
    one program combined (shared among their ops by bytes), ZeRO's gathers per program
    (`_zero.add_zero_gathers`)."""
    graph, ac = model.graph, oc.axis_costs
    S, nk, stage = part.n_stages, len(ac.keys), np.array(part.op_stage)
    lookups = model.tables.iota_lookups
    r, r_phase, r_key, r_count, grad, r_bytes = rows_by_phase(graph, part, oc, per_mb, m, lookups)
    on = r_count > 0
    r_time = np.where(grad, 0.0, ac.by_key(r_key, r_bytes, r_count))
    bucket = (stage[r] * N_PHASES + r_phase) * nk + r_key
    nb = S * N_PHASES * nk
    g = grad & on
    g_bytes = np.bincount(bucket[g], r_bytes[g], minlength=nb)
    g_any = np.bincount(bucket[g], minlength=nb) > 0
    g_time = np.where(g_any, ac.by_key(np.tile(ac.keys, S * N_PHASES), g_bytes, g_any * 1.0), 0.0)
    time = np.bincount(bucket, r_time, minlength=nb) + g_time
    nbytes = np.bincount(bucket[~grad], r_bytes[~grad], minlength=nb) + g_bytes
    count = np.bincount(bucket[~grad], r_count[~grad], minlength=nb) + g_any
    time, nbytes, count = (a.reshape(S, N_PHASES, nk) for a in (time, nbytes, count))
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.nan_to_num(np.where(g, r_bytes / g_bytes[bucket] * g_time[bucket], 0.0))
    once = r_phase == Phase.REDUCE
    op_comm = np.bincount(r[~once], (r_time + share)[~once], minlength=len(graph.ops))
    op_reduce = np.bincount(r[once], (r_time + share)[once], minlength=len(graph.ops))
    if oc.zero_mask:
        recomputed = set(model.residuals.recomputed) if oc.remat else set()
        add_zero_gathers(
            graph,
            part,
            oc,
            time,
            nbytes,
            count,
            recomputed,
            model.tables.gathered,
            model.tables.layers,
            model.tables.casts_again,
            model.tables.gathered_narrow,
        )
    return PhaseComm(time, nbytes, count, op_comm, op_reduce)


def _accumulated(graph, part: Partition, m: int) -> np.ndarray:
    """[n_ops] the op makes a tensor its stage sums over the microbatches (m > 1)."""
    out = np.zeros(len(part.op_stage), dtype=bool)
    if m > 1:
        out[[graph.tensors[t].producer for t in part.accumulated]] = True
    return out


def split_alone(graph, part: Partition, m: int) -> np.ndarray:
    """[n_ops] the call that runs the op reduces the gradient it makes: not one a stage
    accumulates over the microbatches. XLA splits a gradient dot beside data only there
    (its pieces reduced, the dot on its 1/n piece); the reduce program reduce-scatters
    the sum it accumulates (`_beside.py`)."""
    per_mb = np.isin(phase_codes(part), [p for p in Phase if p.per_microbatch])
    return ~(_accumulated(graph, part, m) & per_mb)


def rows_by_phase(
    graph, part: Partition, oc: OpCosts, per_mb: np.ndarray, m: int, lookups=None
):  # fmt: skip
    """Every collective row with the phase it runs in: (op, phase, key, count, combined
    with the others of its program and key (gradients), bytes per run). With m > 1, the reduction over the batch's axes of an op that
    makes an accumulated tensor runs once per step in REDUCE (its row there, full size);
    what is left of its axes stays in its own call, and the row is idle there when
    nothing is left (see the module doc). `lookups` (`Tables.iota_lookups`): a lookup at
    an iota another program makes (a stage's once-per-step PRE) sees no iota in its own
    program: XLA masks it and all-reduces, as any lookup (HF BERT's positions under a
    one-stage pipeline, read in its A100 forward program)."""
    r, key, count, ac = oc.row_op, oc.row_key, oc.row_count, oc.axis_costs
    phase = phase_codes(part)
    apart = [g for g, iota in (lookups or {}).items() if phase[g] != phase[iota]]
    if apart:
        kind, mask = np.divmod(key, ac.masks)
        masked = oc.row_partial & np.isin(r, apart) & (kind == C.AG)
        key = np.where(masked, C.AR * ac.masks + mask, key)
    # A recomputed op's collectives run again in the backward that recomputes it.
    row_phase = phase[r] if oc.row_again is None else np.where(oc.row_again, Phase.BWD, phase[r])
    accumulated = _accumulated(graph, part, m)
    kind, mask = np.divmod(key, ac.masks)
    moved = mask & oc.batch_mask
    if oc.row_split is not None:
        alone = split_alone(graph, part, m)[r]
        count = np.where((oc.row_split == 1) & ~alone | (oc.row_split == 2) & alone, 0, count)
    deferred = oc.row_partial & accumulated[r] & per_mb[r] & (count > 0) & (moved > 0)
    left = np.where(deferred, mask & ~oc.batch_mask, mask)
    d = np.nonzero(deferred)[0]
    # A 16-bit ZeRO gradient left whole, and a lookup's, are all-reduced whole where a B
    # call reduces them (the reduce program scatters them, as `op_costs` prices every
    # ZeRO gradient: `_pipelined._whole_in_backward`).
    whole = oc.row_whole if oc.row_whole is not None else np.zeros(len(r), dtype=bool)
    kind = np.where(oc.row_grad & whole & (kind == C.RS) & ~deferred, C.AR, kind)
    rows = np.concatenate([r, r[d]])
    scale = np.where(per_mb[r] & oc.row_batched, 1.0 / m, 1.0)
    return (
        rows,
        np.concatenate([row_phase, np.full(len(d), Phase.REDUCE)]),
        np.concatenate([kind * ac.masks + left, kind[d] * ac.masks + moved[d]]),
        np.concatenate([np.where(left > 0, count, 0), count[d]]),
        # One program reduces them all: XLA combines every one (the loss sum with the
        # gradients), as it combines the gradient reductions of one call.
        np.concatenate([oc.row_grad, np.ones(len(d), dtype=bool)]),
        np.concatenate([np.where(left > 0, oc.row_bytes * scale, 0.0), oc.row_bytes[d]]),
    )


def collectives_of(ac: C.AxisCosts, time, nbytes, count) -> tuple[Collective, ...]:
    return tuple(
        Collective(
            C.KINDS[ac.key_kind[i]],
            ac.names[ac.key_mask[i]],
            float(nbytes[i]),
            round(count[i]),
            float(time[i]),
        )
        for i in np.nonzero((count > 0) & (ac.key_mask > 0))[0]
    )
