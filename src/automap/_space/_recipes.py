"""A hand-written 3-D configuration as an object: Megatron-LM's recipe, built and priced.

A user holds the configuration they already run (tensor parallel T inside a node,
P pipeline stages equal in layers, data parallel D over the rest, a microbatch size, a
schedule, recomputation, a ZeRO stage) against Auto-MAP's plan. `recipe_plan` turns a
`Recipe` into the Plan that configuration is; the cost model prices it and `am.apply`
runs it like any other plan. The `megatron_3d` expert is the same recipe with Megatron's
own choices: tensor parallel over the node, the fewest stages that fit with full
recomputation, microbatch size 1.

Tensor parallel is Megatron's column-then-row split (`block_groups`): attention heads,
the MLP's hidden width and the vocabulary; a size that does not divide what it must split
is refused, as is a data size that does not divide the batch. Pipeline stages that do not
divide the layers split them as Llama 3 does (`layer_split`: the end stages one fewer),
and the plan says so in a note.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

from .._axes import DATA, MODEL
from .._cluster import Cluster
from .._errors import PlanError
from .._graph import Graph, Role
from .._groups import Groups, plan_from_assignment, sequence_parallel
from .._pipeline import (
    check_remat,
    cut_runs,
    forward_ops,
    pipeline_plan,
    pipeline_schedule,
    scanned_layers,
)
from .._plan import ATTENTIONS, Plan
from .._remat import stage_layer_counts
from ._experts import axis_assignment, batch_groups, block_groups

REMAT = ("none", "selective", "projections", "full")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A hand-written configuration: Megatron-LM's 3-D parallelism with its options."""

    tp: int = 1
    """Tensor parallel: Megatron's column/row split on the `model` axis, inside a node."""
    pp: int = 1
    """Pipeline stages, each holding an equal number of layers; where pp does not divide
    the layers, the first and last stages hold one fewer (Llama 3's split, `layer_split`)."""
    dp: int = 1
    """Data parallel: replicas over the remaining devices (tp × pp × dp = the devices)."""
    microbatch_size: int | None = None
    """Sequences per microbatch per data replica; None: set by `microbatches`."""
    microbatches: int | None = None
    """Microbatches per step; None: from `microbatch_size`, else one. With one stage,
    gradient accumulation over them."""
    schedule: str = "1f1b"
    """Pipeline schedule, by its registered name (`_pipeline.schedule_names`): "1f1b"
    (Megatron's), "gpipe", "interleaved" (Megatron's virtual pipeline) or "zb-h1" (Qi et al.'s
    zero-bubble 1F1B: each backward split into B and W, W deferred into the bubble; not
    with remat)."""
    virtual_stages: int = 1
    """Model chunks per pipeline stage (interleaved 1F1B's v, Megatron's virtual pipeline
    size): the layers split into pp × v chunks of equal layers (else as `pp` says), chunk k
    on stage k mod pp.
    More than 1 needs schedule "interleaved", pp > 1 and microbatches a multiple of pp."""
    remat: str = "none"
    """Activation recomputation: "none", "selective" (recompute only each layer's
    attention core, Korthikanti et al.), "projections" (keep each layer's input and its
    projections' outputs, recompute the rest of it: MaxText's `minimal`), or "full" (keep
    each layer's input, recompute its forward inside the backward)."""
    remat_layers: int | None = None
    """With remat "full": recompute only the first k transformer layers of each stage and
    keep the others' activations (Megatron's "recompute k layers"); None: all of them."""
    zero: int = 0
    """ZeRO stage over the data axis: 0 (none), 1, 2 or 3."""
    sequence_parallel: bool = False
    """Sequence parallelism (Korthikanti et al. 2022): the residual stream (norms, residual
    adds, dropout) split on the sequence over the tensor-parallel axis; needs tp > 1 and a
    sequence that tp divides."""
    attention: str = "written"
    """Each layer's attention core: "written" (as the program writes it: scores and
    softmax in memory) or "flash" (one call to the Pallas flash kernel, as MaxText's
    `attention='flash'`; TPU targets, one-stage plans)."""
    name: str = "recipe"
    """The plan's name."""


def recipe_plan(graph: Graph, groups: Groups, cluster: Cluster, recipe: Recipe) -> Plan:
    """The Plan of `recipe` for this program on `cluster` (not priced), or a one-line
    PlanError naming what does not divide or fit and what to change."""
    _check_sizes(cluster, recipe)
    batch = groups.batch_size
    if batch is None:  # a batch of one (or no `batch` argument): nothing to split
        if recipe.dp > 1 or recipe.pp > 1:
            raise PlanError(
                "this step has no batch dimension to split (a batch of one, or no argument "
                "named `batch`): use dp=1 and pp=1."
            )
        batch = 1
    if batch % recipe.dp:
        raise PlanError(
            f"the batch of {batch} does not divide by dp={recipe.dp}: choose a data size "
            "that divides the batch."
        )
    m = _microbatches(batch, recipe)
    stack = scanned_layers(graph) if recipe.pp > 1 else None
    if stack is not None:
        raise PlanError(
            f"pp={recipe.pp} needs stage cuts between layers, but {stack.why_no_cuts()} "
            "Or use pp=1."
        )
    assignment = axis_assignment(batch_groups(groups), DATA, recipe.dp)
    if recipe.tp > 1:
        blocks = block_groups(groups)
        split = axis_assignment(blocks, MODEL, recipe.tp)
        if not split or len(split) < len(blocks):
            sizes = sorted({g.divisor for g in blocks if g.divisor % recipe.tp})
            raise PlanError(
                f"tp={recipe.tp} does not divide what tensor parallelism splits "
                f"(sizes {sizes[:4]}: heads, MLP width or vocabulary): choose a tp that "
                "divides them."
            )
        assignment.update(split)
    mesh = {k: v for k, v in ((DATA, recipe.dp), (MODEL, recipe.tp)) if v > 1} or {DATA: 1}
    remat = {} if recipe.remat == "none" else dict(remat=True, remat_policy=recipe.remat)
    if recipe.remat_layers is not None:
        remat["remat_layers"] = recipe.remat_layers
    if recipe.pp == 1 and m == 1:
        plan = plan_from_assignment(
            graph, groups, mesh, assignment, name=recipe.name, zero_stage=recipe.zero
        )
    else:
        # One stage with microbatches is gradient accumulation: the staged runtime, no cut.
        v = recipe.virtual_stages
        cuts = layer_cuts(graph, groups, recipe.pp, v) if recipe.pp > 1 else ()
        plan = pipeline_plan(
            graph, groups, cuts, mesh, assignment, m, recipe.schedule, name=recipe.name,
            zero_stage=recipe.zero, virtual_stages=v,
        )  # fmt: skip
    plan = _fits_layers(
        graph, groups, dataclasses.replace(plan, attention=recipe.attention, **remat)
    )
    if recipe.sequence_parallel:
        plan = sequence_parallel(graph, groups, plan, MODEL)
    return _with_split_note(graph, groups, recipe, plan)


def _with_split_note(graph: Graph, groups: Groups, recipe: Recipe, plan: Plan) -> Plan:
    """`plan`, noting how it split the layers where its stages do not hold equal ones."""
    if recipe.pp == 1:
        return plan
    counts = layer_split(layer_count(graph, groups), recipe.pp * recipe.virtual_stages)
    if len(set(counts)) == 1:
        return plan
    notes = (*plan.provenance.notes, split_note(counts, recipe.pp))
    return dataclasses.replace(plan, provenance=dataclasses.replace(plan.provenance, notes=notes))


def _fits_layers(graph: Graph, groups: Groups, plan: Plan) -> Plan:
    """`plan`, or a one-line error where `remat_layers` is more than a stage holds."""
    k = plan.remat_layers
    if not plan.remat or k is None:
        return plan
    held = min(stage_layer_counts(graph, groups, plan))
    if k > held:
        raise PlanError(
            f"remat_layers={k}, but a stage holds {held} layer(s): use at most {held}, or "
            "leave remat_layers unset to recompute every layer."
        )
    return plan


def _check_sizes(cluster: Cluster, recipe: Recipe) -> None:
    for field in ("tp", "pp", "dp"):
        value = getattr(recipe, field)
        if not isinstance(value, int) or value < 1:
            raise PlanError(f"{field} must be a positive integer, not {value!r}.")
    total = recipe.tp * recipe.pp * recipe.dp
    if total != cluster.devices:
        raise PlanError(
            f"tp × pp × dp = {recipe.tp} × {recipe.pp} × {recipe.dp} = {total}, but the "
            f"cluster has {cluster.devices} devices: make the product equal the device count."
        )
    if cluster.devices_per_node % recipe.tp:
        raise PlanError(
            f"tp={recipe.tp} does not fit a node of {cluster.devices_per_node} devices: "
            "tensor parallelism stays inside a node; use a tp that divides it."
        )
    v = recipe.virtual_stages
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise PlanError(f"virtual_stages must be a positive integer, not {v!r}.")
    if v > 1 and recipe.pp == 1:
        raise PlanError(
            f"virtual_stages={v} interleaves the stages of a pipeline, but pp=1: use pp 2 "
            "or more, or virtual_stages 1."
        )
    # A registered name able to run v chunks per stage, or one line saying why not.
    schedule = pipeline_schedule(recipe.schedule, v)
    if recipe.sequence_parallel and recipe.tp == 1:
        raise PlanError(
            "sequence parallelism splits the residual stream over the tensor-parallel "
            "axis, but tp=1: use tp > 1, or drop sequence_parallel."
        )
    if recipe.remat not in REMAT:
        raise PlanError(f"remat {recipe.remat!r}: use one of {', '.join(REMAT)}.")
    if recipe.attention not in ATTENTIONS:
        raise PlanError(f"attention {recipe.attention!r}: use one of {', '.join(ATTENTIONS)}.")
    check_remat(schedule, recipe.remat != "none")  # ZB-H1's split backward: not with remat
    _check_remat_layers(recipe)
    if recipe.zero not in (0, 1, 2, 3):
        raise PlanError(f"zero {recipe.zero!r}: use 0, 1, 2 or 3.")
    if recipe.microbatch_size is not None and recipe.microbatches is not None:
        raise PlanError("give microbatch_size or microbatches, not both.")


def _check_remat_layers(recipe: Recipe) -> None:
    k = recipe.remat_layers
    if k is None:
        return
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise PlanError(f"remat_layers must be a whole number >= 1 (layers per stage), not {k!r}.")
    if recipe.remat != "full":
        raise PlanError(
            f"remat_layers={k} counts layers recomputed in full, but remat is "
            f"{recipe.remat!r}: use remat='full' (--remat full) with it."
        )


def _microbatches(batch: int, recipe: Recipe) -> int:
    local = batch // recipe.dp
    if recipe.microbatches is not None:
        m = recipe.microbatches
        if m < 1 or local % m:
            raise PlanError(
                f"{m} microbatches do not divide the {local} sequences each data replica "
                f"gets (batch {batch} / dp {recipe.dp}): choose a divisor of {local}."
            )
    elif recipe.microbatch_size is not None:
        b = recipe.microbatch_size
        if b < 1 or local % b:
            raise PlanError(
                f"microbatch size {b} does not divide the {local} sequences each data "
                f"replica gets (batch {batch} / dp {recipe.dp}): choose a divisor of {local}."
            )
        m = local // b
    else:
        m = 1
    return m


_DIGITS = re.compile(r"\d+")


def _layer_of(path: str) -> str | None:
    """The repeated layer a parameter belongs to: its path up to the first segment with
    a number in it (`['params']['layer_3']`), or None outside repeated layers."""
    parts = re.findall(r"\[[^\]]*\]|\.\w+", path)
    for k, part in enumerate(parts):
        if k > 0 and _DIGITS.search(part):
            return "".join(parts[: k + 1])
    return None


def _layer_reads(graph: Graph, groups: Groups) -> tuple[dict[int, int], dict[str, list[int]]]:
    """(forward op -> position, repeated layer -> positions of the forward ops that read
    its parameters, directly or through a cast)."""
    fwd = forward_ops(graph, groups)
    pos = {i: k for k, i in enumerate(fwd)}
    owner = {
        leaf.tensor: layer
        for leaf in graph.leaves(Role.PARAM)
        if (layer := _layer_of(leaf.path)) is not None
    }
    reads: dict[str, list[int]] = {}
    for op in graph.ops:  # in program order: the weight casts run before the forward
        layers = {owner[t] for t in op.inputs if t in owner}
        if op.index in pos:
            for layer in layers:
                reads.setdefault(layer, []).append(pos[op.index])
        elif len(layers) == 1 and op.primitive in _CASTS:
            owner.update(dict.fromkeys(op.outputs, next(iter(layers))))
    return pos, reads


_CASTS = frozenset({"convert_element_type", "copy", "reshape"})


def layer_boundaries(graph: Graph, groups: Groups) -> tuple[int, ...]:
    """Per run of cheap cuts (`cut_runs`), its cheapest cut that no repeated layer
    straddles: each starts a layer, as a Megatron stage boundary does (the runs between a
    block's attention and its MLP are left out). Without repeated layers, every candidate.

    The run's own candidate (its first cheapest cut) serves when it is a layer's start (a
    pre-LN layer starts with its norm). A post-LN layer (BERT's) ends with its norm, which
    the run goes through: the candidate, before the norm, is inside the layer, and the cut
    after the norm, as cheap within `BAND`, is the boundary."""
    pos, reads = _layer_reads(graph, groups)
    spans = [(min(v), max(v)) for v in reads.values()]
    out = []
    for run in cut_runs(graph, groups):
        free = [
            (bytes_, c)
            for c, bytes_ in zip(run.cuts, run.crossing, strict=True)
            if not any(lo < pos[c] <= hi for lo, hi in spans)
        ]
        if free:
            out.append(min(free, key=lambda bc: (bc[0], bc[1]))[1])
    return tuple(out)


def layer_split(layers: int, parts: int) -> tuple[int, ...]:
    """Layers per part (stage, or chunk when interleaved) for `layers` over `parts`:
    equal where `parts` divides `layers`, else Llama 3's uneven split (Dubey et al. 2024,
    on pipeline parallelism): every part holds ceil(layers / parts) or one fewer, the
    fewer going to the ends first (the last part, then the first, then inward), as the
    last holds the head and loss and the first the embedding. A one-line PlanError where
    parts > layers."""
    if not 1 <= parts <= layers:
        raise PlanError(f"{layers} layers do not split into {parts} parts of one layer or more.")
    per = -(-layers // parts)
    counts = [per] * parts
    # Outside in: last, first, second-to-last, second, ...; at most parts - 1 of them.
    ends = [k for pair in zip(range(parts - 1, -1, -1), range(parts), strict=True) for k in pair]
    short = list(dict.fromkeys(ends))[: per * parts - layers]
    for k in short:
        counts[k] -= 1
    return tuple(counts)


def split_note(counts: tuple[int, ...], stages: int) -> str:
    """The plan's note for an uneven split: how many layers each stage (each chunk,
    interleaved: chunk k on stage k mod `stages`) holds."""
    what = "stage" if len(counts) == stages else f"chunk (chunk k on stage k mod {stages})"
    return (
        f"layers per {what}: {','.join(map(str, counts))} ({len(counts)} does not divide "
        f"{sum(counts)} layers: the ends hold fewer, as Llama 3's first and last stages do)"
    )


def layer_count(graph: Graph, groups: Groups) -> int:
    """How many repeated layers the program has (parameters owned by a numbered path)."""
    return len(_layer_reads(graph, groups)[1])


def layer_cuts(graph: Graph, groups: Groups, stages: int, chunks: int = 1) -> tuple[int, ...]:
    """`stages * chunks - 1` cuts, each before a layer, giving the stages (the chunks of
    them, interleaved) the layers of `layer_split`: equal where they divide (Megatron's
    stages; the embedding rides with the first, the head with the last), else the ends
    one fewer (Llama 3's)."""
    pos, reads = _layer_reads(graph, groups)
    starts = sorted(min(v) for v in reads.values())  # each layer's first read
    if len(starts) < stages * chunks:
        n = stages * chunks
        what = (
            f"{n} stages"
            if chunks == 1
            else f"pp × virtual_stages = {stages} × {chunks} = {n} chunks"
        )
        raise PlanError(
            f"{len(starts)} layers do not split into {what} of a layer or more: "
            f"use a pp{' × virtual_stages' if chunks > 1 else ''} of at most {len(starts)}."
        )
    counts = layer_split(len(starts), stages * chunks)
    bounds = layer_boundaries(graph, groups)
    cuts = []
    for j in itertools.accumulate(counts[:-1]):
        # The boundary before layer j: the last one between layer j - 1 and layer j.
        between = [b for b in bounds if starts[j - 1] < pos[b] <= starts[j]]
        if not between:
            raise PlanError(f"no place to cut before layer {j}: use fewer stages.")
        cuts.append(between[-1])
    return tuple(cuts)
