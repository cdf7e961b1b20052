"""The DQN's pipeline pricer reads the stage DP's segment tables (`segment_tables`): one
price, sends timed on the link between the plan's S stages. They once timed them on the
finest partition's link (a stage per cut candidate, as many device groups as candidates:
across nodes on a one-node cluster), 10x too slow on the bubble GPT's four stages (0.34
against 0.036 ms a cut), so its features and its cheapest-send cut read other sends than
the plan it priced."""

from __future__ import annotations

import pytest

import automap as am
from automap._cost import estimate_pipeline
from automap._search import PipelinePricer, PipelineProcess, Problem, baseline_time
from automap._space import ShardSpace
from automap._zoo import get_model

BUBBLE = dict(layers=8, hidden=2048, heads=16, batch=8, seq=1024)


@pytest.mark.parametrize("devices", [8, 16], ids=["one-node", "two-nodes"])
def test_the_agents_tables_price_each_stage_as_estimate_does(devices):
    """Four stages, the agent's quick-picked intra-stage plan, the most microbatches,
    balanced cuts: per stage, the tables' time per microbatch and the send after it are
    `am.estimate`'s for the plan (F + B per stage, the lag of each cut)."""
    cluster = am.Cluster.preset("a100", devices)
    spec = get_model("gpt2-xl", **BUBBLE)
    args = spec.abstract_args()
    pb = Problem.build(spec.step_fn, args, cluster)
    pricer = PipelinePricer(pb.cost_model)
    space = ShardSpace(pb.graph, pb.groups, cluster, pb.cost_model)
    process = PipelineProcess(pricer, baseline_time(space), (2, 4))
    S = 4
    intra = process.intra(S)
    m = process.micro_choices(intra, S)[-1]
    tables = pricer.tables(intra, m, S)
    cuts = pricer.balanced(tables, S)
    plan = pricer.plan(intra, m, cuts, name="test")
    cost = am.estimate(spec.step_fn, *args, plan=plan, cluster=cluster)
    assert cost.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
    priced = estimate_pipeline(pb.cost_model, plan)  # what estimate read: per stage, per cut
    assert priced.cost.step_time_s == pytest.approx(cost.step_time_s, rel=1e-12)
    first = 0
    for s, last in enumerate((*cuts, pricer.n_segments - 1)):
        own = tables.span(tables.time, first, last)
        assert own == pytest.approx(sum(priced.stage_times[s]), rel=1e-9)
        if s < S - 1:
            lag = priced.send_s[s]
            assert lag > 0 and tables.send_after(s)[last] == pytest.approx(lag, rel=1e-9)
        first = last + 1
