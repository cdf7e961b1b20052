"""MaxText's published TPU v5p table, priced by Auto-MAP, and the planner's plans.

MaxText's single-slice results on TPU v5p (`configs/v5p/README.md`, first in
AI-Hypercomputer/maxtext at 76bd53b0f, December 2023; now `src/maxtext/configs/tpu/v5p/`)
and the scripts that ran them (`32b.sh`, `64b.sh`, `128b.sh`): a Llama-style decoder
(SwiGLU, multi-head attention with heads of 128, no biases, untied output head),
sequence 2048, vocabulary 32,000, synthetic data, parameters float32 and compute bf16,
`remat_policy=minimal`, `attention='flash'`, `ici_fsdp_parallelism=-1` (the rest of the
slice) with `ici_tensor_parallelism` 4 or 8.

Each row is priced with MaxText's configuration as a `Recipe`:

- FSDP on the axis that carries the batch is ZeRO-3 on the data axis: parameters,
  gradients and Adam moments split over it, parameters gathered where used.
- `ici_tensor_parallelism` is tensor parallelism on the `model` axis.
- MaxText's activation sharding rule `['activation_embed', 'tensor']` (`base.yml`'s
  `logical_axis_rules`, e.g. at 000e9355) splits the residual stream between the layers'
  matmuls (norms, residual adds, each layer's input) over `tensor` by its width: our
  sequence parallelism on the `model` axis, which splits it by sequence. Both hold the
  stream 1/tensor per chip and make the same collectives, an all-gather before the
  column-parallel projections and a reduce-scatter after the row-parallel ones.
- `remat_policy=minimal` is our "projections". MaxText's `minimal` is
  `save_only_these_names` over every projection's output (query, key, value, attention
  out, the MLP's two input projections and its output; `decoders.py`, `minimal_policy`):
  with the scanned layer's input, which the scan keeps, that is what stays alive; the
  attention core between the projections (scores, softmax, context) and the elementwise
  work (norms, rotary, the SwiGLU product, the residual adds) are recomputed in the
  backward, no weight matmul is. Ours, "projections", recomputes each layer but its
  projections (`_remat.projection_gaps`). (MaxText's December 2023 `minimal`,
  `checkpoint_dots_with_no_batch_dims`, saves the same matmuls: the projections' weights
  have no batch dimension, the attention's two products do.)
- `attention='flash'` is our `attention="flash"`: each layer's attention core runs as
  one call to the Pallas flash kernel (MaxText's default TPU kernel is the splash
  variant of it; both skip the masked blocks and hold no scores), priced so
  (`_cost/_flash.py`).
- bf16 compute, float32 parameters and optimizer state: the zoo's Llama as it is.

TFLOP/s per chip is counted as MaxText counts it: `calculate_tflops_training_per_device`
in `src/maxtext/utils/maxtext_utils.py` at e591f30c (August 2026), its dense branch:
three times (forward and backward) the matmul FLOPs of the SwiGLU MLP, the Q/K/V and
output projections and the output head (not the input embedding, a gather), plus three
times causal attention, half of 4·b·s²·heads·head_dim, per layer; recomputation is not
counted. The count MaxText used when the table was published (`calculate_training_tflops`
in `train.py`, December 2023) is 6·params·b·s plus the same attention: it also counts the
input embedding, 0.8% more for 32B, 0.4% for 64B, 0.2% for 128B; the published
figures are within that of either count.

With a planner budget the planner (searcher "auto" unless told) also runs on each row's
model and slice, in a fresh process (`_isolated.plan_isolated`). Planning uses abstract
shapes only: no weights are allocated.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from .._api import plan_recipe
from .._plan import Plan
from .._space import Recipe
from ._isolated import PlanJob, plan_shape, planner_columns, train_step

SEQ, VOCAB, HEAD_DIM = 2048, 32000, 128
SWIGLU = 2  # MaxText's mlp_activations ["silu", "linear"]: two input projections
CLUSTER = "tpu-v5p"
REMAT = "projections"  # MaxText's remat_policy=minimal (see the module's docstring)
ATTENTION = "flash"  # MaxText's attention='flash': the Pallas kernel (`_run/_flash.py`)


@dataclasses.dataclass(frozen=True)
class MaxTextRow:
    """One row of the published table (one slice, `ici_fsdp` × `ici_tensor` chips)."""

    name: str  # as published: "32B"
    model: str  # the zoo preset with the row's shapes
    hidden: int
    heads: int
    ffn: int
    layers: int
    topology: str  # the slice's chips per torus dimension
    fsdp: int  # ici_fsdp_parallelism
    tensor: int  # ici_tensor_parallelism
    per_chip_batch: int  # per_device_batch_size
    published: float  # TFLOP/s per chip
    mfu: float  # as published, percent

    @property
    def chips(self) -> int:
        return self.fsdp * self.tensor

    @property
    def batch(self) -> int:
        """Global batch in sequences: MaxText's per-device batch times the chips."""
        return self.per_chip_batch * self.chips

    @property
    def slice_name(self) -> str:
        return f"v5p-{2 * self.chips}"  # a v5p slice is named by its TensorCores, two a chip


MAXTEXT_TABLE = (
    MaxTextRow("32B", "llama-32b", 8192, 64, 28672, 32, "4x4x4", 16, 4, 6, 328, 71.47),
    MaxTextRow("64B", "llama-64b", 8192, 64, 28672, 64, "4x4x4", 16, 4, 3, 323, 70.31),
    MaxTextRow("128B", "llama-128b", 8192, 128, 57344, 64, "4x4x8", 16, 8, 1, 315, 68.68),
)


def select_maxtext_rows(names: Sequence[str] = ()) -> tuple[MaxTextRow, ...]:
    """The rows whose published name ("32B", "128b") is listed; all if none."""
    wanted = {n.upper() for n in names}
    return tuple(r for r in MAXTEXT_TABLE if not wanted or r.name in wanted)


def maxtext_flops(row: MaxTextRow) -> float:
    """FLOPs per chip per step as MaxText counts them (the module's docstring)."""
    tokens = row.per_chip_batch * SEQ
    proj = row.heads * HEAD_DIM
    ffn = 2 * tokens * row.ffn * row.hidden * (SWIGLU + 1)
    qkv = 2 * tokens * row.hidden * 3 * proj  # multi-head: as many key/value heads as query
    out = 2 * tokens * row.hidden * proj
    head = 2 * tokens * row.hidden * VOCAB
    causal = 4 * row.per_chip_batch * SEQ**2 * proj / 2
    return 3 * ((ffn + qkv + out) * row.layers + head) + 3 * causal * row.layers


def tflops_per_chip(row: MaxTextRow, step_s: float) -> float:
    """TFLOP/s per chip of a step of `step_s` seconds, by MaxText's count."""
    return maxtext_flops(row) / step_s / 1e12


def job_of(row: MaxTextRow) -> PlanJob:
    """The row's model (the zoo's Llama, its shapes set explicitly) on its v5p slice."""
    settings = dict(
        layers=row.layers,
        hidden=row.hidden,
        heads=row.heads,
        kv_heads=row.heads,
        head_dim=HEAD_DIM,
        ffn=row.ffn,
        seq=SEQ,
        vocab=VOCAB,
        batch=row.batch,
    )
    return PlanJob(row.model, settings, CLUSTER, row.chips, row.topology)


def recipe_of(row: MaxTextRow) -> Recipe:
    """MaxText's configuration: FSDP as ZeRO-3 on `data`, tensor parallel on `model` with
    the residual stream split over it (`activation_embed`: sequence parallelism), the
    whole per-replica batch in one step (MaxText accumulates no gradients here)."""
    return Recipe(
        dp=row.fsdp,
        tp=row.tensor,
        zero=3,
        remat=REMAT,
        sequence_parallel=True,
        attention=ATTENTION,
        name=f"maxtext-{row.name}",
    )


def price_row(row: MaxTextRow) -> Plan:
    """MaxText's configuration of the row, priced by the cost model."""
    job = job_of(row)
    spec = job.spec()
    return plan_recipe(
        train_step(spec), *spec.abstract_args(), recipe=recipe_of(row), cluster=job.cluster_of()
    )


def maxtext_record(row: MaxTextRow, plan_s: float = 0.0, searcher: str = "auto") -> dict:
    """One row: the published figures, MaxText's configuration priced, and with
    `plan_s` > 0 the planner's plan found in that budget."""
    start = time.perf_counter()
    priced = price_row(row)
    cost = priced.predicted
    got = tflops_per_chip(row, cost.step_time_s)
    record = {
        **dataclasses.asdict(row),
        "config": plan_shape(priced),
        "chips": row.chips,
        "batch": row.batch,
        "slice": row.slice_name,
        "tflops_per_step": maxtext_flops(row) / 1e12,
        "predicted_tflops": got,
        "ratio": got / row.published,
        "step_s": float(cost.step_time_s),
        "compute_s": float(cost.compute_s),
        "comm_s": float(cost.comm_s),
        "memory_gb": cost.memory_bytes / 1e9,
        "params_gb": cost.memory_breakdown.get("params", 0.0) / 1e9,
        "activations_gb": cost.memory_breakdown.get("activations", 0.0) / 1e9,
        "feasible": bool(cost.feasible),
        "price_s": time.perf_counter() - start,
    }
    if plan_s > 0:
        record.update(
            planner_columns(job_of(row), plan_s, searcher, cost.step_time_s, "vs_maxtext")
        )
    return record


def maxtext_table(
    rows: Sequence[MaxTextRow] = MAXTEXT_TABLE,
    plan_s: float = 0.0,
    searcher: str = "auto",
    step: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Every row (`maxtext_record`) and the settings they were run with: what
    BENCHMARKS.md's MaxText section shows."""
    records = []
    for row in rows:
        step(f"maxtext {row.name}")
        records.append(maxtext_record(row, plan_s, searcher))
    return {
        "cluster": CLUSTER,
        "remat": REMAT,
        "plan_s": plan_s,
        "searcher": searcher,
        "rows": records,
    }


def _head(section: dict) -> str:
    head = (
        "MaxText's TPU v5p table (`configs/v5p/README.md`; Llama-style decoder, sequence "
        "2048, vocabulary 32,000, heads of 128, bf16, `remat_policy=minimal`, flash "
        "attention, one slice). Predicted: MaxText's configuration (ICI fsdp as ZeRO-3 on "
        "the data axis, tensor parallel on the model axis with the residual stream split "
        f"over it, remat `{section['remat']}`) "
        "priced by the cost model on the slice's torus, in TFLOP/s per chip by MaxText's "
        "count (`calculate_tflops_training_per_device`, maxtext e591f30c); ratio: "
        "predicted over published; fits: within the chip's HBM by the memory model. "
        "(`benchmarks/bench_maxtext.py` prints the same rows.)"
    )
    if section["plan_s"] > 0:
        head += (
            f" Planner: `automap plan --searcher {section['searcher']} --budget "
            f"{section['plan_s']:g}` on the same model and slice, one fresh process per row: "
            "its plan, its predicted step time and that over MaxText's (under 1: faster), "
            "whether it fits, its wall time (capture included) and the process's peak RSS."
        )
    return head


def _cells(r: dict, planned: bool) -> list[str]:
    cells = [
        r["name"],
        f"{r['slice']} ({r['chips']})",
        f"{r['fsdp']} × {r['tensor']}",
        f"{r['per_chip_batch']} ({r['batch']})",
        f"{r['published']:g}",
        f"{r['predicted_tflops']:.0f}",
        f"{r['ratio']:.2f}",
        f"{r['step_s']:.2f}",
        f"{r['memory_gb']:.1f}",
        "yes" if r["feasible"] else "no",
    ]
    if not planned:
        return cells
    if "plan_error" in r:
        why = r["plan_error"].replace("|", "/")
        return [*cells, f"none: {why}", "", "", "", f"{r['plan_wall_s']:.0f}", ""]
    return [
        *cells,
        r["plan"],
        f"{r['plan_step_s']:.2f}",
        f"{r['vs_maxtext']:.2f}",
        "yes" if r["plan_feasible"] else "no",
        f"{r['plan_wall_s']:.0f}",
        f"{r['plan_peak_gb']:.1f}",
    ]


def maxtext_lines(section: dict | str) -> list[str]:
    """The MaxText section (`maxtext_table`'s dict) as markdown: one row per published
    row; the planner's columns when it ran. A string is a section that did not run."""
    if isinstance(section, str):
        return [f"MaxText table: {section}."]
    planned = section["plan_s"] > 0
    cols = "| model | slice (chips) | fsdp × tensor | per-chip batch (global) | published "
    cols += "| predicted | ratio | step (s) | memory (GB) | fits |"
    rule = "|---|---|---|--:|--:|--:|--:|--:|--:|---|"
    if planned:
        cols += " planner's plan | its step (s) | vs MaxText | fits | planner wall (s) "
        cols += "| peak RSS (GB) |"
        rule += "---|--:|--:|---|--:|--:|"
    out = [_head(section), "", cols, rule]
    out += ["| " + " | ".join(_cells(r, planned)) + " |" for r in section["rows"]]
    return out
