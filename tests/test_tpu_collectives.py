"""Collectives XLA's TPU compiler inserts, held against the priced ones: ZeRO's gradients
(scattered on their rows or lanes, padded, all-reduced whole), a Llama's rotary and table
lookups under split dimensions. Compiled on the compile-only chips of a v5p topology
(`verify(target=...)`, libtpu without a TPU), as in test_verify_tpu.py."""

import re

import pytest

import automap as am
from automap._graph import Role
from automap._groups import plan_from_assignment
from automap._verify import compile_plan, verify
from automap._zoo import get_model
from test_verify_tpu import small_llama

# Every test here loads libtpu (make puts it in .venv/tpu-compile): `-m tpu_compile`
# selects them, `-m "not tpu_compile"` leaves them out where it is not installed.
pytestmark = pytest.mark.tpu_compile


def zero3_report(mesh: dict[str, int], target: str, **sizes):
    """`verify` of a bf16 `small_llama(**sizes)` under ZeRO-3, its batch on data of
    `mesh`, compiled for the TPU `target`."""
    step, args, graph, groups = small_llama(dtype="bfloat16", **sizes)
    batch = next(leaf.tensor for leaf in graph.inputs if leaf.role == Role.BATCH)
    plan = plan_from_assignment(graph, groups, mesh, {groups.of(batch, 0): "data"}, zero_stage=3)
    return verify(step, plan, *args, target=target)


@pytest.mark.slow  # compiled for 8 v5p chips: ~20 s on two loaded cores
def test_a_llama_splitting_its_hidden_dim_holds_the_rotarys_collectives():
    # A plan asking for the hidden dim, the head dim d and the rotary's halves of it on
    # data (4) x model (2): split there, XLA keeps d split through the rotary's slices,
    # pads, splits and concatenates with halo exchanges and all-to-alls (1-layer llama,
    # hidden 512: 6.6 MiB of collective-permutes, 1.25 of all-to-all) where the cost model
    # priced 12.5 MiB of all-gathers. Those groups are kept whole (`Rule.resized`): the
    # plan splits the hidden dim alone, and the collectives are the ones priced.
    step, args, graph, groups = small_llama()
    concat = next(op for op in graph.ops if op.primitive == "concatenate")
    rotary = {groups.of(t, 3) for t in (*concat.inputs, *concat.outputs)}  # halves, d
    hidden = groups.of(next(op for op in graph.ops if op.primitive == "dot_general").inputs[0], 2)
    wanted = {g: "data" for g in (hidden, *rotary)}
    plan = plan_from_assignment(graph, groups, {"model": 2, "data": 4}, wanted)
    assert plan.assignment == {hidden: "data"}
    report = verify(step, plan, *args, target="v5p:2x2x2")
    assert report.collectives_match, report.mismatches
    assert report.xla_comm_bytes["all-reduce@data"] > 1e6  # the hidden dim's partial sums


@pytest.mark.slow  # compiled for 8 v5p chips: ~10 s on two loaded cores
def test_a_lookup_whose_rows_and_indices_share_an_axis_moves_its_table():
    # A 1-layer bf16 Llama, data 4 x model 2: the token table's rows and the batch on
    # data, the MLP's hidden units on model (llama plans 0, 9, 10, 11 of the TPU bench).
    # XLA partitions the lookup by index passthrough: the batch keeps data, the table is
    # regrouped onto model (a collective-permute of its shard, an all-gather over data),
    # looked up masked and all-reduced over model; the backward all-reduces the table's
    # gradient over data and permutes it back. Priced as a reduce-scatter of the whole
    # lookup over data and an all-gather of its gradient before `_kernel._moved_lookups`.
    step, args, graph, groups = small_llama()
    lookup = next(op for op in graph.ops if op.primitive == "gather")
    table, indices = lookup.inputs[:2]
    up = next(
        op
        for op in graph.ops
        if op.primitive == "dot_general" and graph.tensors[op.inputs[1]].shape == (256, 512)
    )
    wanted = {groups.of(table, 0): "data", groups.of(indices, 0): "data"}
    wanted[groups.of(up.inputs[1], 1)] = "model"
    plan = plan_from_assignment(graph, groups, {"data": 4, "model": 2}, wanted)
    assert plan.specs["[0]['params']['token_embed']['embedding']"] == ("data", None)
    report = verify(step, plan, *args, target="v5p:2x2x2")
    # XLA's permutes of the table's shard (bf16 [128, 256]), there and back
    assert report.xla_comm_bytes["collective-permute@data+model"] == 2 * 128 * 256 * 2
    assert report.collectives_match, report.mismatches
    on_cpu = verify(step, plan, *args)  # the partitioner's, not the TPU's: the CPU alike
    assert on_cpu.xla_comm_bytes["collective-permute@data+model"] > 0
    assert on_cpu.collectives_match, on_cpu.mismatches


@pytest.mark.slow  # compiled for 8 v5p chips: ~25 s on two loaded cores
def test_a_tpu_scatters_lane_split_gradients_by_whole_multiples_of_512_bytes():
    # A 1-layer bf16 Llama, the batch on data 4 of a v5p 2x2x2, ZeRO-3: the backward writes
    # the down kernel's gradient [hidden 512, ffn 1536] row-major, ZeRO's split on its
    # lanes, 384 bf16 lanes (768 bytes) a shard. XLA all-reduces it whole (1.5 MiB) as it
    # does shards of 128 lanes, where it scatters those of 256, 512 and 768 lanes (ffn
    # 1024, 2048, 3072): `_tiles.minor_split` asks a whole multiple of `LANE_BYTES`.
    report = zero3_report(
        {"data": 4, "model": 2}, "v5p:2x2x2", hidden=512, ffn=1536, batch=8, vocab=1024
    )
    assert report.collectives_match, report.mismatches
    xla = report.xla_comm_bytes
    assert xla["all-reduce@data"] > 7 * 2**20  # the down kernel's 1.5 MiB among them
    assert xla["reduce-scatter@data"] == 1024 * 512 * 2  # the token table's gradient alone


@pytest.mark.slow  # compiled for 16 v5p chips: ~20 s on two loaded cores
def test_a_tpu_on_rings_of_four_scatters_zero_gradients_by_their_shards_rows():
    # A 1-layer bf16 Llama (hidden 128), the batch on data 8 x model 2 of a v5p 4x4x1,
    # ZeRO-3: every torus dimension data spans is a ring of 4, and XLA reduce-scatters every
    # matrix's gradient, the key and value kernels' [16, 64] shards and the [16, 128] ones
    # included, which the rule per torus dimension spanned (2048 elements each, 128 lanes:
    # measured on 2x2x2's rings of 2) kept whole (`_tiles.tpu_zero_scatter`, `ring`).
    report = zero3_report(
        {"data": 8, "model": 2}, "v5p:4x4x1", hidden=128, heads=2, kv_heads=1, batch=32
    )
    assert report.collectives_match, report.mismatches
    assert report.xla_comm_bytes["reduce-scatter@data"] > 0.5 * 2**20
    assert report.xla_comm_bytes.get("all-reduce@data", 0) < 2**15  # the norms' alone


@pytest.mark.slow  # compiled for 32 v5p chips: ~10 s on two loaded cores
def test_a_tpu_pads_a_zero_gradients_rows_to_whole_chunks_and_permutes_them_home():
    # A 1-layer bf16 Llama (hidden 512, ffn 192), the batch on data 16 x model 2 of a v5p
    # 4x4x2, ZeRO-1: the down kernel's gradient [192, 512] is split 16 ways on its rows,
    # 12 a shard. XLA pads each shard to 16 rows (whole chunks of 2048 elements in (8, 128)
    # tiles: `_tiles.row_padding`), reduce-scatters the padded [256, 512], then moves each
    # device's 12 rows to it with collective-permutes, one per distance: three of 16 rows
    # and the farthest's last 12 (llama plan 9 of the TPU bench on 256 chips: 1536 rows
    # over 128 chips, 31 permutes of 16 rows and one of 12 a gradient).
    step, args, graph, groups = small_llama(dtype="bfloat16", hidden=512, ffn=192, batch=32)
    batch = next(leaf.tensor for leaf in graph.inputs if leaf.role == Role.BATCH)
    mesh, wanted = {"data": 16, "model": 2}, {groups.of(batch, 0): "data"}
    plan = plan_from_assignment(graph, groups, mesh, wanted, zero_stage=1)
    report = verify(step, plan, *args, target="v5p:4x4x2")
    assert report.collectives_match, report.mismatches
    xla, priced = report.xla_comm_bytes, report.predicted_comm_bytes
    assert xla["collective-permute@data"] == (3 * 16 + 12) * 512 * 2
    assert priced["collective-permute@data"] == xla["collective-permute@data"]
    padding = (256 - 192) * 512 * 2
    assert priced["reduce-scatter@data"] == xla["reduce-scatter@data"] > padding


@pytest.mark.slow  # compiled for 4 v5p chips: ~15 s on two loaded cores
def test_a_tpu_lays_a_zero3_tie_run_of_gradients_alike():
    # A 2-layer bf16 Llama (hidden 512, ffn 1792), the batch on data 4 of a v5p 2x2x1,
    # ZeRO-3. The runtime ties each backward layer's down, up and gate gradients in one
    # chain (`_scatter.tied_runs`), which XLA lays alike: the down's [448, 512] shard pads
    # less row-major (448 lanes would take 512), the gate's and up's [128, 1792] pad alike
    # either way, so all three are laid row-major in the parameter's order and scattered
    # on their rows. Each alone, the gate's and up's would keep the dots' order, ZeRO's
    # split on their 128 lanes, all-reduced whole (10.5 MiB of all-reduce priced, 3.5 XLA).
    report = zero3_report(
        {"data": 4}, "v5p:2x2x1", layers=2, hidden=512, heads=8, ffn=1792, batch=16, vocab=1024
    )
    assert report.collectives_match, report.mismatches
    mlp = 2 * 3 * 512 * 1792 * 2  # the two layers' down, up and gate gradients, bf16
    assert report.xla_comm_bytes["reduce-scatter@data"] == mlp + 1024 * 512 * 2  # and the table's


@pytest.mark.slow  # one compile for 8 v5p chips: ~15 s
def test_a_tied_tables_head_gathers_its_bf16_cast_and_its_lookup_the_table():
    # A float32 GPT whose token table is both its lookup and its head, under ZeRO-3 over
    # data 8: XLA's TPU gathers the table as float32 for the lookup's layer and as its bf16
    # cast for the head's, forward and backward (`_fsdp.served_bytes`). Priced at one
    # float32 width for all three, the all-gathers over data were 42% over XLA's here (a
    # vocabulary of 8192 over a 1-layer model at hidden 256: the table is most of them),
    # now within 0.1%. (The table's gradient XLA all-reduces whole where a reduce-scatter
    # is priced, a mismatch of its own, not read: so the gathers are held, not the whole.)
    spec = get_model(
        "gpt2-xl", layers=1, hidden=256, heads=4, seq=128, batch=16, vocab=8192, dtype="float32"
    )
    step, args = spec.step_fn, spec.abstract_args()
    v5p = am.Cluster.preset("tpu-v5p", topology="2x2x2")
    plan = am.plan_recipe(step, *args, recipe=am.Recipe(dp=8, zero=3), cluster=v5p)
    compiled = compile_plan(step, plan, args, target="v5p:2x2x2")
    report = verify(step, plan, *args, target="v5p:2x2x2", compiled=compiled)
    key = "all-gather@data"
    assert report.predicted_comm_bytes[key] == pytest.approx(report.xla_comm_bytes[key], rel=0.05)
    hlo = compiled[1].as_text()
    # each collective once (an async one's text repeats in the computations it spans)
    found = re.findall(r"= (\w+)\[8192,256\][^ ]* all-gather\(.*?channel_id=(\d+)", hlo)
    gathers = sorted({channel: dtype for dtype, channel in found}.values())
    assert gathers == ["bf16", "bf16", "f32"], found
