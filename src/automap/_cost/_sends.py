"""What each pipeline stage sends: point-to-point traffic between stages, timed
alpha-beta on the pipe link (what each stage holds: `_traffic.py`).

Every tensor made on one stage and read on another is sent once per receiving stage, by
the sender's layout (each device sends its shard to its counterpart). Between two
per-microbatch ops (activations forward, their gradients and crossing residuals
backward) it moves every microbatch; anything else (a weight cast once, a gradient
handed to the stage owning the update, a tied parameter's copy) once per step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from .._cluster import Cluster, Link
from .._graph import Graph, Role
from .._pipeline import Partition, Phase
from ._traffic import PER_MICROBATCH, Layouts, phase_codes


@dataclasses.dataclass(frozen=True)
class Sends:
    """Point-to-point traffic of one partition, in seconds."""

    fwd_s: tuple[float, ...]  # per cut c (stage c to c + 1): per microbatch, forward
    bwd_s: tuple[float, ...]  # per cut c (stage c + 1 to c): per microbatch, backward
    pre_s: tuple[float, ...]  # per receiving stage: once per step, before the microbatches
    post_s: tuple[float, ...]  # per receiving stage: once per step, after them
    sent_bytes: tuple[float, ...]  # per sending stage: bytes per device per step
    sent_count: tuple[int, ...]  # per sending stage: messages per step
    sent_s: tuple[float, ...]  # per sending stage: seconds of its messages per step

    @property
    def sent(self) -> tuple[tuple[float, ...], tuple[int, ...], tuple[float, ...]]:
        """(bytes, messages, seconds) per sending stage per step."""
        return self.sent_bytes, self.sent_count, self.sent_s


def pipe_link(cluster: Cluster, stage_mesh: Mapping[str, int], stages: int) -> Link:
    """The link between consecutive stages: "pipe" is the outermost mesh axis, as
    `Cluster.axis_links` places it, so it crosses nodes once a stage fills a node. Unlike
    `axis_links` this does not need the whole mesh to fit the cluster (a stage DP asks
    about the finest partition, one stage per cut candidate)."""
    stride = math.prod(stage_mesh.values()) if stage_mesh else 1
    if stages <= 1 or stride * stages <= cluster.devices_per_node:
        return Link(cluster.intra_bandwidth, cluster.intra_latency, "intra")
    kind = "inter" if stride >= cluster.devices_per_node else "mixed"
    return Link(cluster.inter_bandwidth, cluster.inter_latency, kind)


def sends(
    graph: Graph, part: Partition, lay: Layouts, link: Link, efficiency: float, microbatches: int
) -> Sends:
    """Every tensor crossing stages, timed alpha-beta on the pipe link (one message per
    tensor and receiving stage, sent one after another over the link)."""
    S, m = part.n_stages, max(1, microbatches)
    stage, phase = np.array(part.op_stage), phase_codes(part)
    consumers = graph.consumers()
    fwd, bwd = np.zeros(max(S - 1, 0)), np.zeros(max(S - 1, 0))
    pre, post = np.zeros(S), np.zeros(S)
    sent, count, busy = np.zeros(S), np.zeros(S, dtype=np.int64), np.zeros(S)
    bw = link.bandwidth * efficiency
    params = {leaf.tensor for leaf in graph.leaves(Role.PARAM)}

    def send(nbytes: float, sender: int, times: int = 1) -> float:
        seconds = link.latency + nbytes / bw
        sent[sender] += nbytes * times
        count[sender] += times
        busy[sender] += seconds * times
        return seconds

    for t in graph.tensors:
        readers = consumers[t.id]
        if not readers:
            continue
        b = t.nbytes * lay.inv[t.id]
        if t.producer is None:
            # An input is handed to every stage that reads it; a parameter read on several
            # stages (tied embeddings) is updated on one and copied to the others each step.
            if t.id in params:
                to = sorted({int(stage[c]) for c in readers})
                for q in to[1:]:
                    pre[q] += send(b, to[0])
            continue
        p, ps = t.producer, int(stage[t.producer])
        for q in sorted({int(stage[c]) for c in readers} - {ps}):
            q_phases = {int(phase[c]) for c in readers if stage[c] == q}
            if phase[p] in PER_MICROBATCH and q_phases & set(PER_MICROBATCH):
                mb = b / m if t.id in part.batched else b
                if q > ps:  # arrives for the forward of stage q, across the cut before it
                    fwd[q - 1] += send(mb, ps, m)
                else:  # arrives for the backward of stage q, across the cut after it
                    bwd[q] += send(mb, ps, m)
            else:
                late = phase[p] in (*PER_MICROBATCH, Phase.POST) and Phase.POST in q_phases
                (post if late else pre)[q] += send(b, ps)
    floats = (tuple(float(x) for x in a) for a in (fwd, bwd, pre, post, sent))
    return Sends(*floats, tuple(int(c) for c in count), tuple(float(x) for x in busy))
