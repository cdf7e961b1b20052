import dataclasses
import json

import pytest

import automap as am


def test_presets_listed_and_built():
    assert {"v100", "a100", "h100", "h200", "tpu-v4", "cpu"} <= set(am.Cluster.presets())
    c = am.Cluster.preset("a100", devices=16)
    assert c.devices == 16 and c.nodes == 2 and c.devices_per_node == 8
    assert c.peak_flops == 312e12 and c.hbm_bytes == 80e9
    assert c.memory_limit < c.hbm_bytes


def test_axis_links_follow_the_node_hierarchy():
    c = am.Cluster.preset("h100", devices=64)
    links = c.axis_links({"data": 8, "model": 8})
    assert links["model"].kind == "intra" and links["data"].kind == "inter"
    assert links["model"].bandwidth > links["data"].bandwidth
    mixed = c.axis_links({"data": 4, "model": 16})
    assert mixed["model"].kind == "mixed"
    assert mixed["model"].bandwidth == c.inter_bandwidth


def test_mesh_larger_than_cluster_is_refused():
    with pytest.raises(am.ClusterError, match="needs 32 devices"):
        am.Cluster.preset("a100", devices=16).axis_links({"data": 4, "model": 8})


def test_unknown_preset_and_partial_nodes():
    with pytest.raises(am.ClusterError, match="unknown cluster preset 'b200'"):
        am.Cluster.preset("b200")
    with pytest.raises(am.ClusterError, match="whole nodes"):
        am.Cluster.preset("a100", devices=12)


def test_cluster_from_yaml_and_json(tmp_path):
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("preset: v100\ndevices: 16\nmatmul_efficiency: 0.5\n")
    c = am.Cluster.from_file(yaml_file)
    assert c.name == "v100" and c.devices == 16 and c.matmul_efficiency == 0.5
    full = am.Cluster.preset("h200", devices=8).to_dict()
    json_file = tmp_path / "c.json"
    json_file.write_text(json.dumps(full))
    assert am.Cluster.from_file(json_file) == am.Cluster.preset("h200", devices=8)


def test_bad_cluster_files(tmp_path):
    bad = tmp_path / "c.json"
    bad.write_text(json.dumps({"name": "x", "devices": 8, "warp_speed": 9}))
    with pytest.raises(am.ClusterError, match="warp_speed"):
        am.Cluster.from_file(bad)
    bad.write_text("{")
    with pytest.raises(am.ClusterError, match="could not be parsed"):
        am.Cluster.from_file(bad)
    with pytest.raises(am.ClusterError, match="no cluster file"):
        am.Cluster.from_file(tmp_path / "none.yaml")


def test_a_cluster_carries_its_compilers_lowering():
    # Every GPU preset compiles as XLA's GPU pipeline does (Hopper's with its 16-bit
    # arithmetic), every TPU preset as its TPU
    # pipeline (the GPU's, its arrays in tiles, small ZeRO gradients all-reduced whole,
    # ZeRO-3's gathers beside compute, a whole 64-chip slice's gathers all-reduced), the
    # cpu preset as its CPU pipeline: one object, each switch off on the CPU.
    for name in ("v100", "a100"):
        assert am.Cluster.preset(name).lowering == am.Lowering.gpu()
    hopper = dataclasses.replace(am.Lowering.gpu(), native_bf16_arithmetic=True)
    for name in ("h100", "h200"):  # Hopper adds and multiplies bfloat16 in bfloat16
        assert am.Cluster.preset(name).lowering == am.Lowering.hopper() == hopper
    tpu = dataclasses.replace(
        am.Lowering.gpu(),
        tile_padding=True,
        concatenates_combined=False,  # every all-reduce written over its own operand
        all_reduce_combine_bytes=120 * 2**20,  # all-reduces joined up to 120 MiB
        scatter_least_elements=2048,
        overlaps_prefetch=True,
        overlaps_stream_gathers=True,  # the split stream's backward gathers chained
        overlaps_backward_gathers=True,  # ZeRO-3's second gathers chained
        flash_attention=True,  # the runtime runs Pallas's flash kernel
        gather_all_reduced_from=64,
        recompute_gathers_casts=True,  # a recompute's ZeRO-3 gathers move the bf16 casts
        fuses_matmul_operands=True,  # float32 matmul operands made again, kept as bf16
        holds_split_operands=True,  # but held for a gradient dot split beside data
        late_split_dots=True,  # ... which runs at the end of a stage's B that reduces it
        fuses_matmul_epilogues=True,  # GELU's derivative run in its matmul's kernel
        matmul_operand_bytes=2,
        fused_row_elements=1024,  # a wide softmax shift written beside its logits
        fused_row_contraction=256,
        apart_row_elements=8192,  # not for a real vocabulary's rows
        apart_row_contraction=1024,
        float32_norm_buffers=False,  # read on A100s' mixed-precision norms, not on a TPU
        major_dim_collectives=False,  # read on A100s and H100s, not read on a TPU
        early_recompute=False,  # read on A100s, not on a TPU
    )
    for name in ("tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e"):
        assert am.Cluster.preset(name).lowering == am.Lowering.tpu() == tpu
    assert am.Lowering.preset("TPU") == tpu
    cpu = am.Cluster.preset("cpu").lowering
    assert cpu == am.Lowering.preset("cpu") != am.Lowering.gpu()
    assert cpu.collective_float_bytes == 4
    numbers = {"collective_float_bytes", "all_reduce_combine_bytes", "scatter_least_elements"}
    numbers.add("gather_all_reduced_from")
    numbers |= {"matmul_operand_bytes", "fused_row_elements", "fused_row_contraction"}
    numbers |= {"apart_row_elements", "apart_row_contraction"}
    assert set(am.Lowering.switches()) == set(am.Lowering.field_names()) - numbers
    assert not any(getattr(cpu, flag) for flag in am.Lowering.switches())
    # ZeRO-3's prefetch beside compute: the TPU's (under the flags the runtime compiles
    # TPU programs with, tests/test_schedule.py); XLA's GPU leaves the window empty
    # (bfloat16 arithmetic in bfloat16 is Hopper's; the major-dim collectives and the
    # early recompute read on GPUs; none measured on a TPU: left off there)
    gpu_only = {
        "native_bf16_arithmetic",
        "float32_norm_buffers",
        "major_dim_collectives",
        "early_recompute",
        "concatenates_combined",  # XLA's TPU writes each all-reduce over its operand
    }
    assert all(getattr(tpu, flag) for flag in set(am.Lowering.switches()) - gpu_only)
    assert not am.Lowering.gpu().overlaps_prefetch
    assert not am.Lowering.gpu().overlaps_stream_gathers
    what_if = am.Cluster.preset("a100").with_lowering(reduce_scatter=False)
    assert what_if.lowering == dataclasses.replace(am.Lowering.gpu(), reduce_scatter=False)
    with pytest.raises(am.ClusterError, match=r"unknown lowering field\(s\) \['fuses'\]"):
        am.Cluster.preset("a100").with_lowering(fuses=True)


def test_cluster_files_name_the_lowering_or_give_its_fields(tmp_path):
    def load(text: str) -> am.Cluster:
        path = tmp_path / "c.yaml"
        path.write_text(text)
        return am.Cluster.from_file(path)

    gpu, cpu = am.Lowering.gpu(), am.Lowering.cpu()
    assert load("preset: a100\nlowering: cpu\n").lowering == cpu
    assert load("preset: cpu\nlowering: GPU\n").lowering == gpu
    # A mapping sets fields on the preset's lowering.
    mapped = load("preset: cpu\nlowering: {reduce_scatter: true}\n").lowering
    assert mapped == dataclasses.replace(cpu, reduce_scatter=True)
    # Files written before `lowering` give its fields at the top level (numbers as
    # strings too): they are set on the lowering, after a named one.
    flat = load("preset: a100\nfrees_at_last_use: false\nall_reduce_combine_bytes: 4096\n")
    assert flat.lowering == dataclasses.replace(
        gpu, frees_at_last_use=False, all_reduce_combine_bytes=4096
    )
    both = load("preset: a100\nlowering: cpu\nreduce_scatter: true\n").lowering
    assert both == dataclasses.replace(cpu, reduce_scatter=True)
    numeric = load("preset: a100\nlowering: {all_reduce_combine_bytes: '1e6'}\n")
    assert numeric.lowering.all_reduce_combine_bytes == 1e6
    # A whole cluster as `automap calibrate` wrote it on a CPU before `lowering`: every
    # field at the top level, no preset.
    old = {k: v for k, v in am.Cluster.preset("cpu").to_dict().items() if k != "lowering"}
    old |= dataclasses.asdict(cpu)
    json_file = tmp_path / "old.json"
    json_file.write_text(json.dumps(old))
    assert am.Cluster.from_file(json_file) == am.Cluster.preset("cpu")
    # And as it writes one now: the lowering a mapping of its own, read back as it was.
    custom = am.Cluster.preset("cpu").with_lowering(remakes_residuals=True)
    json_file.write_text(json.dumps(custom.to_dict()))
    assert am.Cluster.from_file(json_file) == custom
    with pytest.raises(am.ClusterError, match="lowering must be one of gpu, hopper, tpu, cpu"):
        load("preset: a100\nlowering: 3\n")
    with pytest.raises(am.ClusterError, match=r"collective_float_bytes must be an integer"):
        load("preset: a100\nlowering: {collective_float_bytes: 2.5}\n")


def test_tpu_presets_lay_their_chips_on_a_slice():
    # Google's figures per chip (cloud.google.com/tpu/docs/v5p): 459 TFLOP/s bf16, 95 GiB
    # at 2765 GB/s, 1200 GB/s of ICI each way over 6 links: 100 GB/s per link and direction.
    v5p = am.Cluster.preset("tpu-v5p", topology="v5p-128")  # named by TensorCores: 64 chips
    assert (v5p.devices, v5p.devices_per_node, v5p.topology) == (64, 64, (4, 4, 4))
    assert v5p.peak_flops == 459e12 and v5p.ici_link_bandwidth * 2 * 6 == 1200e9
    two = am.Cluster.preset("tpu-v5p", topology="4x4x4", slices=2)
    assert (two.devices, two.nodes, two.slices) == (128, 2, 2)
    assert am.Cluster.preset("tpu-v5e", devices=16).topology == (4, 4)  # Google's v5e-16
    assert am.Cluster.preset("tpu-v6e", topology="v6e-32").topology == (4, 8)
    assert am.Cluster.preset("tpu-v5p", devices=4).topology == (2, 2, 1)
    assert am.Cluster.preset("tpu-v5p", devices=48).topology == ()  # no such slice: flat
    assert v5p.with_devices(16).topology == (2, 2, 4)  # a pipeline stage's sub-slice
    assert am.Cluster.from_dict(json.loads(json.dumps(two.to_dict()))) == two
    with pytest.raises(am.ClusterError, match="are 64 chips, not 8: give --devices 64"):
        am.Cluster.preset("tpu-v5p", devices=8, topology="4x4x4")
    with pytest.raises(am.ClusterError, match="not a v5e slice topology"):
        am.Cluster.preset("tpu-v5e", topology="4x4x4")
    with pytest.raises(am.ClusterError, match="is a v5p slice, not a v6e one"):
        am.Cluster.preset("tpu-v6e", topology="v5p-128")
