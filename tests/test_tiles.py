"""Tile padding (`Lowering.tile_padding`, `_cost/_tiles.py`): the bytes an array takes in
XLA's TPU layouts, and a TPU cluster's memory priced in them."""

import jax
import numpy as np
import pytest

import automap as am
from automap._cost import PADDED_MOST, CostModel, minor_split, row_padding, tiled_bytes
from automap._zoo import get_model


# Read from libtpu 0.0.42 compiling for a v5p without one: memory_analysis()'s argument
# size of one replicated array, and its layout in the HLO text.
@pytest.mark.parametrize(
    ("shape", "itemsize", "laid"),
    [
        ((1,), 4, 512),  # {0:T(128)}: one tile is the least
        ((100,), 4, 512),
        ((129,), 4, 1024),  # T(256)
        ((1000,), 4, 4096),  # T(1024)
        ((1025,), 4, 8192),  # T(1024), two tiles
        ((1, 128), 4, 512),  # T(1,128): a small second-minor takes fewer rows
        ((3, 128), 4, 2048),  # T(4,128)
        ((9, 128), 4, 8192),  # T(8,128)
        ((64, 64), 4, 32768),  # the lanes half empty
        ((64, 16), 4, 8192),  # laid {0,1}: its 64 on the lanes pads less than its 16
        ((2, 3, 5), 4, 3072),  # {2,0,1:T(2,128)}
        ((5, 7, 9, 11), 4, 184320),  # {3,1,2,0}: the 7 second-minor pads less than the 9
        ((100,), 2, 512),  # bf16 {0:T(256)(128)(2,1)}: 16-bit rows pack in twos
        ((1, 128), 2, 512),  # T(2,128)(2,1)
        ((17, 128), 2, 6144),  # T(8,128)(2,1)
        ((64, 64), 2, 16384),
        ((300,), 1, 512),  # s8 {0:T(512)(128)(4,1)}
        ((2, 3, 5), 1, 1024),  # T(4,128)(4,1)
    ],
)
def test_an_array_takes_the_bytes_of_its_tpu_tiles(shape, itemsize, laid):
    assert tiled_bytes(shape, itemsize) == laid


def _mlp_plan(recipe):
    spec = get_model("mlp")  # 64 and 256 wide: most of its arrays pad on a TPU
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    v5p = am.Cluster.preset("tpu-v5p", topology="2x2x2")
    plan = am.plan_recipe(step, *args, recipe=recipe, cluster=v5p)
    return am.capture(step, *args), v5p, plan


def _tiled_shards(graph, plan, role) -> tuple[float, float]:
    """(tiles, bytes) of the shards of `role`'s leaves a chip holds, read off the plan's
    specs: each dim divided by the axes its spec names."""
    tiles = raw = 0.0
    for leaf in graph.leaves(role):
        t = graph.tensors[leaf.tensor]
        spec = plan.specs.get(leaf.path) or ()
        shard = list(t.shape)
        for d, entry in enumerate(spec[: t.ndim]):
            for axis in [entry] if isinstance(entry, str) else entry or ():
                shard[d] //= plan.mesh[axis]
        tiles += tiled_bytes(tuple(shard), t.itemsize)
        raw += t.itemsize * float(np.prod(shard))
    return tiles, raw


@pytest.mark.parametrize(
    "recipe", [am.Recipe(dp=8), am.Recipe(dp=2, tp=4), am.Recipe(dp=4, tp=2, zero=1)]
)
def test_a_tpu_prices_the_state_in_the_tiles_of_its_shards(recipe):
    # The parameters and the optimizer state a chip holds, in its shards' tiles (a
    # 4-way column shard [256, 16] of a [256, 64] weight laid with its 256 on the lanes;
    # ZeRO-1's optimizer state cut once more over "data"); without tiles, in their bytes.
    graph, v5p, plan = _mlp_plan(recipe)
    assert v5p.lowering.tile_padding and not am.Cluster.preset("a100").lowering.tile_padding
    tiled = CostModel(graph, v5p).estimate(plan).memory_breakdown
    plain = CostModel(graph, v5p.with_lowering(tile_padding=False)).estimate(plan)
    for part, role in (("params", am.Role.PARAM), ("opt_state", am.Role.OPT_STATE)):
        tiles, raw = _tiled_shards(graph, plan, role)
        assert tiles > raw  # the biases and the 64-wide layers' shards pad
        assert tiled[part] == pytest.approx(tiles)
        # (ZeRO's bytes count a fourth of the step count's 4, which a tile holds whole)
        assert plain.memory_breakdown[part] == pytest.approx(raw, abs=4)


def _reductions(graph, cluster, plan) -> dict[str, float]:
    cost = CostModel(graph, cluster).estimate(plan)
    return {f"{c.kind}@{c.axis}": c.bytes for c in cost.collectives if "reduce" in c.kind}


def test_a_tpu_reduce_scatters_only_the_zero_gradients_whose_shards_fit_its_rule():
    # ZeRO-1 of data 4 x model 2 on a v5p 2x2x2 (data's groups span two torus dims): XLA's
    # TPU compiler reduce-scatters the three 256-wide kernels' [256, 128] shards (384 KiB,
    # read from its HLO) and all-reduces whole the biases, the 64-wide first kernel's
    # [64, 128] (a [16, 128] shard is under 2 x 2048 elements) and the head's [256, 8].
    graph, v5p, plan = _mlp_plan(am.Recipe(dp=4, tp=2, zero=1))
    assert v5p.lowering.scatter_least_elements
    tpu = _reductions(graph, v5p, plan)
    assert tpu["reduce-scatter@data"] == 3 * 256 * 128 * 4
    small = 64 * 128 * 4 + 256 * 8 * 4
    biases = (8 + 128 + 256 + 128 + 256) * 4  # their local shards, 1-D: never scattered
    assert tpu["all-reduce@data"] == pytest.approx(small + biases, abs=8)
    # Where every ZeRO gradient is reduce-scattered (a GPU's rule), all of them are.
    gpu = _reductions(graph, v5p.with_lowering(scatter_least_elements=0), plan)
    assert "all-reduce@data" not in gpu or gpu["all-reduce@data"] < 8
    total = tpu["reduce-scatter@data"] + tpu["all-reduce@data"]
    assert gpu["reduce-scatter@data"] == pytest.approx(total, abs=8)


def test_a_tpu_cube_all_reduces_every_zero_gradient():
    # Data over all 8 chips of a 2x2x2 spans three torus dimensions: XLA all-reduces every
    # gradient whole and slices it, however large.
    graph, v5p, plan = _mlp_plan(am.Recipe(dp=8, zero=1))
    tpu = _reductions(graph, v5p, plan)
    assert "reduce-scatter@data" not in tpu and tpu["all-reduce@data"] > 500 * 1024


def test_a_tpu_cube_split_into_groups_reduce_scatters_as_a_plane_does():
    # Data 32 x model 2 on a v5p 4x4x4: each data group spans all three torus dimensions
    # but is half the chips, and XLA's TPU compiler reduce-scatters its gradients as on a
    # plane (read from libtpu 0.0.42.1); only the one group of data 64 all-reduces them
    # whole, as the 2x2x2 cube's does.
    from automap._cost import axis_torus_dims

    spec = get_model("mlp", hidden=2048, batch=128)  # [2048, 2048] kernels: [32, 2048] shards
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    graph, v5p = am.capture(step, *args), am.Cluster.preset("tpu-v5p", topology="4x4x4")
    split = am.plan_recipe(step, *args, recipe=am.Recipe(dp=32, tp=2, zero=1), cluster=v5p)
    assert axis_torus_dims(v5p, split.mesh)["data"] == 3
    assert _reductions(graph, v5p, split)["reduce-scatter@data"] >= 3 * 2048 * 1024 * 4
    cube = am.plan_recipe(step, *args, recipe=am.Recipe(dp=64, zero=1), cluster=v5p)
    assert "reduce-scatter@data" not in _reductions(graph, v5p, cube)


# Read from libtpu 0.0.42.1 on v5p 4x4x4 and 2x2x2 (tests/test_verify_tpu.py holds one): a
# gradient the backward writes [512, n] row-major, ZeRO's split on n (its lanes) 4 ways.
@pytest.mark.parametrize(
    ("lanes", "itemsize", "whole"),
    [
        (128, 2, True),  # 256 bytes a shard's row
        (256, 2, False),  # ffn 1024
        (384, 2, True),  # ffn 1536: 768 bytes, not a whole multiple of 512
        (512, 2, False),  # ffn 2048
        (768, 2, False),  # ffn 3072: 1536 bytes
        (128, 4, False),  # float32 [256, 128] shards
    ],
)
def test_a_tpu_scatters_a_gradient_split_on_its_lanes_by_whole_512_byte_rows(
    lanes, itemsize, whole
):

    perm = np.array([[0, 1]])  # written in the parameter's own order
    local = np.array([[512.0, 4 * lanes]])
    zlocal = np.array([[512.0, lanes]])
    got = minor_split(perm, np.array([itemsize]), np.array([False]), local, zlocal)
    assert bool(got[0]) is whole


# Read from libtpu 0.0.42.1 on v5p 4x4x4 (llama plans 9 and 11 of the TPU bench): under
# ZeRO-3 the runtime's ties lay a run of gradients alike, as its last member that pads
# strictly less one way wants (tests/test_verify_tpu.py holds a compiled one).
@pytest.mark.parametrize(
    ("zlocal", "local", "whole"),
    [
        # data 8 x model 8, in the ties' order: down's [192, 64] shard (transposed pads
        # less), then up's and gate's [64, 192] (row-major does): down's 64-lane split
        # all-reduced whole
        ([[192, 64], [64, 192], [64, 192]], [[192, 512], [512, 192], [512, 192]], [1, 0, 0]),
        # data 32 x model 2: the out kernel's [256, 16] shard (eight times less padding
        # transposed), then a value kernel's [16, 64] (row-major): laid row-major, whole
        ([[256, 16], [16, 64]], [[256, 512], [512, 64]], [1, 0]),
    ],
)
def test_a_tpu_lays_a_zero3_tie_run_of_gradients_as_its_last_strict_member(zlocal, local, whole):
    n = len(zlocal)
    perm = np.array([[1, 0]] * n)  # each written transposed, as a Dense kernel's gradient
    args = (perm, np.full(n, 2), np.zeros(n, dtype=bool), np.array(local, float))
    zlocal = np.array(zlocal, float)
    runs = (np.zeros(n, dtype=np.int64), np.arange(n))  # one run, in the ties' order
    assert minor_split(*args, zlocal, runs).tolist() == [bool(w) for w in whole]
    assert not minor_split(*args, zlocal).any()  # each alone: its split is on its rows
    # a run in which no member pads less either way keeps the dots' order
    square = np.array([[128.0, 128.0]] * n)
    assert minor_split(*args[:3], square * 4, square, runs).all()


# Read from libtpu 0.0.42.1 on v5p 4x8x8 at data 128 x model 2: a dot's bf16 or f32
# [lanes, 128 x rows] gradient pinned to P(None, "data"), each shard's rows padded to the
# rows given (and permuted home), or all-reduced whole (None) where that pads over half.
@pytest.mark.parametrize(
    ("lanes", "rows", "padded"),
    [(512, 6, 8), (512, 7, 8), (512, 8, 8), (512, 11, 16), (512, 12, 16), (512, 20, 24),
     (512, 5, None), (512, 10, None), (256, 20, 24), (2048, 6, 8), (128, 12, 16),
     (128, 22, 32), (128, 24, 32), (128, 40, 48), (128, 20, None), (128, 21, None),
     (384, 24, 32), (384, 20, None)],
)  # fmt: skip
def test_a_tpu_pads_a_row_split_zero_shard_to_whole_chunks(lanes, rows, padded):
    zlocal = np.array([[lanes, rows]], dtype=float)
    on_rows, of, to = row_padding(zlocal, zlocal * [1, 128], np.array([2]), 2048)
    assert on_rows[0] and of[0] == rows
    assert (to[0] if to[0] <= PADDED_MOST * rows else None) == padded
