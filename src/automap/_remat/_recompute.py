"""Rematerialization as Megatron's full recomputation: keep each layer's input, recompute
the layer's forward inside the backward.

The captured step is already differentiated: its backward ops read forward tensors
directly, so `jax.checkpoint` around the user's function cannot apply any more. Instead the
program is re-run op by op (`_run/_interpret.py`, `_run/_recompute.py`) with the backward's reads redirected: the first
backward op that reads a tensor a layer made triggers that layer's recomputation from its
inputs, and every later backward read of the layer's tensors takes the recomputed value.
The original forward values then have no reader after the forward, so XLA frees them as
it goes; only the layers' inputs (and the tensors made outside any layer) stay alive.

Two things keep XLA from undoing this, as `jax.checkpoint`'s own lowering does: the
layer's inputs pass through `optimization_barrier` before the recompute (so CSE cannot
merge the recomputed ops with the forward ones), and the barrier also carries the
triggering backward op's backward-made inputs (so the scheduler cannot hoist the recompute
back next to the forward: it depends on the gradient arriving at that layer).

A layer is the program's repeating unit (`_units.py`: a transformer layer, its attention
and MLP blocks, the blocks being the runs of forward ops between consecutive pipeline cut
candidates), so only each transformer layer's input stays alive, as in Megatron. The
embedding before the first candidate and the head after the last one are not recomputed
(for a zoo transformer the candidates also fall inside the embedding and before the loss,
so the first layer carries the embedding's tail). The same `Recompute` drives the one-stage runtime
(`_run/_apply.py`), the pipeline's backward segments (`_run/_segments.recompute_segments`)
and the cost model (`remat_residuals`: what stays in memory; `Residuals.recomputed`: what runs
twice), so that the prices are those of the program that runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from .._capture import Residuals, find_residuals
from .._graph import Graph, TensorKind
from .._groups import Groups
from ._units import layer_ops


@dataclasses.dataclass(frozen=True)
class Recompute:
    """The layers recomputed in the backward and what that leaves alive."""

    boundary: int  # the last forward op: ops after it are the backward
    layers: tuple[tuple[int, ...], ...]  # forward op indices of each recomputed layer
    inputs: tuple[tuple[int, ...], ...]  # per layer: tensors it reads from outside
    owner: Mapping[int, int]  # tensor -> layer, for the tensors a backward read recomputes

    @property
    def ops(self) -> frozenset[int]:
        return frozenset(i for layer in self.layers for i in layer)

    def restricted(self, ops: Iterable[int]) -> Recompute:
        """The layers that lie inside `ops` (a pipeline stage's forward)."""
        keep = set(ops)
        ks = [k for k, layer in enumerate(self.layers) if layer and set(layer) <= keep]
        owner = {t: ks.index(k) for t, k in self.owner.items() if k in ks}
        return Recompute(
            self.boundary,
            tuple(self.layers[k] for k in ks),
            tuple(self.inputs[k] for k in ks),
            owner,
        )

    def rereading(self, tensors: Sequence[int]) -> Recompute:
        """This recompute with a unit of no ops per tensor of `tensors`: the backward's
        reads of it take a value fenced and tied as a recomputed layer's inputs are, so
        that XLA makes what it makes from it again there (a split tensor's gather) instead
        of keeping the forward's."""
        n = len(self.layers)
        return Recompute(
            self.boundary,
            self.layers + tuple(() for _ in tensors),
            self.inputs + tuple((t,) for t in tensors),
            {**self.owner, **{t: n + j for j, t in enumerate(tensors)}},
        )

    def only(self, ks: Iterable[int]) -> Recompute:
        """The layers numbered `ks` (in order), the others left to keep their activations."""
        ks = sorted(set(ks))
        return Recompute(
            self.boundary,
            tuple(self.layers[k] for k in ks),
            tuple(self.inputs[k] for k in ks),
            {t: ks.index(k) for t, k in self.owner.items() if k in ks},
        )


def recompute_plan(graph: Graph, groups: Groups) -> Recompute:
    """The layers (each cut to the ops its backward's reads need: XLA drops the others,
    e.g. the projection whose output only feeds the residual add) and their inputs."""
    return recompute_units(graph, layer_ops(graph, groups))


def megatron_recompute(graph: Graph, groups: Groups) -> Recompute:
    """Every layer recomputed whole, as Megatron-LM's full recomputation runs it: its
    `CheckpointFunction.backward` re-runs the checkpointed layers' forward function, so
    the layer's last matmul (the MLP's output projection), its all-reduce and the
    residual add run again, though no backward op reads what they make. XLA removes
    those from the recompute `recompute_plan` describes (what `am.apply` runs: on a 22B
    GPT layer at tp 8, 2.0 of the 7.7 ms Korthikanti et al.'s Table 4 measures for
    Megatron's recompute). No plan runs this one: the benchmarks price published Megatron
    runs with it (`_bench._korthikanti`, `_bench._megatron`)."""
    return recompute_units(graph, layer_ops(graph, groups), trim=False)


def recompute_units(graph: Graph, whole: Sequence[Sequence[int]], trim: bool = True) -> Recompute:
    """`recompute_plan` for any runs of forward ops recomputed as units (whole layers, or
    the attention cores of selective recomputation); `trim`: each cut to the ops the
    backward's reads need, as XLA compiles it (False: every op, `megatron_recompute`)."""
    boundary = find_residuals(graph).boundary
    borders = {t for layer in whole for t in _reads(graph, layer)}
    read_after = {t for op in graph.ops[boundary + 1 :] for t in op.inputs}
    if trim:
        layers = tuple(_needed(graph, layer, read_after - borders) for layer in whole)
    else:
        layers = tuple(tuple(layer) for layer in whole)
    inputs = tuple(_reads(graph, layer) for layer in layers)
    kept = {t for ins in inputs for t in ins}
    owner = {
        t: k
        for k, layer in enumerate(layers)
        for i in layer
        for t in graph.ops[i].outputs
        if t not in kept
    }
    return Recompute(boundary, layers, inputs, owner)


def _needed(graph: Graph, layer: Sequence[int], wanted: set[int]) -> tuple[int, ...]:
    """The ops of `layer` that the `wanted` tensors depend on, in program order."""
    want, keep = set(wanted), []
    for i in reversed(layer):
        if any(t in want for t in graph.ops[i].outputs):
            keep.append(i)
            want.update(graph.ops[i].inputs)
    return tuple(reversed(keep))


def remat_residuals(graph: Graph, groups: Groups, rc: Recompute | None = None) -> Residuals:
    """`find_residuals` with the rematerialized figures of the runtime's recomputation
    (`rc`, default every layer in full): `saved_remat` is what stays alive at the turn of
    the step (every saved tensor no layer recomputes, every layer's inputs, and the largest
    layer's recomputed residuals, alive while its backward runs); `recomputed` the ops that
    run a second time."""
    res = find_residuals(graph)
    rc = recompute_plan(graph, groups) if rc is None else rc
    saved = set(res.saved)
    per_layer = layer_residuals(graph, rc, saved)
    kept = {t for t in saved if t not in rc.owner}
    kept |= {t for ins in rc.inputs for t in ins if made_in_forward(graph, t, rc.boundary)}
    largest = max(per_layer, key=lambda ts: sum(graph.tensors[t].nbytes for t in ts), default=())
    return dataclasses.replace(
        res,
        saved_remat=tuple(sorted(kept | set(largest))),
        recomputed=tuple(sorted(rc.ops)),
        layer_saved=tuple(per_layer),
        reread=tuple(sorted(t for t, k in rc.owner.items() if not rc.layers[k])),
    )


def layer_residuals(graph: Graph, rc: Recompute, saved: set[int]) -> list[tuple[int, ...]]:
    """Per layer, the residuals its recomputation makes again (alive during its backward):
    not a reread unit's tensor, kept as it is (`Recompute.rereading`)."""
    out: list[list[int]] = [[] for _ in rc.layers]
    for t, k in rc.owner.items():
        if t in saved and rc.layers[k]:
            out[k].append(t)
    return [tuple(sorted(ts)) for ts in out]


def _reads(graph: Graph, ops: Sequence[int]) -> tuple[int, ...]:
    inside = set(ops)
    return tuple(
        dict.fromkeys(
            t
            for i in ops
            for t in graph.ops[i].inputs
            if graph.tensors[t].producer not in inside
            and graph.tensors[t].kind is not TensorKind.CONST
        )
    )


def made_in_forward(graph: Graph, t: int, boundary: int) -> bool:
    p = graph.tensors[t].producer
    return graph.tensors[t].kind is TensorKind.INTERMEDIATE and p is not None and p <= boundary


def made_after(graph: Graph, t: int, boundary: int) -> bool:
    p = graph.tensors[t].producer
    return p is not None and p > boundary
