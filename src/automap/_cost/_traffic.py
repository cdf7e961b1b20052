"""What each pipeline stage holds: memory per device (what it sends: `_sends.py`).

It is a function of the tensors alone (their layouts on the stage mesh, the stage and
phase of the ops that make and read them), kept apart from the timing in `_pipelined.py`.

- memory of stage s, per device: the input leaves its ops read (parameters, their
  gradients, optimizer state, the batch), by their layouts and the ZeRO stage, plus the
  activations kept for backward: the residuals of `_capture.find_residuals` that its
  forward ops make or its backward ops read, per microbatch (the full-batch bytes / m
  for a tensor carrying the batch), times the microbatches in flight
  (`PipelineSchedule.in_flight`; GPipe: m; 1F1B: min(m, S - s), its warm-up depth).
  Interleaved stages share a device group: each holds its microbatches live at the
  group's peak (`stage_in_flight`), and every stage of a group gets the group's memory.
  With rematerialization (`_remat`) those copies are of the layers' inputs and the
  residuals made outside layers; the stage adds
  one microbatch's residuals of its largest layer, which its backward makes again. A
  tied parameter (read on two stages) lives on both. A step that donates nothing holds
  the new state its update makes beside the old until the step returns ("outputs").
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from .._capture import Residuals
from .._graph import Graph, Role
from .._lowering import Lowering
from .._pipeline import Partition, Phase, PipelineSchedule, op_programs
from .._remat import LayerGathers, generated
from ._deferred import deferred_weight_bytes
from ._fsdp import programs_gathered_peak
from ._fusion import FUSIBLE
from ._outputs import NEW_MASTERS, NEW_OPT_STATE, NEW_PARAMS, OTHER_OUTPUTS, held_outputs
from ._remade import Remade, recomputed_values
from ._residuals import stage_residuals
from ._stage_layouts import Layouts

if TYPE_CHECKING:
    from ._buffers import Held

_ROLE_KEY = {Role.PARAM: "params", Role.OPT_STATE: "opt_state"}
_PEAK_KEYS = ("activations", "outputs")  # what a device holds at one program's peak
# The phases as plain ints, for the per-op loops that compare an element of a phase array
# (`phase_codes`, numpy int64) with them: compared with an IntEnum member, numpy probes the
# member's class for its array protocols, each miss a Python-level EnumType.__getattr__ on
# Python 3.11 (three a comparison, about 3 us against 0.03; the stage DP's ZB-H1 search in
# tests/pipeline made 370,000). Equal and hashing alike, they key what `Phase`s do.
_PRE, _FWD, _BWD, _POST = int(Phase.PRE), int(Phase.FWD), int(Phase.BWD), int(Phase.POST)
PER_MICROBATCH = (_FWD, _BWD, int(Phase.WGT))  # the phases run once per microbatch
_BACKWARD = PER_MICROBATCH[1:]  # a microbatch's backward, split in two or not


@dataclasses.dataclass(frozen=True)
class StageMemoryInputs:
    """What a pipeline's memory per stage is a function of (`stage_memory`)."""

    graph: Graph
    part: Partition
    lay: Layouts  # the intra-stage plan's layout of every tensor
    res: Residuals
    microbatches: int
    schedule: PipelineSchedule  # its in-flight microbatches per stage
    zero_stage: int
    remat: bool
    # What the backend holds: the gradients a matmul makes, where it adds the running
    # sums outside it (`held_gradients`); and a stage's peak may be its reduce program
    # (`reduce_program`) where the step's peak is priced as its busiest moment
    # (`Lowering.frees_at_last_use`).
    lowering: Lowering
    # Under remat: per recomputed layer, `stored_residuals` of its `res.layer_saved`, each
    # with the width XLA holds it at and what it serves (`CostModel.layer_stored`).
    layer_stored: Sequence[tuple[Held, ...]] = ()
    # The backward ops XLA runs at the end of their stage's B program, their operands
    # alive to there (`_pipelined.late_ops`: the weight-gradient dots it splits beside
    # data where the B program reduces them, `Lowering.late_split_dots`).
    late: frozenset[int] = frozenset()
    # ZeRO-3's layers (`Tables.layers`, None without a loss) and what its gather of each
    # parameter moves (`Tables.gathered`): F and B gather layer by layer (`_fsdp.py`)
    layers: LayerGathers | None = None
    gathered: Mapping[int, float] = dataclasses.field(default_factory=dict)
    gathered_narrow: Mapping[int, float] = dataclasses.field(default_factory=dict)

    @property
    def layerwise(self) -> bool:
        """ZeRO-3 over a data axis, gathering layer by layer (`_run/_pipelined.py`)."""
        return self.zero_stage >= 3 and self.lay.data_size > 1 and self.layers is not None

    @functools.cached_property
    def groups(self) -> int:
        """Device groups: a pipeline of S stages has S / chunks of them when its stages
        are virtual (interleaved 1F1B), S otherwise."""
        return self.part.n_stages // self.schedule.chunks

    @functools.cached_property
    def generated(self) -> dict[int, tuple[int, ...]]:
        """Per-step values each per-microbatch program makes itself (`_remat.generated`)."""
        return generated(self.graph, self.part)

    @functools.cached_property
    def m(self) -> int:
        return max(1, self.microbatches)

    @functools.cached_property
    def phase(self) -> np.ndarray:
        return phase_codes(self.part)

    @functools.cached_property
    def stage(self) -> np.ndarray:
        return np.array(self.part.op_stage)

    @functools.cached_property
    def consumers(self) -> list:
        return self.graph.consumers()

    def zeroed(self, t: int, on: bool) -> float:
        """Bytes per device of tensor `t` by its layout, and over the data axis if `on`
        (ZeRO's shard) where its layout does not already split it there."""
        b = self.graph.tensors[t].nbytes * self.lay.inv[t]
        D = self.lay.data_size
        return b / D if on and D > 1 and not self.lay.on_data[t] else b


#: The memory parts of a stage, in the order a breakdown lists them.
MEMORY_PARTS = ("params", "grads", "opt_state", "activations", "other", "outputs")


def stage_memory(inp: StageMemoryInputs) -> tuple[list[dict[str, float]], np.ndarray, np.ndarray]:
    """Per stage, the memory breakdown per device (`MEMORY_PARTS`); and per op, the
    parameter-gradient-optimizer bytes of the leaves it reads first and the residual
    bytes it makes per microbatch (what a stage DP sums over a layer segment)."""
    out = [dict.fromkeys(MEMORY_PARTS, 0.0) for _ in range(inp.part.n_stages)]
    op_state = np.zeros(len(inp.graph.ops))
    op_act = np.zeros(len(inp.graph.ops))
    _leaves(inp, out, op_state)
    _gathered_layers(inp, out)
    sums = running_sums(inp.graph, inp.part, inp.lay, inp.phase)
    # The runtime holds the running sums it adds each microbatch's into, or with one
    # microbatch the gradients its B program returns, at their own width (a
    # mixed-precision step's 16-bit weight gradients, not the float32 parameters'):
    # those, rather than the parameter leaves' bytes.
    for s in range(inp.part.n_stages):
        out[s]["grads"] = sum(b for q, _, b in sums if q == s)
    sums = sums if inp.m > 1 else []  # no reduce program adds them up
    _once_made(inp, out, op_state)
    held_act = _residuals(inp, out, op_act, op_state)
    deferred = deferred_weight_bytes(inp.graph, inp.part, inp.lay.inv, inp.res, inp.schedule, inp.m)
    for s, b in enumerate(deferred):
        out[s]["activations"] += b  # ZB-H1's W's, deferred past their B
    at_bwd = _temporaries(inp, out, sums)
    if inp.groups < inp.part.n_stages:
        out = _per_device(out, at_bwd, held_act, inp.groups)
    return out, op_state, op_act


def _leaves(inp: StageMemoryInputs, out: list[dict[str, float]], op_state: np.ndarray) -> None:
    """The input leaves each stage's ops read (parameters, their gradients, optimizer
    state, the batch), by their layouts and the ZeRO stage."""
    phase, consumers, zeroed = inp.phase, inp.consumers, inp.zeroed
    for leaf in inp.graph.inputs:
        t, readers = leaf.tensor, consumers[leaf.tensor]
        if not readers:
            continue
        if leaf.role == Role.PARAM:
            # ZeRO-3 keeps a parameter sharded between programs; F and B gather a layer's
            # as it runs (`_gathered_layers`), or without layers the ones they read at
            # their start, so at a stage's peak they are whole.
            whole = any(phase[c] in PER_MICROBATCH for c in readers) and not inp.layerwise
            part_bytes = {
                "params": zeroed(t, inp.zero_stage >= 3 and not whole),
                # Whole per device at any ZeRO stage: the runtime sums each microbatch's
                # local gradients whole and reduce-scatters them once per step. One copy:
                # a B call adds its own into the donated running sums.
                "grads": zeroed(t, False),
            }
        elif leaf.role == Role.OPT_STATE:
            part_bytes = {"opt_state": zeroed(t, inp.zero_stage >= 1)}
        else:
            part_bytes = {"other": zeroed(t, False)}
        for s in {int(inp.stage[c]) for c in readers}:
            for k, b in part_bytes.items():
                out[s][k] += b
        if leaf.role in _ROLE_KEY:
            op_state[readers[0]] += sum(part_bytes.values())


def _gathered_layers(inp: StageMemoryInputs, out: list[dict[str, float]]) -> None:
    """ZeRO-3 layer by layer: each stage holds, besides its shards, the most of its
    backward's gathered copies alive at once (`_fsdp.programs_gathered_peak`: about a
    layer's parameters). A stage's peak is its backward's (`_temporaries`), when its F's
    copies (about two layers', the next one's prefetched) are dead; under remat its B
    runs each layer's forward again and gathers as F does (read in the CPU's programs,
    `tests/test_fsdp.py`), so F's pattern prices it."""
    if not inp.layerwise:
        return
    per_device = np.where(inp.lay.on_data, 0.0, inp.lay.inv)
    phases = (*_BACKWARD, Phase.FWD) if inp.remat else _BACKWARD
    for s in range(inp.part.n_stages):
        programs = [inp.part.ops(s, ph) for ph in phases]
        out[s]["params"] += programs_gathered_peak(
            inp.graph, inp.layers, programs, inp.gathered, per_device, inp.gathered_narrow
        )


def _once_made(inp: StageMemoryInputs, out: list[dict[str, float]], op_state: np.ndarray) -> None:
    """Values made once per step before the microbatches are held through them by their
    stage and by every stage that reads them later: a weight's cast or transpose,
    ZeRO-3's gathered parameters (by the update's layout where only the update reads
    one: the partition runs an op whose results only the update reads with it)."""
    phase, consumers, stage = inp.phase, inp.consumers, inp.stage
    pre, post, per_microbatch = _PRE, _POST, (_FWD, _BWD)
    for index in np.flatnonzero(phase == pre).tolist():  # the pre ops only, in order
        op = inp.graph.ops[index]
        for t in op.outputs:
            late = [c for c in consumers[t] if phase[c] != pre]
            if t in inp.generated and all(phase[c] in per_microbatch for c in late):
                continue  # made in each program that reads it (`_remat.generated`)
            if late:
                # Read by the update alone: ZeRO pins it to the update's sharded layout.
                update = all(phase[c] == post for c in late)
                b = inp.zeroed(t, inp.zero_stage >= 1 and update)
                for s in {int(stage[op.index])} | {int(stage[c]) for c in late}:
                    out[s]["params"] += b
                op_state[late[0]] += b


def _residuals(
    inp: StageMemoryInputs, out: list[dict[str, float]], op_act: np.ndarray, op_state: np.ndarray
) -> np.ndarray:
    """The activations kept for backward, per microbatch, times the microbatches each
    stage holds in flight (`PipelineSchedule.stage_in_flight`: interleaved stages, each
    its microbatches live at its device group's peak); returns those bytes per stage.
    A stage's F program hands its B program what `_remat.remake_residuals` keeps of the
    residuals its backward reads (each an output, a buffer): the runtime's B makes the
    cheap elementwise ones again (`_run/_segments.remake_segments`). What the step makes
    once before its microbatches (a weight's cast) is not handed over: the B program reads
    the runtime's one copy, which `_once_made` holds. Counted here too, a 175B GPT's
    casts (0.45 GB a layer) were held twice a stage, and the stage DP, which held them
    once per microbatch in flight, found no pipeline that fits. Per op, what it makes
    per microbatch goes to `op_act` (a stage DP holds it once per microbatch in flight),
    anything else it holds once to `op_state`."""
    graph, part, phase = inp.graph, inp.part, inp.phase
    copies = inp.schedule.stage_in_flight(inp.groups, inp.m)
    held_act = np.zeros(part.n_stages)  # residuals held per stage at its device's peak
    counted: set[int] = set()
    # A split backward's W programs read F's residuals as they are: nothing is remade.
    remakes = not inp.schedule.splits_backward
    kept_per_stage = stage_residuals(
        graph, part, inp.res, inp.consumers, inp.remat, set(inp.generated), remakes
    )
    for s, kept in enumerate(kept_per_stage):
        for t in kept:
            p = graph.tensors[t].producer
            if phase[p] == _PRE:
                continue  # the runtime's one copy, held by `_once_made`
            b = graph.tensors[t].nbytes * inp.lay.inv[t]
            per_mb = phase[p] == _FWD
            if per_mb and t in part.batched:
                b /= inp.m
            out[s]["activations"] += b * (copies[s] if per_mb else 1)
            held_act[s] += b * (copies[s] if per_mb else 1)
            if t not in counted:
                (op_act if per_mb else op_state)[p] += b
                counted.add(t)
    return held_act


def _temporaries(
    inp: StageMemoryInputs, out: list[dict[str, float]], sums
) -> list[dict[str, float]]:
    """A stage's peak: its backward's temporaries on top of what it holds, or its update's
    (the update runs after the last microbatch, when no activation is alive, with the
    outputs the step holds apart from its arguments made then and kept to its end), or
    where the buffers are scheduled, the once-per-step reduction of the gradients between
    the two."""
    graph, part, lay, m, phase = inp.graph, inp.part, inp.lay, inp.m, inp.phase
    S = part.n_stages
    program = op_programs(graph, part)
    held = () if inp.lowering.matmul_accumulates else held_gradients(graph, part, lay, m, phase)
    late = inp.late
    remade = (
        recomputed_values(graph, part, lay.inv, inp.res, inp.layer_stored, m, phase, late)
        if inp.remat
        else ()
    )
    bwd = temporaries(graph, part, lay.inv, m, Phase.BWD, program, held, remade, late=late)
    # A split backward (ZB-H1) runs B and W as programs of their own: the larger's.
    wgt = temporaries(graph, part, lay.inv, m, Phase.WGT, program, held)
    bwd = [max(b, w) for b, w in zip(bwd, wgt, strict=True)]
    for s, b in enumerate(bwd):
        out[s]["activations"] += b
    at_bwd = [dict(d) for d in out]  # each stage's backward peak, before the update's
    kept = post_outputs(graph, phase, inp.zeroed, inp.zero_stage)
    makers = [graph.tensors[t].producer for t in kept]
    made = np.bincount(inp.stage[makers], list(kept.values()), minlength=S) if kept else [0.0] * S
    for s, b in enumerate(temporaries(graph, part, lay.inv, m, Phase.POST, program, kept=kept)):
        if b > out[s]["activations"]:
            out[s]["activations"], out[s]["outputs"] = b - made[s], float(made[s])
    if inp.lowering.frees_at_last_use:
        for s, b in enumerate(reduce_program(graph, sums, S, lay.data_size, inp.zero_stage)):
            if b > out[s]["activations"] + out[s]["outputs"]:
                out[s]["activations"], out[s]["outputs"] = b, 0.0
    return at_bwd


def _per_device(out, at_bwd, held_act, groups: int) -> list[dict[str, float]]:
    """Interleaved stages: the memory of each stage's device group, for every stage on it.
    A group holds the state and the in-flight residuals of all its chunks at once, but
    runs one program at a time: its backward peak is every chunk's residuals plus the
    largest backward's temporaries; its update's (or reduction's) peak, after the
    microbatches, the largest of its chunks' (none holds residuals then)."""
    S = len(out)
    merged = []
    for g in range(groups):
        mine = range(g, S, groups)
        dev = {k: sum(out[s][k] for s in mine) for k in out[g] if k not in _PEAK_KEYS}
        resid = sum(held_act[s] for s in mine)
        bwd = resid + max(at_bwd[s]["activations"] - held_act[s] for s in mine)
        # Where the update's peak won: the new state each such chunk's update made is
        # held through the others' (a step that donates nothing), beside the largest one.
        late = [s for s in mine if out[s] != at_bwd[s]]
        act = max((out[s]["activations"] for s in late), default=0.0)
        kept = sum(out[s]["outputs"] for s in late)
        if late and act + kept > bwd:
            dev.update(activations=act, outputs=kept)
        else:
            dev.update(activations=bwd, outputs=0.0)
        merged.append(dev)
    return [dict(merged[s % groups]) for s in range(S)]


def post_outputs(graph: Graph, phase: np.ndarray, zeroed, zero_stage: int) -> dict[int, float]:
    """Bytes per device of each output the update makes and the step holds apart from its
    arguments (`_outputs.held_outputs`: no donated input becomes it), by its layout and
    as ZeRO shards the state it is the new value of (`zeroed(t, on)`). The runtime's post
    programs donate only what the step donates (`_run/_pipelined.py`): the rest of the
    new state is written beside the old and kept until the step returns."""
    kinds = held_outputs(graph)
    on = {NEW_PARAMS: zero_stage >= 3, NEW_OPT_STATE: zero_stage >= 1, OTHER_OUTPUTS: False}
    on[NEW_MASTERS] = on[NEW_PARAMS]  # a pipeline's stages gather the new parameters
    return {
        int(t): zeroed(int(t), on[k])
        for k, b in enumerate(kinds)
        for t in b.tensor
        if phase[graph.tensors[int(t)].producer] == _POST
    }


def running_sums(
    graph: Graph, part: Partition, lay: Layouts, phase: np.ndarray
) -> list[tuple[int, int, float]]:
    """(stage, tensor, bytes per device) of each running sum a stage keeps over several
    microbatches: every accumulated tensor of a per-microbatch program, whole by its
    layout (each device's partial sum)."""
    return [
        (int(part.op_stage[p]), t, graph.tensors[t].nbytes * lay.inv[t])
        for t in part.accumulated
        if (p := graph.tensors[t].producer) is not None and phase[p] in PER_MICROBATCH
    ]


def reduce_program(
    graph: Graph, sums: Sequence[tuple[int, int, float]], n_stages: int, D: int, zero_stage: int
) -> list[float]:
    """Per stage, the bytes per device a stage's reduce program writes besides the
    `running_sums` it reads (the `grads` term), read in XLA's buffer assignment of the
    programs compiled for A100s (`_run/_pipelined.py`, `verify(target=...)`). Its arguments
    are not donated, so its collective cannot work in place on them: it writes its result
    (each tensor whole, or its ZeRO shard) and the copy its combined collective reduces.
    Nothing where no data axis (of size `D`) reduces them."""
    out = [0.0] * n_stages
    if D <= 1:
        return out
    for s, t, whole in sums:
        kept = 1 / D if zero_stage >= 1 and graph.tensors[t].ndim else 1.0  # ZeRO's shard
        out[s] += whole * kept + whole
    return out


def temporaries(
    graph: Graph,
    part: Partition,
    inv: np.ndarray,
    m: int,
    which: Phase,
    program=None,
    held: Collection[int] = (),
    remade: Sequence[Remade] = (),
    kept: Mapping[int, float] | None = None,
    late: Collection[int] = (),
) -> list[float]:
    """Per stage, the most bytes per device the ops of phase `which` (BWD: one
    microbatch's backward; POST: the update) hold at once of what they make themselves
    (`inv`: each tensor's fraction per device). These are the buffers XLA writes, each
    alive from the op that makes it to its last reader on the stage, in program order. A
    buffer is written when a kernel XLA cannot fuse into its reader makes it or reads it
    (a matmul, a reduction), or when it crosses from one program to the next
    (`once_programs`). Not counted: a new parameter or optimizer state, written over the
    old one where the step donates it (else `kept`), and with one microbatch a gradient,
    which is the gradient buffer itself; with several, a microbatch's gradient is a
    buffer of its own until it is added into the running sum: at once, or, for those in
    `held` (`held_gradients`), at the end of its stage's backward. `remade`: the recomputed
    layers' stored residuals, each alive from its layer's recompute to the last backward
    read of what it serves. `late`: ops that run at the end of their stage's program,
    what they read alive to there. `kept`: bytes per device of outputs the step holds
    apart from its arguments (`post_outputs`), each alive from its op to the end of the
    phase. A backward also holds the gradients the next
    stage sent it: arguments of its program, which the runtime does not donate, alive
    while it runs (tests/test_verify.py; stage 0 of the TPU bench's GPipe GPT plan 3 on
    256 chips, cut inside a layer, receives 80 MiB a chip). `program`:
    `op_programs(graph, part)`, when the caller has it."""
    stage, phase = part.op_stage, phase_codes(part)
    skip = {leaf.tensor for leaf in graph.outputs} if which == Phase.POST else set()
    if m == 1:
        skip |= set(part.accumulated)
    walk, last, received = _phase_walk(graph, part, which, program)
    if (held or late) and which in _BACKWARD:
        last = dict(last)
        end = {s: i for i, s, *_ in walk}  # each stage's last op of its B (or W)
        for t in held:
            if phase[p := graph.tensors[t].producer] == which:
                last[t] = end[int(stage[p])]
        for i in late:
            if phase[i] == which:
                for t in graph.ops[i].inputs:
                    last[t] = end[int(stage[i])]
    peak = [0.0] * part.n_stages
    held_now = [0.0] * part.n_stages  # bytes alive now, per stage
    live: list[dict[int, float]] = [{} for _ in range(part.n_stages)]
    starts: dict[int, list[Remade]] = {}
    for r in remade:
        starts.setdefault(r.first, []).append(r)
    ends: dict[int, list[Remade]] = {}
    for s, ts in received.items():  # the program's arguments: alive while it runs
        for t in ts:
            b = graph.tensors[t].nbytes * inv[t]
            held_now[s] += b / m if t in part.batched else b
    for i, s, outputs, touched in walk:
        for r in starts.get(i, ()):
            held_now[r.stage] += r.nbytes
            ends.setdefault(r.last, []).append(r)
        for t, written in outputs:
            if written and t not in skip:
                b = graph.tensors[t].nbytes * inv[t]
                live[s][t] = b / m if t in part.batched and which in _BACKWARD else b
                held_now[s] += live[s][t]
            elif kept and t in kept:  # an output held apart: never freed in the phase
                held_now[s] += kept[t]
        peak[s] = max(peak[s], held_now[s])
        for t in touched:
            if last.get(t, -1) <= i and t in live[s]:
                held_now[s] -= live[s].pop(t)
        for r in ends.pop(i, ()):
            held_now[r.stage] -= r.nbytes
    return peak


def _phase_walk(graph: Graph, part: Partition, which: Phase, program=None):
    """What `temporaries` walks of phase `which`, made once per partition: per op (index,
    stage, each output with whether a kernel writes it, the tensors it touches), each
    tensor's last reader in the phase, and per stage the backward values another stage
    made that its ops read (a backward's received gradients)."""

    def make():
        programs = op_programs(graph, part) if program is None else program
        consumers = graph.consumers()
        phase, stage = phase_codes(part), part.op_stage
        walk, last, received = [], {}, {}
        backward = which in _BACKWARD
        for i in np.flatnonzero(phase == which).tolist():
            op, s = graph.ops[i], int(stage[i])
            for t in op.inputs:
                last[t] = i
                p = graph.tensors[t].producer
                if backward and p is not None and phase[p] in _BACKWARD and stage[p] != s:
                    received.setdefault(s, set()).add(t)
            outputs = tuple(
                (
                    t,
                    op.primitive not in FUSIBLE
                    or any(
                        graph.ops[c].primitive not in FUSIBLE or programs[c] != programs[i]
                        for c in consumers[t]
                    ),
                )
                for t in op.outputs
            )
            walk.append((i, s, outputs, (*op.inputs, *op.outputs)))
        return tuple(walk), last, {s: tuple(sorted(ts)) for s, ts in received.items()}

    return part.derived(graph, f"phase walk {int(which)}", make)


def held_gradients(
    graph: Graph, part: Partition, lay: Layouts, m: int, phase: np.ndarray
) -> set[int]:
    """A microbatch's gradients that a backend adding the running sums outside the matmuls
    (`Lowering.matmul_accumulates` False: XLA's CPU) holds to the end of a stage's B
    program, where it adds them: those a matmul makes, seen through layout ops. A matmul
    whose contraction is one element per device is not one: XLA rewrites it as a
    multiply and fuses it into the add (a microbatch of one example per device). With
    one microbatch there is no running sum: the gradient is its buffer. `phase`: the
    partition's `phase_codes`."""
    if m <= 1:
        return set()
    out = set()
    for t in part.accumulated:
        p = graph.tensors[t].producer
        if p is None or phase[p] not in _BACKWARD:
            continue
        op = graph.ops[p]
        while op.primitive in _LAYOUT and graph.tensors[op.inputs[0]].producer is not None:
            op = graph.ops[graph.tensors[op.inputs[0]].producer]
        if op.primitive != "dot_general":
            continue
        (contracted, _), _ = op.params["dimension_numbers"]
        lhs = op.inputs[0]
        k = math.prod(graph.tensors[lhs].shape[d] for d in contracted)
        if lhs in part.batched:
            k /= m * (lay.data_size if lay.on_data[lhs] else 1)
        if k > 1:
            out.add(t)
    return out


#: Ops XLA's layout assignment makes free (a bitcast) between a matmul and its reader.
_LAYOUT = frozenset({"transpose", "reshape", "squeeze", "expand_dims", "convert_element_type"})


def phase_codes(part: Partition) -> np.ndarray:
    """[n_ops] each op's `Phase`, as integers an array compares and indexes by (`Phase` is
    an IntEnum: `phase == Phase.FWD`)."""
    return part.derived(None, "phase_codes", lambda: _read_only(np.array(part.op_phase, np.int64)))


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False  # one array for every price of the partition
    return array
