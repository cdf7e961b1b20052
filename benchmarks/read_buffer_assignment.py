"""XLA's buffer assignment read back from a dump: the bytes live in the temporary
allocation at each step of the schedule, summed by their offsets, and what is live at the
busiest step.

`memory_analysis()` gives the temporary allocation's size, not what fills it. The dump's
live-range file has a section "Live ranges at N (peak)", but that is the peak of a
simulation that counts every value apart, not the allocation XLA laid out: sum the values
by their offsets instead (values at overlapping offsets are one buffer, an in-place update
or a collective's result written over its operand). Where the union of the live values'
offsets at one step is close to the allocation's size, XLA wastes nothing between its
buffers, and a cost model that prices less than the allocation is missing buffers, not
heap packing.

    XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_step" \
        python benchmarks/bench_recipe_memory.py --hidden 64 --dtypes bfloat16 --target a100
    python benchmarks/read_buffer_assignment.py DIR               # the busiest step
    python benchmarks/read_buffer_assignment.py DIR --at 544 --min-bytes 65536

(or `jax.jit(f).lower(*args).compile(compiler_options={"xla_dump_to": DIR,
"xla_dump_hlo_as_text": True})` for one program). With several programs in DIR,
`--module` picks one by name (default: the one with the largest temporary allocation).

On a TPU dump it reads the chip's VMEM too (the temporary allocation of color 1, where
XLA's memory-space assignment moves values out of HBM): what it holds at HBM's busiest
step, and the step where the two memories together hold most, which is what a cost model
that prices one memory for every buffer should be held against (`apart`: a VMEM copy of
a value HBM still holds counts once; one whose HBM source is dead, a move, counts).

`--matmuls` lists instead the schedule's steps that run a matmul, with what each writes:
where each weight gradient runs, with its layer's backward or after the whole
input-gradient chain (docs/DESIGN.md, "TPU slices"):

    XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_step" \
        automap verify plan.json --target v5p:2x2x1
    python benchmarks/read_buffer_assignment.py DIR --matmuls

It also says how many of the live bytes wait for a matmul that writes float32 and runs
later: on a 16-bit program, XLA's GPU compiles a small weight gradient (a contraction over
batch and sequence) as float32 partial products over slices of the contraction, reduced by
a kernel of their own (split-K), and its memory scheduler, which runs next whichever ready
instruction frees the most bytes net of those it writes, runs such a matmul late, often
just before the step's combined gradient reduction, holding its operands until then.
What that explained on `bench_recipe_memory.py --target a100`'s recomputed bf16 recipes
is in docs/DESIGN.md ("A scheduled step's peak").
"""

import argparse
import dataclasses
import re
from pathlib import Path

SUFFIX = "after_optimizations-buffer-assignment.txt"
_VALUE = re.compile(r" value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (.*)")
_RANGE = re.compile(r"\s+(\S+):(\d+)-(\d+)$")
_STEP = re.compile(r"\s+(\d+):(\S+)$")
_COLOR = re.compile(r", color (\d+),")  # an allocation's memory space (without one: HBM)
VMEM = 1  # XLA's TPU: the chip's vector memory, where memory-space assignment moves values
_FLOAT32_GEMM = re.compile(r"^\s*(?:ROOT )?%(\S+) = f32\[[^\n]*?calls=%gemm_fusion", re.M)


@dataclasses.dataclass(frozen=True)
class Value:
    """One value of the temporary allocation: its bytes at an offset, from its first step
    to its last in the schedule."""

    name: str
    offset: int
    size: int
    shape: str
    start: int
    end: int


@dataclasses.dataclass(frozen=True)
class Assignment:
    """A program's temporary allocation, its values and its schedule (instruction names)."""

    temp_size: int
    values: tuple[Value, ...]
    schedule: tuple[str, ...]
    float32_gemms: frozenset[str]  # matmul fusions that write float32
    program: str = ""  # the optimized HLO's text, where it was dumped beside

    def live(self, step: int) -> list[Value]:
        return [v for v in self.values if v.start <= step <= v.end]

    def live_bytes(self, step: int) -> int:
        """The bytes live at `step`: the union of the live values' offset ranges."""
        total, lo, hi = 0, -1, -1
        for v in sorted(self.live(step), key=lambda v: v.offset):
            if v.offset > hi:
                total += hi - lo
                lo, hi = v.offset, v.offset + v.size
            else:
                hi = max(hi, v.offset + v.size)
        return total + hi - lo

    def busiest(self) -> tuple[int, int]:
        """(step, bytes) of the step with the most bytes live."""
        steps = range(max((v.end for v in self.values), default=0) + 1)
        return max(((t, self.live_bytes(t)) for t in steps), key=lambda s: s[1], default=(0, 0))

    def waiting_for_float32_gemms(self, step: int) -> int:
        """Bytes live at `step` whose last reader is a matmul writing float32 that runs later
        (on a 16-bit program: a contraction XLA split into float32 partials)."""
        later = [v for v in self.live(step) if v.end > step and v.end < len(self.schedule)]
        return sum(v.size for v in later if self.schedule[v.end] in self.float32_gemms)


def together(main: Assignment, alternate: Assignment) -> tuple[int, int, int]:
    """(step, main bytes, alternate bytes) at the step where a program's temporaries in two
    memory spaces of one schedule add up to most: what it holds at once wherever XLA put
    it, which a cost model that knows one memory prices."""
    steps = range(len(main.schedule))
    step = max(steps, key=lambda t: main.live_bytes(t) + alternate.live_bytes(t), default=0)
    return step, main.live_bytes(step), alternate.live_bytes(step)


_COPY_START = re.compile(r"%(copy-start(?:\.\d+)?) = .*? copy-start\(%([\w.\-]+)\)")
_TUPLE_ELEMENT = re.compile(
    r"%(get-tuple-element(?:\.\d+)?) = \S+ get-tuple-element\(%([\w.\-]+)\), index=(\d+)"
)


def apart(main: Assignment, alternate: Assignment) -> Assignment:
    """The alternate memory's values that hold what the main memory does not at the same
    step: those made there, and a copy memory-space assignment made there (`copy-start`)
    for the steps after its source's last in the main memory's temporaries: an activation
    moved out of HBM until its backward reads it. A prefetched copy of a value HBM still
    holds, or of an argument (never in the temporaries), counts once, in HBM."""
    element = {m[0]: f"{m[1]}{{{m[2]}}}" for m in _TUPLE_ELEMENT.findall(main.program)}
    source = {dst: element.get(op, f"{op}{{}}") for dst, op in _COPY_START.findall(main.program)}
    last = {v.name: v.end for v in main.values}
    kept = []
    for v in alternate.values:
        name = v.name.split("{")[0]
        if name.startswith("copy-start"):
            if source.get(name) not in last:
                continue  # an argument's copy, or one not read: HBM holds it too
            v = dataclasses.replace(v, start=max(v.start, last[source[name]] + 1))
            if v.start > v.end:
                continue
        kept.append(v)
    return dataclasses.replace(alternate, values=tuple(kept))


def matmuls(hlo: str, schedule: tuple[str, ...]) -> list[tuple[int, str, str]]:
    """(step, instruction, result shape) of each step of the schedule that runs a matmul
    (`automap._verify.matmul_instructions`): which weight gradients run where."""
    from automap._verify import matmul_instructions

    made = matmul_instructions(hlo) if hlo else {}
    return [(t, name, made[name]) for t, name in enumerate(schedule) if name in made]


def _temp_values(text: str, space: int = 0) -> tuple[int, list[tuple[str, int, int, str]]]:
    """(size, [(value, offset, size, shape)]) of the preallocated temporary allocation in
    memory space `space` (0: the device's main memory). XLA's TPU lays a temporary
    allocation per memory space ("color 1": the chip's VMEM, where its memory-space
    assignment moves values; others for its scalar memories), each from offset 0: only
    the default space's is HBM, and each space's values are summed by offset apart."""
    size, values, inside = 0, [], False
    for line in text.splitlines():
        if line.startswith("allocation"):
            color = _COLOR.search(line)
            inside = "preallocated-temp" in line and int(color.group(1) if color else 0) == space
            if inside:
                size = int(re.search(r"size (\d+)", line).group(1))
        elif inside and (m := _VALUE.match(line)):
            name = m.group(1) if "{" in m.group(1) else m.group(1) + "{}"
            values.append((name, int(m.group(3)), int(m.group(2)), m.group(4)))
    return size, values


def _schedule_and_ranges(text: str) -> tuple[list[str], dict[str, tuple[int, int]]]:
    """The instruction sequence and each value's live range, from the live-range file."""
    schedule: list[str] = []
    ranges: dict[str, tuple[int, int]] = {}
    section = None
    for line in text.splitlines():
        if line.strip() in ("InstructionSequence:", "BufferLiveRange:"):
            section = line.strip()
        elif line.strip().startswith("Live ranges at"):
            break
        elif section == "InstructionSequence:" and (m := _STEP.match(line)):
            schedule.append(m.group(2))
        elif section == "BufferLiveRange:" and (m := _RANGE.match(line)):
            ranges[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    return schedule, ranges


def read(dump: Path, module: str | None = None, space: int = 0) -> Assignment:
    """The buffer assignment of one program dumped in `dump` (`module`: a part of its file
    name; default the program with the largest temporary allocation in HBM), its
    temporaries in memory space `space` (0: HBM; `VMEM` on a TPU)."""
    files = sorted(f for f in Path(dump).glob(f"*{SUFFIX}") if (module or "") in f.name)
    if not files:
        raise SystemExit(
            f"no *{SUFFIX} in {dump}{f' for {module!r}' if module else ''}: compile with "
            "XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text"
        )
    temps = {f: _temp_values(f.read_text()) for f in files}
    path = max(files, key=lambda f: temps[f][0])
    size, raw = temps[path] if space == 0 else _temp_values(path.read_text(), space)
    schedule, ranges = _schedule_and_ranges(
        path.with_name(path.name.replace("-buffer-assignment.txt", "-live-range.txt")).read_text()
    )
    hlo = path.with_name(path.name.replace("-buffer-assignment.txt", ".txt"))
    program = hlo.read_text() if hlo.exists() else ""
    gemms = frozenset(_FLOAT32_GEMM.findall(program))
    values = tuple(
        Value(name, offset, nbytes, shape, *ranges[name])
        for name, offset, nbytes, shape in raw
        if name in ranges
    )
    return Assignment(size, values, tuple(schedule), gemms, program)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dump", type=Path, help="the --xla_dump_to folder")
    parser.add_argument("--module", help="a part of the program's dump file name")
    parser.add_argument("--at", type=int, help="the step to show (default: the busiest)")
    parser.add_argument("--min-bytes", type=int, default=4096, help="smallest value shown")
    parser.add_argument("--matmuls", action="store_true", help="list the matmuls by step")
    opts = parser.parse_args(argv)
    a = read(opts.dump, opts.module)
    if opts.matmuls:
        for t, instruction, shape in matmuls(a.program, a.schedule):
            print(f"  step {t:>6}  {instruction:<40} {shape[:72]}")
        return
    step, peak = a.busiest()
    at = step if opts.at is None else opts.at
    name = a.schedule[at] if at < len(a.schedule) else "?"
    print(f"temporary allocation {a.temp_size} B; busiest step {step}: {peak} B live "
          f"({peak / max(a.temp_size, 1):.3f} of it)")  # fmt: skip
    vmem = read(opts.dump, opts.module, VMEM)
    if vmem.values:
        both, main_bytes, vmem_bytes = together(a, apart(a, vmem))
        print(f"VMEM (color {VMEM}): {vmem.live_bytes(step)} B live at step {step}, "
              f"{vmem.busiest()[1]} B at its busiest; both memories at once: {main_bytes} "
              f"+ {vmem_bytes} B at step {both}, VMEM's copies of what HBM still holds "
              "counted once")  # fmt: skip
    wait = a.waiting_for_float32_gemms(at)
    print(f"step {at} ({name}): {a.live_bytes(at)} B live, {wait} B of it waiting for a "
          "later matmul that writes float32")  # fmt: skip
    for v in sorted(a.live(at), key=lambda v: v.offset):
        if v.size >= opts.min_bytes:
            maker = a.schedule[v.start] if v.start < len(a.schedule) else ""
            print(f"  offset {v.offset:>11} {v.size:>11} B  steps {v.start}-{v.end}  "
                  f"{maker:<36} {v.name:<40} {v.shape[:48]}")  # fmt: skip


if __name__ == "__main__":
    main()
