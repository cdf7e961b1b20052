"""benchmarks/read_buffer_assignment.py reads back what XLA dumps of a compiled program."""

import jax
import jax.numpy as jnp
import pytest

from _scripts import load_script

reader = load_script("read_buffer_assignment")


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    """A small program compiled with its buffer assignment dumped, and its memory stats."""
    out = tmp_path_factory.mktemp("dump")

    def step(x, w):
        h = jnp.tanh(x @ w)
        return (h @ w.T).sum() + jnp.exp(h).sum()

    args = (jnp.ones((64, 128)), jnp.ones((128, 256)))
    options = {"xla_dump_to": str(out), "xla_dump_hlo_as_text": True}
    compiled = jax.jit(step).lower(*args).compile(compiler_options=options)
    return out, compiled.memory_analysis()


def test_the_temporary_allocation_is_read_with_its_values(dumped):
    out, stats = dumped
    a = reader.read(out)
    assert a.temp_size == stats.temp_size_in_bytes > 0
    # every value lies in the allocation, and the allocation is as wide as they reach
    assert max(v.offset + v.size for v in a.values) == a.temp_size
    step, peak = a.busiest()
    assert 0 < peak <= a.temp_size
    assert peak == max(a.live_bytes(t) for t in range(len(a.schedule)))
    assert a.schedule[step] and all(v.start <= v.end for v in a.values)


def test_the_matmuls_are_listed_in_schedule_order(dumped, capsys):
    # where each matmul runs: on a TPU, whether a weight gradient runs with its layer's
    # backward or after the whole input-gradient chain (docs/DESIGN.md, "TPU slices")
    out, _ = dumped
    a = reader.read(out)
    found = reader.matmuls(a.program, a.schedule)
    assert len(found) == 2 and found[0][2].startswith("f32[64,256]")  # x @ w, then h @ w.T
    assert found[0][0] < found[1][0] and all(a.schedule[t] == name for t, name, _ in found)
    reader.main([str(out), "--matmuls"])
    assert f"step {found[1][0]:>6}  {found[1][1]}" in capsys.readouterr().out


def test_values_at_one_offset_count_once():
    def value(offset, size, start, end):
        return reader.Value(f"v{offset}", offset, size, "f32[]", start, end)

    # an in-place update: two values share offset 0 at step 1
    a = reader.Assignment(
        96, (value(0, 64, 0, 1), value(0, 64, 1, 2), value(64, 32, 1, 3)), ("a", "b", "c", "d"),
        frozenset({"d"}),
    )  # fmt: skip
    assert [a.live_bytes(t) for t in range(4)] == [64, 96, 96, 32]
    assert a.busiest() == (1, 96)
    assert a.waiting_for_float32_gemms(1) == 32  # read last by "d", a float32 matmul


def test_a_folder_without_a_dump_says_how_to_make_one(tmp_path):
    with pytest.raises(SystemExit, match="xla_dump_to"):
        reader.read(tmp_path)


def test_only_the_main_memorys_temporaries_are_read(tmp_path):
    # XLA's TPU dumps a temporary allocation per memory space, each from offset 0: the
    # chip's VMEM ("color 1") holds what memory-space assignment moved there, not HBM
    name = "module_0000.jit_step.after_optimizations"
    (tmp_path / f"{name}-buffer-assignment.txt").write_text(
        "BufferAssignment:\n"
        "allocation 0: size 3072, preallocated-temp:\n"
        " value: <2 a @0> (size=2048,offset=0): f32[512]{0}\n"
        " value: <3 b @0> (size=1024,offset=2048): f32[256]{0}\n"
        "allocation 1: size 8192, color 1, preallocated-temp:\n"
        " value: <4 c @0> (size=8192,offset=0): f32[2048]{0:S(1)}\n"
    )
    (tmp_path / f"{name}-live-range.txt").write_text(
        "HloLiveRange (max 2):\n  InstructionSequence:\n    0:a\n    1:b\n    2:c\n"
        "  BufferLiveRange:\n    a{}:0-1\n    b{}:1-2\n    c{}:0-2\n"
    )
    a = reader.read(tmp_path)
    assert a.temp_size == 3072
    assert [v.name for v in a.values] == ["a{}", "b{}"]
    assert a.busiest() == (1, 3072)  # VMEM's 8192 bytes at offset 0 are not HBM's


def test_vmem_is_read_apart_and_with_hbm_at_one_step(tmp_path, capsys):
    # what the program holds in both memories at once: HBM's busiest step is not always
    # where the two together peak
    name = "module_0000.jit_step.after_optimizations"
    (tmp_path / f"{name}-buffer-assignment.txt").write_text(
        "BufferAssignment:\n"
        "allocation 0: size 3072, preallocated-temp:\n"
        " value: <2 a @0> (size=2048,offset=0): f32[512]{0}\n"
        " value: <3 b @0> (size=3072,offset=0): f32[768]{0}\n"
        "allocation 1: size 8192, color 1, preallocated-temp:\n"
        " value: <4 c @0> (size=8192,offset=0): f32[2048]{0:S(1)}\n"
    )
    (tmp_path / f"{name}-live-range.txt").write_text(
        "HloLiveRange (max 2):\n  InstructionSequence:\n    0:a\n    1:b\n    2:c\n"
        "  BufferLiveRange:\n    a{}:0-0\n    b{}:1-2\n    c{}:0-0\n"
    )
    hbm, vmem = reader.read(tmp_path), reader.read(tmp_path, space=reader.VMEM)
    assert hbm.busiest() == (1, 3072)
    assert (vmem.temp_size, [v.name for v in vmem.values]) == (8192, ["c{}"])
    assert [vmem.live_bytes(t) for t in range(3)] == [8192, 0, 0]
    assert reader.together(hbm, vmem) == (0, 2048, 8192)
    reader.main([str(tmp_path)])
    said = capsys.readouterr().out
    assert "VMEM (color 1): 0 B live at step 1, 8192 B at its busiest" in said
    assert "both memories at once: 2048 + 8192 B at step 0" in said


def test_a_vmem_copy_counts_apart_from_hbm_only_once_its_source_is_dead():
    # memory-space assignment moves an activation out of HBM into VMEM until its backward
    # reads it (its HBM source dies at the copy), and prefetches copies of values HBM
    # still holds or of arguments (never in the temporaries): only the move is VMEM's own
    def value(name, offset, size, start, end):
        return reader.Value(name, offset, size, "bf16[]", start, end)

    program = (
        "  %get-tuple-element.1 = bf16[256]{0} get-tuple-element(%fusion.7), index=1\n"
        "  %copy-start.1 = (bf16[256]{0:S(1)}, bf16[256]{0}, u32[]) copy-start(%get-tuple-element.1)\n"
        "  %copy-start.2 = (bf16[256]{0:S(1)}, bf16[256]{0}, u32[]) copy-start(%fusion.8)\n"
        "  %copy-start.3 = (bf16[256]{0:S(1)}, bf16[256]{0}, u32[]) copy-start(%param.0)\n"
    )
    hbm = reader.Assignment(
        1024, (value("fusion.7{1}", 0, 512, 0, 2), value("fusion.8{}", 512, 512, 0, 9)),
        tuple("abcdefghij"), frozenset(), program,
    )  # fmt: skip
    vmem = reader.Assignment(
        1536,
        (
            value("copy-start.1{0}", 0, 512, 1, 8),  # moved: HBM's source dies at step 2
            value("copy-start.2{0}", 512, 512, 3, 5),  # a prefetch: fusion.8 lives to 9
            value("copy-start.3{0}", 1024, 512, 0, 9),  # an argument's copy
            value("fusion.9{}", 1024, 256, 6, 7),  # made in VMEM
        ),
        tuple("abcdefghij"), frozenset(),
    )  # fmt: skip
    own = reader.apart(hbm, vmem)
    assert [(v.name, v.start, v.end) for v in own.values] == [
        ("copy-start.1{0}", 3, 8),
        ("fusion.9{}", 6, 7),
    ]
    assert reader.together(hbm, own) == (6, 512, 768)
