"""ZeRO-3's gathered parameters as FSDP holds them: the terms of the cost model that say
how long each gathered copy lives, and how many bytes the layer-by-layer gathers move.

The runtime (`_run/_fsdp.py`, `_remat.LayerGathers`) gathers each forward layer's
parameters after the previous layer's input has arrived, so a layer's copies are alive
from the start of the previous layer (the prefetch) to the layer's last read: at most two
layers' copies at once, where XLA on its own held every parameter whole. The backward
gathers each parameter once more at its first backward read (under remat, at its layer's
recompute, which the copy serves too) and frees it after its last. A parameter read by
several forward layers (a tied embedding, a norm a cut candidate splits) is gathered by
each of them.

The gradients are reduce-scattered layer by layer (`_remat.Reduction`): a gradient's local
copy lives from its maker to its backward layer's reduction, its shard from there to the
update (`reduction_shares`), and the step's gradient reduce-scatter is one collective per
backward layer (and one at the end, for the layers the last reduction leaves).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from .._graph import Graph, Role
from .._remat import LayerGathers
from ._liveness import NO_BLOCKS, Buffers
from ._residuals import matmuls_alone


def roots(graph: Graph, lg: LayerGathers) -> dict[int, frozenset[int]]:
    """Per lazy tensor (`LayerGathers.lazy`), the parameters it is made from."""
    out = {leaf.tensor: frozenset({leaf.tensor}) for leaf in graph.leaves(Role.PARAM)}
    for i in sorted(lg.remake):
        op = graph.ops[i]
        made = frozenset().union(*(out.get(t, frozenset()) for t in op.inputs))
        out.update((t, made) for t in op.outputs)
    return out


def root_params(graph: Graph) -> list[int]:
    return [leaf.tensor for leaf in graph.leaves(Role.PARAM)]


def forward_reads(
    graph: Graph, lg: LayerGathers, within: Collection[int] | None = None
) -> dict[tuple[int, int], list[int]]:
    """(forward layer, parameter) -> the layer's ops reading it (or what is made from it),
    ascending, but the remade ops (they run where a layer reads them); `within`: only
    those ops (one program's: a pipeline stage's F reads a few layers of the whole
    forward, and each of its programs scanned the whole one)."""
    end = lg.regather.boundary + 1
    out: dict[tuple[int, int], list[int]] = {}
    for i, params in _readers(graph, lg, within).items():
        if i < end and i not in lg.remake:
            for p in params:
                out.setdefault((lg.layer(i), p), []).append(i)
    return out


def backward_reads(
    graph: Graph, lg: LayerGathers, within: Collection[int] | None = None
) -> dict[int, list[int]]:
    """Parameter -> the backward ops reading it (or what is made from it), ascending;
    `within`: only those ops."""
    backward = lg.regather.backward
    out: dict[int, list[int]] = {}
    for i, params in _readers(graph, lg, within).items():
        if i in backward:
            for p in params:
                out.setdefault(p, []).append(i)
    return out


def _readers(
    graph: Graph, lg: LayerGathers, within: Collection[int] | None
) -> dict[int, frozenset[int]]:
    """Op -> the parameters it reads (or what is made from them), ascending by op. Walked
    from the parameters' readers (`Graph.consumers`), not over every op: on a 1T GPT few
    ops read one, and the pipeline's stage memory asks once per stage."""
    root = roots(graph, lg)
    consumers = graph.consumers()
    mine = None if within is None else set(within)
    reads: dict[int, set[int]] = {}
    for t, params in root.items():
        for i in consumers[t]:
            if mine is None or i in mine:
                reads.setdefault(i, set()).update(params)
    return {i: frozenset(reads[i]) for i in sorted(reads)}


def served_bytes(
    graph: Graph,
    p: int,
    ops: Collection[int],
    gathered: Mapping[int, float],
    narrow: Mapping[int, float] | None,
) -> float:
    """The bytes one gather of parameter p moves, serving the ops `ops` (those reading p
    or what is made from it there): `narrow`'s where all are default-precision matmuls
    (`_zero.matmul_gathered_bytes`), else `gathered`'s."""
    if narrow and p in narrow and matmuls_alone([graph.ops[i] for i in ops]):
        return narrow[p]
    return gathered.get(p, graph.tensors[p].nbytes)


class Gathered(NamedTuple):
    """One parameter gathered by ZeRO-3 in one program (`program_gathers`)."""

    # the collective it is gathered in: ("layer", l) combined with forward layer l's
    # others (they wait for one anchor), ("leaf", p) alone (the backward's, one per leaf)
    collective: tuple[str, int]
    param: int
    reader: int  # the program's first op reading it there (a per-op price charges it)
    whole: bool  # read through a recompute's barrier: the parameter gathered, not its cast


def program_gathers(
    graph: Graph, lg: LayerGathers, ops: Collection[int], recomputed: Collection[int] = ()
) -> list[Gathered]:
    """ZeRO-3's gathers in a program running `ops` (every op of one program, or a pipeline
    stage's F or B) with the `recomputed` forward ops run again in it, as the runtime
    makes them (`_run/_fsdp.py`): per forward layer, the parameters its ops read, in one
    collective; in the backward, each parameter its ops or the recompute read, one by
    one (the recompute's copy serves the layer's backward too). A value made from
    parameters alone outside `ops` (a pipeline's pre cast) is an input the program reads
    as it is, gathered where it is made (`_run/_fsdp.within`). `gather_coefs` prices the
    one program by the same reads."""
    mine = set(ops)
    lg = dataclasses.replace(lg, remake=lg.remake & mine)
    out = []
    for (layer, p), readers in sorted(forward_reads(graph, lg, mine).items()):
        out.append(Gathered(("layer", layer), p, min(readers), False))
    root = roots(graph, lg)
    again: dict[int, int] = {}
    for i in sorted(recomputed):
        for p in frozenset().union(*(root.get(t, frozenset()) for t in graph.ops[i].inputs)):
            again.setdefault(p, i)
    first = {p: min(rs) for p, rs in backward_reads(graph, lg, mine).items()}
    for p in sorted(first.keys() | again.keys()):
        out.append(Gathered(("leaf", p), p, first.get(p, again.get(p)), p in again))
    return out


def layer_start(lg: LayerGathers, layer: int) -> int:
    """The first op of forward `layer` (0 for the first)."""
    return 0 if layer == 0 else lg.cuts[layer - 1]


def layer_gathered_parameters(
    graph: Graph,
    lg: LayerGathers,
    gathered: Mapping[int, float],
    blocks: np.ndarray = NO_BLOCKS,
    narrow: Mapping[int, float] | None = None,
) -> Buffers:
    """The whole copies ZeRO-3's layer-by-layer gathers make (`Buffers`, at the width XLA
    gathers: `gathered`, bytes per parameter, or `narrow`'s where only matmuls read the
    copy, `served_bytes`): per forward layer, each parameter it reads
    from the start of the previous layer (where its gather may start: the prefetch; the
    first two layers' gathers have no anchor and go first) to its last read there; and per
    parameter the backward reads, from its first backward read (or the recompute of a
    layer reading it: `blocks`, per recomputed layer its first and last forward op and the
    moment of its recompute) to its last."""
    rows, widths = [], []

    def width(p: int, ops: Collection[int]) -> float:
        nbytes = graph.tensors[p].nbytes
        return served_bytes(graph, p, ops, gathered, narrow) / nbytes if nbytes else 1.0

    forward = sorted(forward_reads(graph, lg).items())
    for (layer, p), ops in forward:
        birth = layer_start(lg, layer - 1) if lg.anchor[layer] is not None else 0
        rows.append((p, birth, max(ops)))
        widths.append(width(p, ops))
    read_in_forward: dict[int, list[int]] = {}
    for (_, p), ops in forward:
        read_in_forward.setdefault(p, []).extend(ops)
    for p, ops in sorted(backward_reads(graph, lg).items()):
        birth, fwd = min(ops), sorted(read_in_forward.get(p, ()))
        for first, last, moment in blocks:  # a recompute reading it gathers it first
            at = bisect.bisect_left(fwd, first)
            if at < len(fwd) and fwd[at] <= last:
                birth = min(birth, int(moment))
        rows.append((p, birth, max(ops)))
        # read through the recompute's barrier, XLA gathers the parameter, not its cast
        widths.append(width(p, ops) if birth == min(ops) else 1.0)
    t, b, d = np.array(rows, dtype=np.int64).reshape(-1, 3).T
    return Buffers(
        tensor=t, birth=b, death=d, width=np.array(widths, dtype=float), blocks=NO_BLOCKS
    )


def programs_gathered_peak(
    graph: Graph,
    lg: LayerGathers,
    programs: Sequence[Collection[int]],
    gathered: Mapping[int, float],
    per_device: np.ndarray,
    narrow: Mapping[int, float] | None = None,
) -> float:
    """The most bytes of ZeRO-3's gathered copies alive at once in any of `programs` (each
    its ops: a pipeline stage's F, B and W), placed as `layer_gathered_parameters` places
    them in one program, each program's own (`program_gathers`: a value made from
    parameters alone outside them is gathered where it is made). `per_device`: per tensor,
    a device's bytes of it per byte (0 where ZeRO gathers nothing of it)."""
    mine = set().union(*programs)
    rows = layer_gathered_parameters(
        graph, dataclasses.replace(lg, remake=lg.remake & mine), gathered, narrow=narrow
    )
    nbytes = np.array([graph.tensors[t].nbytes * per_device[t] for t in rows.tensor]) * rows.width
    peak = 0.0
    for ops in programs:
        inside = np.isin(rows.death, np.fromiter(ops, dtype=np.int64))
        birth, death, b = rows.birth[inside], rows.death[inside], nbytes[inside]
        for x in np.unique(birth):
            peak = max(peak, float(b[(birth <= x) & (death >= x)].sum()))
    return peak


@dataclasses.dataclass(frozen=True)
class GatherCoefs:
    """The bytes (as XLA gathers them: `Tables.gathered`) and the number of leaves (rank
    >= 1) of ZeRO-3's layer-by-layer gathers, per group set as `Tables.param_coef`."""

    forward_coef: np.ndarray  # [n_sets] every forward layer's gathers
    # the layers that gather: one collective each (XLA's all-gather combiner joins the
    # gathers of a layer, which wait for one anchor)
    forward_layers: int
    backward_coef: np.ndarray  # [n_sets] the backward's second gathers, without remat
    backward_leaves: np.ndarray
    remat_coef: np.ndarray  # [n_sets] under remat: the backward's and the recompute's
    remat_leaves: np.ndarray
    # [n_sets] bytes of the values made from parameters alone (a weight's cast) that remat
    # keeps as its layers' inputs: ZeRO-3 gathers them again at the recompute instead
    remat_kept: np.ndarray
    # the gradients' reduce-scatters layer by layer (`reduction_shares`): how many, the
    # largest share of the gradients' bytes one reduces, and the share the last one does
    reductions: int = 1
    largest: float = 1.0
    tail: float = 1.0

    def sub(self, sets: np.ndarray) -> GatherCoefs:
        """The coefficients of some sets only (a scope's own, `_search/_mesh_terms.py`);
        the layers that gather are the step's, whichever sets a scope holds."""
        return GatherCoefs(
            self.forward_coef[sets],
            self.forward_layers,
            self.backward_coef[sets],
            self.backward_leaves[sets],
            self.remat_coef[sets],
            self.remat_leaves[sets],
            self.remat_kept[sets],
            self.reductions,
            self.largest,
            self.tail,
        )


def gather_coefs(
    graph: Graph,
    lg: LayerGathers,
    gathered: Mapping[int, float],
    set_of: Callable[[int], int],
    n_sets: int,
    recomputed: Collection[int],
    saved_remat: Collection[int],
    gradients: Collection[int] = (),
    casts_again: bool = False,
    narrow: Mapping[int, float] | None = None,
) -> GatherCoefs:
    """`GatherCoefs` of `graph` (`set_of`: a tensor's set; `recomputed`: the ops remat runs
    again, whose parameters the backward's gather serves as well; `saved_remat`: what
    remat keeps for the backward; `gradients`: the step's, `_groups.update_region`'s;
    `casts_again`: the recompute's gathers move what the forward's do, `gathered`
    (`Lowering.recompute_gathers_casts`), not the parameters; `narrow`: a gather's bytes
    where only matmuls read its copy, `served_bytes`)."""
    root = roots(graph, lg)
    bwd = backward_reads(graph, lg)
    again: dict[int, list[int]] = {}  # parameter -> the recomputed ops reading it
    for i in recomputed:
        for p in frozenset().union(*(root.get(t, frozenset()) for t in graph.ops[i].inputs)):
            again.setdefault(p, []).append(i)

    pairs = forward_reads(graph, lg)
    kept = np.zeros(n_sets)
    for t in set(saved_remat) & (lg.lazy - set(root_params(graph))):
        kept[set_of(t)] += graph.tensors[t].nbytes

    def coefs(uses, whole=frozenset()) -> tuple[np.ndarray, np.ndarray]:
        """Per (parameter, the ops its gather serves)."""
        coef, leaves = np.zeros(n_sets), np.zeros(n_sets)
        for p, ops in uses:
            nbytes = graph.tensors[p].nbytes
            coef[set_of(p)] += (
                nbytes if p in whole else served_bytes(graph, p, ops, gathered, narrow)
            )
            leaves[set_of(p)] += graph.tensors[p].ndim > 0
        return coef, leaves

    both = {p: bwd.get(p, []) + again.get(p, []) for p in bwd.keys() | again.keys()}
    return GatherCoefs(
        coefs([(p, ops) for (_, p), ops in pairs.items()])[0],
        len({layer for layer, p in pairs if graph.tensors[p].ndim}),
        *coefs(sorted(bwd.items())),
        # the recompute reads through its barrier: XLA's GPU gathers those parameters, not
        # their casts (read on compile-only A100s; the CPU widens a 16-bit gather anyway);
        # XLA's TPU moves the cast across the barrier and gathers it
        *coefs(sorted(both.items()), whole=frozenset() if casts_again else frozenset(again)),
        kept,
        *reduction_shares(graph, lg, gradients),
    )


def reduction_shares(graph: Graph, lg: LayerGathers, gradients: Collection[int]):
    """(reductions, largest, tail) of the gradients' reduce-scatters layer by layer: how
    many collectives (one per `LayerGathers.reductions`, one at the end), and the largest
    share of the `gradients`' bytes one of them reduces, and the end's (unsplit bytes: the
    shares a plan's split gradients keep, as `_liveness.Moments.held` does)."""
    at: dict[int | None, float] = {}
    for t in gradients:
        key = lg.reduced_at(graph.tensors[t].producer)
        at[key] = at.get(key, 0.0) + graph.tensors[t].nbytes
    total = sum(at.values())
    if not total:
        return 1, 1.0, 1.0
    return len(at), max(at.values()) / total, at.get(None, 0.0) / total
