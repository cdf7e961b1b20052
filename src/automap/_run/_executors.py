"""What one pipeline step does with its values: the runtime's step walk (`_pipelined.py`)
calls these to run, move and combine them, so one walk serves three ends.

- `LIVE` (`Live`): real arrays on one host, moved by `jax.device_put`.
- `Hosts`: the live step under `jax.distributed`, every process making the same moves on
  global arrays (`_distributed.move`: `device_put` cannot cross processes off TPU).
- `Dry`: the step walked on abstract values: every segment is compiled for the shardings
  the live step would hand it, nothing runs. `run.compile(*args)` returns its programs
  (`SegmentProgram`) and `run.memory(*args)` its per-stage peaks; that is what
  `am.verify` reads the collectives and memory of.
Kept apart from the pipeline so the step walk cannot tell a dry run from a live one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from .._pipeline import Phase
from ._distributed import move
from ._hbm import hbm_options, no_room, out_of_hbm
from ._segments import Segment


@dataclasses.dataclass(frozen=True, eq=False)
class SegmentProgram:
    """One XLA program of a pipeline step, as `run.compile` found it."""

    stage: int
    # A segment's phase (PRE, FWD, BWD, POST); REDUCE: a stage's once-per-step reduction
    # of its partial sums; None: the runtime joining microbatches' outputs (a concat)
    kind: Phase | None
    runs: int  # times one step runs it (m for F and B, 1 for pre, reduce and post)
    # The stage mesh it is compiled on: its device ids are this mesh's devices in
    # row-major order, which is how `_hlo.axis_of` reads replica groups.
    mesh: dict[str, int]
    compiled: Any  # jax.stages.Compiled: `.as_text()` is the partitioned HLO


class Live:
    """What a step does with its values: run, move and combine real arrays."""

    def call(
        self, seg: Segment, jitted: Callable, values: list[Any], adding: bool = False
    ) -> list[Any]:
        """Run a segment's program (`adding`: its variant adding into running sums)."""
        return list(jitted(*values))

    def reduce(self, stage: int, jitted: Callable, values: list[Any]) -> list[Any]:
        return list(jitted(*values))

    def watch(self, held: Callable[[], list[Any]]) -> None:
        """`held()` lists the values the step holds at any moment (read by `Dry`)."""

    def put(self, value: Any, sharding: NamedSharding) -> Any:
        if isinstance(value, jax.Array) and value.sharding == sharding:
            return value  # what device_put returns, without its host time (`placed`)
        return jax.device_put(value, sharding)

    def slice(self, x: Any, dim: int, i: int, m: int) -> Any:
        return _slice(x, dim, i, m)

    def concat(self, xs: list[Any], dim: int, stage: int) -> Any:
        return jnp.concatenate(xs, axis=dim)


LIVE = Live()


class Hosts(Live):
    """The live step under jax.distributed: every process makes the same moves, on global
    arrays, each doing the part its devices hold (`_distributed.move`)."""

    def __init__(self, meshes: list[Mesh]) -> None:
        self._meshes = meshes

    def put(self, value: Any, sharding: NamedSharding) -> Any:
        return move(value, sharding, self._meshes)


class Dry(Live):
    """The same moves on ShapeDtypeStructs carrying shardings: each program is compiled
    for the shardings the live step would give its inputs (a jitted segment is compiled
    once per input signature, as jit's cache does), counted per run, and not run."""

    def __init__(self, meshes: list[Mesh], hbm: float | None = None) -> None:
        self._meshes = meshes
        # A TPU chip's HBM to compile each program within (`_hbm.py`): what the stage
        # holds beside the program when it is first compiled taken off (None: a whole chip)
        self._hbm = hbm
        self._found: dict[Any, tuple[int, str, Any]] = {}
        self._runs: dict[Any, int] = {}
        self._held: Callable[[], list[Any]] = list
        self.peak = [0.0] * len(meshes)  # per stage, bytes per device (`memory`)
        # the same with each program's live peak for its own part (`memory(live=True)`)
        self.live = [0.0] * len(meshes)

    def watch(self, held: Callable[[], list[Any]]) -> None:
        self._held = held

    def _kept(self, stage: int, values: list[Any]) -> int:
        """Bytes per device the stage holds beside a program run on `values`."""
        devices = set(self._meshes[stage].devices.flat)
        args = {id(v) for v in values}
        others = {id(v): v for v in self._held() if id(v) not in args}
        return sum(
            _device_bytes(v)
            for v in others.values()
            if getattr(v, "sharding", None) is not None and v.sharding.device_set <= devices
        )

    def _note_peak(self, stage: int, compiled: Any, values: list[Any]) -> None:
        """The stage's bytes per device while `compiled` runs on `values`."""
        stats = compiled.memory_analysis()
        if stats is None:
            return
        kept = self._kept(stage, values)
        own = (
            stats.argument_size_in_bytes
            + stats.output_size_in_bytes
            + stats.temp_size_in_bytes
            - stats.alias_size_in_bytes
        )
        self.peak[stage] = max(self.peak[stage], float(kept + own))
        # XLA's TPU figure of the program's bytes alive at once: arguments, outputs and the
        # temporaries live at the busiest step of HBM, or of VMEM where that holds more
        # (`_verify._compare.live_peak`)
        live = getattr(stats, "peak_memory_in_bytes", 0)
        self.live[stage] = max(self.live[stage], float(kept + live))

    @property
    def programs(self) -> dict[Any, SegmentProgram]:
        return {
            key: SegmentProgram(
                stage, kind, self._runs[key], dict(self._meshes[stage].shape), compiled
            )
            for key, (stage, kind, compiled) in self._found.items()
        }

    def _compile(
        self, key: Any, stage: int, kind: Phase | None, jitted: Callable, values
    ) -> list[Any]:
        key = (key, tuple((v.shape, v.dtype, v.sharding) for v in values))
        if key not in self._found:
            self._found[key] = (stage, kind, self._compiled(stage, jitted, values))
        self._runs[key] = self._runs.get(key, 0) + 1
        self._note_peak(stage, self._found[key][2], values)
        outs = self._found[key][2].out_info
        return [jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=o.sharding) for o in outs]

    def _compiled(self, stage: int, jitted: Callable, values: list[Any]) -> Any:
        """`jitted` compiled for `values`, within the chip's HBM less what the stage holds
        beside it where a limit is given."""
        lowered = jitted.lower(*values)
        if self._hbm is None:
            return lowered.compile()
        kept = self._kept(stage, values)
        if kept >= self._hbm:
            raise no_room(self._hbm, kept)
        try:
            return lowered.compile(hbm_options(self._hbm - kept))
        except Exception as e:
            short = out_of_hbm(e, self._hbm, besides=kept)
            if short is None:
                raise
            raise short from None

    def call(
        self, seg: Segment, jitted: Callable, values: list[Any], adding: bool = False
    ) -> list[Any]:
        return self._compile((id(seg), adding), seg.stage, seg.kind, jitted, values)

    def reduce(self, stage: int, jitted: Callable, values: list[Any]) -> list[Any]:
        return self._compile(("reduce", stage), stage, Phase.REDUCE, jitted, values)

    def put(self, value: Any, sharding: NamedSharding) -> Any:
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)

    def slice(self, x: Any, dim: int, i: int, m: int) -> Any:
        shape = list(x.shape)
        shape[dim] //= m
        if getattr(x, "sharding", None) is None:  # the caller's leaf: placed right after
            return jax.ShapeDtypeStruct(tuple(shape), x.dtype)
        # A per-step value made on a stage: the slice's layout is XLA's choice. (Batched
        # values are made per microbatch, so no step reaches this today.)
        compiled = jax.jit(_slice, static_argnums=(1, 2, 3)).lower(x, dim, i, m).compile()
        out = compiled.out_info
        return jax.ShapeDtypeStruct(out.shape, out.dtype, sharding=out.sharding)

    def concat(self, xs: list[Any], dim: int, stage: int) -> Any:
        join = jax.jit(lambda *xs: jnp.concatenate(xs, axis=dim))
        return self._compile(("concat", dim), stage, None, join, xs)[0]


def _device_bytes(value: Any) -> int:
    """Bytes of one device's shard of a value with a sharding."""
    shape = value.sharding.shard_shape(value.shape)
    return math.prod(shape) * value.dtype.itemsize  # a typed PRNG key has no np.dtype


def _slice(x: Any, dim: int, i: int, m: int) -> Any:
    """Microbatch i of m: a contiguous block of the batch dimension."""
    n = x.shape[dim] // m
    index = [slice(None)] * len(x.shape)
    index[dim] = slice(i * n, (i + 1) * n)
    return x[tuple(index)]
