"""What verify found, as data: `VerifyReport` and its summary in words.

A frozen record of the cost model's figures next to XLA's (collectives, memory, FLOPs,
per stage for a pipeline) and the numerics verdict; it goes to JSON and back
(`to_dict`/`from_dict`) because a plan for more devices than this process has is
verified in a child process (`_subprocess.py`). Kept apart from the compiling
(`_compiled.py`) so what is found and how it is said change apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from ._compare import TOLERANCE, TRIVIAL, fmt_bytes


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """The cost model's collectives against XLA's, and numerics against the plain step."""

    mesh: Mapping[str, int]
    # True/False once compared; None when no cost model prediction was available.
    collectives_match: bool | None
    predicted_comm_bytes: Mapping[str, float]  # "kind@axis" -> bytes per device per step
    xla_comm_bytes: Mapping[str, float]
    mismatches: tuple[str, ...] = ()  # one line in words per disagreement
    notes: tuple[str, ...] = ()  # caveats that are not disagreements
    numerics_ok: bool | None = None  # None: no concrete arguments were given
    max_abs_err: float | None = None
    # Peak memory per device: the cost model's, and XLA's buffer assignment of the compiled
    # program (arguments + outputs + temporaries - aliased); None where not compared.
    predicted_memory_bytes: float | None = None
    xla_memory_bytes: float | None = None
    # What each side's peak is made of: the cost model's breakdown ("params", "grads",
    # "opt_state", "activations", "other"), and XLA's ("arguments", "outputs",
    # "temporaries", "aliased"); a pipeline's are its largest stage's.
    predicted_memory_breakdown: Mapping[str, float] = dataclasses.field(default_factory=dict)
    xla_memory_breakdown: Mapping[str, float] = dataclasses.field(default_factory=dict)
    # XLA's TPU live peak (`_compare.live_peak`: the arguments and the temporaries alive
    # at once in HBM, or in the chip's VMEM where that holds more, before placement; a
    # pipeline's largest stage's, as `run.memory(live=True)` combines its programs');
    # None elsewhere. Shown beside the buffer assignment, so a gap can be told apart: the
    # bytes alive, or where XLA lays them.
    xla_live_peak_bytes: float | None = None
    # FLOPs per device per step: the cost model's (remat's recompute included), the same
    # counted as XLA counts them (`_flops.py`: loop bodies once, no padded convolution
    # taps), and XLA's `cost_analysis()` ("flops" + "transcendentals"); a pipeline's are
    # its busiest stage's (every program it runs, times its runs).
    predicted_flops: float | None = None
    predicted_flops_as_xla: float | None = None
    xla_flops: float | None = None
    # Pipeline plans, per stage: (predicted, XLA) peak memory per device, and (predicted,
    # as XLA counts, XLA) FLOPs per device per step.
    stage_memory_bytes: tuple[tuple[float | None, float | None], ...] = ()
    stage_flops: tuple[tuple[float, float, float | None], ...] = ()
    # The GPU ("a100", "h100", "h200") or TPU topology ("v5p:4x4x4") the plan was compiled for
    # without one; None: a CPU mesh.
    target: str | None = None
    # Bytes per "kind@axis" of the collectives XLA's schedule overlaps with compute (some
    # compute between their start and done, `_schedule.py`); the cost model overlaps none.
    xla_overlapped_bytes: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def summary(self) -> str:
        mesh = " × ".join(f"{k}={v}" for k, v in self.mesh.items()) or "one device"
        kind = "TPU devices" if ":" in str(self.target) else "GPUs"  # "v5p:4x4x4", "a100"
        where = f"compile-only {self.target} {kind}" if self.target else "CPU devices"
        lines = [f"verify: mesh {mesh} ({int(np.prod(list(self.mesh.values())))} {where})"]
        verdict = {True: "match", False: "DO NOT MATCH", None: "not compared (no cost model)"}
        lines.append(
            f"collectives: {verdict[self.collectives_match]} (each kind@axis within "
            f"{TOLERANCE:.0%} in bytes; under {TRIVIAL:.0%} of all traffic is trivial)"
        )
        keys = sorted(set(self.predicted_comm_bytes) | set(self.xla_comm_bytes))
        width = max([len(k) for k in keys] + [9])
        lines.append(f"  {'kind@axis':<{width}}  {'predicted':>12}  {'XLA':>12}")
        for k in keys:
            p, x = self.predicted_comm_bytes.get(k), self.xla_comm_bytes.get(k)
            lines.append(f"  {k:<{width}}  {fmt_bytes(p):>12}  {fmt_bytes(x):>12}")
        lines += [f"  - {m}" for m in self.mismatches]
        lines += [f"  note: {n}" for n in self.notes]
        if self.predicted_memory_bytes is not None and self.xla_memory_bytes:
            ratio = self.predicted_memory_bytes / self.xla_memory_bytes
            lines.append(
                f"memory per device: predicted {fmt_bytes(self.predicted_memory_bytes)}, XLA's "
                f"buffer assignment {fmt_bytes(self.xla_memory_bytes)} ({ratio:.2f}x)"
            )
            if self.xla_live_peak_bytes:
                lines.append(
                    f"  XLA's live peak {fmt_bytes(self.xla_live_peak_bytes)} "
                    f"({self.predicted_memory_bytes / self.xla_live_peak_bytes:.2f}x): the most "
                    "bytes its schedule holds at once in HBM, or in VMEM where that holds "
                    "more, before its placement leaves gaps"
                )
            for side, parts in (
                ("predicted", self.predicted_memory_breakdown),
                ("XLA", self.xla_memory_breakdown),
            ):
                if parts:
                    text = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in parts.items())
                    lines.append(f"  {side}: {text}")
        if self.xla_flops and self.predicted_flops_as_xla is not None:
            lines.append(
                f"FLOPs per device per step: predicted {self.predicted_flops:.4g}"
                f" ({self.predicted_flops_as_xla:.4g} as XLA counts), XLA's cost analysis "
                f"{self.xla_flops:.4g} ({self.predicted_flops_as_xla / self.xla_flops:.2f}x)"
            )
        for s, ((pm, xm), (pf, pfx, xf)) in enumerate(
            zip(self.stage_memory_bytes, self.stage_flops, strict=True)
        ):
            mem = f"{pm / xm:.2f}x" if pm and xm else "not compared"
            fl = f"{pfx / xf:.2f}x" if xf else "not compared"
            lines.append(
                f"  stage {s}: memory predicted {fmt_bytes(pm)}, XLA {fmt_bytes(xm)} ({mem}); FLOPs "
                f"predicted {pf:.4g} ({pfx:.4g} as XLA counts), XLA {_fmt_flops(xf)} ({fl})"
            )
        if self.numerics_ok is not None:
            ok = "ok" if self.numerics_ok else "DIFFERENT"
            lines.append(f"numerics vs the unsharded step: {ok} (max |err| {self.max_abs_err:.3g})")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> VerifyReport:
        tuples = {k: tuple(d.get(k, ())) for k in ("mismatches", "notes")}
        for k in ("stage_memory_bytes", "stage_flops"):
            tuples[k] = tuple(tuple(row) for row in d.get(k, ()))
        return cls(**{**d, **tuples})


def _fmt_flops(n: float | None) -> str:
    return "—" if n is None else f"{n:.4g}"
