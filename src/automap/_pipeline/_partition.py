"""Which pipeline stage and which phase of the step each op of a training step belongs to.

A captured training step is forward, then backward (jax emits every primal op before the
transposed ones), then the optimizer update. A pipeline plan cuts the *forward* ops into
contiguous ranges in program order, one per stage (`Plan.stages`); everything else follows
the tensors it reads:

- phase. An op that touches the batch dimension (a tensor dim in the batch linkage group)
  runs once per microbatch: "fwd" up to the loss, "bwd" after it. Its batch-free outputs
  that leave the per-microbatch region (gradients, the loss sum) are *accumulated*: summed
  over microbatches, which is exact because each is a sum over examples (a reduce_sum or a
  contraction over the batch). Ops that only read inputs run once per step before the
  microbatches ("pre": casting a weight), ops downstream of accumulated tensors once after
  them ("post": the loss division, the optimizer update).
- stage. Forward ops take the stage of their range. A backward op takes the lowest stage
  among the tensors it reads, so that backward data only ever flows to lower stages (the
  order every schedule runs them in), and an op that reads only inputs or constants (the
  cotangent seed) the highest stage among its readers. Update ops run where their largest
  input lives (a gradient: the stage that owns the parameter); pre ops on the lowest stage
  that reads them.

Microbatching is exact only when examples do not mix: a batch statistic fed back into
per-example work (batch normalization), per-example random numbers, or a batch reduction
that is not a sum (a max) would change with the microbatch size. `partition` refuses
those with `microbatches > 1`, naming the op.

Stages cut between top-level ops, so layers stacked under one `lax.scan` / `nn.scan` are
one op that no cut can enter: `scanned_layers` finds such a stack (its stacked parameters,
trip count and share of the step's FLOPs) so that the planner can say why a pipeline
cannot split it, instead of silently offering fewer stages.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

from .._capture import find_residuals, loss_boundary
from .._errors import PlanError
from .._graph import Graph, Role
from .._groups import Groups
from ._phase import Phase

#: Primitives whose batch-free output is a sum over the examples they read.
SUMS = frozenset(
    {"reduce_sum", "dot_general", "conv_general_dilated", "scatter-add", "scatter_add"}
)
#: A scanned stack holding at least this share of the step's FLOPs holds "the layers": a
#: pipeline of it can only cut around it (an embedding, a head), never between layers.
MOST_FLOPS = 0.5
_CASTS = frozenset({"convert_element_type", "copy"})
#: Primitives whose values depend on where an example sits in the batch.
_RANDOM = frozenset({"random_bits", "threefry2x32", "random_wrap", "rng_bit_generator"})


@dataclasses.dataclass(frozen=True)
class Partition:
    """Stage and phase of every op; the tensors summed over microbatches."""

    n_stages: int
    forward_end: int  # index of the last forward op (the loss)
    op_stage: tuple[int, ...]  # per op
    op_phase: tuple[Phase, ...]  # per op
    accumulated: tuple[int, ...]  # tensor ids summed over microbatches, ascending
    batched: frozenset[int]  # tensor ids that carry the batch dimension

    def ops(self, stage: int, phase: Phase) -> tuple[int, ...]:
        """Op indices of one stage and phase, in program order."""
        return self._ops_by_place.get((stage, phase), ())

    def derived(self, graph: Graph, name: str, make: Callable[[], Any]) -> Any:
        """`make()`, a value derived from this partition of `graph`, made once: the stage
        DP prices the same partition under other savers and schedules (`partition` keeps
        the latest), each price asking for the same programs and phases again."""
        held = self._derived.get(name)
        if held is None or held[0] is not graph:
            held = self._derived[name] = (graph, make())
        return held[1]

    @functools.cached_property
    def _derived(self) -> dict[str, tuple[Graph, Any]]:
        return {}

    @functools.cached_property
    def _ops_by_place(self) -> dict[tuple[int, int], tuple[int, ...]]:
        # Built once per partition: the pricing of one plan asks for each stage's phases
        # thousands of times (recomputed layers, ZeRO's gathers), and a scan of every op
        # per call cost a 1T GPT's planning a third of its time.
        out: dict[tuple[int, int], list[int]] = {}
        for i, place in enumerate(zip(self.op_stage, self.op_phase, strict=True)):
            out.setdefault(place, []).append(i)
        return {place: tuple(ops) for place, ops in out.items()}


def once_programs(
    graph: Graph, part: Partition, phase: Phase
) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """The once-per-step ops of `phase` (PRE or POST) as the programs the runtime runs
    them in, in order: (stage, op indices in program order).

    Each op gets a level, the stage changes along the chain of this phase's ops it reads
    from (reading another stage's result is one level up), and each (level, stage) is one
    program; levels run in turn. A stage's Adam update is then one program, which XLA
    fuses leaf by leaf; a global gradient norm, which reads every stage, costs two more
    rounds. (Cut at every change of stage in program order instead, optax's tree_map order
    makes many small programs whose every crossing value is a buffer of its own.)"""
    level: dict[int, int] = {}
    for op in graph.ops:
        if part.op_phase[op.index] is not phase:
            continue
        s, up = part.op_stage[op.index], 0
        for t in op.inputs:
            p = graph.tensors[t].producer
            if p in level:
                up = max(up, level[p] + (part.op_stage[p] != s))
        level[op.index] = up
    programs: dict[tuple[int, int], list[int]] = {}
    for i, up in level.items():  # in program order
        programs.setdefault((up, part.op_stage[i]), []).append(i)
    return tuple((s, tuple(ops)) for (_, s), ops in sorted(programs.items()))


def op_programs(graph: Graph, part: Partition) -> tuple[int, ...]:
    """Per op, the program it runs in: F, B (and W, where the backward is split) are one
    program per stage (negative ids); PRE and POST ops as `once_programs` groups them."""
    return part.derived(graph, "op_programs", lambda: _op_programs(graph, part))


def _op_programs(graph: Graph, part: Partition) -> tuple[int, ...]:
    per_mb = {Phase.FWD: 0, Phase.BWD: 1, Phase.WGT: 2}
    out = [
        -1 - 3 * s - per_mb.get(ph, 0) for s, ph in zip(part.op_stage, part.op_phase, strict=True)
    ]
    n = 0
    for phase in (Phase.PRE, Phase.POST):
        for _, ops in once_programs(graph, part, phase):
            for i in ops:
                out[i] = n
            n += 1
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class ScannedStack:
    """Layers stacked under one scan: the forward scan op and what it iterates over."""

    op: int  # the forward scan's op index
    trips: int  # its trip count: the stacked layers
    path: str  # the pytree path the stacked parameters share, e.g. "[0]['layers']"
    params: tuple[str, ...]  # the stacked parameter leaves' paths
    flops_share: float  # the step's FLOPs inside the scans over them (forward and backward)

    def why_no_cuts(self) -> str:
        """Why a pipeline cannot cut between these layers, and what would let it."""
        return (
            f"the layers live in one scan (op {self.op}, over {self.path}: {self.trips} "
            f"trips, {self.flops_share:.0%} of the step's FLOPs), and pipeline stages cut "
            "only between ops, never inside a loop. To cut between layers, write them as a "
            "Python loop over per-layer parameters (a list of layers, or Flax modules in a "
            "loop instead of nn.scan); `unroll=` of lax.scan / nn.scan keeps one scan op in "
            "the program and does not help."
        )


def scanned_layers(graph: Graph) -> ScannedStack | None:
    """The scan over stacked parameters (a parameter leaf sliced along its leading dim,
    one slice per trip) that holds the most FLOPs, counting every scan over the same
    stack (the backward scan runs over it again), if it holds at least `MOST_FLOPS` of the
    step's: the program's layers then live in that one op."""
    leaf_of = {leaf.tensor: leaf.path for leaf in graph.leaves(Role.PARAM)}
    for op in graph.ops:  # mixed precision: a stack cast to bf16 before the scan
        if op.primitive in _CASTS and len(op.inputs) == 1 and op.inputs[0] in leaf_of:
            leaf_of.update(dict.fromkeys(op.outputs, leaf_of[op.inputs[0]]))
    scans = sorted(i for i in graph.bodies if graph.ops[i].primitive == "scan")
    sliced = {  # scan op -> the tensors it slices one per trip (its stacked operands)
        i: {o for b in graph.bodies[i] for o, _, off in b.binds if off}
        for i in scans
        if graph.ops[i].trip_count > 1
    }
    best: ScannedStack | None = None
    counted: set[int] = set()
    for index, operands in sliced.items():  # in program order: the forward scan first
        stacked = {leaf_of[t] for t in operands if t in leaf_of}
        if not stacked or index in counted:
            continue
        # The backward scan runs over the same stack, or over the stacked residuals the
        # forward scan saved for it (a body's weights among them).
        reads = {t for t in operands if t in leaf_of} | set(graph.ops[index].outputs)
        same = [i for i, other in sliced.items() if i == index or other & reads]
        counted.update(same)
        share = sum(graph.ops[i].flops for i in same) / max(graph.total_flops, 1.0)
        if share >= MOST_FLOPS and (best is None or share > best.flops_share):
            params = tuple(sorted(stacked))
            best = ScannedStack(
                index, graph.ops[index].trip_count, _common_path(params), params, share
            )
    return best


def _common_path(paths: Sequence[str]) -> str:
    """The pytree path the stacked leaves share (`[0]['layers']`), or the leaves
    themselves when they share no more than the argument."""
    split = [re.findall(r"\[[^\]]*\]|\.\w+", p) for p in paths]
    common: list[str] = []
    for parts in zip(*split, strict=False):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    if len(common) > 1 or len(paths) == 1:
        return "".join(common) or paths[0]
    return ", ".join(paths[:3]) + (", ..." if len(paths) > 3 else "")


def forward_ops(graph: Graph, groups: Groups) -> tuple[int, ...]:
    """Indices of the per-microbatch forward ops: the ops a plan's stage ranges cut."""
    end = _forward_end(graph)
    # A batch of one has no pipeline, but its layers still recompute (remat).
    batched = _batched(graph, groups) if groups.batch_groups else _made_from_batch(graph, end)
    return tuple(op.index for op in graph.ops[: end + 1] if any(t in batched for t in _touched(op)))


def partition(
    graph: Graph, groups: Groups, bounds: Sequence[tuple[int, int]], microbatches: int = 1
) -> Partition:
    """Assign every op a stage and a phase; `bounds` are the stages' (op_start, op_stop)."""
    bounds = tuple((int(start), int(stop)) for start, stop in bounds)
    # A search prices the same cuts again under other memory savers and schedules (the
    # stage DP's points, the polish's variants): the few latest partitions are kept.
    key = (bounds, microbatches > 1)
    make = functools.partial(_partition, graph, groups, bounds, microbatches)
    return graph.recall("partitions", groups, key, make, keep=RECENT_PARTITIONS)


#: How many partitions of one graph `partition` keeps (a 1T GPT's hold 2 x 88,000 ops each).
RECENT_PARTITIONS = 16


@dataclasses.dataclass(frozen=True)
class _Phases:
    """What a partition is before its cuts: each op's phase, the accumulated tensors."""

    forward_end: int
    batched: frozenset[int]
    phase: tuple[Phase, ...]
    accumulated: tuple[int, ...]
    last_forward: int  # the last per-microbatch forward op: the last stage must reach it


def _phases(graph: Graph, groups: Groups, microbatches: int) -> _Phases:
    """The phases (`partition`'s module doc), the same for every cut of the step: made
    once per graph, for one microbatch and for several."""
    multi = microbatches > 1
    make = functools.partial(_find_phases, graph, groups, multi)
    return graph.recall("phases", groups, multi, make, keep=2)


def _find_phases(graph: Graph, groups: Groups, multi: bool) -> _Phases:
    end = _forward_end(graph)
    batched = _batched(graph, groups)
    n = len(graph.ops)
    consumers = graph.consumers()
    per_mb = _per_microbatch(graph, batched, consumers)
    last_forward = max((i for i in range(end + 1) if per_mb[i]), default=end)
    accumulated, after = _accumulated(graph, per_mb, batched, consumers)
    if multi:
        _check_examples_independent(graph, per_mb, after, set(accumulated), batched)
    else:
        # One microbatch is the whole batch: a batch statistic read back by per-example
        # work (batch norm) is simply part of the microbatch's own work.
        for op in reversed(graph.ops):
            if after[op.index] and any(per_mb[c] for t in op.outputs for c in consumers[t]):
                per_mb[op.index] = True
        accumulated, after = _accumulated(graph, per_mb, batched, consumers)

    phase = [
        (Phase.FWD if i <= end else Phase.BWD)
        if per_mb[i]
        else (Phase.POST if after[i] else Phase.PRE)
        for i in range(n)
    ]
    # An op reading only inputs whose results only the update reads (Adam's decayed
    # moments, b1 * mu) runs with the update: made before the microbatches, its results
    # would be held through them.
    for op in reversed(graph.ops):
        if phase[op.index] is Phase.PRE:
            readers = [c for t in op.outputs for c in consumers[t]]
            if readers and all(phase[c] is Phase.POST for c in readers):
                phase[op.index] = Phase.POST
    return _Phases(end, frozenset(batched), tuple(phase), tuple(accumulated), last_forward)


def _partition(
    graph: Graph, groups: Groups, bounds: tuple[tuple[int, int], ...], microbatches: int
) -> Partition:
    n_stages = len(bounds)
    phases = _phases(graph, groups, microbatches)
    _check_bounds(bounds, phases.last_forward)
    phase, n = phases.phase, len(graph.ops)
    consumers = graph.consumers()
    stage: list[int | None] = [None] * n
    for s, (start, stop) in enumerate(bounds):
        for i in range(start, min(stop, n)):
            if phase[i] is Phase.FWD:
                stage[i] = s
    # Backward and update ops follow their inputs (program order = dependency order).
    for op in graph.ops:
        i = op.index
        if phase[i] not in (Phase.BWD, Phase.POST):
            continue
        placed = [
            (stage[p], graph.tensors[t].nbytes)
            for t in op.inputs
            if (p := _producer(graph, t)) is not None and stage[p] is not None
        ]
        if not placed:
            continue  # reads only inputs and constants: placed by its readers below
        if phase[i] is Phase.BWD:
            stage[i] = min(s for s, _ in placed)
        else:  # the largest input (a gradient) says which stage owns this update
            stage[i] = min(placed, key=lambda sb: (-sb[1], sb[0]))[0]
    # Ops that read only inputs and constants take their place from their readers.
    for op in reversed(graph.ops):
        i = op.index
        if stage[i] is not None:
            continue
        readers = [stage[c] for t in op.outputs for c in consumers[t] if stage[c] is not None]
        if phase[i] is Phase.BWD:
            stage[i] = max(readers, default=n_stages - 1)
        else:
            stage[i] = min(readers, default=0)
    result = Partition(
        n_stages=n_stages,
        forward_end=phases.forward_end,
        op_stage=tuple(int(s) for s in stage),  # type: ignore[arg-type]
        op_phase=phase,
        accumulated=phases.accumulated,
        batched=phases.batched,
    )
    _check_flow(graph, result)
    return result


# ---- helpers ----------------------------------------------------------------------------


def _touched(op) -> tuple[int, ...]:
    return (*op.inputs, *op.outputs)


def _producer(graph: Graph, tensor: int) -> int | None:
    return graph.tensors[tensor].producer


def _per_microbatch(graph: Graph, batched: set[int], consumers) -> list[bool]:
    """Ops run once per microbatch: those touching the batch, except statistics of the
    input data alone (the token count a loss divides by) and the ops they are made from:
    those run once on the whole batch before the microbatches, which keeps them exact."""
    per_mb = [any(t in batched for t in _touched(op)) for op in graph.ops]
    model = {leaf.tensor for leaf in graph.inputs if leaf.role in (Role.PARAM, Role.OPT_STATE)}
    data_only = [False] * len(graph.ops)
    for op in graph.ops:
        data_only[op.index] = all(
            t not in model and (p is None or data_only[p])
            for t in op.inputs
            for p in (graph.tensors[t].producer,)
        )
    whole_batch = [False] * len(graph.ops)
    for op in reversed(graph.ops):  # readers before the ops they read
        statistic = per_mb[op.index] and any(t not in batched for t in op.outputs)
        feeds = any(whole_batch[c] for t in op.outputs for c in consumers[t])
        whole_batch[op.index] = data_only[op.index] and (statistic or feeds)
    return [p and not w for p, w in zip(per_mb, whole_batch, strict=True)]


def _accumulated(graph: Graph, per_mb: list[bool], batched: set[int], consumers):
    """Batch-free tensors leaving the per-microbatch ops (summed over microbatches), and
    which other ops depend on them (they run after the microbatches)."""
    outputs = {leaf.tensor for leaf in graph.outputs}
    accumulated = sorted(
        t
        for op in graph.ops
        if per_mb[op.index]
        for t in op.outputs
        if t not in batched and (t in outputs or any(not per_mb[c] for c in consumers[t]))
    )
    acc = set(accumulated)
    after = [False] * len(graph.ops)
    for op in graph.ops:
        if not per_mb[op.index]:
            after[op.index] = any(
                t in acc or (p is not None and after[p])
                for t in op.inputs
                for p in (graph.tensors[t].producer,)
            )
    return accumulated, after


def _forward_end(graph: Graph) -> int:
    state = {leaf.path for leaf in graph.inputs if leaf.role in (Role.PARAM, Role.OPT_STATE)}
    has_loss = any(
        graph.tensors[leaf.tensor].ndim == 0 and leaf.path not in state for leaf in graph.outputs
    )
    if not has_loss:
        raise PlanError(
            "a pipeline plan needs the step to return its loss (a float scalar output): that "
            "is where the forward pass ends and the backward pass begins. Return the loss "
            "from the step, or make a plan without pipeline stages."
        )
    # find_residuals's boundary, without the residuals it also collects: a partition asks
    # on every pipeline estimate.
    boundary = loss_boundary(graph)
    return find_residuals(graph).boundary if boundary is None else boundary


def _batched(graph: Graph, groups: Groups) -> set[int]:
    batch = set(groups.batch_groups)
    if not batch:
        raise PlanError(
            "a pipeline plan needs a batch dimension to split into microbatches, and this "
            "step has none that can be split (is the batch size 1, or is no argument named "
            "`batch`? pass roles= to capture). Make a plan without pipeline stages."
        )
    return {t.id for t in graph.tensors if batch.intersection(groups.tensor_groups[t.id])}


def _made_from_batch(graph: Graph, end: int) -> set[int]:
    """The forward's tensors computed from the batch inputs. A batch of one has no batch
    dimension to follow (a size-1 dim ties to nothing), yet its forward still has layers to
    recompute: the ops that read the data are its per-example work."""
    made = {leaf.tensor for leaf in graph.leaves(Role.BATCH)}
    for op in graph.ops[: end + 1]:
        if any(t in made for t in op.inputs):
            made.update(op.outputs)
    return made


def _check_bounds(bounds: Sequence[tuple[int, int]], last_forward: int) -> None:
    if not bounds:
        raise PlanError("a pipeline partition needs at least one stage.")
    expected = 0
    for s, (start, stop) in enumerate(bounds):
        if start != expected or stop <= start:
            raise PlanError(
                f"pipeline stage {s} covers ops [{start}, {stop}), but stages must cover the "
                f"forward ops in order without gaps (stage {s} should start at op {expected}, "
                "and each stage needs at least one op). Fix the plan's stages."
            )
        expected = stop
    if expected <= last_forward:
        raise PlanError(
            f"the pipeline stages end at op {expected}, before the forward pass does (op "
            f"{last_forward}): the last stage must cover it. Fix the plan's stages."
        )


def _check_examples_independent(graph, per_mb, after, acc, batched) -> None:
    """Refuse microbatching where it would change the step's result (see module doc)."""
    fix = "Use one microbatch, or a plan without pipelining."
    for op in graph.ops:
        if per_mb[op.index] and op.primitive in _RANDOM:
            raise PlanError(
                f"op {op.index} ({op.primitive}) draws random numbers per example: splitting "
                f"the batch into microbatches would change them. {fix}"
            )
        if per_mb[op.index]:
            # A batch-free value made from the batch (a reduction over it) read again by
            # per-example work: its value depends on which examples the microbatch holds.
            mixed = [
                t
                for t in op.inputs
                if t not in batched
                and (p := graph.tensors[t].producer) is not None
                and (per_mb[p] or after[p])
            ]
            if mixed:
                raise PlanError(
                    f"op {op.index} ({op.primitive}) feeds a statistic of the whole batch "
                    f"(tensor {mixed[0]}) back into per-example work (batch normalization?): "
                    f"microbatches would compute it over part of the batch only. {fix}"
                )
    for t in sorted(acc):
        p = graph.ops[graph.tensors[t].producer]
        if p.primitive not in SUMS:
            raise PlanError(
                f"op {p.index} ({p.primitive}) reduces over the batch in a way that is not a "
                f"sum, so its result cannot be accumulated over microbatches. {fix}"
            )


def _check_flow(graph: Graph, part: Partition) -> None:
    """Every schedule runs fwd(s) before fwd(s+1) and bwd(s+1) before bwd(s): refuse an
    assignment whose data would flow against that (a sign of a misread forward pass)."""
    for op in graph.ops:
        i, s, ph = op.index, part.op_stage[op.index], part.op_phase[op.index]
        for t in op.inputs:
            p = graph.tensors[t].producer
            if p is None:
                continue
            ps, pph = part.op_stage[p], part.op_phase[p]
            bad = (ph is Phase.FWD and (pph is Phase.BWD or ps > s)) or (
                ph is Phase.BWD and pph is Phase.BWD and ps < s
            )
            if ph in (Phase.FWD, Phase.BWD) and pph is Phase.POST:
                bad = True
            if bad:
                raise PlanError(
                    f"op {i} ({op.primitive}, {ph} on stage {s}) reads tensor {t} made by op "
                    f"{p} ({pph} on stage {ps}): no pipeline schedule can run that order. "
                    "The step's forward and backward passes could not be told apart; make a "
                    "plan without pipeline stages."
                )
