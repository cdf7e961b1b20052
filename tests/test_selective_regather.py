"""Selective recomputation under sequence parallelism keeps each norm's output split and
gathers it again in the backward for the weight gradients, as Megatron-LM does
(Korthikanti et al. §4.2.2): the runtime reads it afresh there (`_remat.regathered_reads`)
and the cost model prices the gather (`_cost/_seqpar._regathered`). Read in the compiled
A100 program."""

import pytest

import automap as am
from automap._verify import comm_bytes, compile_plan, parse_collectives
from automap._zoo import get_model

A100 = am.Cluster.preset("a100", devices=8)


@pytest.mark.gpu_compile
@pytest.mark.slow  # two programs compiled for 8 A100s without one
def test_selective_gathers_each_norms_output_again_in_the_backward():
    spec = get_model(
        "llama", layers=2, hidden=256, heads=4, kv_heads=4, ffn=512, seq=256, batch=16, vocab=512
    )
    step, args = spec.step_fn, spec.abstract_args()
    gathered = {}
    for remat in ("none", "selective"):
        recipe = am.Recipe(dp=4, tp=2, remat=remat, sequence_parallel=True)
        plan = am.plan_recipe(step, *args, recipe=recipe, cluster=A100)
        compiled = compile_plan(step, plan, args, target="a100")
        report = am.verify(step, plan, *args, cluster=A100, target="a100", compiled=compiled)
        assert report.collectives_match, report.mismatches
        gathered[remat] = comm_bytes(parse_collectives(compiled[1].as_text(), 8), plan.mesh)[
            "all-gather@model"
        ]
    # Two norms a layer, two layers: each output gathered whole once more, a
    # bf16 [batch / dp, seq, hidden] per device (without remat XLA keeps the forward's copy).
    whole = 16 // 4 * 256 * 256 * 2
    assert gathered["selective"] - gathered["none"] == pytest.approx(2 * 2 * whole, rel=0.05)
