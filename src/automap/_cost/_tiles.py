"""Tile padding: the bytes an array holds in XLA's TPU layouts, per plan.

XLA's TPU compiler lays every array out in tiles and a buffer holds whole tiles: the
minor dimension in lanes of 128 and the second-minor in rows of 8 (of fewer where that
dimension is small: the least power of two that holds it, never under one 32-bit row of
packed 16- or 8-bit values), a 1-D array in tiles of 128 to 1024 elements; one tile,
512 bytes, is the least any array takes. Where the layout is its own to choose it lays
minor and second-minor the two dimensions that pad least (an argument f32[64, 16] is laid
{0,1}: its 64 on the lanes). Read from libtpu 0.0.42 (`jax[tpu]` 0.10.2's pin) compiling
for a v5p slice without one: `memory_analysis()` argument sizes and the HLO's layouts
(f32[64,16]{0,1:T(8,128)}, bf16[9,128]{1,0:T(8,128)(2,1)}, f32[300]{0:T(512)});
held by tests/test_tiles.py.

So the bytes a plan holds per device are not its shards' bytes: a 64-wide model's
matrices take twice theirs whole, and a 4-way shard of one ([64, 16]) four times. The
cost model's tables sum bytes by group set (`_tables.py`); `tile_shares` says, for one
plan's layout, how many bytes each set's arrays take per byte of their shards, per
memory part, which the memory terms multiply (`_terms.memory_terms`). Only where the
cluster's lowering pads (`Lowering.tile_padding`: TPUs).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np

from .._graph import Graph, Role
from .._groups import Groups
from ._scatter import gradient_orders, tied_runs
from ._sets import SetIndex
from ._torus import axis_spans_and_rings

LANES = 128  # a tile's minor dimension
ROWS = 8  # a tile's second-minor dimension (its most: small arrays take fewer)
ROW_BYTES = 4  # a tile row's lane holds 32 bits: 16-bit rows pack in twos, 8-bit in fours
LEAST_1D, MOST_1D = LANES, 1024  # a 1-D array's tile: a power of two in this range

# The kinds of array a plan's memory parts are made of (`TileTable.kind`).
PARAM, OPT, OTHER, MADE = range(4)


def tiled_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    """The bytes an array of `shape` takes in its least-padded TPU layout."""
    dims = np.array([list(shape) or [1]], dtype=float)
    return int(_tiled(dims, np.array([max(len(shape), 1)]), np.array([itemsize]))[0])


def _tiled(dims: np.ndarray, rank: np.ndarray, itemsize: np.ndarray) -> np.ndarray:
    """[T] bytes of arrays of local `dims` ([T, R], 1 past their rank), each in the layout
    that pads it least: the (minor, second-minor) pair of its dims whose lane and row
    padding multiply to the least."""
    pack = np.maximum(ROW_BYTES // itemsize, 1)[:, None]
    d = np.maximum(dims, 1)
    # 1-D: tiles of the least power of two holding it, in [128 x packing, 1024] elements.
    n = d[:, :1]
    tile = np.clip(2 ** np.ceil(np.log2(n)), LEAST_1D * pack, MOST_1D)
    flat = (np.ceil(n / tile) * tile)[:, 0]
    real = np.arange(d.shape[1])[None, :] < rank[:, None]
    lanes = np.where(real, np.ceil(d / LANES) * LANES / d, np.inf)
    rows_tile = np.clip(2 ** np.ceil(np.log2(d)), pack, ROWS)
    rows = np.where(real, np.ceil(d / rows_tile) * rows_tile / d, np.inf)
    pad = lanes[:, :, None] * rows[:, None, :]  # [T, minor, second-minor]
    pad[:, np.arange(d.shape[1]), np.arange(d.shape[1])] = np.inf
    laid = d.prod(axis=1) * pad.min(axis=(1, 2), initial=np.inf)
    return np.where(rank <= 1, flat, laid) * itemsize


@dataclasses.dataclass(frozen=True)
class TileTable:
    """Every array of a step, as tile padding needs it (built once per graph)."""

    dims: np.ndarray  # [T, R] sizes, 1 past each array's rank
    groups: np.ndarray  # [T, R] the group of each dim (the pad group past the rank)
    rank: np.ndarray  # [T] at least 1 (a scalar is laid as one element)
    itemsize: np.ndarray  # [T]
    tset: np.ndarray  # [T] each array's group set (`_sets.py`)
    kind: np.ndarray  # [T] PARAM, OPT, OTHER (inputs), MADE (the step's own)
    n_sets: int
    # Per parameter, the buffer a dot_general writes its gradient in: for each of its dims
    # the parameter's dim ([T, R], -1 where none is known) and its itemsize ([T], 0 for
    # none), and whether a lookup's scatter-add writes it ([T]): `_scatter.gradient_orders`,
    # read by `tpu_zero_scatter`. None: not known.
    grad_perm: np.ndarray | None = None
    grad_itemsize: np.ndarray | None = None
    grad_lookup: np.ndarray | None = None
    # Per parameter, how many parts of its gradient dot_generals write, and other ops
    # ([T] each; `_scatter.gradient_orders`), read by `beside_candidates`. None: not known.
    grad_dots: np.ndarray | None = None
    grad_others: np.ndarray | None = None
    # Makes `runs` (`_scatter.tied_runs`): read under ZeRO-3 alone, whose runtime needs
    # the step's loss (a step without one has no layers to tie).
    make_runs: Callable[[], tuple[np.ndarray, np.ndarray]] | None = None

    @functools.cached_property
    def runs(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Per parameter, the run of ZeRO-3 gradients the runtime's ties lay alike ([T],
        -1 for none) and its place in their order ([T]), read by `minor_split`."""
        return None if self.make_runs is None else self.make_runs()


def tile_table(graph: Graph, groups: Groups, splittable: np.ndarray, n_sets: int) -> TileTable:
    """The `TileTable` of `graph` (`splittable`, `n_sets`: its `Tables`' groups and sets;
    the tables give the arrays' sets their ids first, in this order)."""
    index = SetIndex(splittable)
    tset = [index.of(g) for g in groups.tensor_groups]
    pad = len(groups.groups)
    width = max([t.ndim for t in graph.tensors] + [1])
    dims = np.ones((len(graph.tensors), width))
    gids = np.full((len(graph.tensors), width), pad, dtype=np.int64)
    kind = np.full(len(graph.tensors), MADE, dtype=np.int64)
    roles = {Role.PARAM: PARAM, Role.OPT_STATE: OPT, Role.BATCH: OTHER, Role.OTHER: OTHER}
    for leaf in graph.inputs:
        kind[leaf.tensor] = roles.get(leaf.role, OTHER)
    for i, t in enumerate(graph.tensors):
        dims[i, : t.ndim] = t.shape
        gids[i, : t.ndim] = groups.tensor_groups[i][: t.ndim]
    size = np.array([t.itemsize for t in graph.tensors])
    rank = np.array([max(t.ndim, 1) for t in graph.tensors])
    orders = gradient_orders(graph, groups, width)
    runs = functools.partial(tied_runs, graph, groups)
    return TileTable(dims, gids, rank, size, np.array(tset), kind, n_sets, *orders, runs)


@dataclasses.dataclass(frozen=True)
class TileShares:
    """Per set, the bytes one plan's arrays take in tiles per byte of their shards."""

    memory: np.ndarray  # [5, sets] the memory rows' (`Tables.memory_coef`)
    zero: np.ndarray  # [2, sets] parameters' and optimizer state's ZeRO shards'
    made: np.ndarray  # [sets] the step's own buffers' (activations, gradients)


def tile_shares(table: TileTable, codes: np.ndarray, sizes: np.ndarray, data: int) -> TileShares:
    """`TileShares` of the plan whose groups take the mesh axes `codes` (0: none; `sizes`
    per code) with ZeRO's data axis' code `data` (0: no ZeRO), each array's dims divided
    as `_kernel.set_axes` divides its set (an axis once per array) and a ZeRO shard's one
    more dim as `_groups.zero_spec` picks it."""
    local = _local(table, codes, sizes)
    shards = _tiled(local, table.rank, table.itemsize)
    raw = local.prod(axis=1) * table.itemsize
    plain = [_ratio(table, shards, raw, k) for k in (PARAM, OPT, MADE, MADE, OTHER)]
    zero = [plain[0], plain[1]]
    if data:
        zlocal = _zero_local(table, local, codes, sizes[data], data)
        zshards = _tiled(zlocal, table.rank, table.itemsize)
        # Per byte of the shard the model prices (its set's bytes / the data axis too).
        whole = np.where((codes[table.groups] == data).any(axis=1), 1.0, sizes[data])
        zero = [_ratio(table, zshards, raw / whole, k) for k in (PARAM, OPT)]
    return TileShares(np.stack(plain), np.stack(zero), plain[2])


def _local(table: TileTable, codes: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """[T, R] each array's shard dims (`shard_dims`)."""
    return shard_dims(table.dims, codes[table.groups], sizes)


def shard_dims(dims: np.ndarray, code: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """[..., T, R] the shard dims of arrays of `dims` ([T, R]) whose dims take the axis
    codes `code` ([..., T, R]): a dim split by the first dim holding its axis."""
    local = np.broadcast_to(dims, code.shape).astype(float)
    for r in range(code.shape[-1]):
        c = code[..., r]
        first = (c > 0) & ~(code[..., :r] == c[..., None]).any(axis=-1)
        local[..., r] = np.where(first, local[..., r] / sizes[c], local[..., r])
    return local


def _zero_local(table: TileTable, local, codes, n: float, data: int) -> np.ndarray:
    return zero_shard_dims(local, codes[table.groups], table.rank, n, data)


def zero_shard_dims(local, code, rank, n: float, data: int) -> np.ndarray:
    """[..., T, R] the ZeRO shards' dims (over the axis code `data`, of n devices) of
    arrays of shard dims `local` ([..., T, R], `shard_dims`) and `rank` the data axis does
    not split: the first unsplit dim n divides, else the first split dim whose shard it
    divides."""
    free = ~(code == data).any(axis=-1)
    out, done = local.copy(), ~free
    real = np.arange(local.shape[-1]) < rank[:, None]
    for unsplit in (True, False):
        for r in range(local.shape[-1]):
            fits = real[:, r] & ((code[..., r] == 0) == unsplit) & (local[..., r] % n == 0)
            take = fits & ~done
            out[..., r] = np.where(take, local[..., r] / n, out[..., r])
            done |= take
    return out


def _ratio(table: TileTable, tiled: np.ndarray, raw: np.ndarray, kind: int) -> np.ndarray:
    """[sets] the tiled bytes of a kind's arrays per byte of their shards as the cost
    model prices them (`raw`), 1 for none."""
    pick = table.kind == kind
    sets = table.tset[pick]
    num = np.bincount(sets, tiled[pick], minlength=table.n_sets)
    den = np.bincount(sets, raw[pick], minlength=table.n_sets)
    return np.where(den > 0, num / np.where(den > 0, den, 1), 1.0)


def beside_candidates(table: TileTable) -> np.ndarray:
    """[T] the parameters whose gradient XLA's SPMD partitioner may split beside ZeRO's
    data axis (`beside_axis`): of rank 2 or more, some part of the gradient written by a
    dot in the parameter's own type (behind a convert, a bf16 step's gradients cast to
    its float32 parameters, the partitioner scatters: a bf16 Llama's at data 8 x model 8,
    llama plan 10 of the TPU bench, are reduce-scattered)."""
    dots, size = table.grad_dots, table.grad_itemsize
    if dots is None or size is None:
        return np.zeros(len(table.kind), dtype=bool)
    return (table.kind == PARAM) & (table.rank >= 2) & (size == table.itemsize) & (dots > 0)


def beside_axis(dims, rank, code, sizes: np.ndarray, data: int) -> np.ndarray:
    """[..., T] per parameter of `dims` ([T, R]) and `rank` whose dims take the axis codes
    `code` ([..., T, R]), the axis code XLA's SPMD partitioner splits its gradient dot
    over under ZeRO over the axis code `data` (of n devices), 0 for none: the first axis
    in mesh order of n devices or more that holds the parameter whole, where data does
    not split it and ZeRO does (its shard, `zero_shard_dims`, is smaller). There, where
    the dot's operands are whole, it splits the output n ways rather than over data;
    each device all-reduces its 1/n piece over data and a collective-permute moves it to
    the device ZeRO gives it. Read on a 2-layer float32 GPT under ZeRO-1, batch on data
    alone: at data 2 x model 2 (v5p 2x2x1), 2 x 4 (v5p 2x2x2 and A100s alike) and 4 x 4
    (v5p 4x4x1) the kernels' 7 MiB are all-reduced and permuted as 7/n MiB each, the
    lookup's and biases' reduce-scattered; at data 4 x model 2 reduce-scattered (libtpu
    0.0.42.1). Candidates only (`beside_candidates`)."""
    n = sizes[data]
    local = shard_dims(dims, code, sizes)
    zlocal = zero_shard_dims(local, code, rank, n, data)
    ok = ~(code == data).any(axis=-1) & (zlocal.prod(axis=-1) < local.prod(axis=-1))
    axis = np.zeros(ok.shape, dtype=np.int64)
    for a in range(1, len(sizes)):
        if a != data and sizes[a] >= n:
            axis = np.where(ok & (axis == 0) & ~(code == a).any(axis=-1), a, axis)
    return axis


@dataclasses.dataclass(frozen=True)
class ZeroScatter:
    """How XLA's TPU moves one plan's ZeRO gradients, where it departs from a plain
    reduce-scatter of each (bytes per device; `tpu_zero_scatter`)."""

    whole: float = 0.0  # gradients all-reduced whole
    padding: float = 0.0  # rows added to those reduce-scattered padded (`row_padding`)
    permute_bytes: float = 0.0  # the collective-permutes that move padded shards home
    permutes: int = 0


def tpu_zero_scatter(
    table: TileTable,
    codes,
    sizes: np.ndarray,
    data: int,
    spans: int,
    ring: int,
    least: int,
    tied: bool = False,
) -> ZeroScatter:
    """How XLA's TPU compiler moves one plan's ZeRO gradients (`ZeroScatter`): the bytes
    it all-reduces whole rather than reduce-scatters (`Lowering.scatter_least_elements`,
    `least`), and those it pads and permutes (`row_padding`). Whole: a parameter the
    data axis (code `data`, its groups spanning `spans` torus dimensions) does not split,
    whose ZeRO shard (`_zero_local`) is 1-D, has no dim of 128 lanes with another of 16
    rows (XLA lays a gradient as it pads least: f32[128, 64] shards of [128, 256] are
    laid {0,1} and reduce-scattered), or is under `least` elements per dimension spanned;
    every one where the group spans three dimensions and is every device of the program
    (a cube's all-reduce: data 64 on a v5p 4x4x4, 8 on 2x2x2). Where another axis splits
    the devices into several groups, groups spanning three dimensions reduce-scatter as
    the rest do (data 32 x model 2 on 4x4x4: libtpu 0.0.42.1, `x.sum(0)` of f32
    [32, 512, 2048] pinned to P("data"), [16, 2048] shards). Where every torus dimension
    the groups span is a ring of 4 chips or more (`ring`: the shortest), the size rule is
    a shard's rows, not its torus dimensions: 16 of them, or 8 and `least` elements, with
    no lane minimum (v5p 4x4x4, libtpu 0.0.42.1: `x.sum(0)` f32 [16, 128] and [8, 512]
    shards scattered, [8, 128] and [4, 1024] not, over 1, 2 or 3 dimensions; a bf16
    Llama's gradients at data 32 x model 2 (llama plans 4, 8 of the TPU bench): [16, 64],
    [8, 256] scattered, [8, 128] not), 128 lanes only where no dot writes the gradient
    (`x.sum(0)`'s [16, 64] shards lie on the lanes: whole); on 2x2x2, rings of 2, f32
    [16, 128], [8, 512] and bf16 [16, 64] stay whole: the rule per dimension spanned.
    Over long rings a 2-D shard split on its rows is first padded to whole chunks
    (`row_padding`), or kept whole where that pads it by over half.
    `tied`: ZeRO-3, whose runtime ties lay runs of gradients alike (`minor_split`)."""
    if not (data and least and spans):
        return ZeroScatter()
    local = _local(table, codes, sizes)
    zlocal = _zero_local(table, local, codes, sizes[data], data)
    code = codes[table.groups]
    free = (table.kind == PARAM) & ~(code == data).any(axis=1)
    real = np.arange(zlocal.shape[1])[None, :] < table.rank[:, None]
    # Laid as it pads least (a step's own buffer): some dim on the lanes, another on rows.
    lanes = (real & (zlocal >= LANES)).any(axis=1)
    rows = (real & (zlocal >= 2 * ROWS)).sum(axis=1) >= 2
    elements = zlocal.prod(axis=1)
    on_rows, rows_of, rows_to = row_padding(zlocal, local, table.rank, least)
    on_rows &= ring >= 4  # padded over long rings alone
    if ring >= 4:
        sized = _long_ring_sized(table, zlocal, real, lanes, least)
        sized = np.where(on_rows, rows_to <= PADDED_MOST * rows_of, sized)
    else:
        sized = lanes & rows & (elements >= least * spans)
    scattered = (
        (table.rank >= 2)
        & sized
        & ((spans < 3) | (sizes.prod() > sizes[data]))  # the cube: one group only
        & (zlocal.prod(axis=1) < local.prod(axis=1))  # a shard exists: data divides a dim
    )
    itemsize = table.itemsize
    if table.grad_perm is not None and table.grad_itemsize is not None:
        lookup = table.grad_lookup if table.grad_lookup is not None else table.rank < 0
        # ... and none whose split lies on the lanes of its dot's buffer (`minor_split`),
        # moved as that buffer is (a bf16 step's gradients in bf16, before their cast)
        runs = table.runs if tied else None
        scattered &= ~minor_split(table.grad_perm, table.grad_itemsize, lookup, local, zlocal, runs)
        itemsize = np.where(table.grad_itemsize > 0, table.grad_itemsize, itemsize)
    # ... and none whose dot XLA splits beside data (`beside_axis`), but a tied table's
    # lookup part (`_beside.py`)
    cand = beside_candidates(table) & (table.grad_others == 0)
    whole = (
        free & ~scattered & ~(cand & (beside_axis(table.dims, table.rank, code, sizes, data) > 0))
    )
    nbytes = local.prod(axis=1) * itemsize
    padded = free & scattered & on_rows & ~whole
    moves = _padded_moves(rows_of, rows_to, nbytes, padded, int(sizes[data]))
    return ZeroScatter(float(nbytes[whole].sum()), *moves)


def _long_ring_sized(table: TileTable, zlocal, real, lanes, least: int) -> np.ndarray:
    """Per array of ZeRO shard dims `zlocal` (`real` past none of its rank; `lanes`: a dim
    of 128 or more), whether a shard is large enough to scatter over rings of 4 chips or
    more: 16 rows, or 8 and `least` elements (its second dim); a gradient no dot writes
    is laid as it pads least, so a shard under 128 lanes wide lies on the lanes
    (x.sum(0)'s [512, 64], split 32 ways, laid {0,1}: whole)."""
    second = np.sort(np.where(real, zlocal, 0), axis=1)[:, -2 if zlocal.shape[1] > 1 else -1]
    sized = (second >= 2 * ROWS) | ((second >= ROWS) & (zlocal.prod(axis=1) >= least))
    written = table.grad_itemsize > 0 if table.grad_itemsize is not None else ~real[:, 0]
    return sized & (lanes | written)


#: Over long rings XLA's TPU reduce-scatters a 2-D gradient split on its rows in chunks of
#: whole (8, 128) tiles of `Lowering.scatter_least_elements` (2048) elements: a shard of
#: other rows is padded to the next (bf16 [512, 12] shards over 128 chips to [512, 16]:
#: one all-reduce of the padded [512, 2048] and a slice), then moved to the device owning
#: its rows by collective-permutes, one per distance a shard moves: the padded shard, and
#: the last one's rows in the farthest. Where that pads a shard by over this share, it
#: is all-reduced whole. libtpu 0.0.42.1, v5p 4x8x8, data 128 x model 2 (and 4x4x4 at
#: data 32 x model 2), a dot's bf16 or f32 [H, 128 r] gradient pinned to P(None, "data"):
#: at H = 512, r = 6, 7, 11, 12, 13, 20 padded to 8, 8, 16, 16, 16, 24 (32, 16, 40, 32, 24,
#: 22 permutes), r = 5 and 10 whole; at H = 128 and 384 (3 lane tiles) r = 12, 22, 24 to
#: 16, 32, 32, r = 20 and 21 whole. Past 6 chunks XLA sometimes pads further: at H = 512
#: r = 52 and 56 went to 64 and r = 72 to 80 over 128 chips (not over 32), not priced.
PADDED_MOST = 1.5


def row_padding(zlocal, local, rank: np.ndarray, least: int) -> tuple[np.ndarray, ...]:
    """Per array of ZeRO shard dims `zlocal` ([T, R]) of dims `local` and `rank`: whether
    it is a 2-D shard split on its smaller dim, laid on the rows (as it pads least,
    `_padding`: a lane tile's 128 or more on the lanes), that dim's rows, and those rows
    padded to whole chunks of `least` elements of (8, 128) tiles (`PADDED_MOST`)."""
    if zlocal.shape[1] < 2:
        return np.zeros(len(rank), dtype=bool), np.ones(len(rank)), np.ones(len(rank))
    at, small = np.arange(len(rank)), np.argmin(zlocal[:, :2], axis=1)
    rows, lanes = zlocal[at, small], zlocal[at, 1 - small]
    ones = np.ones(len(rows))
    on_rows = (rank == 2) & (lanes >= LANES) & (rows < lanes) & (rows < local[at, small])
    on_rows &= _padding(lanes, rows, ones) <= _padding(rows, lanes, ones)
    laid = np.ceil(lanes / LANES) * LANES * ROWS  # elements of 8 rows
    unit = ROWS * least / np.gcd(laid.astype(np.int64), least)
    return on_rows, rows, np.ceil(rows / unit) * unit


def _padded_moves(rows, rows_to, nbytes, padded, n: int) -> tuple[float, float, int]:
    """(bytes added by padding, bytes permuted, permutes) of the `padded` gradients, of
    `nbytes` each on a device, their shards' `rows` padded to `rows_to` (`row_padding`),
    reduce-scattered over n devices."""
    pick = padded & (rows_to > rows)
    if not pick.any():
        return 0.0, 0.0, 0
    s, p, whole = rows[pick], rows_to[pick], nbytes[pick]
    # device i owns rows [s i, s i + s), the padded scatter leaves it [p i, p i + p)
    far = (n - 1) - np.floor(s * (n - 1) / p)
    last = np.minimum(s * n, p * (n - far)) - s * (n - 1)
    row_bytes = whole / (s * n)
    moved = ((far - 1) * p + last) * row_bytes
    return float((whole * (p / s - 1)).sum()), float(moved.sum()), int(far.sum())


def _padding(minor: np.ndarray, second: np.ndarray, itemsize: np.ndarray) -> np.ndarray:
    """How many times its elements a 2-D buffer takes laid with `minor` on the lanes and
    `second` on the rows (`_tiled`'s tiles)."""
    pack = np.maximum(ROW_BYTES // np.maximum(itemsize, 1), 1)
    rows = np.clip(2 ** np.ceil(np.log2(np.maximum(second, 1))), pack, ROWS)
    lanes = np.ceil(minor / LANES) * LANES / np.maximum(minor, 1)
    return lanes * np.ceil(second / rows) * rows / np.maximum(second, 1)


#: Where ZeRO splits a dot's gradient on its lanes, XLA's TPU reduce-scatters it only where
#: each shard's row of lanes holds a multiple of these bytes (128 float32 lanes, 256
#: bfloat16 ones): bf16 shards of 256, 512 and 768 lanes scattered, of 128 and 384 not.
LANE_BYTES = 512


def minor_split(
    perm: np.ndarray,
    itemsize: np.ndarray,
    lookup: np.ndarray,
    local: np.ndarray,
    zlocal: np.ndarray,
    runs: tuple[np.ndarray, np.ndarray] | None = None,
) -> np.ndarray:
    """[T] whether XLA's TPU all-reduces whole a 2-D gradient whose ZeRO split lies on the
    lanes of the layout it gives the buffer the backward writes (`_scatter.gradient_orders`:
    `perm`, `itemsize`, `lookup`): its shard (`zlocal`, of the array's `local` dims) in the
    writer's order, laid row-major unless transposed pads less. A dot's where its shard's
    row of lanes is not a whole multiple of `LANE_BYTES` (bf16 [256, 128] and [128, 64]
    shards all-reduced whole; f32 [256, 128] and bf16 [512, 256] ones reduce-scattered;
    a 1-layer bf16 Llama's down kernel, its gradient written [hidden 512, ffn], ffn split
    4 ways by data on v5p 4x4x4 and 2x2x2: ffn 1024, 2048, 3072 reduce-scattered, 1536,
    whose 384-lane shards hold 768 bytes, all-reduced whole; libtpu 0.0.42.1); a lookup's
    scatter-add one where they are under two tiles' 256 (f32 and bf16 [512, 128] shards
    of a Llama's table at data 4 x model 2 on v5p 2x2x2 all-reduced whole, bf16 [512,
    256] reduce-scattered; libtpu 0.0.42.1).

    `runs` (`TileTable.tie_run`, `tie_place`; under ZeRO-3): the gradients of one run are
    laid alike in their parameter's order, row-major or transposed as the last of them
    (in the ties' order) that pads strictly less one way wants; transposed (the dots'
    order) where none does. A bf16 Llama at data 8 x model 8 on v5p 4x4x4 (llama plan 9
    of the TPU bench): a layer's gate, up and down gradients are one run, the gate's and
    up's [64, 192] shards pad less row-major, the down's [192, 64] transposed; the up,
    last, lays all three row-major, the down's split on its lanes (64 of them): all-reduced
    whole. At data 32 x model 2 (plan 11) a [256, 16] shard of the out kernel, which pads
    eight times less transposed, is laid row-major behind a value kernel's [16, 64] (a
    sum of padding does not say it); libtpu 0.0.42.1."""
    known = (itemsize > 0) & (perm[:, 0] >= 0) & (perm[:, 1] >= 0)
    if perm.shape[1] > 2:
        known &= perm[:, 2] < 0  # rank 2 only: higher ranks are read as before
    at = np.arange(len(perm))
    first, last = np.maximum(perm[:, 0], 0), np.maximum(perm[:, 1], 0)
    a, b = zlocal[at, first], zlocal[at, last]
    across, along = _padding(a, b, itemsize), _padding(b, a, itemsize)
    transposed = across < along
    if runs is not None:
        transposed = _run_layouts(across, along, runs, known, perm)
    split_last = zlocal[at, last] < local[at, last]
    split_first = zlocal[at, first] < local[at, first]
    on_lanes = np.where(transposed, split_first, split_last)
    lanes = np.where(transposed, a, b)
    narrow = np.where(lookup, lanes < 2 * LANES, np.mod(lanes * itemsize, LANE_BYTES) > 0)
    return known & on_lanes & narrow


def _run_layouts(across, along, runs, known, perm) -> np.ndarray:
    """Per 2-D gradient, whether its buffer is laid transposed (its dim 0 on the lanes),
    each run's members (`runs`, where `known`) as the last of them with a strict
    preference wants, the rest as each pads least. `across`, `along`: each buffer's
    padding laid transposed and row-major; `perm`: its dims' order in the parameter's."""
    run, place = runs
    member = known & (run >= 0)
    transposed = across < along
    if not member.any():
        return transposed
    # row-major in the parameter's order is the buffer's transposed layout for a gradient
    # written transposed (perm [1, 0]), its row-major one for one written in that order
    flipped = perm[:, 0] != 0
    wants = np.where(flipped, transposed, ~transposed)  # row-major in the parameter's order
    strict = member & ~np.isclose(across, along)
    key = np.maximum(run, 0)
    last = np.full(len(run), -1, dtype=np.int64)
    np.maximum.at(last, key[strict], place[strict])
    decided = strict & (place == last[key])
    row_major = np.zeros(len(run), dtype=bool)
    row_major[key[decided]] = wants[decided]
    # no strict member: the dots' order, transposed in the parameter's (a Llama's at data 4)
    laid = row_major[key] & (last[key] >= 0)
    return np.where(member, np.where(flipped, laid, ~laid), transposed)


class TileMemo:
    """A graph's `tile_shares` and `tpu_zero_scatter` per layout, each computed once
    (the searchers revisit layouts); the `TileTable` is made on first use, as only TPU
    lowerings read it."""

    LIMIT = 4096  # layouts kept per figure: a long search's memory stays bounded

    def __init__(self, make_table: Callable[[], TileTable], least: int):
        self._make_table, self.least = make_table, least
        self._shares: dict[tuple, TileShares] = {}
        self._whole: dict[tuple, ZeroScatter] = {}

    @functools.cached_property
    def table(self) -> TileTable:
        return self._make_table()

    def shares(self, codes: np.ndarray, mesh, sizes: np.ndarray, data: int) -> TileShares:
        """`tile_shares` of the layout (`codes` over `mesh`, ZeRO's axis code `data`)."""
        key = (codes.tobytes(), tuple(mesh.items()), data)
        hit = self._shares.get(key)
        if hit is None:
            hit = tile_shares(self.table, codes, sizes, data)
            if len(self._shares) < self.LIMIT:
                self._shares[key] = hit
        return hit

    def zero_scatter(
        self, cluster, codes, mesh, sizes: np.ndarray, data: int, zero_stage: int = 0
    ) -> ZeroScatter:
        """`tpu_zero_scatter` of the layout (`codes` over `mesh` on `cluster`; none where
        the lowering scatters every ZeRO gradient), its data axis' groups spanning the
        torus dimensions `_torus.axis_spans_and_rings` says; under ZeRO-3 (`zero_stage`)
        with the runs the runtime's ties lay alike."""
        if not self.least:
            return ZeroScatter()
        tied = zero_stage >= 3
        key = (codes.tobytes(), tuple(mesh.items()), data, tied)
        hit = self._whole.get(key)
        if hit is None:
            spans = axis_spans_and_rings(cluster, mesh, list(mesh)[data - 1])
            hit = tpu_zero_scatter(self.table, codes, sizes, data, *spans, self.least, tied)
            if len(self._whole) < self.LIMIT:
                self._whole[key] = hit
        return hit
