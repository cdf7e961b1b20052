"""ZeRO-1/2/3 in pipeline stages as DeepSpeed runs it: each stage sums its local gradients
over the microbatches, its once-per-step "reduce" program reduce-scatters them into the
ZeRO layout (on the CPU: all-reduces the whole buffer and slices it), Adam runs on shards
and the new parameters are all-gathered once after the update (ZeRO-3: the parameters stay
sharded and each F and B program gathers the ones it reads).

Read from the programs the runtime compiles (`run.compile`) for a 2-stage, data-parallel
plan on the 8 CPU devices of conftest; the pipelined cost model is held against their
collectives (`am.verify`) and against their buffer assignment plus what the runtime holds
(`run.memory`), and the step computes what the unsharded step does.
"""

import dataclasses
import functools
import re

import jax
import pytest

import automap as am
from automap._capture import capture
from automap._cluster import Cluster
from automap._cost import CostModel, estimate_pipeline
from automap._graph import Role
from automap._groups import build_groups, plan_from_assignment
from automap._pipeline import Phase, partition, pipeline_plan, uniform_cuts
from automap._space import block_groups
from automap._verify import axis_of, comm_bytes, parse_collectives, verify
from automap._zoo import get_model

MESH = {"data": 4}
M = 2


def _captured(name: str, **overrides):
    """A float32 zoo model (a 16-bit one would sum its gradients in 16 bits, ZeRO or not),
    its graph and groups."""
    spec = get_model(name, layers=2, hidden=64, heads=4, batch=16, dtype="float32", **overrides)
    graph = capture(spec.step_fn, *spec.abstract_args())
    return spec, graph, build_groups(graph)


@functools.cache
def gpt():
    """A float32 GPT."""
    return _captured("gpt-1.3b", seq=32, vocab=128)


@functools.cache
def zero_plan(stage: int, microbatches: int = M):
    _, graph, groups = gpt()
    batch = {g: "data" for g in groups.batch_groups}
    cuts = uniform_cuts(graph, groups, 2)
    return pipeline_plan(graph, groups, cuts, MESH, batch, microbatches, zero_stage=stage)


@functools.cache
def compiled(stage: int):
    """(every program of one step, per stage the peak bytes per device) of a ZeRO plan."""
    spec, _, _ = gpt()
    run = am.apply(spec.step_fn, zero_plan(stage))
    args = spec.abstract_args()
    return run.compile(*args), run.memory(*args)


@functools.cache
def stage_part():
    _, graph, groups = gpt()
    plan = zero_plan(1)
    return partition(graph, groups, [(s.op_start, s.op_stop) for s in plan.stages], M)


def stage_sums(stage: int) -> float:
    """Bytes of what a stage sums over the microbatches: its gradients (a tied embedding's
    on both stages that use it) and, on the last, the loss."""
    _, graph, _ = gpt()
    part = stage_part()
    return sum(
        graph.tensors[t].nbytes
        for t in part.accumulated
        if part.op_stage[graph.tensors[t].producer] == stage
    )


def stage_params(stage: int) -> float:
    """Bytes of the parameters updated on a pipeline stage (read by its POST ops)."""
    _, graph, _ = gpt()
    part = stage_part()
    consumers = graph.consumers()
    return sum(
        graph.tensors[leaf.tensor].nbytes
        for leaf in graph.leaves(Role.PARAM)
        if any(
            part.op_stage[c] == stage and part.op_phase[c] is Phase.POST
            for c in consumers[leaf.tensor]
        )
    )


def data_bytes(programs, kind: str) -> float:
    """Bytes of `kind` over the data axis in `programs`, times their runs per step."""
    return sum(
        comm_bytes(parse_collectives(p.compiled.as_text()), p.mesh).get(f"{kind}@data", 0.0)
        * p.runs
        for p in programs
    )


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stages_reduce_scatter_update_on_shards_and_gather_once(stage):
    programs, _ = compiled(stage)
    for s in (0, 1):
        mine = [p for p in programs if p.stage == s]
        per_mb = [p for p in mine if p.kind in (Phase.FWD, Phase.BWD)]
        # The microbatches move nothing over data but ZeRO-3's parameter gathers.
        assert not data_bytes(per_mb, "all-reduce")
        (reduce,) = [p for p in mine if p.kind is Phase.REDUCE]
        assert reduce.runs == 1
        # One reduction of the stage's gradients (the loss sum with them on the last
        # stage), sliced into the ZeRO layout: the CPU's lowering of a reduce-scatter.
        assert data_bytes([reduce], "all-reduce") == stage_sums(s)
        assert "dynamic-slice" in reduce.compiled.as_text()
        assert any("data" in str(o.sharding.spec) for o in reduce.compiled.out_info)
        post = [p for p in mine if p.kind is Phase.POST]
        texts = "\n".join(p.compiled.as_text() for p in post)
        # Adam runs on shards: a [64, 256] kernel's moments are read as [16, 256].
        if s == 0:
            assert re.search(r"sqrt[^\n]*f32\[16,256\]", texts)
            assert not re.search(r"sqrt[^\n]*f32\[64,256\]", texts)
        if stage < 3:  # the new parameters gathered once, after the update
            assert data_bytes(post, "all-gather") == pytest.approx(stage_params(s))
            assert not data_bytes(per_mb, "all-gather")
        else:  # kept sharded, gathered where F and B read them (not in the update)
            assert not data_bytes(post, "all-gather")
            assert data_bytes([p for p in per_mb if p.kind is Phase.FWD], "all-gather") > 0
            assert data_bytes([p for p in per_mb if p.kind is Phase.BWD], "all-gather") > 0


@pytest.mark.slow  # pipelines compiled and run (8-12 s each loaded)
@pytest.mark.parametrize(
    ("stage", "microbatches", "remat"), [(2, 4, False), (3, 2, False), (3, 2, True)]
)
def test_the_model_predicts_the_collectives_and_the_step_is_unchanged(stage, microbatches, remat):
    # Under remat a B program gathers again, for its recompute, what the recomputed ops
    # read (XLA merges no gather behind the recompute's barrier with the backward's).
    spec, _, _ = gpt()
    plan = dataclasses.replace(zero_plan(stage, microbatches), remat=remat)
    report = verify(spec.step_fn, plan, *spec.concrete_args())
    assert report.collectives_match is True, report.summary()
    assert report.numerics_ok, report.summary()
    # The check can fail: the old pattern (the moments gathered for a whole update)
    # predicts twice the parameter gathers.
    assert set(report.xla_comm_bytes) >= {f"all-gather@data (stage {s})" for s in (0, 1)}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_predicted_stage_memory_is_what_the_compiled_stage_holds(stage):
    # XLA's buffer assignment of each program a stage runs, plus what the runtime holds
    # on the stage's devices then (run.memory): the largest, per stage.
    _, xla = compiled(stage)
    _, graph, _ = gpt()
    pc = estimate_pipeline(CostModel(graph, Cluster.preset("cpu", devices=8)), zero_plan(stage))
    for predicted, held in zip(pc.stage_memory_bytes, xla, strict=True):
        assert predicted == pytest.approx(held, rel=0.15)
    # ZeRO shards the optimizer state (and with ZeRO-3 the parameters) by the data axis.
    plain = estimate_pipeline(CostModel(graph, Cluster.preset("cpu", devices=8)), zero_plan(0))
    for zeroed, whole in zip(pc.stage_memory, plain.stage_memory, strict=True):
        assert zeroed["opt_state"] == pytest.approx(whole["opt_state"] / 4, rel=0.02)
        assert zeroed["grads"] == whole["grads"]  # summed whole until reduce-scattered


def test_zero_moves_data_parallels_bytes_per_stage_on_a_gpu_cluster():
    # Where reduce-scatter exists: per stage, the gradients reduce-scattered and the
    # parameters gathered take data parallel's all-reduce time (float32 gradients and
    # parameters at gpt-1.3b's width, where bandwidth, not latency, sets the time), once
    # per step whatever the microbatches.
    spec = get_model("gpt-1.3b", layers=4, dtype="float32")
    graph = capture(spec.step_fn, *spec.abstract_args())
    groups = build_groups(graph)
    model = CostModel(graph, Cluster.preset("a100", devices=16), groups)
    cuts = uniform_cuts(graph, groups, 2)
    batch = {g: "data" for g in groups.batch_groups}

    def priced(zero: int):
        plan = pipeline_plan(graph, groups, cuts, {"data": 8}, batch, 4, zero_stage=zero)
        return estimate_pipeline(model, plan).stage_collectives

    def seconds(collectives) -> float:
        return sum(c.time_s for c in collectives if c.axis == "data")

    dp = priced(0)
    for zero in (1, 2):
        z = priced(zero)
        for mine, plain in zip(z, dp, strict=True):
            (reduced,) = [c for c in plain if c.axis == "data"]
            (scattered,) = [c for c in mine if c.kind == "reduce-scatter"]
            assert scattered.bytes == pytest.approx(reduced.bytes)
            assert seconds(mine) <= 1.05 * seconds(plain)
        # The first stage reduce-scatters and gathers what it all-reduced; the last moves
        # less: GPT's tied embedding has a gradient there, reduce-scattered, but it is
        # updated (and gathered) on the first stage only.
        assert seconds(z[0]) == pytest.approx(seconds(dp[0]), rel=0.05)


@pytest.mark.slow  # a pipeline compiled and verified
def test_one_microbatch_reduce_scatters_in_the_backward():
    # No reduce program: the B call reduce-scatters the gradients itself, the update runs
    # on shards and gathers the parameters once, as predicted.
    spec, _, _ = gpt()
    plan = zero_plan(1, 1)
    programs = am.apply(spec.step_fn, plan).compile(*spec.abstract_args())
    assert not [p for p in programs if p.kind is Phase.REDUCE]
    for prog in programs:
        if prog.kind is Phase.BWD:
            found = parse_collectives(prog.compiled.as_text())
            assert any(axis_of(c.kind, c.groups, prog.mesh) == "data" for c in found)
            assert "dynamic-slice" in prog.compiled.as_text()
    report = verify(spec.step_fn, plan, *spec.abstract_args())
    assert report.collectives_match is True, report.summary()


def test_the_gradient_sums_are_whole_until_reduced():
    # Each device sums its own examples' gradient whole ([1, *shape] per device) in the
    # B calls: a ZeRO layout there would be reduce-scattered once per microbatch.
    programs, _ = compiled(2)
    for prog in programs:
        if prog.kind is Phase.BWD:
            shapes = [o.sharding.shard_shape(o.shape) for o in prog.compiled.out_info]
            assert (1, 64, 256) in shapes
    jax.clear_caches()


@pytest.mark.slow  # a bf16 pipeline compiled, run and verified
def test_sixteen_bit_gradients_are_reduce_scattered_too():
    # The plan leaves a bf16 gradient free (one program would sum it after its float32
    # cast); a stage sums it in bf16 anyway, so its reduce program scatters it into the
    # layout the update reads it in, and the model prices a reduce-scatter for it.
    spec = get_model("gpt-1.3b", layers=2, hidden=64, heads=4, seq=32, batch=16, vocab=128)
    args = spec.abstract_args()
    graph = capture(spec.step_fn, *args)
    groups = build_groups(graph)
    batch = {g: "data" for g in groups.batch_groups}
    cuts = uniform_cuts(graph, groups, 2)
    plan = pipeline_plan(graph, groups, cuts, MESH, batch, M, zero_stage=1)
    for prog in am.apply(spec.step_fn, plan).compile(*args):
        if prog.kind is Phase.REDUCE:
            sums = [o for o in prog.compiled.out_info if o.shape]
            assert sums and all("data" in str(o.sharding.spec) for o in sums)
    model = CostModel(graph, Cluster.preset("a100", devices=8), groups)
    for own in estimate_pipeline(model, plan).stage_collectives:
        assert {c.kind for c in own if c.axis == "data" and c.bytes > 4} == {
            "reduce-scatter",
            "all-gather",
        }
    report = verify(spec.step_fn, plan, *args)
    assert report.collectives_match is True, report.summary()


@functools.cache
def gpt2():
    """A float32 GPT-2 (its token embedding, tied to the LM head, looked up by a gather)."""
    return _captured("gpt2-xl", seq=16, vocab=512)


@pytest.mark.slow  # three pipelines compiled and run (4-23 s each loaded)
@pytest.mark.parametrize(("stages", "zero"), [(2, 3), (1, 3), (1, 1)])
def test_an_embedding_lookup_under_zero_and_tensor_parallelism_moves_what_is_priced(stages, zero):
    # Data × model with the vocab split over model: ZeRO adds data on the table's hidden
    # dim. Looked up in that layout (ZeRO-3's forward) or scattered into it (its gradient),
    # XLA moved the rows with an all-to-all over data that no plan priced; the table is
    # gathered where the lookup reads it and its gradient reduced whole, as priced.
    spec, graph, groups = gpt2()
    assignment = {g: "data" for g in groups.batch_groups}
    assignment.update({g.id: "model" for g in block_groups(groups)})
    if stages == 2:
        cuts = uniform_cuts(graph, groups, 2)
        mesh = {"data": 2, "model": 2}
        plan = pipeline_plan(graph, groups, cuts, mesh, assignment, M, zero_stage=zero)
    else:
        mesh = {"data": 4, "model": 2}
        plan = plan_from_assignment(graph, groups, mesh, assignment, zero_stage=zero)
    report = verify(spec.step_fn, plan, *spec.concrete_args())
    assert not [k for k in report.xla_comm_bytes if k.startswith("all-to-all")], report.summary()
    assert report.collectives_match is True, report.summary()
    assert report.numerics_ok, report.summary()
