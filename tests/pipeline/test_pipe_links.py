"""Each pipeline cut is priced on its own link (issue 26): with "pipe" outermost, device
group g holds devices [g * stride, (g + 1) * stride), so on a pipe axis spanning nodes
only the cuts between groups on different nodes (and interleaving's wrap-around from the
last group to the first) cross the network; the others stay on NVLink. Before, one link
for the whole axis priced every cut on the network (0.161 ms a microbatch on each of
pipe 4 x model 4's cuts on 16 A100s, where NVLink takes 0.021 ms)."""

from __future__ import annotations

import numpy as np
import pytest

import automap as am
from automap._cost import (
    PipeLinks,
    cut_links,
    estimate_pipeline,
    link_between,
    plan_op_costs,
    stage_costs,
)
from automap._pipeline import partition, pipeline_schedule
from automap._search import Problem, segment_tables
from automap._space import recipe_plan
from automap._zoo import get_model

A100_16 = am.Cluster.preset("a100", 16)  # two nodes of 8
MODEL_4 = {"model": 4}


def kinds(links):
    return [None if link is None else link.kind for link in links]


def test_cuts_inside_a_node_are_on_nvlink_and_across_nodes_on_the_network():
    """pipe 4 x model 4 on two nodes of 8: groups 0, 1 on node 0, groups 2, 3 on node 1.
    Interleaved (v = 2, 8 virtual stages, stage p on group p % 4), the cut from stage 3
    (group 3) to stage 4 (group 0) wraps around to node 0: the network."""
    intra, inter = A100_16.intra_bandwidth, A100_16.inter_bandwidth
    assert inter < intra
    links = cut_links(A100_16, MODEL_4, 4, 4)
    assert kinds(links) == ["intra", "inter", "intra"]
    assert [link.bandwidth for link in links] == [intra, inter, intra]
    assert links[1].latency == A100_16.inter_latency > links[0].latency
    wrapped = ["intra", "inter", "intra", "inter", "intra", "inter", "intra"]
    assert kinds(cut_links(A100_16, MODEL_4, 4, 8)) == wrapped
    # A send that skips stages runs between the two groups, wherever the cuts are.
    assert link_between(A100_16, MODEL_4, 4, 0, 3).kind == "inter"
    assert link_between(A100_16, MODEL_4, 4, 2, 3).kind == "intra"
    assert link_between(A100_16, MODEL_4, 4, 1, 5) is None  # one group: nothing moves
    # A stage mesh of a node or more: every cut crosses; all in one node: none does.
    assert set(kinds(cut_links(A100_16, {"model": 8}, 2, 2))) == {"inter"}
    assert set(kinds(cut_links(A100_16, {"model": 2}, 4, 4))) == {"intra"}


def test_a_group_straddling_two_nodes_is_mixed():
    """Groups of 3 devices on nodes of 8: group 2 holds devices 6, 7 (node 0) and 8 (node
    1). Its cut from group 1 (3, 4, 5) crosses for one device of three, its cut to group 3
    (9, 10, 11) for two: both as slow as the network; the cut from group 0 stays inside."""
    assert kinds(cut_links(A100_16, {"model": 3}, 4, 4)) == ["intra", "mixed", "mixed"]
    assert link_between(A100_16, {"model": 3}, 4, 0, 3).kind == "inter"


def test_tpu_slices_are_nodes():
    """On TPU a slice is a node: pipe 2 over two slices crosses the DCN, pipe 2 inside one
    slice runs on the flat ICI link, as the whole pipe axis was priced before."""
    two = am.Cluster.preset("tpu-v5p", topology="4x4x4", slices=2)
    chips = two.devices_per_node
    assert kinds(cut_links(two, {"model": chips}, 2, 2)) == ["inter"]
    inside = cut_links(two, {"model": chips // 2}, 2, 2)
    assert kinds(inside) == ["intra"] and inside[0].bandwidth == two.intra_bandwidth


def _pipe4_model4(layers=4, hidden=64, heads=4, batch=16, seq=16):
    spec = get_model("gpt2-xl", layers=layers, hidden=hidden, heads=heads, batch=batch, seq=seq)
    pb = Problem.build(spec.step_fn, spec.abstract_args(), A100_16)
    return pb, am.Recipe(tp=4, pp=4, dp=1, microbatch_size=1)


def test_each_send_is_timed_on_its_cuts_link():
    """A tiny GPT, pipe 4 x model 4 on two nodes: the middle cut's lag is the network's,
    the others NVLink's, each the alpha-beta time of the bytes and messages recorded for it
    (what a caller re-times on another link)."""
    pb, recipe = _pipe4_model4()
    plan = recipe_plan(pb.graph, pb.groups, pb.cluster, recipe)
    pc = estimate_pipeline(pb.cost_model, plan)
    lag, traffic = pc.send_s, pc.sends
    assert len(lag) == 3 and lag[0] < lag[1] and lag[2] < lag[1]
    links = PipeLinks(A100_16, MODEL_4, 4)
    for c in range(3):
        fwd = links.lag(c, traffic.fwd_bytes[c], traffic.fwd_count[c])
        bwd = links.lag(c, traffic.bwd_bytes[c], traffic.bwd_count[c])
        assert traffic.fwd_count[c] > 0 and traffic.bwd_count[c] > 0
        assert lag[c] == pytest.approx(max(fwd, bwd), rel=1e-12)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_the_dps_tables_time_each_stage_send_as_stage_costs_does(schedule):
    """The stage DP's tables made on a plan's own partition (each stage one segment):
    the send it adds to stage s is `stage_costs`' lag of cut s, NVLink's or the network's,
    so the DP no longer prices cuts inside a node on the network."""
    pb, recipe = _pipe4_model4()
    plan = recipe_plan(pb.graph, pb.groups, pb.cluster, recipe)
    model, m = pb.cost_model, plan.microbatches
    oc = plan_op_costs(model, plan)
    part = partition(model.graph, model.groups, [(s.op_start, s.op_stop) for s in plan.stages], m)
    the_schedule = pipeline_schedule(schedule)
    pc = stage_costs(model, part, oc, m, the_schedule)
    tables = segment_tables(model, part, oc, m, the_schedule, 4)
    tau = tables.stage_time(4)
    own = tables.stage_phase_s(4).sum(axis=-1)
    sent = [float(tau[s, s, s] - own[s, s, s]) for s in range(4)]
    assert sent[3] == 0.0
    assert sent[:3] == pytest.approx(list(pc.send_s), rel=1e-9)
    assert sent[0] < sent[1] and sent[2] < sent[1]
    assert np.all(tables.send_after(3 - 1) <= tables.send_after(1))
    with pytest.raises(ValueError, match="for 4 stages, not 3"):
        tables.stage_time(3)
