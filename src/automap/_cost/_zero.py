"""ZeRO's terms of a plan's price: which ops ZeRO's layout makes run on a device's data
shard, the bytes ZeRO-3's gather of each parameter moves, the gathers a step makes, and
the all-reduce of the update's own sums over ZeRO's split (`UpdateReductions`).

Under ZeRO a gradient is made where it meets its sharded optimizer state, and the update
runs on the shard (`_groups.zero_region`): those ops' compute is divided over the data
axis (`zero_shares`, `zero_compute`) unless their iteration space is split over it
already. ZeRO-3 gathers each parameter where an op needs it whole, at the width XLA
gathers it (`gathered_bytes`): in one-stage steps layer by layer, and again in the
backward (`RegatherCoefs`, its per-layer coefficients in `_fsdp.py`). The one-stage
estimate and the shard ILP read these through `_terms.py`, the one statement of the price.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from .._capture import loss_boundary
from .._graph import Graph, Role
from .._groups import (
    REDUCE_SUM_LIKE,
    Groups,
    Regather,
    dim_ties,
    reduced_dims,
    shardable,
    update_region,
    zero_pinned_dims,
    zero_region,
)
from .._lowering import Lowering
from .._pipeline import Partition, Phase, op_programs
from .._remat import LayerGathers, layer_gathers
from . import _collectives as C
from ._fsdp import GatherCoefs, Gathered, gather_coefs, program_gathers, served_bytes
from ._residuals import matmuls_alone
from ._stage_layouts import Layouts
from ._traffic import phase_codes

if TYPE_CHECKING:
    from ._tables import Tables


def zero_ops(graph: Graph, pinned: Collection[int], update: Collection[int]) -> np.ndarray:
    """[n_ops] whether ZeRO's layout pins each op's result (`Tables.zero_op`): the makers
    of the `pinned` tensors (gradients made where they meet their shard) and the `update`
    ops (`_groups.zero_region` gives both)."""
    zero_op = np.zeros(len(graph.ops), dtype=bool)
    zero_op[[graph.tensors[t].producer for t in pinned]] = True
    zero_op[sorted(update)] = True
    return zero_op


def zero_shares(T: Tables, P: np.ndarray, d: int, size: float) -> np.ndarray:
    """[n_ops] the share of its work each op runs on a device under ZeRO over the mesh
    axis of code `d` and size `size` (`P`: per set, its axes): 1 / size for an op ZeRO
    pins (`Tables.zero_op`) whose iteration space is not already split over that axis,
    else 1."""
    return shares(T.zero_op, T.op_set, P, d, size)


def shares(pinned: np.ndarray, sets: np.ndarray, P: np.ndarray, d: int, size: float):
    """`zero_shares` of any entries: `pinned` and `sets`, per entry (a loop body op's too)."""
    return np.where(pinned & ~P[sets, d], 1.0 / size, 1.0)


def gathered_bytes(
    graph: Graph, consumers, update: Collection[int], lowering: Lowering
) -> dict[int, float]:
    """Per parameter leaf, the bytes ZeRO-3's gather of it moves (whole). XLA gathers a
    sharded parameter where an op needs it whole, after the elementwise ops that keep its
    sharding: where every reader outside the `update` casts it to a narrower float (a
    mixed-precision step's weights), it gathers the cast. Read in the programs compiled
    for A100s: a bf16 gather, half the float32 parameter's bytes (XLA's CPU widens a
    16-bit collective to `Lowering.collective_float_bytes` an element). Where matmuls
    read float32 operands narrower (`Lowering.matmul_operand_bytes`, XLA's TPU: one bf16
    pass at the default precision), a float32 weight only such matmuls read is gathered
    as that narrower copy too: a float32 GPT's ZeRO-3 gathers on v5p are bf16 [2048, 512]
    and the like, its embedding tables (read by a gather) float32."""
    wide, operand = lowering.collective_float_bytes, lowering.matmul_operand_bytes
    out = {}
    for leaf in graph.leaves(Role.PARAM):
        x = graph.tensors[leaf.tensor]
        readers = [graph.ops[c] for c in consumers[leaf.tensor] if c not in update]
        casts = [
            graph.tensors[op.outputs[0]]
            for op in readers
            if op.primitive == "convert_element_type"
            and graph.tensors[op.outputs[0]].dtype.startswith(("float", "bfloat"))
        ]
        narrow = readers and len(casts) == len(readers)
        per_element = (
            min(x.itemsize, max(max(c.itemsize for c in casts), wide)) if narrow else x.itemsize
        )
        if operand and x.dtype == "float32" and matmuls_alone(readers):
            per_element = min(per_element, operand)
        out[leaf.tensor] = float(x.size * per_element)
    return out


def matmul_gathered_bytes(
    graph: Graph, gathered: Mapping[int, float], lowering: Lowering
) -> dict[int, float]:
    """Per float32 parameter leaf whose gathers `gathered_bytes` prices wider than a
    matmul's operand (a reader other than matmuls: a tied token table's lookup), the
    bytes a gather of it moves where only default-precision matmuls read what it gathers
    (`_fsdp.served_bytes`): XLA's TPU gathers a float32 GPT's tied table as float32 for
    the lookup's layer and as its bf16 cast for the head's, forward and backward (gpt 1
    of the chip-size TPU bench, ZeRO-3 over data 32: three gathers, 125 MiB a chip less
    than three of float32)."""
    operand = lowering.matmul_operand_bytes
    out = {}
    for leaf in graph.leaves(Role.PARAM):
        x = graph.tensors[leaf.tensor]
        if operand and x.dtype == "float32" and gathered[leaf.tensor] > x.size * operand:
            out[leaf.tensor] = float(x.size * operand)
    return out


@dataclasses.dataclass(frozen=True)
class RegatherCoefs:
    """ZeRO-3's second gather by group set, like `Tables.param_coef` (`_groups.Regather`),
    and its gathers layer by layer (`_fsdp.py`)."""

    param_coef: np.ndarray  # [n_sets] bytes of the parameters the backward gathers again
    param_leaves: np.ndarray  # [n_sets] how many of them (rank >= 1)
    act_coef: np.ndarray  # [n_sets] bytes of the forward's gathered values no longer saved
    # ZeRO-3's gathers layer by layer (`_fsdp.py`), None for a step without a loss
    layers: GatherCoefs | None = None

    def sub(self, sets: np.ndarray) -> RegatherCoefs:
        """The coefficients of some sets only (a scope's own, `_search/_mesh_terms.py`)."""
        return RegatherCoefs(
            self.param_coef[sets],
            self.param_leaves[sets],
            self.act_coef[sets],
            None if self.layers is None else self.layers.sub(sets),
        )


def tensor_sets(groups: Groups, T) -> Callable[[int], int]:
    """A tensor's group set as `build_tables` keys them: its splittable groups, sorted."""
    ng = len(groups.groups)
    index = {tuple(int(g) for g in row if g < ng): i for i, row in enumerate(T.sets)}

    def set_of(t: int) -> int:
        return index[tuple(sorted({g for g in groups.tensor_groups[t] if T.splittable[g]}))]

    return set_of


def regather_coefs(graph: Graph, groups: Groups, T, res, rg: Regather) -> RegatherCoefs:
    """The per-set coefficients of ZeRO-3's second gather `rg` (sets keyed as
    `build_tables` keys them: a tensor's splittable groups, sorted), and of its gathers
    layer by layer where the step has a loss (`_fsdp.gather_coefs`; a recompute's gather
    of the casts where `Tables.casts_again`)."""
    set_of = tensor_sets(groups, T)
    n = len(T.sets)
    coef, leaves, acts = np.zeros(n), np.zeros(n), np.zeros(n)
    for t in rg.params:  # gathered as the forward gathers them (a cast, say)
        coef[set_of(t)] += T.gathered[t]
        leaves[set_of(t)] += graph.tensors[t].ndim > 0
    # Saved values made from parameters alone (their casts: the same groups, so the same
    # set as theirs, and split on data exactly where the parameter is).
    for t in set(res.saved) & rg.tensors:
        acts[set_of(t)] += graph.tensors[t].nbytes
    layers = None
    if loss_boundary(graph) is not None:
        lg = layer_gathers(graph, groups)
        grads = update_region(graph, groups)[0]
        layers = gather_coefs(
            graph, lg, T.gathered, set_of, n, res.recomputed, res.saved_remat, grads,
            T.casts_again, T.gathered_narrow,
        )  # fmt: skip
    return RegatherCoefs(coef, leaves, acts, layers)


#: The update's ops whose sum over a split dim XLA completes with an all-reduce.
_SUMS = REDUCE_SUM_LIKE | {"dot_general"}


@dataclasses.dataclass(frozen=True)
class UpdateReductions:
    """The optimizer's own sums over a ZeRO-split dim: a contraction or reduction in the
    update (a preconditioner's g^T g, a global norm) whose summed dim is the one ZeRO
    splits its operand on leaves each device a partial sum, which XLA all-reduces over
    data (on 8 CPU devices, an `eigh` preconditioner's 256 x 256 g^T g per weight: 544 of
    the step's 800 KiB). Per data size (ZeRO's dims depend on what it divides), the bytes
    of those results summed by their set (`at`), and per result (`per_tensor`).

    Priced where a plan splits no other dim of the parameters (data parallelism's layout,
    where the searchers offer ZeRO): a parameter dim split on another axis may move ZeRO's
    dim (`_groups.zero_spec`), which the sets' layout cannot tell."""

    results: Callable[[int], Mapping[int, float]]  # data size -> {result: bytes whole}
    tset: np.ndarray  # [tensors] each tensor's set
    n_sets: int
    sets: np.ndarray | None = None  # the sets kept (`sub`), None for all
    # Every dim size of the program, ascending. ZeRO's split of an unsplit layout goes on
    # the first dim a data size divides (`_groups.zero_spec`), so two sizes that divide the
    # same of these have the same `results`: on thousands of GPUs the searchers' many data
    # sizes make a few such patterns, and each `results` walks the whole update.
    dims: tuple[int, ...] = ()
    # `results` by divisibility pattern, shared by every `sub`: searchers price many plans
    cache: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def per_tensor(self, data_size: float) -> Mapping[int, float]:
        """{result tensor: its bytes whole} of the sums a data axis of `data_size` splits."""
        size = int(data_size)
        key = size <= 1, tuple(d % size == 0 for d in self.dims) if size > 0 else ()
        if key not in self.cache:
            self.cache[key] = self.results(size)
        return self.cache[key]

    def at(self, data_size: float) -> np.ndarray:
        """[n_sets] (or the kept sets') the bytes of those results, summed by set."""
        out = np.zeros(self.n_sets)
        for t, b in self.per_tensor(data_size).items():
            out[self.tset[t]] += b
        return out if self.sets is None else out[self.sets]

    def sub(self, sets: np.ndarray) -> UpdateReductions:
        """The sums of `sets` only, as their positions there."""
        kept = np.asarray(sets).ravel() if self.sets is None else self.sets[sets]
        return dataclasses.replace(self, sets=kept)


def update_sums(graph: Graph, groups: Groups, T) -> UpdateReductions:
    """The update's sums over ZeRO's split (`UpdateReductions`), sets as `T` keys them."""
    set_of = tensor_sets(groups, T)
    tset = np.array([set_of(t.id) for t in graph.tensors], dtype=np.int64)
    dims = tuple(sorted({n for t in graph.tensors for n in t.shape}))
    return UpdateReductions(
        lambda size: split_sums(graph, groups, size), tset, len(T.sets), dims=dims
    )


def split_sums(graph: Graph, groups: Groups, data_size: int) -> dict[int, float]:
    """{result: bytes} of the update's sums whose summed dim carries ZeRO's split over a
    data axis of `data_size`. A tensor ZeRO pins is split where its constraint says
    (`_groups.zero_pinned_dims`); one it does not pin, where its operand's split reaches
    it through the op's ties (XLA's propagation). A sum's result is whole (all-reduced)."""
    _, update = zero_region(graph, groups)
    if data_size <= 1 or not update:
        return {}
    split = zero_pinned_dims(graph, groups, data_size)
    out: dict[int, float] = {}
    for i in sorted(update):
        op = graph.ops[i]
        summed = set(reduced_dims(op, graph)) if op.primitive in _SUMS else set()
        if any((t, split.get(t)) in summed for t in op.inputs):
            out.update((t, float(graph.tensors[t].nbytes)) for t in op.outputs)
            continue
        for (t, d), (u, e) in dim_ties(op, graph):
            for (a, x), (b, y) in (((t, d), (u, e)), ((u, e), (t, d))):
                if a in op.inputs and b in op.outputs and split.get(a) == x:
                    split.setdefault(b, y)
    return out


@dataclasses.dataclass(frozen=True)
class Gathers:
    """ZeRO's all-gathers of the parameters over the data axis in one step: `nbytes`
    moved; `leaves` parameter leaves (rank >= 1) left to gather (none where 0), gathered
    in `combined` collectives where there are any (XLA's all-gather combiner joins the
    gathers that wait for the same value: one for the whole step, or one per forward layer
    when ZeRO-3 gathers layer by layer); `calls` more collectives, one per leaf, that
    ZeRO-3 gathers again (in the backward, or a recompute). ZeRO-1/2 keeping a
    mixed-precision step's masters on shards gathers their casts apart, where the step
    starts: `cast_nbytes` in one more collective where `cast_leaves` are left to gather."""

    nbytes: float | np.ndarray
    leaves: float | np.ndarray
    calls: float | np.ndarray
    combined: float = 1.0
    cast_nbytes: float | np.ndarray = 0.0
    cast_leaves: float | np.ndarray = 0.0

    @property
    def count(self) -> float | np.ndarray:
        """The collectives in all: `combined` where a leaf is left to gather, one more
        where a master's cast is, and `calls`."""
        return self.combined * (self.leaves > 0) + (self.cast_leaves > 0) + self.calls

    @property
    def total_bytes(self) -> float | np.ndarray:
        """The bytes of every gather."""
        return self.nbytes + self.cast_nbytes


@dataclasses.dataclass(frozen=True)
class MasterCoefs:
    """The float32 masters ZeRO-1/2 keeps on shards where it gathers a mixed-precision
    step's casts (`_groups.narrow_params`), per master: its bytes, what its casts' gathers
    move (`Tables.gathered`, one copy per dtype cast to), 1 (a leaf); its group set and
    shape. `at(size)` sums them by set, leaving out a master no dim of which a data axis
    of that size divides: the runtime holds it whole, updates it whole and gathers
    nothing of it (`_groups.shardable`), and so does the price."""

    coef: np.ndarray  # [3, masters]
    sets: np.ndarray  # [masters] each one's group set
    shapes: tuple[tuple[int, ...], ...]
    n_sets: int
    # `at`'s sums by data size: searchers price many plans per mesh
    cache: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def at(self, data_size: float) -> np.ndarray:
        """[3, n_sets] the masters a data axis of `data_size` shards, summed by set."""
        size = int(data_size)
        if size not in self.cache:
            kept = np.array([shardable(s, size) for s in self.shapes], dtype=bool)
            out = np.zeros((3, self.n_sets))
            np.add.at(out, (slice(None), self.sets[kept]), self.coef[:, kept])
            self.cache[size] = out
        return self.cache[size]

    def sub(self, sets: np.ndarray) -> MasterCoefs:
        """The masters of `sets` only, renumbered as their positions there."""
        where = {int(s): i for i, s in enumerate(np.asarray(sets).ravel())}
        mine = [k for k, s in enumerate(self.sets) if int(s) in where]
        return MasterCoefs(
            self.coef[:, mine],
            np.array([where[int(self.sets[k])] for k in mine], dtype=np.int64),
            tuple(self.shapes[k] for k in mine),
            len(where),
        )


def zero_gathers(
    param_coef,
    gather_coef,
    param_leaves,
    rg: RegatherCoefs,
    inv,
    free,
    zero_stage: int,
    remat,
    masters=None,
) -> Gathers:
    """ZeRO's gathers under a layout (`inv`: per set, 1 / divisor; `free`: per set, not
    split on data; both [sets, ...]). Parameters not already split on data are gathered:
    once after the sharded update (ZeRO-1/2, the new parameters: `param_coef`); by ZeRO-3
    layer by layer where the step has a loss (`_fsdp.py`: each forward layer's, one
    combined collective per layer, and once more each in the backward, one per leaf,
    under remat serving the recompute too), else once for use (what the step reads, a
    cast say: `gather_coef`). `masters` ([3, sets] each, `MasterCoefs.at`), where ZeRO-1/2
    keeps a mixed-precision step's masters on shards: those the data axis shards and those
    it cannot. The first are gathered at their casts' width where the step starts, in a
    combined collective of their own; the others are whole, gathered by nobody."""
    free_inv = inv * free
    G = rg.layers
    if zero_stage < 3 and masters is not None:
        kept, whole = masters
        param_coef, param_leaves = param_coef - whole[0], param_leaves - whole[2]
        rest = (param_coef - kept[0]) @ free_inv, (param_leaves - kept[2]) @ free
        return Gathers(*rest, 0.0, 1.0, kept[1] @ free_inv, kept[2] @ free)
    if zero_stage < 3:
        return Gathers(param_coef @ free_inv, param_leaves @ free, 0.0)
    if G is None:
        return Gathers(gather_coef @ free_inv, param_leaves @ free, 0.0)
    coef, leaves = (G.remat_coef, G.remat_leaves) if remat else (G.backward_coef, G.backward_leaves)
    nbytes = (G.forward_coef + coef) @ free_inv
    return Gathers(nbytes, param_leaves @ free, leaves @ free, float(G.forward_layers))


# ---- per op and per program, for pipelines (`_pipelined.py`) ------------------------------


def zero_gradient_keys(lowering: Lowering, ac, row_grad, key, zero_mask: int) -> np.ndarray:
    """The gradients meet the ZeRO layout: their all-reduce over data becomes a
    reduce-scatter of the same buffer where the backend has one (as `_kernel.totals`
    for one stage)."""
    if not lowering.reduce_scatter:
        return key
    ar = row_grad & (key == C.AR * ac.masks + zero_mask)
    return np.where(ar, key + (C.RS - C.AR) * ac.masks, key)


def zero_leaves(graph, lay: Layouts, gathered: Mapping[int, float] | None = None):
    """(tensor, bytes per device, gathers) of the parameters ZeRO gathers: those whose
    layout is not already split on the data axis (as `_model.py`). `gathered`: the bytes
    a ZeRO-3 gather of each moves whole (`Tables.gathered`: a cast, say), else its own."""
    for leaf in graph.leaves(Role.PARAM):
        t = leaf.tensor
        if not lay.on_data[t]:
            whole = graph.tensors[t].nbytes if gathered is None else gathered[t]
            yield t, whole * lay.inv[t], int(graph.tensors[t].ndim > 0)


def zero_op_gathers(
    model, lay, ac, zero_mask: int, zero_stage: int, remat: bool, masters: bool = False
):
    """[n_ops] seconds of ZeRO's all-gathers, on the first op reading each parameter. Each
    parameter not already split on data is gathered once per step after its sharded
    update (ZeRO-1/2), in one combined collective, shared by bytes. ZeRO-3 in a step with
    a loss gathers layer by layer, each gather on its first reader, as one program does
    (`_fsdp.program_gathers`, the same bytes and collectives as `zero_gathers`;
    `stage_costs` charges each stage's programs theirs); without a loss, once where each
    parameter is first used, and under remat again, one by one, for the recompute.
    `masters`: ZeRO-1/2 of one program keeps a mixed-precision step's masters on shards
    (`Tables.masters`): their casts are gathered apart, as `zero_gathers` prices them."""
    graph, T = model.graph, model.tables
    if masters and zero_stage < 3 and T.masters:
        out = np.zeros(len(graph.ops))
        readers = graph.consumers()
        # a master the data axis cannot shard is whole: nobody gathers it (`MasterCoefs`)
        whole = {t for t in T.masters if not shardable(graph.tensors[t].shape, lay.data_size)}
        for kept in (False, True):  # the rest, then the masters' casts: two collectives
            leaves = [
                (t, b, c)
                for t, b, c in zero_leaves(graph, lay, T.gathered)
                if (t in T.masters) == kept and t not in whole
            ]
            if kept:  # one copy per dtype cast to (`Tables.master_coef`)
                leaves = [(t, b * T.masters[t], c) for t, b, c in leaves]
            else:  # the rest is gathered at its own width
                leaves = [(t, graph.tensors[t].nbytes * lay.inv[t], c) for t, _, c in leaves]
            out += _shared(leaves, readers, ac, zero_mask, len(graph.ops))
        return out
    out = np.zeros(len(graph.ops))
    if zero_stage >= 3 and T.layers is not None:  # layer by layer, as `zero_gathers`
        recomputed = model.residuals.recomputed if remat else ()
        gs = program_gathers(graph, T.layers, range(len(graph.ops)), recomputed)
        charged, n = gather_bytes(graph, lay, T.gathered, gs, T.casts_again, T.gathered_narrow)
        total = sum(b for _, b in charged)
        if total and n:
            seconds = ac.time1(C.AG, zero_mask, total, n)
            for reader, b in charged:
                out[reader] += seconds * b / total
        return out
    gathered = T.gathered if zero_stage >= 3 else None
    readers, leaves = graph.consumers(), list(zero_leaves(graph, lay, gathered))
    recomputed = set(model.residuals.recomputed) if zero_stage >= 3 and remat else set()
    again = [(t, b) for t, b, c in leaves if c and any(i in recomputed for i in readers[t])]
    total = sum(b for _, b, _ in leaves) + sum(b for _, b in again)
    if total and any(c for *_, c in leaves):
        seconds = ac.time1(C.AG, zero_mask, total, 1 + len(again))
        for t, b in [(t, b) for t, b, _ in leaves] + again:
            out[(readers[t] or (0,))[0]] += seconds * b / total
    return out


def zero_op_sums(graph, reductions: UpdateReductions | None, lay: Layouts, ac, zero_mask: int):
    """[n_ops] seconds of the all-reduce of the update's sums over ZeRO's split
    (`_terms.update_reductions`: one collective), shared by bytes among the ops making
    them."""
    out = np.zeros(len(graph.ops))
    if reductions is None:
        return out
    made = reductions.per_tensor(lay.data_size).items()
    charged = [(graph.tensors[t].producer, b * lay.inv[t]) for t, b in made if not lay.on_data[t]]
    total = sum(b for _, b in charged)
    if total > 0:
        seconds = ac.time1(C.AR, zero_mask, total, 1)
        for op, b in charged:
            out[op] += seconds * b / total
    return out


def gather_bytes(
    graph,
    lay: Layouts,
    gathered: Mapping[int, float],
    gs: Sequence[Gathered],
    casts_again: bool = False,
    narrow: Mapping[int, float] | None = None,
) -> tuple[list[tuple[int, float]], int]:
    """(reader, bytes per device) of each of ZeRO-3's gathers `gs` (`program_gathers`) of
    a parameter the layout does not already split on data, and the collectives they take
    (those holding a leaf of rank >= 1, as `Gathers.count`). `casts_again`: a recompute's
    gather moves `gathered` as the forward's does (`Lowering.recompute_gathers_casts`);
    `narrow`: as `_fsdp.served_bytes`, by the gather's first reader."""
    charged, collectives = [], set()
    for g in gs:
        if lay.on_data[g.param]:
            continue
        nbytes = graph.tensors[g.param].nbytes
        whole = g.whole and not casts_again
        served = served_bytes(graph, g.param, (g.reader,), gathered, narrow)
        charged.append((g.reader, (nbytes if whole else served) * lay.inv[g.param]))
        if graph.tensors[g.param].ndim:
            collectives.add(g.collective)
    return charged, len(collectives)


def _shared(leaves, readers, ac, zero_mask: int, n_ops: int) -> np.ndarray:
    """[n_ops] one combined all-gather of `leaves` ((tensor, bytes, rank >= 1)), its
    seconds shared by bytes among each leaf's first reader; none without a leaf of rank
    >= 1 (as `_kernel.totals` counts it)."""
    out = np.zeros(n_ops)
    total = sum(b for _, b, _ in leaves)
    if total and any(c for *_, c in leaves):
        seconds = ac.time1(C.AG, zero_mask, total, 1)
        for t, b, _ in leaves:
            out[(readers[t] or (0,))[0]] += seconds * b / total
    return out


def add_zero_gathers(
    graph,
    part: Partition,
    oc,
    time,
    nbytes,
    count,
    recomputed: set[int],
    gathered: Mapping[int, float],
    layers: LayerGathers | None = None,
    casts_again: bool = False,
    narrow: Mapping[int, float] | None = None,
) -> None:
    """ZeRO's all-gathers, charged to the (stage, phase) programs that gather each
    parameter, as XLA compiles each program apart (seen with jax 0.10 on the CPU). ZeRO-1/2:
    the POST program that updates a parameter on shards gathers the new one. ZeRO-3: the
    parameter stays sharded and every PRE, F and B program that reads it gathers it for
    use (with `layers`, F and B layer by layer: `per_layer_gathers`). A program gathers its parameters in one combined collective (XLA's all-gather
    combiner); PRE and POST run as `_pipeline.once_programs` groups them. A parameter read on two stages (tied embeddings,
    a layer cut mid-way) is updated on only one of them. Under remat a B program
    gathers again, for its recompute, the parameters the `recomputed` ops read (XLA merges
    no gather behind the recompute's barrier with the backward's own). `gathered`: what
    a ZeRO-3 gather of each parameter moves (`Tables.gathered`; `narrow`, where only
    matmuls read it, `Tables.gathered_narrow`). With `layers` (a step
    with a loss), ZeRO-3's F, B and W programs gather layer by layer instead, as one
    program does (`per_layer_gathers`)."""
    ac, consumers = oc.axis_costs, graph.consumers()
    key = C.AG * ac.masks + oc.zero_mask
    phases = (Phase.PRE, Phase.FWD, Phase.BWD) if oc.zero_stage >= 3 else (Phase.POST,)
    if oc.zero_stage >= 3 and layers is not None:
        into = (time, nbytes, count)
        per_layer_gathers(graph, part, oc, into, recomputed, gathered, layers, casts_again, narrow)
        phases = (Phase.PRE,)
    phase, program = phase_codes(part), op_programs(graph, part)
    moved: dict[tuple[int, int], float] = {}
    programs: dict[tuple[int, int], set[int]] = {}
    whole = gathered if oc.zero_stage >= 3 else None  # ZeRO-1/2: the new float32 ones
    for t, b, c in zero_leaves(graph, oc.layouts, whole):
        # Gathered once in each program that reads it.
        for s, ph, prog in {(part.op_stage[i], int(phase[i]), program[i]) for i in consumers[t]}:
            if ph in phases and c:
                moved[(s, ph)] = moved.get((s, ph), 0.0) + b
                programs.setdefault((s, ph), set()).add(prog)
        if oc.zero_stage >= 3 and c and Phase.BWD in phases:
            for s in {part.op_stage[i] for i in consumers[t] if i in recomputed}:
                moved[(s, Phase.BWD)] = moved.get((s, Phase.BWD), 0.0) + b
    for (s, ph), b in moved.items():
        n = len(programs[(s, ph)])
        time[s, ph, key] += ac.time1(C.AG, oc.zero_mask, b, n)
        nbytes[s, ph, key] += b
        count[s, ph, key] += n


def per_layer_gathers(
    graph,
    part: Partition,
    oc,
    into: tuple[np.ndarray, np.ndarray, np.ndarray],
    recomputed: set[int],
    gathered: Mapping[int, float],
    layers: LayerGathers,
    casts_again: bool = False,
    narrow: Mapping[int, float] | None = None,
) -> None:
    """ZeRO-3's gathers of each stage's F, B and W programs, layer by layer as the runtime
    makes them (`_fsdp.program_gathers`: a combined collective per forward layer, one per
    leaf in the backward, B's recompute served by its backward's copies), added `into`
    (seconds, bytes, collectives) per (stage, phase, key); `casts_again`: as
    `gather_bytes`."""
    time, nbytes, count = into
    ac, key = oc.axis_costs, C.AG * oc.axis_costs.masks + oc.zero_mask
    for s in range(part.n_stages):
        forward = set(part.ops(s, Phase.FWD))
        for ph in (Phase.FWD, Phase.BWD, Phase.WGT):
            again = recomputed & forward if ph is Phase.BWD else ()
            gs = program_gathers(graph, layers, part.ops(s, ph), again)
            charged, n = gather_bytes(graph, oc.layouts, gathered, gs, casts_again, narrow)
            b = sum(b for _, b in charged)
            if b and n:
                time[s, ph, key] += ac.time1(C.AG, oc.zero_mask, b, n)
                nbytes[s, ph, key] += b
                count[s, ph, key] += n
