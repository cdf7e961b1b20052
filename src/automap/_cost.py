"""The cost model: predicted step time, collectives and peak memory of a plan.

Everything a plan changes is a function of the mesh axis of each linkage group, so the
model is precomputed once per graph as tables keyed by *group sets* (the splittable groups
of a tensor, or of an op's iteration space). Evaluating an assignment is then a handful of
numpy operations over those tables:

- a set's sharding divisor = the product of the distinct mesh-axis sizes on its groups;
- compute: per op, flops / divisor / (peak x matmul efficiency) for dot/conv, bytes /
  divisor / (HBM bandwidth x memory efficiency) for the rest (metadata ops are free);
  ops sharing an iteration set are summed ahead of time, so compute is one dot product;
- partial sums: a reduced group split on axis a, when a is not dropped inside the op,
  leaves the outputs partial: an all-reduce on a, or a reduce-scatter when the output is
  itself split on a (what XLA's SPMD partitioner does);
- resharding: an input dim split on a that the op needs whole (untied, or the axis is
  dropped by the op's own layout): an all-gather on a, or an all-to-all when the op wants
  a on another dim of that input. A dim the op wants split but that arrives whole is a
  free local slice;
- gradient all-reduces (partial sums whose result has a parameter's layout) are combined
  into one tuple collective per axis, as XLA's all-reduce combiner does;
- ZeRO (stage >= 1) turns the gradient all-reduce on the data axis into a reduce-scatter
  plus an all-gather of the updated (stage 1, 2) or used (stage 3) parameters;
- memory: parameters, gradients, optimizer state and inputs by their layouts (and ZeRO),
  plus activations kept for backward (`_memory.py`) by their layouts, / microbatches.

Time is compute + communication (no overlap: XLA on GPUs overlaps little by default; a
conservative prediction) + the pipeline bubble (`pipeline_cost`, 0 without stages).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import numpy as np

from . import _collectives as C
from ._cluster import Cluster
from ._graph import Graph, Role
from ._linkage import Groups, build_groups
from ._memory import find_residuals
from ._plan import Collective, Cost, Plan
from ._rules import rule
from ._tables import RowTable, build_tables

_log = logging.getLogger("automap")
_warned: set[str] = set()


class CostModel:
    """Predicts a plan's cost on a cluster. Build once per graph; evaluate many plans."""

    def __init__(self, graph: Graph, cluster: Cluster, groups: Groups | None = None):
        self.graph = graph
        self.cluster = cluster
        self.groups = groups if groups is not None else build_groups(graph)
        unknown = sorted({op.primitive for op in graph.ops if not rule(op, graph).known})
        for p in unknown:
            if p not in _warned:
                _warned.add(p)
                _log.warning("no sharding rule for %r: kept replicated, costed as memory-bound", p)
        self.unknown_primitives = tuple(unknown)
        self.tables = build_tables(graph, self.groups, cluster, find_residuals(graph))
        self._axis_costs: dict[tuple, C.AxisCosts] = {}
        self._total_flops = graph.total_flops

    # ---- public -----------------------------------------------------------------------

    def evaluate(
        self,
        assignment: Mapping[int, str | None] | Sequence[int] | np.ndarray,
        mesh: Mapping[str, int],
        *,
        zero_stage: int = 0,
        microbatches: int = 1,
        remat: bool = False,
        data_axis: str | None = None,
        detail: bool = False,
    ) -> Cost:
        """Cost of an assignment {group id: axis} (or an array of axis codes, 1-based in
        mesh order, 0 for none) on a mesh. `detail` adds the per-op breakdown (slower)."""
        codes = self.codes(assignment, mesh)
        return self._evaluate(codes, dict(mesh), zero_stage, microbatches, remat, data_axis, detail)

    def estimate(self, plan: Plan) -> Cost:
        """Cost of a plan: its recorded assignment, else one read back from its specs."""
        raw = plan.decisions.get("assignment") if plan.decisions else None
        if raw is not None:
            assignment = {int(g): a for g, a in raw.items()}
        else:
            assignment = self.assignment_from_specs(plan)
        cost = self.evaluate(
            assignment,
            plan.mesh,
            zero_stage=plan.zero_stage,
            microbatches=plan.microbatches,
            remat=plan.remat,
            detail=True,
        )
        bubble = self.pipeline_cost(plan, cost)
        if bubble:
            step = cost.step_time_s + bubble
            return _replace(
                cost, step_time_s=step, bubble_s=bubble, mfu=self._mfu(step, plan.devices)
            )
        return cost

    def pipeline_cost(self, plan: Plan, cost: Cost) -> float:
        """Hook for the pipeline schedule (bubble and sends): 0 without stages."""
        return 0.0

    def codes(self, assignment, mesh: Mapping[str, int]) -> np.ndarray:
        """Axis code per group (+ a trailing 0 for padding), dropping splits the group cannot
        take: unsplittable groups and axes whose size does not divide the group."""
        n = len(self.groups.groups)
        if isinstance(assignment, Mapping):
            names = {name: i for i, name in enumerate(mesh, start=1)}
            codes = np.zeros(n + 1, dtype=np.int64)
            for g, axis in assignment.items():
                if axis is not None and axis in names:
                    codes[int(g)] = names[axis]
        else:
            codes = np.zeros(n + 1, dtype=np.int64)
            codes[:n] = np.asarray(assignment, dtype=np.int64)[:n]
        sizes = np.array([1, *mesh.values()], dtype=np.int64)
        ok = self.tables.splittable & (self.tables.divisor % sizes[codes] == 0)
        return np.where(ok, codes, 0)

    def assignment_from_specs(self, plan: Plan, data_axis: str = "data") -> dict[int, str]:
        """Propagate the axes named in a plan's specs and constraints to their groups (the
        data axis ZeRO adds to parameters and optimizer state is not a group decision)."""
        out: dict[int, str] = {}
        role = {leaf.path: leaf.role for leaf in self.graph.inputs}
        sources = [
            (leaf.tensor, plan.specs.get(leaf.path), role[leaf.path]) for leaf in self.graph.inputs
        ]
        sources += [(t, spec, None) for t, spec in plan.constraints.items()]
        for t, spec, r in sources:
            if spec is None or t >= len(self.graph.tensors):
                continue
            zero = (r == Role.OPT_STATE and plan.zero_stage >= 1) or (
                r == Role.PARAM and plan.zero_stage >= 3
            )
            for d, e in enumerate(spec[: self.graph.tensors[t].ndim]):
                axes = [e] if isinstance(e, str) else list(e or ())
                if zero:
                    axes = [a for a in axes if a != data_axis]
                if axes:
                    out.setdefault(self.groups.of(t, d), axes[0])
        return out

    # ---- the kernel -------------------------------------------------------------------

    def _costs_for(self, mesh: dict[str, int]) -> C.AxisCosts:
        key = tuple(mesh.items())
        if key not in self._axis_costs:
            self._axis_costs[key] = C.AxisCosts(self.cluster, mesh)
        return self._axis_costs[key]

    def _evaluate(self, A, mesh, zero_stage, microbatches, remat, data_axis, detail) -> Cost:
        T = self.tables
        ac = self._costs_for(mesh)
        S = ac.sizes
        k = len(mesh)
        AS = A[T.sets]  # [n_sets, K] axis code of each group of each set
        P = np.zeros((AS.shape[0], k + 1), dtype=bool)  # set holds axis a
        div = np.ones(AS.shape[0])
        for a in range(1, k + 1):
            P[:, a] = (a == AS).any(axis=1)
            div *= np.where(P[:, a], S[a], 1.0)
        inv = 1.0 / div

        compute = float(T.compute_coef @ inv)
        if remat:
            compute += float(T.remat_coef @ inv)

        m = max(1, int(microbatches))
        partial, reshard = (T.partial_full, T.reshard_full) if detail else (T.partial, T.reshard)
        bit = ac.bit
        parts = [
            _partial_rows(partial, A, P, S, bit, inv, m, self.cluster.reduce_scatter),
            _reshard_rows(reshard, A, P, S, bit, inv, m),
        ]
        kind = np.concatenate([p[0] for p in parts])
        axis = np.concatenate([p[1] for p in parts])
        nbytes = np.concatenate([p[2] for p in parts])
        count = np.concatenate([p[3] for p in parts])
        grad = np.concatenate([p[4] for p in parts])
        ops = np.concatenate([p[5] for p in parts]) if detail else None

        if data_axis is None:
            data_axis = "data" if "data" in mesh else None
        d = list(mesh).index(data_axis) + 1 if data_axis in mesh else 0
        D = S[d] if d else 1.0
        if zero_stage >= 1 and D > 1:
            # Gradients reduce-scattered over data, updated (or used) parameters gathered.
            zg = grad & (axis == bit[d]) & (kind == C.AR)
            kind = np.where(zg, C.RS, kind)
            extra = np.where(zg)[0]
            kind = np.concatenate([kind, np.full(len(extra), C.AG)])
            axis = np.concatenate([axis, axis[extra]])
            nbytes = np.concatenate([nbytes, nbytes[extra]])
            count = np.concatenate([count, count[extra]])
            grad = np.concatenate([grad, grad[extra]])
            if detail:
                ops = np.concatenate([ops, ops[extra]])

        # Gradient collectives: one combined occurrence per (kind, axis).
        nk, nm = len(C.KINDS), ac.masks
        key = kind * nm + axis
        comb_bytes = np.bincount(key[grad], nbytes[grad], minlength=nk * nm)
        comb_any = np.bincount(key[grad], minlength=nk * nm) > 0
        ng = ~grad
        tot_bytes = np.bincount(key[ng], nbytes[ng], minlength=nk * nm) + comb_bytes
        tot_count = np.bincount(key[ng], count[ng], minlength=nk * nm) + comb_any
        row_time = ac.time(kind[ng], axis[ng], nbytes[ng], count[ng])
        tot_time = np.bincount(key[ng], row_time, minlength=nk * nm).astype(float)
        kk, aa = np.divmod(np.arange(nk * nm), nm)
        tot_time += np.where(comb_any, ac.time(kk, aa, comb_bytes, comb_any.astype(float)), 0.0)
        comm = float(tot_time.sum())
        collectives = tuple(
            Collective(
                C.KINDS[kk[i]],
                ac.names[aa[i]],
                float(tot_bytes[i]),
                int(tot_count[i]),
                float(tot_time[i]),
            )
            for i in np.nonzero(tot_count)[0]
            if aa[i] > 0
        )

        zdiv = np.where(P[:, d], 1.0, D) if d else np.ones_like(inv)
        params = float(T.param_coef @ (inv / (zdiv if zero_stage >= 3 else 1.0)))
        grads = float(T.param_coef @ (inv / (zdiv if zero_stage >= 2 else 1.0)))
        opt = float(T.opt_coef @ (inv / (zdiv if zero_stage >= 1 else 1.0)))
        acts = float((T.act_remat_coef if remat else T.act_coef) @ inv) / m
        other = float(T.other_coef @ inv)
        memory = params + grads + opt + acts + other
        limit = self.cluster.memory_limit
        feasible = memory <= limit
        reason = ""
        if not feasible:
            reason = (
                f"needs {memory / 1e9:.2f} GB per device (parameters {params / 1e9:.2f}, "
                f"gradients {grads / 1e9:.2f}, optimizer state {opt / 1e9:.2f}, activations "
                f"{acts / 1e9:.2f}, inputs {other / 1e9:.2f}) but {self.cluster.name} has "
                f"{limit / 1e9:.2f} GB usable"
            )
        per_op: tuple = ()
        if detail:
            per_op = self._per_op(inv, ops[ng], row_time)
        step = compute + comm
        devices = math.prod(mesh.values()) if mesh else 1
        return Cost(
            step_time_s=step,
            compute_s=compute,
            comm_s=comm,
            bubble_s=0.0,
            memory_bytes=memory,
            mfu=self._mfu(step, devices),
            feasible=feasible,
            reason=reason,
            memory_limit_bytes=limit,
            memory_breakdown={
                "params": params,
                "grads": grads,
                "opt_state": opt,
                "activations": acts,
                "other": other,
            },
            collectives=collectives,
            per_op=per_op,
        )

    def _mfu(self, step: float, devices: int) -> float:
        if step <= 0:
            return 0.0
        return self._total_flops / (step * self.cluster.peak_flops * devices)

    def _per_op(self, inv, ops, row_time) -> tuple[tuple[int, float, float], ...]:
        T = self.tables
        comp = T.op_coef * inv[T.op_set]
        comm = np.bincount(ops, row_time, minlength=len(comp))
        return tuple((i, float(comp[i]), float(comm[i])) for i in range(len(comp)))


def _partial_rows(R: RowTable, A, P, S, bit, inv, m, reduce_scatter: bool):
    a = A[R.group]  # [rows, KR]
    act = (a > 0) & ~P[R.small, a]
    inout = act & P[R.tset[:, None], a]
    ar = np.bitwise_or.reduce(np.where(act & ~inout, bit[a], 0), axis=1)
    rs = np.bitwise_or.reduce(np.where(inout, bit[a], 0), axis=1)
    base = R.nbytes * inv[R.tset]
    count = np.where(R.grad, R.count, R.count * m)
    # Split on axes the output keeps: reduce-scatter of the unsplit result over them;
    # split on the others: all-reduce over their joint axes. Without reduce-scatters
    # (XLA on the CPU) one all-reduce of the unsplit result over all of them.
    rs_bytes = base * np.prod(np.where(inout, S[a], 1.0), axis=1)
    if not reduce_scatter:
        ar, rs, base = ar | rs, np.zeros_like(rs), rs_bytes
    i, j = np.nonzero(ar)[0], np.nonzero(rs)[0]
    kind = np.concatenate([np.full(len(i), C.AR), np.full(len(j), C.RS)])
    idx = np.concatenate([i, j])
    nbytes = np.concatenate([base[i], rs_bytes[j]])
    return kind, np.concatenate([ar[i], rs[j]]), nbytes, count[idx], R.grad[idx], R.op[idx]


def _reshard_rows(R: RowTable, A, P, S, bit, inv, m):
    h = R.group[:, 0]
    a = A[h]
    has = (a > 0) & ~P[R.tsmall, a]
    active = has & (R.untied | P[R.small[:, 0], a])
    a2a = P[R.other, a]
    base = R.nbytes * inv[R.tset]
    kind = np.where(a2a, C.A2A, C.AG)
    nbytes = np.where(a2a, base, base * S[a])
    return _active(active, kind, bit[a], nbytes, R.count * m, R.grad, R.op)


def _active(active, kind, a, nbytes, count, grad, op):
    i = np.nonzero(active)[0]
    return kind[i], a[i], nbytes[i], count[i], grad[i], op[i]


def _replace(cost: Cost, **kw) -> Cost:
    import dataclasses

    return dataclasses.replace(cost, **kw)
