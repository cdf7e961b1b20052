"""What each pipeline stage sends: point-to-point traffic between stages, each message
timed alpha-beta on the link between its two stages' device groups (what each stage
holds: `_traffic.py`).

Every tensor made on one stage and read on another is sent once per receiving stage, by
the sender's layout (each device sends its shard to its counterpart). Between two
per-microbatch ops (activations forward, their gradients and crossing residuals
backward) it moves every microbatch; anything else (a weight cast once, a gradient
handed to the stage owning the update, a tied parameter's copy) once per step.

Links: devices are laid row-major with "pipe" outermost (`Cluster.axis_links`), so device
group g (stage g; with interleaving, virtual stage p on group p % G) holds devices
[g * stride, (g + 1) * stride), stride the stage mesh's size, and device i of one group
sends to device i of another. A pair of groups talks over the intra-node link where every
such pair of devices shares a node, over the network otherwise: on a pipe axis that spans
nodes only the cuts between groups on different nodes (and interleaving's wrap-around from
group G - 1 to group 0) cross the network, the rest stay on NVLink. Two virtual stages on
one group send nothing: the value stays on its devices (`_run/_pipelined.py`). On a TPU a
slice is a node (`devices_per_node`), so a cut inside a slice is priced on ICI's flat link
and one between slices on the DCN, as the pipe axis was priced before.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from .._cluster import Cluster, Link
from .._graph import Graph, Role
from .._pipeline import Partition, Phase
from ._stage_layouts import Layouts
from ._traffic import PER_MICROBATCH, phase_codes


@dataclasses.dataclass(frozen=True)
class Sends:
    """Point-to-point traffic of one partition, in seconds and bytes."""

    fwd_s: tuple[float, ...]  # per cut c (stage c to c + 1): per microbatch, forward
    bwd_s: tuple[float, ...]  # per cut c (stage c + 1 to c): per microbatch, backward
    pre_s: tuple[float, ...]  # per receiving stage: once per step, before the microbatches
    post_s: tuple[float, ...]  # per receiving stage: once per step, after them
    sent_bytes: tuple[float, ...]  # per sending stage: bytes per device per step
    sent_count: tuple[int, ...]  # per sending stage: messages per step
    sent_s: tuple[float, ...]  # per sending stage: seconds of its messages per step
    # Per cut and direction, per microbatch: bytes per device and messages, so that a
    # caller can time a cut on another link (`lag`): what the stage DP's tables keep.
    fwd_bytes: tuple[float, ...]
    fwd_count: tuple[int, ...]
    bwd_bytes: tuple[float, ...]
    bwd_count: tuple[int, ...]

    @property
    def sent(self) -> tuple[tuple[float, ...], tuple[int, ...], tuple[float, ...]]:
        """(bytes, messages, seconds) per sending stage per step."""
        return self.sent_bytes, self.sent_count, self.sent_s


@dataclasses.dataclass(frozen=True)
class PipeLinks:
    """Where a pipeline's device groups sit: `groups` groups of `stage_mesh`'s devices laid
    one after another on `cluster` (module doc). Unlike `axis_links` the groups need not fit
    the cluster (nodes past its last are numbered on)."""

    cluster: Cluster
    stage_mesh: Mapping[str, int]
    groups: int

    @property
    def stride(self) -> int:
        return math.prod(self.stage_mesh.values()) if self.stage_mesh else 1

    @property
    def efficiency(self) -> float:
        return self.cluster.comm_efficiency

    def between(self, a: int, b: int) -> Link | None:
        """The link from (virtual) stage a to stage b, None where both are on one group."""
        ga, gb = a % self.groups, b % self.groups
        if ga == gb:
            return None
        # Device i of one group sends to device i of the other: node by node.
        c, i = self.cluster, np.arange(self.stride)
        node_a = (ga * self.stride + i) // c.devices_per_node
        apart = node_a != (gb * self.stride + i) // c.devices_per_node
        if not apart.any():
            return Link(c.intra_bandwidth, c.intra_latency, "intra")
        return Link(c.inter_bandwidth, c.inter_latency, "inter" if apart.all() else "mixed")

    def cut(self, p: int) -> Link | None:
        """The link of cut p, from (virtual) stage p to p + 1."""
        return self.between(p, p + 1)

    def lag(self, p: int, nbytes, count):
        """Seconds of `count` messages of `nbytes` bytes in all across cut p, one after
        another on its link (alpha-beta, as `sends` times each); element-wise on arrays."""
        link = self.cut(p)
        if link is None:
            return 0.0 * np.asarray(nbytes)
        bandwidth = link.bandwidth * self.efficiency
        return np.asarray(count) * link.latency + np.asarray(nbytes) / bandwidth


def cut_links(
    cluster: Cluster, stage_mesh: Mapping[str, int], groups: int, n_stages: int
) -> tuple[Link | None, ...]:
    """The link of each cut p -> p + 1 of `n_stages` (virtual) stages on `groups` device
    groups (None where both stages are on one group: interleaving on one group)."""
    links = PipeLinks(cluster, dict(stage_mesh), max(1, groups))
    return tuple(links.cut(p) for p in range(n_stages - 1))


def link_between(
    cluster: Cluster, stage_mesh: Mapping[str, int], groups: int, a: int, b: int
) -> Link | None:
    """The link from (virtual) stage a to stage b on `groups` device groups (None where
    both are on one group)."""
    return PipeLinks(cluster, dict(stage_mesh), max(1, groups)).between(a, b)


def sends(
    graph: Graph, part: Partition, lay: Layouts, links: PipeLinks, microbatches: int
) -> Sends:
    """Every tensor crossing stages, each message timed alpha-beta on the link between its
    two stages (one message per tensor and receiving stage, sent one after another)."""
    S, m = part.n_stages, max(1, microbatches)
    # Per direction (forward, backward) and cut, per microbatch: seconds, bytes, messages.
    lag, moved = np.zeros((2, max(S - 1, 0))), np.zeros((2, max(S - 1, 0)))
    messages = np.zeros((2, max(S - 1, 0)), dtype=np.int64)
    pre, post = np.zeros(S), np.zeros(S)
    sent, count, busy = np.zeros(S), np.zeros(S, dtype=np.int64), np.zeros(S)

    def send(nbytes: float, sender: int, link: Link | None, times: int = 1) -> float:
        if link is None:  # two virtual stages of one group: the value stays where it is
            return 0.0
        seconds = link.latency + nbytes / (link.bandwidth * links.efficiency)
        sent[sender] += nbytes * times
        count[sender] += times
        busy[sender] += seconds * times
        return seconds

    for kind, t, src, q, *where in crossings(graph, part):
        b = graph.tensors[t].nbytes * lay.inv[t]
        if kind == _TIED:
            pre[q] += send(b, src, links.between(src, q))
        elif kind == _EACH_MICROBATCH:
            d, cut = where
            mb = b / m if t in part.batched else b
            link = links.between(src, q)
            lag[d, cut] += send(mb, src, link, m)
            if link is not None:
                moved[d, cut] += mb
                messages[d, cut] += 1
        else:
            (post if kind == _AFTER else pre)[q] += send(b, src, links.between(src, q))
    floats = (tuple(float(x) for x in a) for a in (*lag, pre, post, sent))
    return Sends(
        *floats,
        tuple(int(c) for c in count),
        tuple(float(x) for x in busy),
        fwd_bytes=tuple(float(x) for x in moved[0]),
        fwd_count=tuple(int(x) for x in messages[0]),
        bwd_bytes=tuple(float(x) for x in moved[1]),
        bwd_count=tuple(int(x) for x in messages[1]),
    )


# What `crossings` says of a value crossing stages: a tied parameter copied before the
# step, a value sent each microbatch, once before the microbatches or once after them.
_TIED, _EACH_MICROBATCH, _BEFORE, _AFTER = range(4)


def crossings(graph: Graph, part: Partition) -> tuple[tuple[int, ...], ...]:
    """Every value crossing stages, in tensor order, as (kind, tensor, from stage, to
    stage) and, for `_EACH_MICROBATCH`, (direction: 0 forward / 1 backward, cut). A
    function of the partition alone, made once for it: `sends` prices it on each layout."""
    return part.derived(graph, "crossings", lambda: _crossings(graph, part))


def _crossings(graph: Graph, part: Partition) -> tuple[tuple[int, ...], ...]:
    stage, phase = np.array(part.op_stage), phase_codes(part)
    post_code = int(Phase.POST)  # an int, as PER_MICROBATCH's: fast against phase's
    consumers = graph.consumers()
    params = {leaf.tensor for leaf in graph.leaves(Role.PARAM)}
    out: list[tuple[int, ...]] = []
    for t in graph.tensors:
        readers = consumers[t.id]
        if not readers:
            continue
        if t.producer is None:
            # An input is handed to every stage that reads it; a parameter read on several
            # stages (tied embeddings) is updated on one and copied to the others each step.
            if t.id in params:
                to = sorted({int(stage[c]) for c in readers})
                out.extend((_TIED, t.id, to[0], q) for q in to[1:])
            continue
        p, ps = t.producer, int(stage[t.producer])
        for q in sorted({int(stage[c]) for c in readers} - {ps}):
            q_phases = {int(phase[c]) for c in readers if stage[c] == q}
            if phase[p] in PER_MICROBATCH and q_phases & set(PER_MICROBATCH):
                # Forward: for stage q's forward, across the cut before it; backward:
                # for its backward, across the cut after it.
                d, cut = (0, q - 1) if q > ps else (1, q)
                out.append((_EACH_MICROBATCH, t.id, ps, q, d, cut))
            else:
                late = phase[p] in (*PER_MICROBATCH, post_code) and post_code in q_phases
                out.append((_AFTER if late else _BEFORE, t.id, ps, q))
    return tuple(out)
