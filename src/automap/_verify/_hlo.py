"""Read the collectives XLA really inserted from partitioned HLO text.

`jax.jit(f, in_shardings=...).lower(*abstract).compile().as_text()` is the program after
the SPMD partitioner; its collectives are the ground truth the cost model is held against
(`_compiled.py`). Bytes follow the convention of docs/DESIGN.md (per device, per occurrence):
all-reduce the buffer, all-gather the result, reduce-scatter the operand, all-to-all and
collective-permute the operand; a tuple counts the sum of its parts, once.

Replica groups print in several forms, all seen with jax 0.10 on the CPU and all handled:
explicit `{{0,1,2,3},{4,5,6,7}}`, iota `[2,4]<=[8]` / `[4,2]<=[2,4]T(1,0)`, and mesh form
`mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`, optionally with `device_ids=([2,4]T(1,0))`.
Each is turned into explicit device-id groups and then mapped onto the plan's mesh axes.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

# Bytes per element of every HLO primitive type; sub-byte types count fractional bytes.
_DTYPE_BYTES: dict[str, float] = {
    "pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0, "opaque": 0,
}  # fmt: skip

_COMP_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*->.*\{\s*$")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([<=\d,]*)\]")
_CALLEE = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation|"
    r"branch_computations)=(\{[^}]*\}|%?[\w.\-]+)"
)
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
# XLA TPU's async collective fusion (`xla_tpu_enable_async_collective_fusion`, MaxText's
# flags; libtpu 0.0.42.1): a collective runs as a chain of fusions over the schedule, each
# holding the whole collective and the step it is at ("flag_start", -1 on the first).
_FUSED_STEP = re.compile(r'"async_collective_fusion_config":\{"flag_start":"(-?\d+)"')
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")
_EXPLICIT = re.compile(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}")
_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH = re.compile(
    r"replica_groups=mesh\[([^\]]*)\]"
    r"(?:,\s*device_ids=\((\[[\d,]+\](?:T\([\d,]+\))?|[\d,\s]+)\))?"
    r"\s*\{([^}]*)\}"
)
# XLA's SPMD partitioner writes a matmul whose result it reduce-scatters ("rs"), or
# whose operand it all-gathers ("ag"), as a windowed einsum: a while loop of matmuls on
# blocks, passing partial sums (or operand blocks) round the group by collective-permutes
# (seen on TPU, libtpu 0.0.42.1: a ZeRO gradient of a model-sharded kernel).
_WINDOWED = re.compile(r"windowed_dot_general_body_(rs|ag)\b")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


@dataclasses.dataclass(frozen=True)
class HloCollective:
    """One collective instruction of the compiled program."""

    name: str  # HLO instruction name, e.g. "all-reduce.3"
    kind: str  # one of KINDS (async -start/-done pairs are one collective)
    bytes: float  # per device, per occurrence, by the DESIGN.md convention
    # Device-id groups; for collective-permute, the (source, target) pairs.
    groups: tuple[tuple[int, ...], ...]
    count: int = 1  # occurrences per step (trip count of enclosing while loops)
    shape: str = ""  # the result shape as printed
    op_name: str = ""  # the JAX op it came from (metadata), for finding where it comes from


def dtype_bytes(dtype: str) -> float:
    if dtype in _DTYPE_BYTES:
        return _DTYPE_BYTES[dtype]
    if dtype.startswith("f8") or dtype.startswith("f4") or dtype.startswith("f6"):
        return int(dtype[1]) / 8  # f8e4m3fn, f8e5m2, f4e2m1fn, ...
    raise ValueError(f"unknown HLO element type {dtype!r}")


def shape_bytes(shape: str) -> float:
    """Bytes of an HLO shape; a tuple is the sum of its parts (layouts are ignored)."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        n = math.prod(int(d.lstrip("<=")) for d in dims.split(",") if d)
        total += n * dtype_bytes(dtype)
    return total


def _iota(dims: list[int], perm: list[int] | None = None) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose(perm) if perm else ids


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.replace(" ", "").split(",") if x]


def parse_replica_groups(line: str, num_devices: int) -> tuple[tuple[int, ...], ...]:
    """Explicit device-id groups of one instruction line, whatever form XLA printed."""
    if m := _PAIRS.search(line):
        return tuple(tuple(_ints(p)) for p in re.findall(r"\{(\d+,\d+)\}", m.group(1)))
    if m := _IOTA.search(line):
        shape = _ints(m.group(1))
        perm = _ints(m.group(3)) if m.group(3) else None
        ids = _iota(_ints(m.group(2)), perm).reshape(shape)
        return tuple(tuple(int(x) for x in row) for row in ids)
    if m := _MESH.search(line):
        return _mesh_groups(m.group(1), m.group(2), m.group(3))
    if m := _EXPLICIT.search(line):
        groups = tuple(tuple(_ints(g)) for g in re.findall(r"\{([\d,\s]*)\}", m.group(1)))
        if groups:
            return groups
    # No groups printed (or `{}`): one group of every device.
    return (tuple(range(num_devices)),)


def _mesh_groups(axes_text: str, ids_text: str | None, kept_text: str) -> tuple:
    """Groups of the mesh form: devices that differ only along the axes in braces."""
    names = re.findall(r"'([^']+)'=(\d+)", axes_text)
    sizes = [int(s) for _, s in names]
    if ids_text is None:
        ids = np.arange(math.prod(sizes))
    elif ids_text.startswith("["):
        m = re.match(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", ids_text)
        assert m is not None
        ids = _iota(_ints(m.group(1)), _ints(m.group(2)) if m.group(2) else None)
    else:
        ids = np.array(_ints(ids_text))
    # Split sub-axes `'a':(k)m` (size m after a pre-size k) into their own dimensions.
    dims: list[int] = []
    labels: list[str] = []
    subs = dict.fromkeys((n for n, _ in names), None)
    for ref in re.findall(r"'([^']+)'(?::\((\d+)\)(\d+))?", kept_text):
        subs[ref[0]] = (int(ref[1]), int(ref[2])) if ref[1] else subs[ref[0]] or "whole"
    for (name, _), size in zip(names, sizes, strict=True):
        sub = subs[name]
        if isinstance(sub, tuple):
            pre, m = sub
            dims += [pre, m, size // (pre * m)]
            labels += ["", name, ""]
        else:
            dims.append(size)
            labels.append(name if sub == "whole" else "")
    grid = ids.reshape(dims)
    kept = [i for i, lab in enumerate(labels) if lab]
    rest = [i for i in range(len(dims)) if i not in kept]
    rows = grid.transpose(rest + kept).reshape(-1, math.prod(dims[i] for i in kept) if kept else 1)
    return tuple(tuple(int(x) for x in row) for row in rows)


def axis_of(kind: str, groups: tuple[tuple[int, ...], ...], mesh: Mapping[str, int]) -> str:
    """The plan's mesh axes along which a collective's devices vary, "+"-joined in mesh
    order ("" when no device talks to another: a no-op collective)."""
    names, sizes = list(mesh), list(mesh.values())
    n = math.prod(sizes)
    varying = [False] * len(names)
    for group in groups:
        members = [d for d in group if d < n]
        if len(members) != len(group):
            raise ValueError(f"device ids {group} exceed the mesh {dict(mesh)} ({n} devices)")
        if kind == "collective-permute" and group[0] == group[1]:
            continue  # a device keeping its own data moves nothing
        coords = np.array(np.unravel_index(members, sizes)) if sizes else np.zeros((0, 1))
        for i, row in enumerate(coords):
            varying[i] |= bool(np.any(row != row[0]))
    return "+".join(name for name, v in zip(names, varying, strict=True) if v)


def split_instruction(line: str) -> tuple[str, str, str, str] | None:
    """(name, shape, opcode, rest) of an instruction line, or None for other lines."""
    m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*", line)
    if not m:
        return None
    rest = line[m.end() :]
    if rest.startswith("("):  # a tuple shape: up to the matching parenthesis
        depth, end = 0, len(rest)
        for end, ch in enumerate(rest, start=1):  # noqa: B007 - `end` is used below
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                break
        shape, rest = rest[:end], rest[end:]
    else:
        shape, _, rest = rest.partition(" ")
    op = re.match(r"\s*([\w\-]+)\(", rest)
    if not op:
        return None
    return m.group(1), shape, op.group(1), rest[op.end() :]


Instruction = tuple[str, str, str, str, str]  # name, shape, opcode, rest, line


def computations(hlo_text: str) -> tuple[dict[str, list[Instruction]], str]:
    """Each computation's instructions in printed order (a scheduled module prints its
    schedule), and the ENTRY computation's name."""
    comps: dict[str, list[Instruction]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        if h := _COMP_HEADER.match(line):
            current = h.group(2)
            comps[current] = []
            entry = current if h.group(1) else entry
        elif current is not None and (parts := split_instruction(line)):
            comps[current].append((*parts, line))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text: pass compiled.as_text()")
    return comps, entry


def call_counts(comps: Mapping[str, list[Instruction]], entry: str) -> dict[str, int]:
    """How many times each computation runs per step: a while body its known trip count
    (an unknown one once), every branch of a conditional once, an async pair's body once
    (from its -start)."""
    mult: dict[str, int] = dict.fromkeys(comps, 0)

    def visit(comp: str, times: int) -> None:
        mult[comp] += times
        for _, _, opcode, _, line in comps[comp]:
            if opcode.endswith("-done"):
                continue  # an async pair calls its body once, from -start
            trip = _TRIP.search(line)
            trips = int(trip.group(1)) if trip else 1
            if not trip and opcode == "while":
                trips = _counted_trips(comps, comp, line) or 1
            for role, callee in _CALLEE.findall(line):
                for c in re.findall(r"[\w.\-]+", callee.replace("%", "")):
                    if c in comps:
                        visit(c, times * (trips if role == "body" else 1))

    visit(entry, 1)
    return mult


def _counted_trips(comps: Mapping[str, list[Instruction]], caller: str, line: str) -> int:
    """The trip count of a while loop that does not print one but counts: its condition
    `i < N` on a tuple element i that starts at a constant and its body adds a constant
    to. XLA's TPU writes its windowed einsums so (`windowed_dot_general_body_rs`, libtpu
    0.0.42.1: i from 0 by 2 to 16, four collective-permutes a turn). 0 where unread."""
    roles = {role: callee.lstrip("%") for role, callee in _CALLEE.findall(line)}
    cond, body = comps.get(roles.get("condition", "")), comps.get(roles.get("body", ""))
    if not cond or not body:
        return 0
    cond_by, body_by = {i[0]: i for i in cond}, {i[0]: i for i in body}
    caller_by = {i[0]: i for i in comps[caller]}
    root = next((i for i in cond if "ROOT" in i[4].split("=")[0]), None)
    if root is None or root[2] != "compare" or "direction=LT" not in root[3]:
        return 0
    counter, bound = (cond_by.get(n) for n in _operands(root[3])[:2])
    k, limit = _element(counter), _constant(bound, cond_by)
    step_root = next((i for i in body if "ROOT" in i[4].split("=")[0]), None)
    init = caller_by.get((_operands(line.split("while(", 1)[1]) or [""])[0])
    if k is None or limit is None or not step_root or not init or init[2] != "tuple":
        return 0
    nexts, starts = _operands(step_root[3]), _operands(init[3])
    if k >= min(len(nexts), len(starts)):
        return 0
    add, start = body_by.get(nexts[k]), _constant(caller_by.get(starts[k]), caller_by)
    if not add or add[2] != "add" or start is None:
        return 0
    terms = [body_by.get(n) for n in _operands(add[3])[:2]]
    step = next((_constant(t, body_by) for t in terms if _element(t) != k), None)
    if not step or _element(next(t for t in terms if _constant(t, body_by) is None)) != k:
        return 0
    return max(0, -(-(limit - start) // step))


def _operands(rest: str) -> list[str]:
    """The operand names of an instruction, from what follows its opcode's parenthesis."""
    return re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])


def _element(instr: Instruction | None) -> int | None:
    """k for `get-tuple-element(param), index=k`, else None."""
    if instr is None or instr[2] != "get-tuple-element":
        return None
    m = re.search(r"\bindex=(\d+)", instr[3])
    return int(m.group(1)) if m else None


def _constant(instr: Instruction | None, by_name: Mapping[str, Instruction]) -> int | None:
    """The integer a scalar `constant(n)` holds (through copies), else None."""
    while instr is not None and instr[2] == "copy":
        instr = by_name.get((_operands(instr[3]) or [""])[0])
    if instr is None or instr[2] != "constant":
        return None
    m = re.match(r"\s*(-?\d+)\)", instr[3])
    return int(m.group(1)) if m else None


def fused_collective_step(line: str) -> tuple[str, bool] | None:
    """(channel id, whether it is the first step) of a collective XLA's TPU runs as an
    async collective fusion chain, None for any other instruction. The chain's steps
    share the collective's channel; each prints the whole collective, which moves once."""
    step, channel = _FUSED_STEP.search(line), _CHANNEL.search(line)
    if not step or not channel:
        return None
    return channel.group(1), step.group(1) == "-1"


def parse_collectives(hlo_text: str, num_devices: int | None = None) -> list[HloCollective]:
    """Every collective of a compiled HLO module, with its bytes and device groups.

    A collective inside a while loop with a known trip count counts that many times (an
    unknown trip count counts once). Every branch of a conditional counts once, as if all
    ran: training steps seldom branch, and an upper bound is the safer error for a check.
    A collective XLA's TPU runs as a chain of async collective fusions counts once, by its
    first step (`fused_collective_step`).
    """
    if num_devices is None:
        m = re.search(r"num_partitions=(\d+)", hlo_text)
        num_devices = int(m.group(1)) if m else 1
    comps, entry = computations(hlo_text)
    mult = call_counts(comps, entry)
    out: list[HloCollective] = []
    scattered = _reduce_scatter_fusions(comps)
    for comp, instrs in comps.items():
        by_name = {i[0]: i for i in instrs}
        for name, shape, opcode, rest, line in instrs:
            kind = opcode.removesuffix("-done")
            if kind not in KINDS or opcode.endswith("-start") or mult[comp] == 0:
                continue
            if (fused := fused_collective_step(line)) and not fused[1]:
                continue  # a later step of a chain: its first step counts it
            if kind == "all-reduce" and comp in scattered:
                # XLA's TPU reduce-scatter: the whole buffer, as a reduce-scatter counts.
                groups = parse_replica_groups(line, num_devices)
                out.append(_collective(name, "reduce-scatter", shape, line, groups, mult[comp]))
                continue
            src = line
            if opcode.endswith("-done"):  # groups live on the matching -start
                start = re.match(r"\s*%?([\w.\-]+)", rest)
                src = by_name[start.group(1)][4] if start and start.group(1) in by_name else line
            groups = parse_replica_groups(src, num_devices)
            if kind == "collective-permute" and (windowed := _WINDOWED.search(comp)):
                # A windowed einsum's ring: each turn moves one block of the matmul's
                # reduce-scattered result (or gathered operand); the blocks sum to the
                # operand a reduce-scatter (the result an all-gather) counts.
                kind = "reduce-scatter" if windowed.group(1) == "rs" else "all-gather"
                out.append(_collective(name, kind, shape, src, groups, mult[comp]))
                continue
            nbytes = shape_bytes(shape)
            if kind == "reduce-scatter":  # operand = result times the group size
                nbytes *= len(groups[0])
            op_name = re.search(r'op_name="([^"]*)"', src)
            out.append(
                HloCollective(
                    name,
                    kind,
                    nbytes,
                    groups,
                    mult[comp],
                    shape,
                    op_name.group(1) if op_name else "",
                )
            )
    return out


def _reduce_scatter_fusions(comps: Mapping[str, list]) -> set[str]:
    """Computations that are XLA TPU's reduce-scatter: it writes one as a fusion of an
    all-reduce and the slice each device keeps (computation `%all-reduce-scatter`, emitter
    `...AllReduceScatterFusion`), run as a reduce-scatter, not as the all-reduce inside
    (seen with libtpu 0.0.42.1, `_tpu.py`)."""
    out = {c for c in comps if re.fullmatch(r"all-reduce-scatter(\.\d+)?", c)}
    for instrs in comps.values():
        for _, _, opcode, _, line in instrs:
            if opcode == "fusion" and "AllReduceScatter" in line:
                out.update(c for role, c in _CALLEE.findall(line) if role == "calls")
    return {c.lstrip("%") for c in out}


def _collective(
    name: str, kind: str, shape: str, line: str, groups: tuple, count: int
) -> HloCollective:
    """One collective counted by its own line's shape (the whole buffer)."""
    op_name = re.search(r'op_name="([^"]*)"', line)
    return HloCollective(
        name, kind, shape_bytes(shape), groups, count, shape, op_name.group(1) if op_name else ""
    )


def comm_bytes(collectives: list[HloCollective], mesh: Mapping[str, int]) -> dict[str, float]:
    """Bytes per "kind@axis", summed over every occurrence (no-op collectives dropped)."""
    totals: dict[str, float] = {}
    for c in collectives:
        axis = axis_of(c.kind, c.groups, mesh)
        if axis:
            key = f"{c.kind}@{axis}"
            totals[key] = totals.get(key, 0.0) + c.bytes * c.count
    return totals
