"""The moments of a one-stage step at which its buffers may peak, for a scheduled backend.

XLA's GPU pipeline frees each buffer after its last reader, and its scheduler runs the
optimizer update of a gradient no collective holds right after the matmul that makes it:
the step's peak is the largest sum of the buffers alive at one moment, not the sum of every
activation and every gradient (read on compile-only A100s, where that sum was 1.2x XLA's
buffers on ReLU MLPs whose gradients are not reduced, and 1.3-1.6x on transformers under
rematerialization, whose loss' residuals are gone before any layer is recomputed).

A buffer here is a tensor XLA writes to memory (`_fusion.in_memory_tensors`), alive from
the op that makes it to its last reader in program order (the jaxpr's: forward, then the
backward in reverse layer order); `_buffers.step_buffers` lists them: a residual XLA keeps
in place of one it remakes lives until the remade one's last reader, a recomputed layer's
residuals live in the first forward and again from the layer's backward on, and two
copies a convolutional net's GPU program makes are buffers too. Parameters, optimizer
state and inputs are the program's arguments (counted apart); the updated state aliases
them where the step donates them, else it is a buffer of its own from the update to the
end of the program (`_outputs.py`; the program's last op is then a candidate moment).

Which moments peak depends on the plan (how it splits each tensor): the candidates are the
highest moments under a fixed set of probe splittings (seeded, so the same graph always
gives the same candidates), and a plan's peak is the largest of their sums under its own.
Gradients a collective reduces are held past their update, until the step's combined
reduction at the end of the backward (`held`: the share of the gradients' bytes made and
past their update at each moment), or with ZeRO-3 until their backward layer's reduction,
then as shards (`unreduced`, `reduced`); ZeRO-3's gathered parameters are priced per moment
apart (`gathered`), as only that stage gathers them."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence

import numpy as np

from .._graph import Graph, Role

# Candidate moments kept per probe splitting (its highest local maxima), and probes.
PER_PROBE = 3
PROBES = 12


@dataclasses.dataclass(frozen=True)
class Moments:
    """Candidate peak moments of one program: bytes per group set alive at each (unsplit)."""

    live: np.ndarray  # [k, n_sets]
    # [k] share of the gradients' bytes made and past their update (held where reduced)
    held: np.ndarray
    # [k, n_sets] the parameters ZeRO-3 gathers in use then (whole over the data axis)
    gathered: np.ndarray
    at: np.ndarray  # [k] the moments (op index in program order), for reading
    # [k, n_sets] of `live`, the forward's values made from parameters alone (a weight's
    # cast) held past the forward for the backward: ZeRO-3 without remat makes them again
    # from the shards there instead (`_groups.regather_plan`), so they are not held then.
    regathered: np.ndarray | None = None
    # [3, k, n_sets] the step's outputs held apart from its arguments made by then (a step
    # that donates nothing: `_outputs.held_outputs`, a row per kind), None where none is.
    outputs: np.ndarray | None = None
    # ZeRO-3 reduce-scatters the gradients layer by layer (`_remat.Reduction`): per moment,
    # the share of the gradients' bytes past their last reader and not reduced yet (held
    # whole), and the share reduced by then (held as shards); None where it does not.
    unreduced: np.ndarray | None = None
    reduced: np.ndarray | None = None
    # [k, n_sets] `live` where the attention cores run as the flash kernel, which writes
    # none of their inner values (`_flash.kernel_buffers`); None where none can.
    flash: np.ndarray | None = None


NO_BLOCKS = np.zeros((0, 3), dtype=np.int64)


@dataclasses.dataclass(frozen=True)
class Buffers:
    """Every buffer of one program: its tensor, birth and last op (program order), and its
    bytes as a multiple of the tensor's (2 where XLA keeps a 16-bit result in float32)."""

    tensor: np.ndarray
    birth: np.ndarray
    death: np.ndarray
    width: np.ndarray
    # [layers, 3] per recomputed layer: its first and last forward op and the moment its
    # recompute runs (its residuals' birth in the backward); empty without remat.
    blocks: np.ndarray
    # per buffer, the matmul output whose contraction decides whether XLA's TPU writes it
    # (`_epilogue.epilogue_rows`), -1 where none does; None where none may be spared
    epilogue: np.ndarray | None = None
    # [n, 5] (buffer, first moment, last moment, that matmul output, kind) where that
    # matmul's split holds a buffer longer or a value takes it over (`_apart.apart_rows`);
    # None where none may
    apart: np.ndarray | None = None


def gathered_parameters(
    graph: Graph,
    consumers,
    boundary: int,
    update: set[int],
    remat: bool,
    gathered: Mapping[int, float] | None = None,
) -> Buffers:
    """The whole copies of the parameters ZeRO-3 gathers (`_run/_apply.py`): each from its
    first reader to its last in the forward, and gathered again for the backward's
    (`_groups.regather_plan`); under rematerialization XLA keeps the forward's copy for the
    backward (one gather, CSE'd with the recompute's: read on compile-only A100s). The
    `update` ops read the device's shard. Without remat a copy is as wide as what is
    gathered (`gathered`, bytes per parameter: a bf16 cast, say); under it the parameter."""
    rows, widths = [], []
    for leaf in graph.leaves(Role.PARAM):
        reads = sorted(set(consumers[leaf.tensor]) - update)
        fwd, bwd = [r for r in reads if r <= boundary], [r for r in reads if r > boundary]
        nbytes = graph.tensors[leaf.tensor].nbytes
        width = gathered[leaf.tensor] / nbytes if gathered and not remat and nbytes else 1.0
        for part in [reads] if remat else [fwd, bwd]:
            if part:
                rows.append((leaf.tensor, part[0], part[-1]))
                widths.append(width)
    t, b, d = np.array(rows, dtype=np.int64).reshape(-1, 3).T
    return Buffers(
        tensor=t, birth=b, death=d, width=np.array(widths, dtype=float), blocks=NO_BLOCKS
    )


def step_moments(
    buffers: Buffers,
    gathered: Buffers,
    nbytes: np.ndarray,
    tensor_set: np.ndarray,
    set_groups: np.ndarray,
    n_groups: int,
    gradients: Sequence[tuple[int, float]],
    n_ops: int,
    regathered: Buffers | None = None,
    outputs: Sequence[Buffers] = (),
    flash: Buffers | None = None,
) -> Moments:
    """The candidate moments of `buffers` and ZeRO-3's `gathered` parameters (`nbytes`,
    `tensor_set` per tensor; `set_groups` the groups of each set, padded with `n_groups`).
    `gradients`: (last reader, bytes) of each gradient a collective may reduce, and the op
    before which ZeRO-3's layer-by-layer reduction reduces it (where it does). `outputs`:
    the outputs held apart from the arguments (`_outputs.held_outputs`), alive from their
    op to the end: the program's last op, where all are made, is a candidate too. `flash`:
    the buffers where the attention cores run as the flash kernel, whose peaks are
    candidates too, and whose bytes at every candidate are `Moments.flash`."""
    n_sets = len(set_groups)
    rows = [tuple(g) for g in gradients]
    layered = bool(rows) and all(len(g) == 3 for g in rows)
    grads = np.array([g[:2] for g in rows], dtype=float).reshape(-1, 2)
    due = np.array([g[2] for g in rows] if layered else [], dtype=np.int64)

    def curve(per_set: np.ndarray, zero: bool, own: Buffers) -> np.ndarray:
        ev = np.zeros(n_ops + 2)
        for buf in (own, gathered) if zero else (own,):
            w = nbytes[buf.tensor] * buf.width * per_set[tensor_set[buf.tensor]]
            np.add.at(ev, buf.birth, w)
            np.add.at(ev, buf.death + 1, -w)
        out = np.cumsum(ev)[:n_ops]
        if zero:
            # every gradient reduced, held from its last reader to the end (or, layer by
            # layer, whole to its layer's reduction and an eighth from there)
            past = np.bincount(grads[:, 0].astype(np.int64) + 1, grads[:, 1], minlength=n_ops + 2)
            if zero == "layered":
                past -= np.bincount(due, grads[:, 1] * 7 / 8, minlength=n_ops + 2)
            out = out + np.cumsum(past)[:n_ops]
        return out

    rng = np.random.default_rng(0)
    probes = [np.ones(n_sets)]
    for _ in range(PROBES):
        split = np.append(rng.random(n_groups) < 0.5, False)
        probes.append(1.0 / 8.0 ** split[set_groups].sum(axis=1))
    picked: set[int] = set()
    for per_set in probes:
        # as data parallel holds the gradients, ZeRO-3 its gathered parameters too
        for zero in (False, True, "layered") if layered else (False, True):
            for own in (buffers,) if flash is None else (buffers, flash):
                picked.update(_highest_peaks(curve(per_set, zero, own), PER_PROBE))
    # and each recomputed layer's recompute, where its combined all-reduces copy
    picked.update(int(b) for b in buffers.blocks[:, 2])
    # and each kernel a split matmul's chain runs apart in, which reads what it makes its
    # value from as it runs (`_apart.py`: where the plan splits the matmul, it is busier)
    if buffers.apart is not None:
        picked.update(int(u) for u in buffers.apart[:, 2])
    held = any(len(b.tensor) for b in outputs)
    if held:
        picked.add(n_ops - 1)
    at = np.array(sorted(picked), dtype=np.int64)
    return Moments(
        live=_alive(buffers, at, nbytes, tensor_set, n_sets),
        held=held_at(at, grads),
        gathered=_alive(gathered, at, nbytes, tensor_set, n_sets),
        at=at,
        regathered=None
        if regathered is None
        else _alive(regathered, at, nbytes, tensor_set, n_sets),
        outputs=np.stack([_alive(b, at, nbytes, tensor_set, n_sets) for b in outputs])
        if held
        else None,
        unreduced=held_at(at, grads, due) if layered else None,
        reduced=held_at(at, np.column_stack([due - 1, grads[:, 1]])) if layered else None,
        flash=None if flash is None else _alive(flash, at, nbytes, tensor_set, n_sets),
    )


def past_forward(buffers: Buffers, tensors: Collection[int], consumers, boundary: int) -> Buffers:
    """Of the `buffers` of `tensors`, what is left after their last forward reader (an op at
    or before `boundary`)."""
    rows, widths = [], []
    for t, birth, death, width in zip(
        buffers.tensor, buffers.birth, buffers.death, buffers.width, strict=True
    ):
        if int(t) in tensors:
            last = max((c for c in consumers[int(t)] if c <= boundary), default=int(birth))
            if max(int(birth), last + 1) <= death:
                rows.append((int(t), max(int(birth), last + 1), int(death)))
                widths.append(float(width))
    t, b, d = np.array(rows, dtype=np.int64).reshape(-1, 3).T
    return Buffers(
        tensor=t, birth=b, death=d, width=np.array(widths, dtype=float), blocks=NO_BLOCKS
    )


def alive_among(
    buf: Buffers, tensors: Collection[int], at: np.ndarray, nbytes, tensor_set, n_sets: int
) -> np.ndarray:
    """[moments, sets] bytes of the buffers of `tensors` alive at each moment `at`."""
    mine = np.isin(buf.tensor, np.fromiter(tensors, dtype=np.int64, count=len(tensors)))
    part = Buffers(buf.tensor[mine], buf.birth[mine], buf.death[mine], buf.width[mine], NO_BLOCKS)
    return _alive(part, at, nbytes, tensor_set, n_sets)


def _alive(buf: Buffers, at: np.ndarray, nbytes, tensor_set, n_sets: int) -> np.ndarray:
    """[moments, sets] bytes of the buffers alive at each moment."""
    out = np.zeros((len(at), n_sets))
    for k, t in enumerate(at):
        on = (buf.birth <= t) & (buf.death >= t)
        x = buf.tensor[on]
        out[k] = np.bincount(tensor_set[x], nbytes[x] * buf.width[on], minlength=n_sets)
    return out


def held_at(at: np.ndarray, grads: np.ndarray, due: np.ndarray | None = None) -> np.ndarray:
    """Per moment, the share of the gradients' bytes made and past their last reader (and,
    with `due`, not yet reduced: before the op each is reduced at)."""
    if not grads[:, 1].sum():
        return np.zeros(len(at))
    past = grads[None, :, 0] < at[:, None]
    if due is not None:
        past &= at[:, None] < due[None, :]
    return past.astype(float) @ grads[:, 1] / grads[:, 1].sum()


def _highest_peaks(curve: np.ndarray, k: int) -> list[int]:
    """The k highest local maxima of a curve (the first moment of a plateau)."""
    if not len(curve):
        return []
    rise = np.diff(curve, prepend=-np.inf) > 0
    tops = np.flatnonzero(rise & (np.diff(curve, append=-np.inf) <= 0))
    order = np.argsort(-curve[tops], kind="stable")[:k]
    return [int(t) for t in tops[order]]
