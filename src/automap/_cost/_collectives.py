"""Alpha-beta times of collectives on one mesh axis, vectorized over many occurrences.

Per axis of n devices with per-device bandwidth bw (link bandwidth x comm efficiency) and
per-step latency alpha:

- all-reduce, ring: 2(n-1)/n * B/bw + 2(n-1) alpha; tree (reduce then broadcast along a
  binary tree): 2 B/bw + 2 ceil(log2 n) alpha. The cheaper wins: trees for small messages.
- all-gather / reduce-scatter, ring: (n-1)/n * B/bw + (n-1) alpha; recursive doubling:
  same bandwidth term, ceil(log2 n) alpha.
- all-to-all: (n-1)/n * B/bw + (n-1) alpha (each device sends n-1 pieces).
- collective-permute: B/bw + alpha.

B is the full buffer in the DESIGN.md convention: the all-reduce buffer, the all-gather
result, the reduce-scatter operand, the all-to-all operand.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from .._cluster import Cluster
from ._torus import axis_links

KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
AR, RS, AG, A2A, CP = range(len(KINDS))


class AxisCosts:
    """Per-kind (alpha, beta) pairs for one mesh, indexed by an axis *mask*: bit i-1 set for
    mesh axis i (mesh order), so a collective over several axes ("data+model") is one
    index. Mask 0 is "no axis" (free). A multi-axis group runs at its slowest link."""

    def __init__(self, cluster: Cluster, mesh: Mapping[str, int]):
        links = axis_links(cluster, mesh) if mesh else {}  # on a TPU torus: `_torus`
        names = list(mesh)
        k = 1 << len(names)
        n = np.ones(k)
        bw = np.full(k, np.inf)
        lat = np.zeros(k)
        labels = [""] * k
        for m in range(1, k):
            axes = [names[i] for i in range(len(names)) if m >> i & 1]
            n[m] = math.prod(mesh[a] for a in axes)
            bw[m] = min(links[a].bandwidth for a in axes) * cluster.comm_efficiency
            lat[m] = max(links[a].latency for a in axes)
            labels[m] = "+".join(axes)
        log = np.ceil(np.log2(np.maximum(n, 1)))
        frac = (n - 1) / n
        inv = np.where(np.isinf(bw), 0.0, 1.0 / np.where(np.isinf(bw), 1.0, bw))
        # [kind, variant (ring, tree), mask] for alpha (per occurrence) and beta (per byte).
        self.alpha = np.zeros((len(KINDS), 2, k))
        self.beta = np.zeros((len(KINDS), 2, k))
        self.alpha[AR] = [2 * (n - 1) * lat, 2 * log * lat]
        self.beta[AR] = [2 * frac * inv, 2 * inv]
        for kind in (RS, AG):
            self.alpha[kind] = [(n - 1) * lat, log * lat]
            self.beta[kind] = [frac * inv, frac * inv]
        self.alpha[A2A] = [(n - 1) * lat] * 2
        self.beta[A2A] = [frac * inv] * 2
        self.alpha[CP] = [np.where(n > 1, lat, 0.0)] * 2
        self.beta[CP] = [np.where(n > 1, inv, 0.0)] * 2
        self.alpha[:, :, 0] = 0.0
        self.beta[:, :, 0] = 0.0
        self.names = tuple(labels)
        # sizes[a] for axis code a (1-based, 0 = none); bit[a] its mask.
        self.sizes = np.array([1.0, *mesh.values()])
        self.int_sizes = self.sizes.astype(np.int64)
        self.codes = {name: i for i, name in enumerate(names, start=1)}
        self.bit = np.array([0] + [1 << i for i in range(len(names))], dtype=np.int64)
        self.masks = k
        # [variant, kind * masks + mask]: the same tables flattened for keyed lookups.
        self._flat_alpha = self.alpha.transpose(1, 0, 2).reshape(2, -1)
        self._flat_beta = self.beta.transpose(1, 0, 2).reshape(2, -1)
        self.keys = np.arange(len(KINDS) * k)
        self.key_kind, self.key_mask = np.divmod(self.keys, k)
        # Masks whose group is every chip of a one-slice torus (`Lowering.
        # gather_all_reduced_from`): a pipeline stage's sub-mesh has none.
        whole = cluster.topology and cluster.slices == 1
        self.slice_chips = int(cluster.devices) if whole else 0
        self.whole_slice = (
            (n == cluster.devices) & (np.arange(k) > 0) if whole else np.zeros(k, bool)
        )

    def by_key(self, key: np.ndarray, nbytes: np.ndarray, count: np.ndarray) -> np.ndarray:
        """`time` for rows keyed kind * masks + axis mask (one gather per table)."""
        a, b = self._flat_alpha[:, key], self._flat_beta[:, key]
        return np.minimum(count * a[0] + nbytes * b[0], count * a[1] + nbytes * b[1])

    def time(self, kind: np.ndarray, axis: np.ndarray, nbytes: np.ndarray, count: np.ndarray):
        """Seconds for `count` occurrences moving `nbytes` in all (arrays, one per row)."""
        ring = count * self.alpha[kind, 0, axis] + nbytes * self.beta[kind, 0, axis]
        tree = count * self.alpha[kind, 1, axis] + nbytes * self.beta[kind, 1, axis]
        return np.minimum(ring, tree)

    def time1(self, kind: int, axis: int, nbytes: float, count: int = 1) -> float:
        return float(
            self.time(np.array([kind]), np.array([axis]), np.array([nbytes]), np.array([count]))[0]
        )


def ring_allreduce_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Reference formula (tests, docs): ring all-reduce of nbytes over n devices."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def tree_allreduce_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    if n <= 1:
        return 0.0
    return 2 * nbytes / bandwidth + 2 * math.ceil(math.log2(n)) * latency
