"""ZeRO beside a wider axis: the gradient dots XLA's SPMD partitioner splits over another
mesh axis rather than reduce-scattering their result over data (`_tiles.beside_axis`),
priced alike by every path that prices a plan's gradients: the one-stage estimate
(`_kernel.totals`, given a `Split`), the ILP's factors per scope (`scope_split`, read by
`_search/_mesh_terms.py`) and the pipeline's per-op rows (`_pipelined.op_costs`, whose
stage programs keep the rule where a B call reduces the gradient, `_stage_comm.py`).

It is read per gradient row of the kernel's tables (`_rows.RowTable`): a row a
dot_general writes, of a set that holds a candidate parameter
(`_tiles.beside_candidates`), that the plan all-reduces over ZeRO's data axis alone (ZeRO
makes that a reduce-scatter). Where the set's parameters take a beside axis under the plan
the row's reduce-scatter goes (not a tied table's, whose lookup part is still
reduce-scattered), and the row adds an all-reduce over data of 1/n of its bytes, combined
with the step's other gradients there, and a collective-permute of those bytes over data
and that axis, once per occurrence. Per row, so each path reads it on the rows it has: a
row's scope in the ILP holds its set's groups, so the scope's options fix the rule.

The dot that writes a moved row runs on its 1/n piece too (n: the data axis' size), not
only its collectives: XLA's TPU compile of gpt's GPipe plan 4 of the TPU bench runs stage
2's weight-gradient dots as f32[512, 256], half the [512, 512] kernel, over each chip's
sequences. `split_compute` is what every path takes off its compute for it: the
estimate's (`Split.compute`, from each moved row's `RowTable.op_s`), the ILP's per scope
(`scope_split`'s last array), the per-op rows' (`SplitRows.ops`, `_pipelined.op_costs`;
a pipeline stage's only where its B calls reduce the gradients, `_stage_comm.split_alone`)
and verify's FLOPs (`BesideMemo.ops`, `_verify/_flops.op_divisors`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from . import _collectives as C
from ._buffers import SplitOperands
from ._kernel import partial_slots, per_slot, tied_rows
from ._kernel import set_axes as held_axes
from ._rows import RowTable
from ._terms import Layout
from ._tiles import TileTable, beside_axis, beside_candidates


@dataclasses.dataclass(frozen=True)
class Beside:
    """A graph's candidates (built once per graph, `beside_table`)."""

    dims: np.ndarray  # [k, R] each candidate parameter's dims
    groups: np.ndarray  # [k, R] their groups (the pad group past the rank)
    rank: np.ndarray  # [k]
    slot: np.ndarray  # [k] its set's index among `sets`
    sets: np.ndarray  # [s] the sets holding a candidate
    of_set: np.ndarray  # [n_sets] each set's index among `sets`, -1 for none
    # [s] the set holds a tied table: its reduce-scatter stays where the lookup's part is
    # summed into the head's (one program; not where reduced apart: `rows`, `BesideMemo`)
    keeps: np.ndarray
    dot_ops: np.ndarray  # [n_ops] a dot_general
    op_set: np.ndarray  # [n_ops] each op's iteration set (`Tables.op_set`)
    op_groups: np.ndarray  # [n_ops, K] its groups (`Tables.sets`, the pad past them)

    def axes(self, code: np.ndarray, sizes: np.ndarray, data: int) -> np.ndarray:
        """[..., s] the beside axis code of each candidate set (0: none) where the
        candidates' dims take the axis codes `code` ([..., k, R])."""
        ax = beside_axis(self.dims, self.rank, code, sizes, data).reshape(-1, len(self.rank))
        out = np.zeros((len(ax), len(self.sets)), dtype=np.int64)
        np.maximum.at(out, (np.arange(len(ax))[:, None], self.slot[None, :]), ax)
        return out.reshape(*code.shape[:-2], len(self.sets))

    def rows(self, R: RowTable, idx=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per virtual row of `R` (`_kernel.partial_slots`; of its rows `idx`, in that
        order, where given): its set's index among `sets` (0 for none), whether the rule
        may take it (a step's gradient a dot writes) and whether its reduce-scatter stays
        (a tied table's, the lookup's part summed in: no scatter-add row of its own, as
        two stages' programs have, `Tables.staged_partial_full`)."""
        idx = np.arange(len(R.tset)) if idx is None else idx
        at = self.of_set[R.tset[idx]]
        may = R.grad[idx] & (R.combine[idx] == 0) & (R.lookup[idx] == 0)
        may &= self.dot_ops[R.op[idx]] & (at >= 0)
        apart = np.isin(R.tset[idx], R.tset[R.grad & (R.lookup == 2)])
        keeps = np.append(self.keeps, False)[at] & ~apart  # -1: no candidate
        slots = partial_slots(R)
        return tuple(np.tile(x, slots) for x in (np.maximum(at, 0), may, keeps))


def beside_table(graph, table: TileTable, T) -> Beside:
    """The `Beside` of `graph`, from its `TileTable` and its `Tables` (its ops' sets)."""
    pick = np.flatnonzero(beside_candidates(table))
    sets, slot = np.unique(table.tset[pick], return_inverse=True)
    of_set = np.full(table.n_sets, -1, dtype=np.int64)
    of_set[sets] = np.arange(len(sets))
    others = table.grad_others[pick] if table.grad_others is not None else np.zeros(len(pick))
    keeps = np.bincount(slot, others > 0, minlength=len(sets)) > 0
    dots = np.array([op.primitive == "dot_general" for op in graph.ops] + [False], dtype=bool)
    rank = table.rank[pick]
    return Beside(
        table.dims[pick], table.groups[pick], rank, slot, sets, of_set, keeps, dots,
        T.op_set, T.sets[T.op_set],
    )  # fmt: skip


class Split(NamedTuple):
    """What the rule moves in one plan (`row_split`): the reduce-scatter's bytes and rows
    over data that go, the bytes and rows all-reduced over data instead, and per beside
    axis code (axis, bytes, occurrences) of its collective-permutes; the dots that write
    the moved rows (`moved_rows`: of a merged table, one per row), and the seconds their
    split takes off compute (`split_compute`)."""

    removed: float = 0.0
    removed_rows: int = 0
    pieces: float = 0.0
    piece_rows: int = 0
    permutes: tuple[tuple[int, float, float], ...] = ()
    ops: tuple[int, ...] = ()
    n: float = 1.0  # the data axis' size
    compute: float = 0.0
    sets: tuple[int, ...] = ()  # the tensor sets of the moved rows (the split gradients)


def split_compute(seconds, n: float):
    """What the rule takes off its dots' compute (`seconds`, or FLOPs): each runs the 1/n
    piece of its gradient it writes (n: the data axis' size), not the whole."""
    return (1.0 - 1.0 / n) * seconds


def moved_rows(R: RowTable, axis: np.ndarray) -> np.ndarray:
    """The rows of `R` (once each) whose virtual rows the rule moves (`row_axes`' `axis`
    > 0): each written by a dot (by the dots merged into it, `RowTable.op_s`)."""
    return np.unique(np.flatnonzero(axis > 0) % max(len(R.tset), 1))


def moved_seconds(bes: Beside, R: RowTable, rows: np.ndarray, inv: np.ndarray) -> np.ndarray:
    """Per row of `rows` (`moved_rows`), its dots' compute seconds under a plan whose sets'
    inverse divisors are `inv`. Their sets hold the data axis (the rows are reduced over
    it), so ZeRO's shares leave them whole (`_zero.zero_shares`)."""
    return R.op_s[rows] * inv[bes.op_set[R.op[rows]]]


def split_seconds(split: Split | None) -> float:
    """Seconds the rule takes off a plan's compute (`Split.compute`; 0 for None)."""
    return 0.0 if split is None else split.compute


def less_split(seconds: np.ndarray, split: Split | None) -> np.ndarray:
    """[n_ops] each op's compute `seconds` (`_compute.op_compute`) less what the rule
    takes off its dots (`split_seconds`, op by op)."""
    if split is None or not split.ops:
        return seconds
    out, ops = seconds.copy(), list(split.ops)
    out[ops] -= split_compute(seconds[ops], split.n)
    return out


def row_axes(rows, set_axes: np.ndarray, key, count, zero_key: int):
    """Per virtual row of a table (`rows`: its `Beside.rows`; the first of `key` and
    `count`, a state's rows): the beside axis code the rule moves it to (0: none;
    `set_axes`: `Beside.axes` of the plan, [s]), and whether its reduce-scatter stays."""
    at, may, keeps = rows
    n = len(at)
    on = may & (key[:n] == zero_key) & (count[:n] != 0)
    return np.where(on, set_axes[at], 0), keeps


def split_of(axis, keeps, nbytes, count, n: float, ops=(), seconds: float = 0.0, sets=()) -> Split:
    """The `Split` of rows moved to the beside axes `axis` (`row_axes`), of `nbytes` and
    `count` each, over a data axis of n devices, written by `ops` whose compute is
    `seconds` (`moved_seconds`), of the tensor sets `sets`."""
    on = axis > 0
    if not on.any():
        return Split()
    go = on & ~keeps
    piece = np.where(on, nbytes[: len(on)], 0.0) / n
    permutes = tuple(
        (int(a), float(piece[axis == a].sum()), float(count[: len(on)][axis == a].sum()))
        for a in np.unique(axis[on])
    )
    removed = float(np.where(go, nbytes[: len(on)], 0.0).sum())
    ops = tuple(int(o) for o in ops)
    saved = float(split_compute(seconds, n))
    sets = tuple(int(x) for x in sets)
    return Split(
        removed, int(go.sum()), float(piece.sum()), int(on.sum()), permutes, ops, n, saved, sets
    )


def split_held(operands: SplitOperands | None, L: Layout, split: Split | None):
    """[moments] bytes per device the `split` gradient dots' operands hold from the
    forward at each candidate moment of a step without remat (`_buffers.split_operands`:
    each where a dot that reads it writes a split gradient), laid as `L` lays each set;
    None where nothing is (under remat the recompute writes them: `Moments` of its own)."""
    if operands is None or split is None or not split.sets or L.remat:
        return None
    on = np.isin(operands.grads, split.sets).any(axis=1)
    return operands.live[:, on] @ L.made_inv[operands.sets[on]] if on.any() else None


class BesideMemo:
    """A cost model's `Beside`, made on first use, and each layout's `Beside.axes`,
    computed once per layout. `on`: the lowering reduce-scatters ZeRO's gradients (XLA's
    CPU all-reduces them: no rule)."""

    LIMIT = 4096

    def __init__(self, make: Callable[[], Beside], on: bool):
        self._make, self.on = make, on
        self._axes: dict[tuple, np.ndarray] = {}
        self._rows: dict[int, tuple] = {}  # per row table (kept: its id stays its own)

    def rows(self, R: RowTable) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`Beside.rows` of `R`, computed once per table."""
        hit = self._rows.get(id(R))
        if hit is None:
            hit = self._rows[id(R)] = (R, *self.table.rows(R))
        return hit[1:]

    @functools.cached_property
    def table(self) -> Beside:
        return self._make()

    def axes(self, codes: np.ndarray, sizes: np.ndarray, data: int) -> np.ndarray:
        key = (codes.tobytes(), sizes.tobytes(), data)
        hit = self._axes.get(key)
        if hit is None:
            hit = self.table.axes(codes[self.table.groups], sizes, data)
            if len(self._axes) < self.LIMIT:
                self._axes[key] = hit
        return hit

    def split(self, st, ac: C.AxisCosts, data: int, tied: RowTable, stage: int) -> Split:
        """The `Split` of a kernel state `st` (`_kernel.State`), ZeRO at `stage` over the
        axis code `data`; a tied table whose parts it reduce-scatters apart (`tied`, the
        tables' `tied_partial`: `_kernel.tied_rows`) keeps none of its head's."""
        R = st.partial
        if not self.on or R is None or not len(self.table.sets):
            return Split()
        bes = self.table
        zero_key = C.AR * ac.masks + int(ac.bit[data])
        set_axes = self.axes(st.codes, ac.sizes, data)
        axis, keeps = row_axes(self.rows(R), set_axes, st.key, st.count, zero_key)
        apart = tied.tset[tied_rows(tied, st, ac, data, stage) > 0]
        keeps = keeps & ~np.isin(bes.sets[self.rows(R)[0]], apart)
        rows = moved_rows(R, axis)
        seconds = moved_seconds(bes, R, rows, st.inv).sum()
        n = float(ac.sizes[data])
        ops = np.unique(R.op[rows])
        return split_of(axis, keeps, st.nbytes, st.count, n, ops, seconds, np.unique(R.tset[rows]))

    def ops(self, st, ac: C.AxisCosts, data: int) -> np.ndarray:
        """The dots the rule splits in a kernel state `st` of one row per op (`detail`),
        ZeRO over the axis code `data`: what verify counts 1/n of."""
        R = st.partial
        if not self.on or R is None or not len(self.table.sets):
            return np.zeros(0, dtype=np.int64)
        zero_key = C.AR * ac.masks + int(ac.bit[data])
        set_axes = self.axes(st.codes, ac.sizes, data)
        axis, _ = row_axes(self.rows(R), set_axes, st.key, st.count, zero_key)
        return np.unique(R.op[moved_rows(R, axis)])


def scope_split(bes: Beside, R: RowTable, idx, cfg, grad, A, local, key, nbytes, count, ac, data):
    """The rule on every joint option of an ILP scope (`_search/_mesh_terms.py`): `R`'s
    rows `idx`, the scope's partial-sum rows once per option (option-major), per virtual
    row its option `cfg`, whether it is a step's gradient (`grad`: combined in slot 0)
    and its kernel outputs (`key`, `nbytes`, `count`); `A` [options, local groups + pad]
    the axis codes of the scope's groups (`local`: each group's index there, the pad for
    the rest). Returns per option the active gradient rows over data alone before the
    rule, and its `Split` as arrays ([options] each; the permutes' bytes and occurrences
    [options, axis codes]; last, the seconds its dots' split takes off compute, each
    moved row's once, on its dots' set's divisor in that option), or None where nothing
    moves. A dot's set is its gradient's groups and its reduced ones: the row's scope
    holds them (its set and its reduced groups are among the row's)."""
    n_c = len(A)
    zero_key = C.AR * ac.masks + int(ac.bit[data])
    at, may, keeps = bes.rows(R, idx)
    n = len(at)
    cfg, count, nbytes = cfg[:n], count[:n], nbytes[:n]
    active = grad[:n] & (key[:n] == zero_key) & (count != 0)
    rows = np.bincount(cfg[active], minlength=n_c)
    if not (may & active).any():
        return rows, None
    set_axes = bes.axes(A[:, local[bes.groups]], ac.sizes, data)  # [options, s]
    axis = np.where(may & active, set_axes[cfg, at], 0)
    on = axis > 0
    if not on.any():
        return rows, None
    go = on & ~keeps
    piece = np.where(on, nbytes, 0.0) / float(ac.sizes[data])
    permutes = np.zeros((2, n_c, len(ac.sizes)))
    np.add.at(permutes[0], (cfg[on], axis[on]), piece[on])
    np.add.at(permutes[1], (cfg[on], axis[on]), count[on])
    # Each moved row's dots once per option, on their set's divisor there (`moved_seconds`).
    c, row = np.unique(np.stack([cfg[on], per_slot(R, idx)[:n][on]]), axis=1)
    groups = local[bes.op_groups[R.op[row]]] + (c * A.shape[1])[:, None]
    _, inv = held_axes(A.ravel(), groups, ac.sizes)
    saved = split_compute(R.op_s[row] * inv, float(ac.sizes[data]))
    return rows, (
        np.bincount(cfg[go], nbytes[go], minlength=n_c),
        np.bincount(cfg[go], minlength=n_c),
        np.bincount(cfg[on], piece[on], minlength=n_c),
        np.bincount(cfg[on], minlength=n_c),
        permutes[0],
        permutes[1],
        np.bincount(c, saved, minlength=n_c),
    )


class SplitRows(NamedTuple):
    """The rule as rows of their own, for per-op prices (`_pipelined.op_costs`): per new
    row the row it comes from, its key, bytes, occurrences and whether it is a gradient
    (the pieces' all-reduce over data, combined) or not (their permute); per old row
    whether its reduce-scatter goes; and the dots that write them (`moved_rows`)."""

    source: np.ndarray
    key: np.ndarray
    nbytes: np.ndarray
    count: np.ndarray
    grad: np.ndarray
    gone: np.ndarray
    ops: np.ndarray


def split_rows(memo: BesideMemo, st, ac: C.AxisCosts, data: int) -> SplitRows | None:
    """`SplitRows` of a kernel state `st` (`_kernel.State`, its keys before ZeRO's
    reduce-scatter), ZeRO over the axis code `data`; None where nothing moves."""
    R = st.partial
    if not memo.on or R is None or not len(memo.table.sets):
        return None
    mask = int(ac.bit[data])
    set_axes = memo.axes(st.codes, ac.sizes, data)
    axis, keeps = row_axes(memo.rows(R), set_axes, st.key, st.count, C.AR * ac.masks + mask)
    on = np.flatnonzero(axis > 0)
    if not len(on):
        return None
    gone = np.zeros(len(st.key), dtype=bool)
    gone[on[~keeps[on]]] = True
    piece = st.nbytes[on] / float(ac.sizes[data])
    permute = C.CP * ac.masks + (mask | ac.bit[axis[on]])
    return SplitRows(
        source=np.concatenate([on, on]),
        key=np.concatenate([np.full(len(on), C.AR * ac.masks + mask), permute]),
        nbytes=np.concatenate([piece, piece]),
        count=np.concatenate([st.count[on], st.count[on]]),
        grad=np.arange(2 * len(on)) < len(on),
        gone=gone,
        ops=np.unique(R.op[moved_rows(R, axis)]),
    )
