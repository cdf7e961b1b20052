"""The cost model: predicted step time, collectives and peak memory of a plan.

Everything a plan changes is a function of the mesh axis of each linkage group, so the
model is precomputed once per graph as tables keyed by *group sets* (the splittable groups
of a tensor, or of an op's iteration space). Evaluating an assignment is then a handful of
numpy operations over those tables:

- a set's sharding divisor = the product of the distinct mesh-axis sizes on its groups;
- compute: per op, flops / divisor / (peak x matmul efficiency) for dot/conv, bytes /
  divisor / (HBM bandwidth x memory efficiency) for the rest, where an op that XLA fuses
  (elementwise, layout, reductions) only pays for the tensors entering or leaving its
  fusion (`_fusion.fused_bytes`: broadcasts such as a causal mask are regenerated in
  each fusion, never written; on GPUs a reduction runs in the kernel that writes its
  operand, `Lowering.multi_output_fusion`); ops sharing an iteration set are summed ahead
  of time, so compute is one dot product;
- partial sums: a reduced group split on axis a, when a is not dropped inside the op,
  leaves the outputs partial: an all-reduce on a, or a reduce-scatter when the output is
  itself split on a (XLA's GPU/TPU pipelines; its CPU one all-reduces the whole buffer,
  `Lowering.reduce_scatter`). Several reduced groups on several axes: one collective
  over their joint axes ("data+model") on GPUs and TPUs, a chain of one all-reduce per
  axis on the CPU (`_kernel.partial_rows`). Bytes follow DESIGN.md; 16-bit floats are
  widened where the backend widens them (`Lowering.collective_float_bytes`: the CPU);
- resharding: an input dim split on a that the op needs whole (untied, or the axis is
  dropped by the op's own layout): an all-gather on a, or an all-to-all when the op wants
  a on another dim of that input. A dim the op wants split but that arrives whole is a
  free local slice. At a seam (a flatten where the batch group was cut, `Seam`) the
  input's batch dim moves only when the other side's group is not on the same axis;
- gradient all-reduces (partial sums whose result has a parameter's layout) are combined
  into one tuple collective per axis, as XLA's all-reduce combiner does; a loop body's
  (a scanned layer's weight gradients) into one per axis per trip, inside the loop;
- ZeRO (stage >= 1), as XLA compiles a plan that pins the gradients and the optimizer
  update to the ZeRO layout (`_groups.plan_from_assignment`): the data-parallel gradient
  all-reduce becomes a reduce-scatter (the CPU's lowering: an all-reduce and a slice),
  the update runs on shards and the parameters are all-gathered: once after the update
  (ZeRO-1/2), or layer by layer (ZeRO-3 as FSDP, `_fsdp.py`: one combined gather per
  forward layer, and again, one gather per leaf, for the backward's reads and under remat
  its recompute; about FSDP's 1.5x of data parallel's bytes).
  The ops ZeRO pins (the update, and a gradient whose iteration space the data axis does
  not already split) compute on the device's data shard (`_zero.zero_shares`).
  Checked against XLA's HLO and `cost_analysis()`;
- memory: parameters, gradients, optimizer state and inputs by their layouts (ZeRO shards
  the optimizer state, and with ZeRO-3 the stored parameters, whose gathered copies live
  about two layers (`_fsdp.py`) and whose casts are not kept for the backward; the local
  gradients are whole until their reduce-scatter, in every stage, as XLA compiles them:
  at the end of the backward, but with ZeRO-3 layer by layer, as the runtime ties them),
  plus activations kept for backward (`_capture/_residuals.py`) by their layouts, / microbatches.
  With rematerialization (`_remat/_recompute.py`, what `am.apply` runs): each recomputed layer's ops
  are charged a second time, and the activations are the layers' inputs, the residuals
  made outside them, and one layer's residuals (its backward's). A step that does not
  donate its state holds the new beside the old from the update on (`_outputs.py`). A TPU
  matmul's elementwise readers run in its kernel, which writes no output of its own where
  no axis splits its contraction (`_epilogue.py`).

Each of these terms is stated once, in `_terms.py` (ZeRO's in `_zero.py`), and read both
here and by the shard ILP's factors (`_search/_mesh_terms.py`); this module evaluates the
collectives, places the peak and assembles the `Cost`.

Time is compute + communication (an upper bound where XLA's GPU hides FSDP's gathers:
`_verify/_schedule.py`, DESIGN.md "Collectives overlapped with compute"), less ZeRO-3's
prefetch beside the forward's compute where the lowering overlaps it (`_overlap.py`: XLA's
TPU, `Lowering.tpu()`). The gradients' all-reduce is not overlapped with the backward:
XLA's GPU runs its latency-hiding scheduler only when asked (off by default), as
Megatron-LM's SC'21 runs (local DDP) all-reduce after the backward. Pipelines are timed by
their schedule on top of these per-op costs (`_pipelined.py`: bubble, sends, memory).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Mapping, Sequence

import numpy as np

from .._axes import DATA
from .._cluster import Cluster
from .._graph import Graph
from .._groups import Groups, assignment_from_specs, build_groups, regather_plan, rule
from .._plan import Collective, Cost, Plan
from .._remat import Recompute, full_remat, layer_spans, plan_recompute, remat_key, remat_residuals
from . import _collectives as C
from . import _kernel as K
from ._beside import BesideMemo, beside_table, split_held, split_seconds
from ._buffers import Held, held_widths
from ._epilogue import less_unwritten
from ._flash import with_flash
from ._overlap import backward_taken, gather_beta, step_prefetch
from ._peaks import busiest_moment, reduced_gradients, reduction_copy, update_peak
from ._per_op import per_op
from ._pipelined import estimate_pipeline
from ._remat_terms import recompute_copies, recomputed_collectives
from ._rows import PARTIAL_SETS, RESHARD_SETS, RowTable
from ._seqpar import SeqparTerms, SplitMemory, seqpar_terms, split_memory, with_sequence_parallel
from ._seqpar_layout import layout_rate
from ._tables import build_tables
from ._terms import (
    Layout,
    Memory,
    SetCoefs,
    compute_time,
    early_outputs,
    gathers,
    gradient_trips,
    hidden_time,
    memory_terms,
    moments_held,
    reduction_shares,
    step_moments,
    update_reductions,
)
from ._tiles import TileMemo, tile_table
from ._zero import regather_coefs, update_sums

_log = logging.getLogger("automap")
_warned: set[str] = set()


class CostModel:
    """Predicts a plan's cost on a cluster. Build once per graph; evaluate many plans."""

    def __init__(
        self,
        graph: Graph,
        cluster: Cluster,
        groups: Groups | None = None,
        recompute: Recompute | None = None,
    ):
        self.graph = graph
        self.cluster = cluster
        self.groups = groups if groups is not None else build_groups(graph)
        unknown = sorted({op.primitive for op in graph.ops if not rule(op, graph).known})
        for p in unknown:
            if p not in _warned:
                _warned.add(p)
                _log.warning("no sharding rule for %r: kept replicated, costed as memory-bound", p)
        self.unknown_primitives = tuple(unknown)
        # What the step keeps for its backward, with and without rematerialization.
        # `recompute`: what remat recomputes, default every layer in full (`for_plan`).
        self.residuals = remat_residuals(graph, self.groups, recompute)
        self._own_recompute = recompute is not None  # a `for_plan` variant prices its own
        self._variants: dict[tuple, CostModel] = {}
        rg = regather_plan(graph, self.groups)
        self.tables = build_tables(graph, self.groups, cluster, self.residuals, rg.tensors)
        self._remat_rows = (self.tables.remat_partial.merged(), self.tables.remat_reshard.merged())
        self.regather = regather_coefs(graph, self.groups, self.tables, self.residuals, rg)
        # Every term's coefficients per set: what a plan's layout multiplies (`_terms.py`).
        prefetch = step_prefetch(  # ZeRO-3's gathers beside compute (`_overlap.py`)
            graph, self.groups, self.tables, cluster.lowering, self.residuals.recomputed
        )
        reductions = update_sums(graph, self.groups, self.tables)
        self.coefs = SetCoefs.of(self.tables, self.regather, prefetch, reductions)
        self._axis_costs: dict[tuple, C.AxisCosts] = {}
        self._total_flops = graph.total_flops
        self._param_bytes = float(self.tables.param_coef.sum())
        self._touch_cache: dict[tuple[int, ...], tuple] = {}
        self._split_cache: dict[tuple, SplitMemory] = {}
        self._tile_memo = TileMemo(
            functools.partial(
                tile_table, graph, self.groups, self.tables.splittable, len(self.tables.sets)
            ),
            cluster.lowering.scatter_least_elements,
        )
        on, T = cluster.lowering.reduce_scatter, self.tables  # XLA's split beside data
        self.beside = BesideMemo(lambda: beside_table(graph, self._tile_memo.table, T), on)

    # ---- public -----------------------------------------------------------------------

    @functools.cached_property
    def layer_stored(self) -> tuple[tuple[Held, ...], ...]:
        """Per recomputed layer, the residuals of it XLA stores, each with its width and
        what it serves (`held_widths` of `residuals.layer_saved`): the same for every
        pipeline partition priced, so made once (a 1T GPT's Megatron expert prices some 40
        partitions)."""
        consumers = self.graph.consumers()
        return tuple(
            held_widths(self.graph, ts, self.cluster.lowering, consumers, recomputed=True)
            for ts in self.residuals.layer_saved
        )

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
        st = self._state(self.codes(assignment, mesh), dict(mesh), microbatches, remat, detail)
        return self._finish(st, zero_stage, data_axis, detail)

    def estimate(self, plan: Plan) -> Cost:
        """Cost of a plan: its recorded assignment, else one read back from its specs. A
        plan with pipeline stages is timed by its schedule (`_pipelined.py`)."""
        if self._remat_key(plan) is not None:
            return self.for_plan(plan).estimate(full_remat(plan))
        if plan.pipelined:
            return estimate_pipeline(self, plan).cost
        low, terms, split = self.cluster.lowering, None, None
        if plan.sequence_parallel:
            again = self.residuals if plan.remat else ()  # their gathers run again
            terms = seqpar_terms(self.graph, self.groups, plan, low.collective_float_bytes, again,
                                 taken=backward_taken(self.coefs.prefetch, plan, low),
                                 layout_rate=layout_rate(self.cluster))  # fmt: skip
            # The stream's tensors 1/t where the step holds them, before its peak is placed.
            t = plan.mesh[str(plan.sequence_parallel)]
            split = (self._split_memory(terms, bool(plan.remat)), 1 - 1 / t)
        # One program on the whole batch (microbatches run through the staged runtime, above).
        codes = self.codes(self.plan_assignment(plan), plan.mesh)
        st = self._state(codes, dict(plan.mesh), 1, plan.remat, True)
        flash = plan.attention == "flash"
        cost = self._finish(st, plan.zero_stage, None, True, split, plan.zero_gather, flash)
        cost = with_flash(self, st, plan, cost)  # the attention cores as the kernel runs them
        if terms is None:
            return cost
        axis, costs = str(plan.sequence_parallel), self._costs_for(plan.mesh)
        return with_sequence_parallel(
            cost, terms, plan.mesh, axis, costs, low.reduce_scatter, low.overlaps_stream_gathers
        )

    def _split_memory(self, terms: SeqparTerms, remat: bool) -> SplitMemory:
        """`_seqpar.split_memory`, once per split and remat (a search prices many plans)."""
        key = (terms.split, terms.whole_reads, terms.reduce_ops, remat)
        if key not in self._split_cache:
            self._split_cache[key] = split_memory(self, terms, remat)
        return self._split_cache[key]

    def for_plan(self, plan: Plan) -> CostModel:
        """The model whose `remat=True` prices what `plan` recomputes: this one for every
        layer in full, else one built (once per policy) on that plan's `Recompute`."""
        key = self._remat_key(plan)
        if key is None:
            return self
        if key not in self._variants:
            rc = plan_recompute(self.graph, self.groups, plan)
            self._variants[key] = CostModel(self.graph, self.cluster, self.groups, rc)
        return self._variants[key]

    def _remat_key(self, plan: Plan) -> tuple | None:
        """`remat_key` of `plan` in this graph (None in a variant: it prices its own)."""
        return None if self._own_recompute else remat_key(plan, self._layer_spans)

    @functools.cached_property
    def _layer_spans(self) -> tuple[tuple[int, int], ...]:
        return layer_spans(self.graph, self.groups)  # a stage may start inside a layer

    def plan_assignment(self, plan: Plan) -> dict[int, str]:
        """A plan's assignment {group: axis}: as recorded, else read back from its specs."""
        if plan.assignment is not None:
            return dict(plan.assignment)
        return self.assignment_from_specs(plan)

    def op_state(
        self, assignment, mesh: Mapping[str, int], staged: bool = False
    ) -> tuple[K.State, C.AxisCosts]:
        """An assignment evaluated with one collective row per op (the full tables) for the
        whole batch at once, and its mesh's axis costs: the base of per-op and per-stage
        costs (`_pipelined.py`); `staged`: for two stages or more, which reduce apart what
        one program adds first (`Tables.staged_partial_full`)."""
        st = self._state(self.codes(assignment, mesh), dict(mesh), 1, False, True, staged)
        return st, self._costs_for(mesh)

    def codes(self, assignment, mesh: Mapping[str, int]) -> np.ndarray:
        """Axis code per group (+ a trailing 0 for padding), dropping splits the group cannot
        take: unsplittable groups and axes whose size does not divide the group."""
        n = len(self.groups.groups)
        ac = self._costs_for(mesh)
        codes = np.zeros(n + 1, dtype=np.int64)
        if isinstance(assignment, Mapping):
            names = ac.codes
            pairs = [(int(g), names[a]) for g, a in assignment.items() if a in names]
            if pairs:
                idx, val = zip(*pairs, strict=True)
                codes[list(idx)] = val
        else:
            codes[:n] = np.asarray(assignment, dtype=np.int64)[:n]
        ok = self.tables.splittable & (self.tables.divisor % ac.int_sizes[codes] == 0)
        return np.where(ok, codes, 0)

    def assignment_from_specs(self, plan: Plan, data_axis: str = DATA) -> dict[int, str]:
        """`_groups.assignment_from_specs` of this model's program."""
        return assignment_from_specs(self.graph, self.groups, plan, data_axis)

    # ---- the kernel -------------------------------------------------------------------

    def _costs_for(self, mesh: Mapping[str, int]) -> C.AxisCosts:
        key = tuple(mesh.items())
        if key not in self._axis_costs:
            self._axis_costs[key] = C.AxisCosts(self.cluster, mesh)
        return self._axis_costs[key]

    def state(
        self,
        assignment,
        mesh: Mapping[str, int],
        *,
        microbatches: int = 1,
        remat: bool = False,
        detail: bool = False,
    ) -> K.State:
        """An evaluated assignment, the base of `evaluate_delta`."""
        return self._state(self.codes(assignment, mesh), dict(mesh), microbatches, remat, detail)

    def evaluate_delta(
        self,
        base: K.State,
        changes: Mapping[int, str | None],
        *,
        zero_stage: int = 0,
        data_axis: str | None = None,
    ) -> tuple[Cost, K.State]:
        """The cost of `base` with a few groups moved to other axes, recomputing only the
        sets and rows that mention them. Returns the cost and the new state (the base of
        the next move when a searcher accepts this one)."""
        T, mesh = self.tables, base.mesh
        ac = self._costs_for(mesh)
        names = {name: i for i, name in enumerate(mesh, start=1)}
        A = base.codes.copy()
        for g, axis in changes.items():
            code = names.get(axis, 0) if axis is not None else 0
            ok = T.splittable[g] and T.divisor[g] % int(ac.sizes[code]) == 0
            A[g] = code if ok else 0
        gs = [g for g in changes if A[g] != base.codes[g]]
        if not gs:
            return self._finish(base, zero_stage, data_axis), base
        sets, sub_sets, sub_p, sub_r, idx = self._touched(gs)
        P, inv = base.P.copy(), base.inv.copy()
        P[sets], inv[sets] = K.set_axes(A, sub_sets, ac.sizes)
        key, nbytes, count, grad, time = K.collective_rows(
            sub_p, sub_r, A, P, inv, ac, base.microbatches, self.cluster.lowering
        )
        slot = K.combine_slots(sub_p, sub_r)
        # One signed pass: the touched rows' new contributions minus their old ones.
        both = K.sums(
            np.concatenate([key, base.key[idx]]),
            np.concatenate([nbytes, -base.nbytes[idx]]),
            np.concatenate([count, -base.count[idx]]),
            np.concatenate([grad, grad]),
            np.concatenate([time, -base.time[idx]]),
            len(C.KINDS) * ac.masks,
            np.concatenate([slot, slot]),
            len(T.combine_trips),
            signed=True,
        )
        state = K.State(
            codes=A,
            mesh=mesh,
            microbatches=base.microbatches,
            remat=base.remat,
            P=P,
            inv=inv,
            key=_patch(base.key, idx, key),
            nbytes=_patch(base.nbytes, idx, nbytes),
            count=_patch(base.count, idx, count),
            time=_patch(base.time, idx, time),
            sums=base.sums + both,
            partial=base.partial,
        )
        return self._finish(state, zero_stage, data_axis), state

    def _touched(self, gs) -> tuple:
        """Sets holding any of the groups and the rows that read them (as sub-tables, and
        as indices of their virtual rows): cached, searchers revisit the same groups."""
        key = tuple(sorted(gs))
        hit = self._touch_cache.get(key)
        if hit is None:
            T = self.tables
            in_set = np.isin(T.sets, key).any(axis=1)
            p, r = T.partial, T.reshard
            prow = np.nonzero(
                np.isin(p.group, key).any(axis=1) | in_set[p.read_sets(PARTIAL_SETS)].any(axis=1)
            )[0]
            rrow = np.nonzero(
                np.isin(r.group[:, 0], key) | in_set[r.read_sets(RESHARD_SETS)].any(axis=1)
            )[0]
            sets = np.nonzero(in_set)[0]
            n_p, slots = len(p.tset), K.partial_slots(p)
            idx = np.concatenate([*(prow + j * n_p for j in range(slots)), rrow + slots * n_p])
            hit = (sets, T.sets[sets], _take(p, prow), _take(r, rrow), idx)
            if len(self._touch_cache) < 4096:
                self._touch_cache[key] = hit
        return hit

    def _state(self, A, mesh, microbatches, remat, detail, staged=False) -> K.State:
        T = self.tables
        ac = self._costs_for(mesh)
        P, inv = K.set_axes(A, T.sets, ac.sizes)
        m = max(1, int(microbatches))
        partial, reshard = (T.partial_full, T.reshard_full) if detail else (T.partial, T.reshard)
        if staged:
            partial = T.staged_partial_full
        key, nbytes, count, grad, time = K.collective_rows(
            partial, reshard, A, P, inv, ac, m, self.cluster.lowering
        )
        slot = K.combine_slots(partial, reshard)
        sums = K.sums(
            key, nbytes, count, grad, time, len(C.KINDS) * ac.masks, slot, len(T.combine_trips)
        )
        return K.State(A, mesh, m, bool(remat), P, inv, key, nbytes, count, time, sums, partial)

    def _layout(
        self,
        st: K.State,
        zero_stage: int,
        data_axis: str | None,
        zero_gather: str = "compute",
        flash: bool = False,
    ) -> tuple[Layout, int]:
        """The plan's layout per set (`_terms.Layout`) and the axis code ZeRO shards over:
        `data_axis` (default: the mesh's data axis; 0 where there is none). `zero_gather`:
        the plan's (`Plan.zero_gather`); what plans are made with, "compute", otherwise
        (on the mesh's data axis: `plan_from_assignment` keeps masters on no other).
        `flash`: the attention cores run as the flash kernel (`Plan.attention`)."""
        mesh = st.mesh
        if data_axis is None:
            data_axis = DATA if DATA in mesh else None
        d = list(mesh).index(data_axis) + 1 if data_axis in mesh else 0
        D = self._costs_for(mesh).sizes[d] if d else 1.0
        free = ~st.P[:, d] if d else np.ones(len(st.inv), dtype=bool)
        tiles = None
        if self.cluster.lowering.tile_padding:
            sizes = self._costs_for(mesh).sizes
            tiles = self._tile_memo.shares(
                st.codes, mesh, sizes, d if zero_stage >= 1 and D > 1 else 0
            )
        compute = zero_gather == "compute" and data_axis == DATA
        layout = Layout(st.inv, free, D, zero_stage, st.remat, st.microbatches, tiles)
        return dataclasses.replace(layout, gathers_compute=compute, flash=flash), d

    def _finish(
        self,
        st: K.State,
        zero_stage,
        data_axis,
        detail: bool = False,
        split=None,
        zero_gather: str = "compute",
        flash: bool = False,
    ) -> Cost:
        """The plan's `Cost` from its evaluated state: the terms of `_terms.py`, the
        combined collectives, and the memory at its busiest moment (`split`: sequence
        parallelism's (`SplitMemory`, 1 - 1/t), its stream tensors held 1/t)."""
        L, d = self._layout(st, zero_stage, data_axis, zero_gather, flash)
        ac, tied = self._costs_for(st.mesh), self.tables.tied_partial  # XLA's split beside data
        beside = self.beside.split(st, ac, d, tied, L.zero_stage) if L.zero else None
        compute = float(compute_time(self.coefs, L)) - split_seconds(beside)
        comm, collectives = self._communication(st, L, d, beside)
        if self.coefs.prefetch is not None:  # ZeRO-3's beside compute: off the path
            comm -= float(hidden_time(self.coefs, L, self._gather_beta(st, d)))
        mem = memory_terms(self.coefs, L)
        grads, acts, outputs = self._peak(st, L, mem, split, beside)
        parts = {
            "params": float(mem.params),
            "grads": grads,
            "opt_state": float(mem.opt),
            "activations": acts,
            "other": float(mem.other),
            "outputs": outputs,
        }
        total = sum(parts.values())
        limit = self.cluster.memory_limit
        per_op: tuple = ()
        if detail:
            per_op = self._per_op(st, (st.P, d, L.data_size) if L.zero else None, beside)
        step = compute + comm
        return Cost(
            step_time_s=step,
            compute_s=compute,
            comm_s=comm,
            bubble_s=0.0,
            memory_bytes=total,
            mfu=self._mfu(step, math.prod(st.mesh.values()) if st.mesh else 1),
            feasible=total <= limit,
            reason=self._too_big(parts, total) if total > limit else "",
            memory_limit_bytes=limit,
            memory_breakdown=parts,
            collectives=collectives,
            per_op=per_op,
        )

    def _communication(self, st: K.State, L: Layout, d: int, split) -> tuple[float, tuple]:
        """Seconds of the step's collectives and the collectives per (kind, axes): rows summed
        (a recomputed layer's twice), gradients combined, ZeRO's scattered but `split`'s."""
        ac = self._costs_for(st.mesh)
        zero_mask = int(ac.bit[d]) if L.zero else 0
        g = gathers(self.coefs, L)
        count = int(g.count) if zero_mask else 0
        if st.remat:  # the recompute runs its ops' collectives again
            slots = len(self.tables.combine_trips)
            lowering = self.cluster.lowering
            sums = st.sums + recomputed_collectives(self._remat_rows, st, ac, lowering, slots)
        else:
            sums = st.sums
        time, nbytes, calls, kk, aa = K.totals(
            sums,
            ac,
            zero_mask,
            float(g.total_bytes),
            count,
            self.cluster.lowering,
            gradient_trips(self.coefs, L, self.tables.combine_trips),
            self._tile_memo.zero_scatter(self.cluster, st.codes, st.mesh, ac.sizes, d, L.zero_stage)
            if zero_mask
            else None,
            float(update_reductions(self.coefs, L)) if zero_mask else 0.0,
            K.tied_bytes(self.tables.tied_partial, st, ac, d, L.zero_stage) if zero_mask else 0.0,
            split if zero_mask else None,
        )
        collectives = tuple(
            Collective(
                C.KINDS[kk[i]], ac.names[aa[i]], float(nbytes[i]), round(calls[i]), float(time[i])
            )
            for i in np.nonzero((calls > 0) & (aa > 0))[0]
        )
        return float(time.sum()), collectives

    def _gather_beta(self, st: K.State, d: int) -> float:
        """Seconds per byte of ZeRO's gathers over the data axis (code `d`; 0 where none)."""
        ac = self._costs_for(st.mesh)
        return gather_beta(ac, int(ac.bit[d])) if d else 0.0

    def _peak(self, st: K.State, L: Layout, mem: Memory, split=None, beside=None):
        """(gradients, activations, outputs) at the step's peak: its busiest candidate
        moment where the backend schedules its buffers (`_peaks.busiest_moment`), else
        the larger of the backward's, the reduction's and the update's (`update_peak`);
        without remat, with what the `beside` split's dots hold (`_beside.split_held`)."""
        ac = self._costs_for(st.mesh)
        acts, outputs = float(mem.acts), float(mem.outputs)
        if split is not None:  # sequence parallelism's stream tensors held 1/t
            part, shrink = split
            acts -= shrink * float(part.kept @ L.inv) / L.microbatches
        if step_moments(self.coefs, L) is None:
            # Where the gradients' all-reduce is not in place (XLA's CPU), its result is a
            # second copy of what it reduces, beside the local gradients at the backward's
            # end, the activations gone: a second peak (layer by layer, a layer's copy).
            in_place = self.cluster.lowering.all_reduce_in_place
            largest, _ = reduction_shares(self.coefs, L)
            reduced = 0.0 if in_place else largest * reduced_gradients(st.sums, ac)
            return update_peak(float(mem.grads), acts, reduced, outputs)
        reduced = reduced_gradients(st.sums, ac)
        share, const = reduction_copy(
            L.data_size if L.zero else 0, self.cluster.lowering, self._param_bytes
        )
        copy = share * reduced + const
        alone = split[0].uncombined if split is not None else None  # reduced alone: no copy
        operands = split_held(self.tables.split_operands, L, beside)  # None under remat
        copied = recompute_copies(self.tables, st, ac, alone) if st.remat else operands
        copied = less_unwritten(copied, self.tables.epilogues, st.codes, st.P, L)
        made, at, out = moments_held(self.coefs, L, reduced, copied)
        if split is not None:
            at = at + part.at_moments(L.inv, shrink) / L.microbatches
        moments = step_moments(self.coefs, L)
        early = float(early_outputs(self.coefs, L)) if moments.outputs is not None else 0.0
        # At the end: the gradients the last reduction reduces (all, or a layer's) and its copy.
        _, last = reduction_shares(self.coefs, L)
        return busiest_moment(made, at, out, last * reduced + copy, early)

    def _too_big(self, parts: Mapping[str, float], total: float) -> str:
        """Why a plan does not fit: its memory parts against the cluster's limit."""
        gb = {k: v / 1e9 for k, v in parts.items()}
        return (
            f"needs {total / 1e9:.2f} GB per device (parameters {gb['params']:.2f}, "
            f"gradients {gb['grads']:.2f}, optimizer state {gb['opt_state']:.2f}, activations "
            f"{gb['activations']:.2f}, inputs {gb['other']:.2f}, outputs held apart "
            f"{gb['outputs']:.2f}) but {self.cluster.name} has "
            f"{self.cluster.memory_limit / 1e9:.2f} GB usable"
        )

    def _mfu(self, step: float, devices: int) -> float:
        if step <= 0:
            return 0.0
        return self._total_flops / (step * self.cluster.peak_flops * devices)

    def _per_op(self, st: K.State, zero=None, split=None) -> tuple[tuple[int, float, float], ...]:
        """(op, compute s, comm s) per op (`_per_op.per_op`)."""
        return per_op(self.tables, st, self._costs_for(st.mesh), zero, split)


def _take(R: RowTable, idx: np.ndarray) -> RowTable:
    return RowTable(**{f.name: getattr(R, f.name)[idx] for f in dataclasses.fields(R)})


def _patch(a: np.ndarray, idx: np.ndarray, values: np.ndarray) -> np.ndarray:
    out = a.copy()
    out[idx] = values
    return out
