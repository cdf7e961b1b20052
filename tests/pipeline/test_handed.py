"""A value made from constants alone that one pipeline program hands another leaves in
the plan's layout (`_run/_handed.py`): read in the compiled programs' arguments on 8 CPU
devices."""

import re

import jax
import pytest

from automap._capture import capture
from automap._groups import build_groups
from automap._pipeline import Phase, partition, pipeline_plan
from automap._run import apply_pipeline
from automap._space import batch_groups
from automap._verify import verify
from automap._zoo import get_model


@pytest.mark.slow  # two stages' programs compiled and run on 8 CPU devices: ~20 s
def test_a_causal_mask_handed_to_another_stages_backward_leaves_split_on_data():
    # A Llama cut at its first layer's mask broadcast ([batch, kv heads, group, q, k],
    # made from a [q, k] constant). The partition puts a backward op on the lowest stage
    # of its inputs' makers, so stage 0's backward reads the mask from stage 1's forward.
    # Unpinned, XLA's propagation has nothing to split the broadcast by: it left the
    # program replicated, pred[16, ...] on each device where the plan splits the batch of
    # 16 over data 4.
    spec = get_model(
        "llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, seq=32, vocab=256, batch=16
    )
    step, args = jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()
    graph = capture(step, *args)
    groups = build_groups(graph)
    mask = next(
        t
        for t, x in enumerate(graph.tensors)
        if x.dtype == "bool" and x.ndim == 5 and x.shape[0] == 16
    )
    cut = graph.tensors[mask].producer
    part = partition(graph, groups, [(0, cut), (cut, len(graph.ops))])
    readers = graph.consumers()[mask]
    assert part.op_stage[cut] == 1
    assert any(part.op_phase[c] is Phase.BWD and part.op_stage[c] == 0 for c in readers)

    data = {g.id: "data" for g in batch_groups(groups)}
    plan = pipeline_plan(graph, groups, [cut], {"data": 4}, data, 1, "gpipe")
    programs = apply_pipeline(step, plan, jax.devices()).compile(*args)
    handed = {
        (p.stage, p.kind): re.findall(r"pred\[[\d,]+\]", _entry(p.compiled.as_text()))
        for p in programs
    }
    assert handed[(1, Phase.FWD)] == ["pred[4,2,2,32,32]"]  # its output, a quarter a device
    assert handed[(0, Phase.BWD)] == ["pred[4,2,2,32,32]"]  # stage 0's backward reads it so

    # The same numbers as the step on one device.
    assert verify(step, plan, *spec.concrete_args()).numerics_ok


def _entry(hlo: str) -> str:
    return next(line for line in hlo.splitlines() if line.startswith("ENTRY"))
