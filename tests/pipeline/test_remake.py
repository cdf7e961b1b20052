"""A pipeline stage's forward hands its backward the residuals worth keeping (matmul
operands and results, expensive results): its backward makes the cheap elementwise
chains again (a layer norm's float32 intermediates, the tanh-GELU's products), and a
causal mask is made in each program that reads it, not held all step. Read in the
compiled programs' buffer assignment, priced as the cost model prices it, and with the
unsharded step's numbers."""

from __future__ import annotations

import dataclasses

import jax
import pytest

import automap as am
from automap._pipeline import Phase, partition, pipeline_plan, uniform_cuts
from automap._remat import remake_residuals
from automap._space import batch_groups

from ._models import assert_same, zoo

M = 2  # microbatches


def _plan(graph, groups, remat: bool = False):
    cuts = uniform_cuts(graph, groups, 2)
    assignment = {g.id: "data" for g in batch_groups(groups)}
    plan = pipeline_plan(graph, groups, cuts, {"data": 2}, assignment, M, "1f1b")
    return dataclasses.replace(plan, remat=True) if remat else plan


def _forward_outputs(spec, plan) -> dict[int, int]:
    """Per stage, the bytes per device its F program hands out (its outputs)."""
    programs = am.apply(spec.step_fn, plan).compile(*spec.abstract_args())
    return {
        p.stage: p.compiled.memory_analysis().output_size_in_bytes
        for p in programs
        if p.kind is Phase.FWD
    }


def _jaxpr_residuals(graph, part, stage: int) -> set[int]:
    """What the stage's F handed its B before: every forward tensor its backward reads."""
    fwd = set(part.ops(stage, Phase.FWD))
    made = {t for i in fwd for t in graph.ops[i].outputs}
    return {t for i in part.ops(stage, Phase.BWD) for t in graph.ops[i].inputs if t in made}


def _per_device(graph, part, ts) -> float:
    """Bytes per device of one microbatch's `ts` (the data axis of 2 splits the batch)."""
    return sum(graph.tensors[t].nbytes / (M * 2 if t in part.batched else 1) for t in ts)


@pytest.mark.slow  # a GPT pipeline compiled on 4 CPU devices
def test_a_stage_forward_hands_out_the_kept_residuals_and_its_sends_alone():
    spec, graph, groups = zoo("gpt2-xl")
    plan = _plan(graph, groups)
    part = partition(graph, groups, [(s.op_start, s.op_stop) for s in plan.stages], M)
    held = _forward_outputs(spec, plan)
    consumers = graph.consumers()
    for s in (0, 1):
        fwd = set(part.ops(s, Phase.FWD))
        made = {t for i in fwd for t in graph.ops[i].outputs}
        before = _jaxpr_residuals(graph, part, s)
        sent = {
            t
            for t in made
            if any(part.op_stage[c] != s and part.op_phase[c] is Phase.FWD for c in consumers[t])
        }
        reads = before | {
            t for i in part.ops(s, Phase.BWD) for t in graph.ops[i].inputs if t not in made
        }
        kept = set(remake_residuals(graph, part, s, reads).stored) & made
        # The program's outputs are the kept residuals and what goes on, no more (XLA
        # adds the output tuple's table, 8 bytes an output; the last stage's forward
        # hands its loss part, a scalar, to the update).
        assert held[s] == pytest.approx(_per_device(graph, part, kept | sent), rel=0.01)
        # What the jaxpr's residuals took: a layer norm's float32 intermediates and the
        # GELU's chain were most of it.
        assert held[s] < 0.6 * _per_device(graph, part, before | sent)


@pytest.mark.slow  # two GPT pipelines compiled and run on 4 CPU devices
@pytest.mark.parametrize("remat", [False, True])
def test_the_backward_that_makes_residuals_again_computes_the_step(remat):
    spec, graph, groups = zoo("gpt2-xl")
    plan = _plan(graph, groups, remat)
    args = spec.concrete_args(0)
    got = am.apply(spec.step_fn, plan)(*args)
    assert_same(got, jax.jit(spec.step_fn)(*args), spec.config["learning_rate"])
