"""Korthikanti et al.'s table (sequence parallelism + selective recomputation against full
recomputation): its rows, their published configurations priced, and its markdown."""

from __future__ import annotations

import re

import jax
import pytest

import automap as am
from automap._bench import (
    KORTHIKANTI_TABLE,
    OPTIMIZER_PASS_BYTES,
    korthikanti_lines,
    korthikanti_table,
    megatron_priced,
    optimizer_passes_s,
    select_korthikanti_rows,
    to_markdown,
    train_step,
)
from automap._capture import capture
from automap._cost import CostModel
from automap._groups import build_groups
from automap._remat import megatron_recompute, recompute_plan
from automap._search import Problem
from automap._space import recipe_plan
from automap._verify import comm_bytes, compile_plan, parse_collectives
from automap._zoo import get_model


def test_rows_are_the_published_configurations():
    assert [r.name for r in KORTHIKANTI_TABLE] == ["22B", "175B", "530B", "1T"]
    for r in KORTHIKANTI_TABLE:
        assert r.gpus == r.tp * r.pp  # data parallel 1 on every row
        assert r.batch % r.microbatch == 0 and r.layers % (r.pp * r.virtual) == 0
        # The paper's speedups of SP + selective over full recomputation: 1.29 to 1.32.
        assert 1.28 < r.published_speedup < 1.33
    assert [r.name for r in select_korthikanti_rows(["1T", "22B"])] == ["22B", "1T"]


def _record(name, full_pred, modern_pred, **planned):
    row = next(r for r in KORTHIKANTI_TABLE if r.name == name)
    return {
        "name": row.name, "tp": row.tp, "pp": row.pp, "gpus": row.gpus, "batch": row.batch,
        "microbatch": row.microbatch, "virtual": row.virtual, "full_s": row.full_s,
        "modern_s": row.modern_s, "full_pred_s": full_pred, "modern_pred_s": modern_pred,
        "full_ratio": full_pred / row.full_s, "modern_ratio": modern_pred / row.modern_s,
        "published_speedup": row.published_speedup,
        "predicted_speedup": full_pred / modern_pred, "full_memory_gb": 60.0,
        "modern_memory_gb": 40.0, "feasible": True, "price_s": 1.0,
        "megatron_full_pred_s": full_pred * 1.05, "megatron_full_ratio": full_pred * 1.05 / row.full_s,
        "megatron_modern_pred_s": modern_pred + 0.1,
        "megatron_modern_ratio": (modern_pred + 0.1) / row.modern_s,
        "megatron_speedup": full_pred * 1.05 / (modern_pred + 0.1), **planned,
    }  # fmt: skip


def test_section_renders_from_its_records():
    planned = _record(
        "175B", 18.0, 14.0, plan="data 1 × model 8 × 8 stages", plan_step_s=13.0,
        plan_feasible=True, vs_published=13.0 / 14.0, plan_wall_s=80.0, plan_peak_gb=3.0,
    )  # fmt: skip
    failed = _record("1T", 100.0, 75.0, plan_error="none fits | at all", plan_wall_s=9.0)
    section = {
        "cluster": "a100", "plan_s": 60.0, "searcher": "auto", "rows": [planned, failed],
        "mean_abs_error": 0.04, "megatron_mean_abs_error": 0.03,
    }  # fmt: skip
    lines = korthikanti_lines(section)
    head = next(i for i, line in enumerate(lines) if line.startswith("| model |"))
    assert lines[head].count("|") == lines[head + 1].count("|") == 26
    assert lines[head + 2].startswith(
        "| 175B | 8 × 8 | 64 | 64 | 1 | 3 | 18.13 | 18.00 | 0.99 | 13.75 | 14.00 | 1.02 "
        "| 1.32 | 1.29 | 60 → 40 | 18.90 | 1.04 | 14.10 | 1.03 | 1.34 "
        "| data 1 × model 8 × 8 stages | 13.00 | 0.93 |"
    )
    assert "| none fits / at all | — | — | 9 | — |" in lines[head + 3]
    assert lines[-1] == "Mean absolute error of the priced times: 4.0%; as Megatron runs: 3.0%."
    assert korthikanti_lines("not run")[-1] == "Korthikanti table: not run."
    result = {
        "machine": {"cpu": "cpu", "cores": 2, "memory_bytes": None, "python": "3", "jax": "0",
                    "automap": "0", "commit": None, "date": "today"},
        "command": "automap bench", "settings": {"budget_s": 1.0, "seeds": 1}, "wall_s": 1.0,
        "cases": [], "fidelity": "not run", "speed": "not run", "megatron": "not run",
        "korthikanti": section,
    }  # fmt: skip
    assert "## Sequence parallelism and selective recomputation" in to_markdown(result)


@pytest.mark.slow
def test_the_22b_row_is_priced_in_both_columns():
    """Both published configurations of the one-stage row priced on abstract shapes:
    sequence parallelism with selective recomputation must come out faster than full
    recomputation (the paper measures 1.29x) and hold less than full recomputation's
    kept activations plus the attention scores it no longer stores."""
    section = korthikanti_table(select_korthikanti_rows(["22B"]))
    (r,) = section["rows"]
    assert r["feasible"]
    assert r["predicted_speedup"] > 1.0
    assert r["full_pred_s"] > r["modern_pred_s"] > 0
    assert section["mean_abs_error"] == pytest.approx(
        (abs(r["full_ratio"] - 1) + abs(r["modern_ratio"] - 1)) / 2
    )
    # As Megatron-LM runs it, its optimizer passes over its main gradients (8 bytes a
    # parameter: the clip's norm reads them, the buffer is zeroed) add the same seconds
    # to both columns: a device's 1/8 of the model's parameters (the count read from its
    # optimizer state) at the A100's rate for memory-bound kernels.
    a100 = am.Cluster.preset("a100", devices=8)
    params = KORTHIKANTI_TABLE[0].job().spec().param_count
    passes = 8 * params / 8 / (a100.hbm_bandwidth * a100.memory_efficiency)
    assert r["megatron_modern_pred_s"] - r["modern_pred_s"] == pytest.approx(passes, rel=0.01)
    assert section["megatron_mean_abs_error"] == pytest.approx(
        (abs(r["megatron_full_ratio"] - 1) + abs(r["megatron_modern_ratio"] - 1)) / 2
    )


def _dots(text: str) -> int:
    return len(re.findall(r"= \S+ dot\(", text))


@pytest.mark.slow  # two plans compiled for 8 A100s
@pytest.mark.gpu_compile
def test_xla_recomputes_less_of_a_layer_than_megatron_and_each_is_priced():
    """Full recomputation as XLA compiles it (what `am.apply` runs) leaves out of the
    recompute what no backward op reads: each layer's last matmul (the MLP's output
    projection), its all-reduce and the residual add. Megatron-LM's `CheckpointFunction`
    runs the layer's forward whole again; `megatron_recompute` prices that, one more
    stream all-reduce and matmul per layer, for its published runs."""
    layers, hidden, batch, seq = 2, 64, 16, 32
    spec = get_model(
        "gpt2-xl", layers=layers, hidden=hidden, heads=8, seq=seq, batch=batch, vocab=128,
        dtype="float32",
    )  # fmt: skip
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    cluster = am.Cluster.preset("a100", devices=8)
    graph = capture(step, *args)
    groups = build_groups(graph)
    xla_rc, megatron_rc = recompute_plan(graph, groups), megatron_recompute(graph, groups)
    dropped = [graph.ops[i] for i in sorted(megatron_rc.ops - xla_rc.ops)]
    # One matmul per layer, its layer's last: the output projection of the MLP.
    last = [max(i for i in layer if graph.ops[i].primitive == "dot_general")
            for layer in megatron_rc.layers]  # fmt: skip
    assert [op.index for op in dropped if op.primitive == "dot_general"] == last
    megatron = CostModel(graph, cluster, groups, megatron_rc)
    stream = batch * seq * hidden * 4  # one float32 all-reduce of the residual stream
    ar, dots, priced, as_megatron = {}, {}, {}, {}
    for remat in ("none", "full"):
        plan = am.plan_recipe(step, *args, recipe=am.Recipe(tp=8, remat=remat), cluster=cluster)
        text = compile_plan(step, plan, args, target="a100")[1].as_text()
        ar[remat] = comm_bytes(parse_collectives(text, 8), plan.mesh)["all-reduce@model"]
        dots[remat] = _dots(text)
        priced[remat] = _bytes(plan.predicted, "all-reduce")
        as_megatron[remat] = _bytes(megatron.estimate(plan), "all-reduce")
    # XLA's recompute all-reduces what the model prices it to (the attention's output
    # projection of each layer, the embedding's in the first), not the MLP's.
    assert ar["full"] - ar["none"] == pytest.approx(priced["full"] - priced["none"], rel=0.01)
    assert as_megatron["full"] - priced["full"] == pytest.approx(layers * stream)
    assert as_megatron["none"] == priced["none"]  # without recomputation nothing changes
    # XLA's recompute runs no more matmuls than the model's (its dot merger joins the
    # queries', keys' and values'): the last of each layer is not among them.
    recomputed = sum(graph.ops[i].primitive == "dot_general" for i in xla_rc.ops)
    assert 0 < dots["full"] - dots["none"] <= recomputed


def _bytes(cost, kind: str) -> float:
    return sum(c.bytes for c in cost.collectives if c.kind == kind)


def test_megatrons_optimizer_passes_count_a_stages_parameters_not_its_16_bit_casts():
    # A pipeline stage holds each weight's 16-bit cast beside its float32 master, so its
    # parameter bytes over 4 would count 1.5 parameters a weight; the passes count them
    # from the optimizer state (Adam's two float32 moments a parameter). A 4-layer bf16
    # GPT in 2 stages of 2 layers (vocabulary 128): the busiest stage holds half the
    # layers' parameters and the tables it reads.
    spec = get_model("gpt-1.3b", layers=4, hidden=256, heads=4, seq=64, vocab=128, batch=8)
    cluster = am.Cluster.preset("a100", devices=2)
    problem = Problem.build(train_step(spec), spec.abstract_args(), cluster)
    plan = recipe_plan(problem.graph, problem.groups, cluster, am.Recipe(pp=2, microbatches=2))
    cost = problem.estimate(plan)
    rate = cluster.hbm_bandwidth * cluster.memory_efficiency
    held = optimizer_passes_s(problem, cost) * rate / OPTIMIZER_PASS_BYTES
    layer = 12 * 256 * 256  # a layer's matrices; its biases and norms are under 1% more
    assert 2 * layer < held < 2 * layer + 256 * (128 + 64) + 0.02 * layer * 2
    assert cost.memory_breakdown["params"] / 4 > 1.2 * held  # the casts the count leaves out
    priced = megatron_priced(problem, plan)
    assert priced.step_time_s == pytest.approx(cost.step_time_s + held * 8 / rate)
