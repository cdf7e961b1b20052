"""Read a compiled program's schedule: which collectives XLA runs asynchronously, and what
compute it scheduled to run while each one is in flight.

A scheduled HLO module (`is_scheduled=true`, what `compiled.as_text()` prints) lists each
computation's instructions in the order they run. An asynchronous collective is a pair,
`all-gather-start` ... `all-gather-done` (or a generic `async-start` / `async-done` whose
called computation holds the collective); whatever compute sits between the two runs
while the collective moves its bytes, so only the part of the collective's time that
outlasts that compute is on the critical path. A collective printed as one instruction
(`all-reduce(...)`) runs synchronously: nothing overlaps it.

What was read with this (issue 27, item 5; jax 0.10.2, a 2-layer GPT at hidden 256,
ZeRO-3 over 4 v5p chips or 8 A100s, `tests/test_schedule.py`):

- XLA's TPU compiler (libtpu 0.0.42.1, compile-only, default flags) printed every
  collective synchronous: no start/done pair, nothing overlapped (also a 4-layer Llama
  at hidden 1024 under ZeRO-3 on v5p 2x2x2: 97 collectives, none asynchronous). With
  MaxText's flags (`--xla_tpu_enable_async_collective_fusion=true`, `..._fuse_all_gather`,
  `..._multiple_steps`, `--xla_tpu_overlap_compute_collective_tc`,
  `--xla_enable_async_all_gather`; in `LIBTPU_INIT_ARGS` or as `compile(compiler_options=)`)
  each layer gather runs as a chain of async collective fusions (`async-collective-start`
  ... `async-collective-done`, a matmul fusion between carrying it on), read here as one
  collective in flight from the chain's first step to its last (`_fusion_chains`): that
  Llama's 54 chained gathers all had compute inside, 236 of its 277 MB gathered, with 70
  of the step's 119 matmuls. The runtime now compiles TPU programs with these flags
  (`_run/_compiler.py`); each chain's window holds the matmul reading the weight gathered
  before it ("one weight ahead"), which `Lowering.tpu()` prices (`_cost/_overlap.py`).
- XLA's GPU compiler (compile-only A100s) makes every collective a start/done pair, but
  its default scheduler puts most dones right after their starts: compute sat inside
  pairs holding 56% of the gathers' bytes and 38% of the reduce-scatters', mostly
  elementwise; matmuls inside two pairs only, 0.20 GFLOP of the step's 2.85 per device.
  With the latency-hiding scheduler (`xla_gpu_enable_latency_hiding_scheduler`) 33% and
  36% of those bytes, 0.34 GFLOP of matmuls.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping

from ._hlo import (
    HloCollective,
    Instruction,
    axis_of,
    computations,
    fused_collective_step,
    parse_collectives,
    shape_bytes,
)

# Instructions that move or name data without computing: they hide no collective's time.
_NOT_COMPUTE = frozenset(
    {
        "parameter",
        "constant",
        "get-tuple-element",
        "tuple",
        "bitcast",
        "copy-start",
        "copy-done",
        "opt-barrier",
        "after-all",
        "partition-id",
        "replica-id",
        "add-dependency",
    }
)
_MATMUL_OPS = frozenset({"dot", "convolution"})
# What runs inside one collective's window: compute instructions, matmuls, dot FLOPs, bytes
# written, and of those the matmuls' (`ScheduledCollective`'s fields of those names).
_Span = tuple[int, int, float, float, float]
_NOTHING: _Span = (0, 0, 0.0, 0.0, 0.0)
_CALLS = re.compile(r"\b(?:calls|to_apply)=(%?[\w.\-]+)")
_OPERAND = re.compile(r"\s*%?([\w.\-]+)")
_DIMS = re.compile(r"\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class ScheduledCollective:
    """One collective of the compiled program and what the schedule runs beside it."""

    collective: HloCollective
    asynchronous: bool  # a start/done pair (else one synchronous instruction)
    between: int = 0  # compute instructions scheduled between its start and its done
    matmuls: int = 0  # of those, matmuls and convolutions (or fusions holding one)
    flops: float = 0.0  # the dots' and convolutions' FLOPs among them (library calls: 0)
    written: float = 0.0  # bytes their results hold (an elementwise op's traffic is ~2x)
    # where it starts in the entry computation's schedule (the index of its instruction,
    # its start, its chain's first step, or the fusion calling it); -1 in a loop's body
    position: int = -1
    matmul_written: float = 0.0  # of `written`, what the matmuls among them write

    @property
    def overlapped(self) -> bool:
        """Whether any compute runs while the collective is in flight."""
        return self.between > 0

    def compute_s(self, flop_rate: float, byte_rate: float) -> float:
        """Seconds of the compute inside at these rates, as the cost model prices an op
        (`_cost/_compute.py`: max of its FLOPs' and its bytes' time): the matmuls' FLOPs
        or their results' bytes, whichever is longer, then every other op's written bytes,
        read back (~2x)."""
        matmuls = max(self.flops / flop_rate, 2 * self.matmul_written / byte_rate)
        return matmuls + 2 * (self.written - self.matmul_written) / byte_rate


def scheduled_collectives(
    hlo_text: str, num_devices: int | None = None
) -> list[ScheduledCollective]:
    """Every collective of a compiled module (`_hlo.parse_collectives`, same names, bytes
    and counts), with the compute its schedule places between its start and done."""
    comps, entry = computations(hlo_text)
    flops = _dot_flops(comps)
    with_matmul = _with_matmul(comps, flops)
    spans: dict[str, _Span] = {}
    position: dict[str, int] = {}  # in the entry: what a fusion or an async pair calls, there
    for k, ins in enumerate(comps[entry]):
        position.setdefault(ins[0], k)
        for callee in _callees(ins, comps):
            for inner in comps[callee]:
                position.setdefault(inner[0], k)
    starts: dict[str, str] = {}  # an asynchronous collective's name -> its start's
    for instrs in comps.values():
        index = {ins[0]: k for k, ins in enumerate(instrs)}
        shapes = {ins[0]: ins[1] for ins in instrs}

        def span(first: int, last: int, instrs=instrs, shapes=shapes) -> _Span:
            return _span(instrs[first + 1 : last], shapes, comps, with_matmul, flops)

        for k, (name, _, opcode, rest, _) in enumerate(instrs):
            start = _OPERAND.match(rest)
            if not opcode.endswith("-done") or not start or start.group(1) not in index:
                continue
            s = index[start.group(1)]
            spans[name] = span(s, k)  # `kind-done`: parse_collectives names the pair by it
            starts[name] = instrs[s][0]
            for callee in _callees(instrs[s], comps):  # `async-start`: by what it calls
                for inner in comps[callee]:
                    spans[inner[0]] = span(s, k)
                    starts[inner[0]] = instrs[s][0]
        for first, last, collective in _fusion_chains(instrs, comps).values():
            spans[collective] = span(first, last)
            starts[collective] = instrs[first][0]
    return [
        ScheduledCollective(
            c,
            c.name in spans,
            *spans.get(c.name, _NOTHING)[:4],
            position.get(starts.get(c.name, c.name), -1),
            spans.get(c.name, _NOTHING)[4],
        )
        for c in parse_collectives(hlo_text, num_devices)
    ]


def _span(
    window: list[Instruction],
    shapes: Mapping[str, str],
    comps: Mapping[str, list[Instruction]],
    with_matmul: set[str],
    flops: Mapping[str, float],
) -> _Span:
    """`ScheduledCollective`'s between, matmuls, flops, written and matmul_written of the
    instructions the schedule runs while a collective is in flight."""
    work = [ins for ins in window if _computes(ins)]
    matmuls = [ins for ins in work if _is_matmul(ins, with_matmul)]
    return (
        len(work),
        len(matmuls),
        sum(_own_flops(ins, shapes) + sum(flops[c] for c in _callees(ins, comps)) for ins in work),
        sum(shape_bytes(ins[1]) for ins in work),
        sum(shape_bytes(ins[1]) for ins in matmuls),
    )


def _fusion_chains(
    instrs: list[Instruction], comps: Mapping[str, list[Instruction]]
) -> dict[str, tuple[int, int, str]]:
    """XLA TPU's async collective fusions among one computation's instructions: per chain
    (channel id), the positions of its first and last step in the schedule and the name
    of the collective its first step holds (the one `parse_collectives` counts). What the
    schedule places between the two, the chain's middle steps included (a matmul fusion
    carrying the collective on), runs while it is in flight."""
    chains: dict[str, tuple[int, int, str]] = {}
    for k, ins in enumerate(instrs):
        for callee in _callees(ins, comps):
            for inner in comps[callee]:
                if not (step := fused_collective_step(inner[4])):
                    continue
                channel, first = step
                begin, _, name = chains.get(channel, (k, k, ""))
                chains[channel] = (begin, k, inner[0] if first else name)
    return {c: chain for c, chain in chains.items() if chain[2]}


def overlapped_bytes(
    scheduled: Iterable[ScheduledCollective], mesh: Mapping[str, int]
) -> dict[str, tuple[float, float]]:
    """Per "kind@axis" (`_hlo.comm_bytes`' keys): (bytes of the collectives some compute
    overlaps, all bytes), summed over every occurrence; no-op collectives dropped."""
    out: dict[str, tuple[float, float]] = {}
    for s in scheduled:
        c = s.collective
        axis = axis_of(c.kind, c.groups, mesh)
        if not axis:
            continue
        key = f"{c.kind}@{axis}"
        hidden, total = out.get(key, (0.0, 0.0))
        nbytes = c.bytes * c.count
        out[key] = (hidden + (nbytes if s.overlapped else 0.0), total + nbytes)
    return out


def matmul_instructions(hlo_text: str) -> dict[str, str]:
    """The entry computation's instructions that run a matmul, in themselves or in what
    they call (a fusion, an asynchronous collective fused with the work it overlaps), each
    with its result's shape: where a compiled schedule runs its matmuls."""
    comps, entry = computations(hlo_text)
    with_matmul = _with_matmul(comps, _dot_flops(comps))
    return {ins[0]: ins[1] for ins in comps[entry] if _is_matmul(ins, with_matmul)}


def _with_matmul(comps: Mapping[str, list[Instruction]], flops: Mapping[str, float]) -> set[str]:
    """Computations holding a matmul: a dot (however deep its fusion nests it) or a
    convolution (XLA's TPU writes matmuls as convolutions)."""
    return {c for c, ins in comps.items() if flops[c] or any(i[2] in _MATMUL_OPS for i in ins)}


def _computes(ins: Instruction) -> bool:
    opcode = ins[2]
    return not (opcode in _NOT_COMPUTE or opcode.endswith("-start") or opcode.endswith("-done"))


def _is_matmul(ins: Instruction, with_matmul: set[str]) -> bool:
    """A dot or convolution, a fusion calling one, or a library GEMM / convolution."""
    _, _, opcode, _, line = ins
    if opcode in _MATMUL_OPS:
        return True
    if opcode == "custom-call":
        return bool(re.search(r'custom_call_target="[^"]*(gemm|cublas|conv)', line, re.I))
    return any(c.lstrip("%") in with_matmul for c in _CALLS.findall(line))


def _callees(ins: Instruction, comps: Mapping[str, list[Instruction]]) -> list[str]:
    return [c.lstrip("%") for c in _CALLS.findall(ins[4]) if c.lstrip("%") in comps]


def _dot_flops(comps: Mapping[str, list[Instruction]]) -> dict[str, float]:
    """Per computation, the FLOPs of the dots it holds, those of the computations it
    calls included (each once: a loop body's trips are not counted)."""
    memo: dict[str, float] = {}

    def of(comp: str) -> float:
        if comp not in memo:
            memo[comp] = 0.0  # a guard against a cycle; HLO has none
            shapes = {ins[0]: ins[1] for ins in comps[comp]}
            memo[comp] = sum(
                _own_flops(ins, shapes) + sum(of(c) for c in _callees(ins, comps))
                for ins in comps[comp]
            )
        return memo[comp]

    for c in comps:
        of(c)
    return memo


def _own_flops(ins: Instruction, shapes: Mapping[str, str]) -> float:
    """A dot's FLOPs: 2 x its result's elements x the contracted size of its lhs; a
    convolution's (XLA's TPU writes matmuls as convolutions): 2 x its result's elements x
    its kernel's elements per output feature (exact for a matmul's window of 1; a
    dilated window's zero taps are counted too)."""
    _, shape, opcode, rest, line = ins
    if opcode == "convolution":
        return _conv_flops(shape, rest, line, shapes)
    if opcode != "dot":
        return 0.0
    lhs = _OPERAND.match(rest)
    dims = _dims(shapes.get(lhs.group(1), "")) if lhs else []
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)
    k = math.prod(dims[int(d)] for d in contracting.group(1).split(",") if d) if contracting else 1
    return 2.0 * math.prod(_dims(shape)) * k


def _dims(shape: str) -> list[int]:
    m = _DIMS.search(shape)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _conv_flops(shape: str, rest: str, line: str, shapes: Mapping[str, str]) -> float:
    operands = re.findall(r"%?([\w.\-]+)", rest.split(")")[0])
    labels = re.search(r"dim_labels=\w+_(\w+)->", line)
    kernel = _dims(shapes.get(operands[1], "")) if len(operands) > 1 else []
    if not labels or len(kernel) != len(labels.group(1)) or "o" not in labels.group(1):
        return 0.0
    per_output = math.prod(kernel) / max(kernel[labels.group(1).index("o")], 1)
    return 2.0 * math.prod(_dims(shape)) * per_output
