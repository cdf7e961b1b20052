"""Gradient accumulation in a pipeline step: running sums, reduced once per step.

- Accumulated tensors (a weight's gradient, the loss sum) are added up on their stage in
  the schedule's order (GPipe adds the last microbatch first), in place: the first "B"
  (or "F") unit makes the running sums, every later one takes them as donated inputs and
  returns them with its own added (`adding`), so XLA writes into the same buffers
  (Megatron-LM's main_grad). One buffer per tensor (per device: its own partial sum, the
  size of the reduced tensor), never a second copy.
- With more than one microbatch, the op that sums such a tensor over the batch (a
  contraction or reduce_sum over it) runs under `jax.shard_map` with the batch's mesh
  axes manual (the others stay XLA's), so the segment returns each device's partial sum
  on a leading axis split over those axes: [d, *shape], no collective (`partial_sum`).
- After the stage's last unit, one "reduce" program per stage sums the leading axis
  (`total`): one all-reduce over the data axes per step (XLA combines the stage's
  tensors), as Megatron-LM reduces gradients once per step, not once per microbatch. With
  ZeRO the plan pins the gradients to the ZeRO layout: the sums stay whole per device in
  F and B, and the reduce program reduce-scatters them into that layout (DeepSpeed's ZeRO).

`Accumulation` is mixed into the pipeline runtime (`_pipelined.py`): it reads the plan,
stage meshes, graph, partition, groups and input specs the runtime sets, and is kept apart
so the data-parallel reduction, which the cost model prices on its own, reads in one place.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._axes import DATA
from .._pipeline import SUMS
from ._compiler import compiler_options
from ._segments import batch_dim


class Accumulation:
    """The pipeline runtime's partial sums, running sums and per-stage reduce programs.

    A mixin of the runtime (`_pipelined._Pipeline`), which sets what these methods read:
    `plan`, `meshes`, `graph`, `part` (the partition), `groups`, `spec` (the input leaves'
    specs), `micro` (the per-microbatch segments), and `partial` (`partial_ops`) with
    `deferred` (the tensors those ops make) before it compiles its segments."""

    def _stage_of(self, t: int) -> int:
        return self.part.op_stage[self.graph.tensors[t].producer]

    def _batch_axes(self) -> dict[int, tuple[str, ...]]:
        """The mesh axes each batch group is split on, read from the plan's specs of the
        batched inputs and its constraints on batched tensors."""
        found: dict[int, tuple[str, ...]] = {}
        sources = [(leaf.tensor, self.spec[leaf.tensor]) for leaf in self.graph.inputs]
        sources += list(self.plan.constraints.items())
        for t, spec in sources:
            if t not in self.part.batched or t >= len(self.graph.tensors):
                continue
            d = batch_dim(self.groups, t)
            entry = spec[d] if d is not None and d < len(spec) else None
            axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            if axes:
                found.setdefault(self.groups.tensor_groups[t][d], axes)
        return found

    def partial_ops(self) -> dict[int, tuple[str, ...]]:
        """Per-microbatch ops that sum an accumulated tensor over a split batch: op index
        -> the mesh axes of that split (what their "reduce" program reduces over). An op
        whose batched inputs are split on different axes, or whose result the plan splits
        on them, is left to XLA."""
        graph, part = self.graph, self.part
        axes_of = self._batch_axes()
        accumulated = set(part.accumulated)
        out: dict[int, tuple[str, ...]] = {}
        for op in graph.ops:
            if not part.op_phase[op.index].per_microbatch:
                continue
            if op.primitive not in SUMS or not accumulated.intersection(op.outputs):
                continue
            mesh = self.meshes[part.op_stage[op.index]].shape
            found = {
                axes_of.get(self.groups.tensor_groups[u][batch_dim(self.groups, u)], ())
                for u in op.inputs
                if u in part.batched
            }
            if len(found) != 1 or not (axes := found.pop()) or any(a not in mesh for a in axes):
                continue
            # A result the plan splits over those very axes (ZeRO's gradients) is summed
            # whole per device here and reduce-scattered into that layout by the stage's
            # "reduce" program, once per step.
            out[op.index] = axes
        return out

    def jit(self, fn: Callable, stage: int, donate: tuple[int, ...] = ()) -> Callable:
        """`fn` jitted for stage `stage`'s mesh, with the compiler options of its backend
        (`_compiler.py`: XLA's TPU overlap flags on TPUs, none elsewhere)."""
        options = compiler_options(self.meshes[stage])
        return jax.jit(fn, donate_argnums=donate, compiler_options=options)

    def _reducer(self, tensors: tuple[int, ...], s: int) -> Callable:
        """Stage s's once-per-step program: each deferred tensor's partial sums ([d, ...],
        the leading axis split over the batch's axes) summed into the tensor, with the
        layout the plan asks of it where it asks one."""
        mesh = self.meshes[s]
        wanted = self.wanted()
        specs = [self._scattered(t, wanted.get(t), mesh) for t in tensors]
        shardings = [
            None if spec is None else NamedSharding(mesh, PartitionSpec(*spec)) for spec in specs
        ]

        def reduce(*partials: Any) -> tuple[Any, ...]:
            sums = [total(p) for p in partials]
            return tuple(
                x if sh is None else jax.lax.with_sharding_constraint(x, sh)
                for x, sh in zip(sums, shardings, strict=True)
            )

        return self.jit(reduce, s)

    def _scattered(self, t: int, spec: tuple | None, mesh: Mesh) -> tuple | None:
        """The layout a ZeRO plan's reduce program leaves a gradient in. The plan pins the
        float32 gradients to the ZeRO layout but leaves a 16-bit one free (one program
        would sum it after its cast to float32): here it is summed in its own dtype
        anyway (`total`), so it is reduce-scattered too, with the data axis on its dim
        linked to one the update's ops that read it take it on."""
        data, graph = DATA, self.graph
        if self.plan.zero_stage < 1 or mesh.shape.get(data, 1) == 1 or not graph.tensors[t].ndim:
            return spec
        spec = tuple(spec) if spec is not None else (None,) * graph.tensors[t].ndim
        if any(data in _axes_of(e) for e in spec):
            return spec
        wanted = self.wanted()
        linked = {
            g
            for c in graph.consumers()[t]
            for u in graph.ops[c].outputs
            for e, g in zip(wanted.get(u, ()), self.groups.tensor_groups[u], strict=False)
            if data in _axes_of(e)
        }
        for d, (e, g) in enumerate(zip(spec, self.groups.tensor_groups[t], strict=True)):
            size = mesh.shape[data] * math.prod(mesh.shape[a] for a in _axes_of(e))
            if g in linked and graph.tensors[t].shape[d] % size == 0:
                return (*spec[:d], axes_entry((*_axes_of(e), data)), *spec[d + 1 :])
        return spec

    def wanted(self) -> dict[int, tuple]:
        """Specs the plan fixes inside the step: its constraints, and an output spec acts
        as a constraint where the output is made."""
        wanted = dict(self.plan.constraints)
        for leaf in self.graph.outputs:
            if leaf.path in self.plan.out_specs and leaf.tensor not in self.part.batched:
                wanted.setdefault(leaf.tensor, self.plan.out_specs[leaf.path])
        return wanted

    def running_sums(self, bodies: dict[int, Callable]) -> tuple[dict, dict, dict]:
        """(per segment that makes accumulated tensors, those tensors; its `adding`
        program; per stage, its deferred tensors and their reduce program), from the
        segments' bodies."""
        part, m = self.part, self.plan.microbatches
        # A segment that makes accumulated tensors runs every microbatch after the first
        # as `adding`: it takes the running sums, donated, and returns them with its own
        # added, so a stage holds one copy of its gradients (Megatron's main_grad).
        sums = {
            id(seg): ts
            for seg in self.micro
            if seg.ops and m > 1 and (ts := tuple(t for t in seg.outputs if t in part.accumulated))
        }
        adding_programs = {
            id(seg): self.jit(
                adding(bodies[id(seg)], seg.outputs, sums[id(seg)]),
                seg.stage,
                tuple(range(len(seg.inputs), len(seg.inputs) + len(ts))),
            )
            for seg in self.micro
            if (ts := sums.get(id(seg)))
        }
        reducers = {
            s: (ts, self._reducer(ts, s))
            for s in range(len(self.meshes))
            if (ts := tuple(t for t in sorted(self.deferred) if self._stage_of(t) == s))
        }
        return sums, adding_programs, reducers

    def partial_sum(self, graph, i: int, mesh: Mesh) -> Callable:
        """Op i (a sum over the batch) computed by every device on its own examples: its
        result is [d, *shape], device k's partial sum at index k of the leading axis (split
        over the batch's axes), with no collective over them. The other axes stay XLA's."""
        eqn, op, axes = graph.eqns[i], graph.ops[i], self.partial[i]
        in_specs = []
        for u in op.inputs:
            d = batch_dim(self.groups, u) if u in self.part.batched else None
            spec = [None] * graph.tensors[u].ndim
            if d is not None:
                spec[d] = axes_entry(axes)
            in_specs.append(PartitionSpec(*spec))
        # A scatter-add adds its updates into its operand, batch-free as its result is (the
        # zeros of an embedding's gradient, in general any value): counted once, not d times.
        into_operand = op.primitive in ("scatter-add", "scatter_add")

        def local(*xs: Any) -> Any:
            if into_operand:
                first = jnp.all(jnp.array([jax.lax.axis_index(a) == 0 for a in axes]))
                xs = (jnp.where(first, xs[0], jnp.zeros_like(xs[0])), *xs[1:])
            return eqn.primitive.bind(*xs, **eqn.params)[None]

        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=tuple(in_specs),
            out_specs=PartitionSpec(axes_entry(axes)),
            axis_names=set(axes),
            check_vma=False,
        )


def adding(body: Callable, outputs: Sequence[int], sums: Sequence[int]) -> Callable:
    """`body` that also takes the running sums of its outputs `sums` (after its own
    inputs) and returns each with its own result added: XLA writes the sum into the
    donated running buffer."""
    at = [list(outputs).index(t) for t in sums]

    def run(*values: Any) -> tuple[Any, ...]:
        n = len(values) - len(at)
        outs = list(body(*values[:n]))
        for k, running in zip(at, values[n:], strict=True):
            outs[k] = running + outs[k]
        return tuple(outs)

    return run


def total(partials: Any) -> Any:
    """Partial sums ([d, ...]) summed over their leading axis in their own dtype, as
    Megatron-LM's runs reduce 16-bit gradients in 16 bits (and DeepSpeed by default):
    `jnp.sum` would sum a 16-bit float in float32, twice the bytes over the data axis,
    which `_cost/_pipelined.py` does not price."""
    return jax.lax.reduce(partials, jnp.zeros((), partials.dtype), jax.lax.add, (0,))


def _axes_of(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def axes_entry(axes: tuple[str, ...]) -> str | tuple[str, ...]:
    """A PartitionSpec entry for a dimension split over `axes`."""
    return axes[0] if len(axes) == 1 else axes


def without_axes(spec: tuple, axes: tuple[str, ...]) -> tuple:
    """`spec` with `axes` taken off every dimension (they split the partial sums' leading
    axis instead: a ZeRO gradient is whole per device until its reduce-scatter)."""
    out = []
    for e in spec:
        kept = tuple(a for a in ((e,) if isinstance(e, str) else e or ()) if a not in axes)
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return tuple(out)
