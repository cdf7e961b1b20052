"""The shard space's cost model as factors: `MeshTerms`, one mesh's terms by scope, and
the factor sums of its MILP per ZeRO stage (`MeshTerms.problem`). Read by the ILP
(`_shard_ilp.py`), the feasibility proof (`_leanest.py`) and the stage DP (`_dp.py`).

On a fixed mesh the cost model's step time is a sum of terms that each read the axes of a
few decision units (the groups of one set or one collective row, see `_cost/_tables.py`).
The terms are not restated here: each scope keeps its own sets' layout under every joint
option, and reads the cost model's terms on it (`_cost/_terms.py`, the one statement of a
plan's price), so the factor sums are the cost model's terms by construction:

- compute (`compute_time`): per group set s, `compute_coef[s] / divisor(s)`, ZeRO's
  pinned ops on data shards;
- a non-gradient collective row: its own alpha-beta time (the cheaper of ring and tree for
  that row alone), a function of the units of the row's groups and sets (the kernel's,
  `_cost/_kernel.collective_rows`);
- memory (`memory_terms`, `moments_held`): per set, its parameter, optimizer, activation and
  input bytes over its divisor (and over data under ZeRO), at each point the cost model
  checks (the turn of the step; where the step's buffers are scheduled, each candidate
  moment of `_cost/_liveness.py` and the gradients' reduction): one memory factor sum
  per point, each bounded.

Each distinct unit *scope* becomes one `Factor`, its table filled by running the cost
model's own kernel (`_cost/_kernel.collective_rows`, `set_axes`) on every joint option of the scope
at once. Two parts are not separable, and are made exact with auxiliary units:

- gradient collectives are combined per (kind, axis) into one tuple collective, timed as
  `min(ring, tree)` of the summed bytes with one latency if any row is active. An auxiliary
  unit per such key picks off / ring / tree: a scope factor makes "off" infinite when a row
  of the scope is active and charges beta x bytes otherwise, a unary factor charges alpha.
  Minimizing picks min(ring, tree) exactly; a variant no cheaper in both alpha and beta is
  dropped.
- ZeRO's all-gathers of the moments (and parameters) are one collective of summed bytes
  and counts: linear when one variant dominates (always so for all-gathers), else again an
  auxiliary unit. One corner is not exact: the cost model skips that collective when no
  parameter of rank >= 1 is left off the data axis, where the factors still charge beta x
  the bytes of the scalar parameters left (an overestimate of a few bytes' transfer).
  ZeRO-3 gathers layer by layer: its forward's are that indicated collective once per
  forward layer (`Gathers.combined`, a count of the step's); its second gathers, in the
  backward, are one collective per parameter leaf: linear, their latencies per scope.

Where the backend overlaps ZeRO-3's prefetch (`Lowering.overlaps_prefetch`), each pair's
max(gather, compute) is the one term that is not a sum: per pair, one `Overlap` of the
scopes' shares of both sides (`_cost/_terms.prefetch_sides`), whose min the ILP takes off
with a continuous column (`_solvers/_ilp.py`).

The masks become unary `allowed` masks (axis present, divides the unit) and pairwise
factors that forbid one axis on two units sharing a tensor, or a seam's dense side on an
axis its convolutions do not take.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

from .._axes import DATA
from .._cost import (
    AG,
    AR,
    CP,
    KINDS,
    PARTIAL_SETS,
    RESHARD_SETS,
    RS,
    AxisCosts,
    Layout,
    RowTable,
    SetCoefs,
    collective_rows,
    combine_slots,
    compute_time,
    early_outputs,
    gather_beta,
    gathers,
    gradient_trips,
    memory_terms,
    moments_held,
    partial_slots,
    prefetch_sides,
    reduction_copy,
    reduction_shares,
    scope_split,
    set_axes,
    update_reductions,
)
from .._lowering import Lowering
from .._solvers import MEMORY_RTOL, Factor, FactorProblem, Overlap
from .._space import OPTIONS, ShardSpace

OFF = np.inf  # an auxiliary "off" entry when a row of the scope is active

#: Joint options of the scopes (the MILP's y columns before merging) a mesh may have per
#: second of its share of the budget. Past it the mesh is skipped, not solved: building
#: the tables and HiGHS's presolve do not watch the clock, and a scan that ties every
#: parameter into one scope gives millions (3.1M on a 4 x 2 mesh of a small
#: gradient-accumulation step: 16 s to build, 18 s in HiGHS under a 2 s limit; 3.3
#: billion for a Flax `nn.scan` stack). HiGHS proved the 8-device data mesh of that step
#: (24,630 joint options, 17,071 columns) optimal in 1.0 s: the rate leaves it a margin.
#: A nominal rate, like the other searchers' evaluations per second: the same budget
#: skips the same meshes on any machine.
COLUMNS_PER_SECOND = 20_000
#: At least this many whatever the budget: every zoo model's meshes (layer grouping keeps
#: them under 1,000) are solved on the smallest budget, in a fraction of a second each.
MIN_COLUMNS = 5_000
#: And at most this many (a budget of inf included): past it the tables alone take
#: minutes and gigabytes.
MAX_COLUMNS = 4_000_000
#: HiGHS's own set-up per MILP, in joint options at `COLUMNS_PER_SECOND`: 8 to 13 ms
#: measured on a 134-column MILP (bert-large's 8 x 2 mesh) on the shared 2-core machine,
#: whatever the MILP's size.
MILP_SETUP = 200


class TooLarge(Exception):
    """A mesh's MILP is larger than the budget affords (`COLUMNS_PER_SECOND`)."""


@dataclasses.dataclass
class _Scope:
    """Per joint option of a scope's units: the terms whose units are exactly the scope.
    Its sets' layout under each option is kept, not its terms: every term is the cost
    model's own (`_cost/_terms.py`), read per ZeRO stage in `MeshTerms.problem`."""

    units: tuple[int, ...]
    configs: np.ndarray  # [n_c, k] option of each unit
    comm: np.ndarray  # [n_c] non-gradient collectives
    grad_bytes: np.ndarray  # [n_c, slots * keys] gradient bytes per (slot, kind, axis mask)
    grad_any: np.ndarray  # [n_c, slots * keys] some gradient row is active on the key
    reduced: np.ndarray  # [n_c] the step's gradient reductions' bytes (`reduced_gradients`)
    coefs: SetCoefs  # the coefficients of the scope's own sets
    # [n_c] active gradient rows over data alone, and the gradients XLA splits beside it
    # under ZeRO (`_cost/_beside.scope_split`: arrays per option, the compute its dots
    # save last), None where none
    zero_rows: np.ndarray | None
    split: tuple | None
    inv: np.ndarray  # [own sets, n_c] 1 / divisor of each
    free: np.ndarray  # [own sets, n_c] the data axis is not on it

    def layout(self, D: float, zero_stage: int) -> Layout:
        """The scope's sets' layout under every joint option, ZeRO at `zero_stage`."""
        return Layout(self.inv, self.free, D, zero_stage)

    def compute(self, D: float, zero_stage: int) -> np.ndarray:
        """[n_c] its compute seconds (`compute_time`), less the dots XLA splits beside data
        under ZeRO (`_cost/_beside.scope_split`, where the backend reduce-scatters)."""
        L = self.layout(D, zero_stage)
        saved = self.split[6] if L.zero and self.split is not None else 0.0
        return compute_time(self.coefs, L) - saved


@dataclasses.dataclass(frozen=True)
class _Copies:
    """One copy of a scope's groups and sets per joint option, for one pass of the kernel:
    the copy of option c has group ids offset by `g_off[c]`, set ids by `s_off[c]`."""

    local: np.ndarray  # [groups] the scope's local id of each group (the pad if outside)
    sl: np.ndarray  # the sets the scope's rows read, sorted: a set's local id is its index
    g_off: np.ndarray  # [n_c] first group id of each copy
    s_off: np.ndarray  # [n_c] first set id of each copy

    def rows(self, R: RowTable, idx: np.ndarray, used: tuple[str, ...]) -> RowTable:
        """Rows `idx` of R once per copy; set columns not in `used` (their sets are not
        among `sl`) point at the copy's first set."""
        out = {}
        for f in dataclasses.fields(R):
            x = getattr(R, f.name)[idx]
            if f.name == "group":
                x = (self.local[x][None] + self.g_off[:, None, None]).reshape(-1, x.shape[1])
            elif f.name in RESHARD_SETS:
                pos = np.searchsorted(self.sl, x) if f.name in used else np.zeros_like(x)
                off = self.s_off.reshape((-1,) + (1,) * x.ndim)
                x = (pos[None] + off).reshape((-1, *x.shape[1:]))
            else:
                x = np.tile(x, len(self.g_off))
            out[f.name] = x
        return RowTable(**out)


class MeshTerms:
    """The cost model's terms on one mesh of a space, by scope; built once per mesh and
    assembled into one `FactorProblem` per ZeRO stage."""

    def __init__(self, space: ShardSpace, mesh_index: int, max_columns: float = np.inf):
        self.space, self.mesh_index = space, mesh_index
        self.mesh = mesh = space.meshes[mesh_index]
        self.T = T = space.cost_model.tables
        self.coefs = space.cost_model.coefs  # every term's coefficients (`_cost/_terms.py`)
        self.ac = ac = AxisCosts(space.cluster, mesh)
        self.n_units = len(space.units)
        self.unary = [space.allowed(mesh, u, []) for u in range(self.n_units)]
        ng = len(T.splittable) - 1
        self.unit_of = np.full(ng + 1, -1, dtype=np.int64)
        for u, unit in enumerate(space.units):
            self.unit_of[list(unit.groups)] = u
        # Option -> axis code per group, dropping splits it cannot take (CostModel.codes).
        opt_code = np.array([ac.codes.get(a, 0) if a else 0 for a in OPTIONS])
        ok = T.splittable[:, None] & (T.divisor[:, None] % ac.int_sizes[opt_code] == 0)
        self.eff = np.where(ok, opt_code, 0)  # [ng + 1, options]
        self.d = ac.codes.get(DATA, 0)
        self.D = float(ac.sizes[self.d])
        buckets = self._buckets()
        # Joint options of every scope, counted before any is built (Python ints: a scope
        # of 40 units has 3^40 and must not overflow on its way to being refused).
        self.columns = sum(math.prod(int(self.unary[u].sum()) for u in b[0]) for b in buckets)
        if self.columns > max_columns:
            raise TooLarge(f"{self.columns:,} joint options, more than {max_columns:,.0f}")
        self.scopes = [self._evaluate(*b) for b in buckets]

    def _buckets(self):
        """(scope, own sets, partial rows, reshard rows) for every scope with terms."""
        T, unit_of = self.T, self.unit_of
        set_scope = [frozenset(unit_of[row][unit_of[row] >= 0].tolist()) for row in T.sets]
        buckets: dict[tuple, tuple[list, list, list]] = {}

        def put(scope, slot, i):
            buckets.setdefault(tuple(sorted(scope)), ([], [], []))[slot].append(i)

        for s, scope in enumerate(set_scope):
            put(scope, 0, s)
        p, r = T.partial, T.reshard
        p_sets, r_sets = p.read_sets(PARTIAL_SETS), r.read_sets(RESHARD_SETS)
        for i in range(len(p.tset)):
            units = set(unit_of[p.group[i]][unit_of[p.group[i]] >= 0].tolist())
            put(units.union(*(set_scope[s] for s in p_sets[i])), 1, i)
        for i in range(len(r.tset)):
            units = {int(unit_of[r.group[i, 0]])} - {-1}
            put(units.union(*(set_scope[s] for s in r_sets[i])), 2, i)
        return [(k, *(np.array(x, dtype=np.int64) for x in v)) for k, v in buckets.items()]

    def _evaluate(self, scope, own, prows, rrows) -> _Scope:
        """Every term of the scope on every joint option, in one pass of the kernel: each
        option gets its own copy of the scope's groups and sets (ids offset per copy)."""
        T, ac, space = self.T, self.ac, self.space
        opts = [np.flatnonzero(self.unary[u]) for u in scope]
        combos = list(itertools.product(*opts))
        configs = np.array(combos, dtype=np.int64).reshape(len(combos), len(scope))
        n_c = len(configs)
        sizes = [len(space.units[u].groups) for u in scope]
        gl = np.array([g for u in scope for g in space.units[u].groups], dtype=np.int64)
        n_gl = len(gl)
        A = np.zeros((n_c, n_gl + 1), dtype=np.int64)  # [n_c, local groups + pad]
        A[:, :n_gl] = self.eff[gl[None, :], configs[:, np.repeat(np.arange(len(scope)), sizes)]]
        local = np.full(len(T.splittable), n_gl, dtype=np.int64)
        local[gl] = np.arange(n_gl)
        p, r = T.partial, T.reshard
        used = [own, p.read_sets(PARTIAL_SETS)[prows].ravel()]
        sl = np.unique(np.concatenate([*used, r.read_sets(RESHARD_SETS)[rrows].ravel()]))
        n_sl = len(sl)
        copies = _Copies(local, sl, np.arange(n_c) * (n_gl + 1), np.arange(n_c) * n_sl)
        sets = (local[T.sets[sl]][None] + copies.g_off[:, None, None]).reshape(n_c * n_sl, -1)
        P, inv = set_axes(A.ravel(), sets, ac.sizes)
        Rp = copies.rows(p, prows, PARTIAL_SETS)
        Rr = copies.rows(r, rrows, RESHARD_SETS)
        key, nbytes, count, grad, rtime = collective_rows(
            Rp, Rr, A.ravel(), P, inv, ac, 1, space.cluster.lowering
        )
        cfg = np.concatenate(
            [np.repeat(np.arange(n_c), len(prows))] * partial_slots(Rp)
            + [np.repeat(np.arange(n_c), len(rrows))]
        )
        n_keys = len(KINDS) * ac.masks
        # Gradient rows by combine slot (`_cost/_kernel.sums`): the step's, each body's.
        slot = combine_slots(Rp, Rr)
        combined = grad | (slot > 0)
        g = combined & (count != 0)
        gkey = slot[g] * n_keys + key[g]
        grad_bytes = np.zeros((n_c, n_keys * len(T.combine_trips)))
        np.add.at(grad_bytes, (cfg[g], gkey), nbytes[g])
        grad_any = np.zeros(grad_bytes.shape, dtype=bool)
        grad_any[cfg[g], gkey] = True
        rtime = np.where(combined, 0.0, rtime)

        zero_rows, split = None, None
        if self.d and self.D > 1 and space.cost_model.beside.on:
            zero_rows, split = scope_split(
                space.cost_model.beside.table, p, np.tile(prows, n_c), cfg,
                combined & (slot == 0), A,
                local, key, nbytes, count, ac, self.d,
            )  # fmt: skip
        j = np.searchsorted(sl, own)
        inv_c = inv.reshape(n_c, n_sl)[:, j]  # [n_c, own sets]
        on_data = P.reshape(n_c, n_sl, -1)[:, j, self.d] if self.d else np.zeros_like(inv_c, bool)
        return _Scope(
            units=tuple(scope),
            configs=configs,
            comm=np.bincount(cfg, rtime, minlength=n_c),
            grad_bytes=grad_bytes,
            reduced=grad_bytes[:, :n_keys].sum(axis=1),
            grad_any=grad_any,
            coefs=self.coefs.sub(own),
            zero_rows=zero_rows,
            split=split,
            inv=inv_c.T,
            free=~on_data.T,
        )

    # ---- one FactorProblem per ZeRO stage ---------------------------------------------

    def problem(self, zero_stage: int, memory_limit: float | None = None) -> FactorProblem:
        """The MILP's factored problem: units 0..n_units-1 are the space's, the rest are
        auxiliary (combined collectives). The terms go in in a fixed order (each scope's
        own, the gradients', ZeRO's gathers, the masks): a table's sums are the same
        floats on every call."""
        zero = zero_stage >= 1 and self.d and self.D > 1
        points = memory_points(self.space.cluster.lowering, self.T)
        blocks = _Blocks(self.ac, [len(OPTIONS)] * self.n_units, points)
        self._add_scopes(blocks, zero_stage, zero)
        self._add_gradients(blocks, zero, zero_stage)
        if zero:
            self._add_gathers(blocks, zero_stage)
            self._add_prefetch(blocks, zero_stage)
            self._add_update_reductions(blocks, zero_stage)
        if self.space.pruning.masks:
            self._add_masks(blocks)
        return self._assemble(blocks, zero, memory_limit)

    def _add_scopes(self, blocks: _Blocks, zero_stage: int, zero: bool) -> None:
        """Each scope's time and memory at each point (the cost model's terms on its own
        sets, `_cost/_terms.py`), and the reduction's constant.

        Memory points: the backward's peak; where the gradients' all-reduce is not in
        place, also its end, local gradients and their reduced copy (`_cost/_model.py`).
        Where the buffers are scheduled, each candidate moment and the reduction."""
        lowering, scheduled = self.space.cluster.lowering, self.T.moments is not None
        # What the reduction writes beside the gradients: share x reduced + a constant.
        share, const = reduction_copy(
            self.D if zero else 0, lowering, float(self.T.param_coef.sum())
        )
        for sc in self.scopes:
            L = sc.layout(self.D, zero_stage)
            time = sc.comm + sc.compute(self.D, zero_stage)
            mem = memory_terms(sc.coefs, L)
            if scheduled:
                # `_cost/_peaks.busiest_moment`: one point per moment, and the reduction's
                _, at, _ = moments_held(sc.coefs, L, sc.reduced)
                base = mem.params + mem.opt + mem.other
                end = base + sc.reduced * (reduction_shares(sc.coefs, L)[1] + share)
                if sc.coefs.moments.outputs is not None:  # beside the outputs no update makes
                    end = end + early_outputs(sc.coefs, L)
                blocks.add(sc.units, sc.configs, time, (*(base[None, :] + at), end))
                continue
            state = mem.params + mem.grads + mem.opt + mem.other
            # `_cost/_peaks.update_peak`: the backward's, the reduction's where its result
            # is a copy, the update's where the step holds outputs apart.
            peaks = [state + mem.acts]
            if not lowering.all_reduce_in_place:
                peaks.append(state + reduction_shares(sc.coefs, L)[0] * sc.reduced)
            if self.T.output_coef.any():
                peaks.append(state - mem.grads + mem.outputs)
            blocks.add(sc.units, sc.configs, time, tuple(peaks))
        if scheduled and const:
            ends = np.zeros(blocks.points)
            ends[-1] = const
            blocks.add((), None, np.zeros(1), tuple(ends[:, None]))

    def _add_gradients(self, blocks: _Blocks, zero: bool, zero_stage: int) -> None:
        """The gradients' collectives, combined per (slot, kind, axis mask).

        With ZeRO the gradients' all-reduce over data is a reduce-scatter where the
        backend has one (`_cost/_kernel.totals`): one combined collective either way.
        A loop body's gradients are combined per trip, inside the loop (its slot's trips);
        ZeRO-3 reduces the step's layer by layer (`_cost/_terms.gradient_trips`)."""
        ac = self.ac
        layout = Layout(np.ones(0), np.ones(0, dtype=bool), self.D if zero else 1.0, zero_stage)
        combine_trips = gradient_trips(self.coefs, layout, self.T.combine_trips)
        by_kind: dict[tuple[int, int, int], list] = {}
        zero_key = AR * ac.masks + int(ac.bit[self.d])
        split = zero and self.space.cluster.lowering.reduce_scatter
        for key in np.flatnonzero(np.any([sc.grad_any.any(axis=0) for sc in self.scopes], axis=0)):
            slot, rest = divmod(int(key), len(KINDS) * ac.masks)
            kind, mask = divmod(rest, ac.masks)
            if zero and not slot and kind == AR and mask == ac.bit[self.d]:
                kind = RS if self.space.cluster.lowering.reduce_scatter else kind
            by_kind.setdefault((slot, kind, mask), []).extend(
                _gradient_part(sc, key, split and key == zero_key)
                for sc in self.scopes
                if sc.grad_any[:, key].any()
            )
        for (slot, kind, mask), parts in by_kind.items():
            trips = float(combine_trips[slot])
            blocks.combined(kind, mask, parts, indicator=True, trips=trips)
        if split:
            self._add_split(blocks, float(combine_trips[0]))

    def _add_split(self, blocks: _Blocks, trips: float) -> None:
        """The gradients XLA splits beside ZeRO's data axis (`_cost/_beside.py`): their
        pieces all-reduced over data, combined as the step's gradients are (`trips`: one
        per layer under ZeRO-3), and each permuted over data and its axis."""
        mask = int(self.ac.bit[self.d])
        split = [sc for sc in self.scopes if sc.split is not None]
        parts = [(sc, sc.split[3].astype(float), sc.split[2], 0.0) for sc in split]
        if parts:
            blocks.combined(AR, mask, parts, indicator=True, trips=trips)
        for a in range(1, len(self.ac.sizes)):
            permutes = [(sc, sc.split[5][:, a], sc.split[4][:, a], 0.0) for sc in split]
            permutes = [p for p in permutes if p[1].any()]
            if permutes:
                blocks.combined(CP, mask | int(self.ac.bit[a]), permutes, indicator=False)

    def _add_gathers(self, blocks: _Blocks, zero_stage: int) -> None:
        """ZeRO's all-gathers of the parameters, combined into one (ZeRO-3: one per forward
        layer, `Gathers.combined`, the step's whichever scope); with ZeRO-3 also the
        backward's, one per leaf (`_cost/_zero.zero_gathers`)."""
        parts, casts, trips = [], [], 1.0
        for sc in self.scopes:
            g = gathers(sc.coefs, sc.layout(self.D, zero_stage))
            parts.append((sc, (g.leaves > 0).astype(float), g.nbytes, g.calls))
            trips = g.combined
            casts.append((sc, np.asarray(g.cast_leaves > 0, dtype=float), g.cast_nbytes, 0.0))
        blocks.combined(AG, int(self.ac.bit[self.d]), parts, indicator=True, trips=trips)
        if any(np.any(c[1]) for c in casts):  # ZeRO-1/2's masters' casts: their own gather
            blocks.combined(AG, int(self.ac.bit[self.d]), casts, indicator=True)

    def _add_update_reductions(self, blocks: _Blocks, zero_stage: int) -> None:
        """The update's sums over ZeRO's split, all-reduced over data in one more
        collective (`_cost/_terms.update_reductions`)."""
        parts = []
        for sc in self.scopes:
            nbytes = np.asarray(update_reductions(sc.coefs, sc.layout(self.D, zero_stage)))
            if nbytes.any():
                parts.append((sc, (nbytes > 0).astype(float), nbytes, 0.0))
        if parts:
            blocks.combined(AR, int(self.ac.bit[self.d]), parts, indicator=True)

    def _add_prefetch(self, blocks: _Blocks, zero_stage: int) -> None:
        """ZeRO-3's prefetch beside compute (`_cost/_terms.hidden_time`): per pair, one
        `Overlap` of the scopes' shares of its gather's seconds and of its window's
        compute, which the time factors charge in full."""
        beta = gather_beta(self.ac, int(self.ac.bit[self.d]))
        shares = []
        for sc in self.scopes:
            sides = prefetch_sides(sc.coefs, sc.layout(self.D, zero_stage), beta)
            if sides is not None:
                shares.append((sc, *sides))
        pairs = max((len(g) for _, g, _ in shares), default=0)
        for p in range(pairs):
            comm = tuple(blocks.factor(sc.units, sc.configs, g[p]) for sc, g, _ in shares)
            compute = tuple(blocks.factor(sc.units, sc.configs, c[p]) for sc, _, c in shares)
            blocks.overlaps.append(Overlap(comm, compute))

    def _add_masks(self, blocks: _Blocks) -> None:
        """The pairwise masks as infinite time: one mesh axis twice in one tensor, and a
        seam's dense side on an axis its convolutions do not take."""
        pair = np.zeros((len(OPTIONS),) * 2)
        for k in range(1, len(OPTIONS)):
            pair[k, k] = np.inf  # one mesh axis twice in one tensor
        for u in range(self.n_units):
            for v in sorted(w for w in self.space.neighbours[u] if w > u):
                blocks.tables.setdefault((u, v), blocks.blank((3, 3)))[0] += pair
        # A seam's dense side: none, or the convolutions' axis (`ShardSpace.seam_units`).
        codes = np.arange(len(OPTIONS))
        seam = np.where((codes[None, :] != 0) & (codes[None, :] != codes[:, None]), np.inf, 0)
        for conv, dense in self.space.seam_units:
            key, table = ((conv, dense), seam) if conv < dense else ((dense, conv), seam.T)
            blocks.tables.setdefault(key, blocks.blank((3, 3)))[0] += table

    def _assemble(self, blocks: _Blocks, zero: bool, memory_limit: float | None) -> FactorProblem:
        """The tables as one `FactorProblem` under the memory limit (the cluster's when
        None)."""
        n, n_options, points = self.n_units, blocks.n_options, blocks.points
        tables = _absorb(blocks.tables)
        const = tables.pop((), blocks.blank(()))
        limit = self.space.cluster.memory_limit if memory_limit is None else memory_limit
        allowed = [*self.unary, *(np.ones(k, bool) for k in n_options[n:])]
        if zero and self.space.batch_unit is not None:
            # ZeRO only with the batch on data (`ShardSpace.zero_options`).
            u = self.space.batch_unit
            allowed[u] = allowed[u] & (np.arange(len(OPTIONS)) == OPTIONS.index(DATA))
        return FactorProblem(
            n_options=tuple(n_options),
            allowed=tuple(allowed),
            time_factors=tuple(Factor(k, v[0]) for k, v in tables.items()),
            memory_factors=tuple(
                (Factor((), const[p]), *(Factor(k, v[p]) for k, v in tables.items()))
                for p in range(1, 1 + points)
            ),
            # The cost model's test is memory <= limit; the factor test adds MEMORY_RTOL.
            memory_limit=limit / (1.0 + MEMORY_RTOL),
            constant_time=float(const[0]),
            overlaps=tuple(blocks.overlaps),
        )


class _Blocks:
    """The factor tables of one problem as it is built: per scope, a time table and one
    memory table per point. An auxiliary unit's options are appended to `n_options`."""

    def __init__(self, ac: AxisCosts, n_options: list[int], points: int):
        self.ac, self.n_options, self.points = ac, n_options, points
        self.tables: dict[tuple, list] = {}  # scope -> [time table, one memory table per point]
        self.overlaps: list[Overlap] = []  # seconds two sums share (`FactorProblem.overlaps`)

    def factor(self, units, configs, values) -> Factor:
        """A table over `units`' options holding `values` at the joint options `configs`
        (0 elsewhere: options no scope row takes, which the masks forbid anyway)."""
        table = np.zeros(tuple(self.n_options[u] for u in units))
        if units:
            table[tuple(configs.T)] = values
        else:
            table = np.asarray(np.sum(values), dtype=float)
        return Factor(units, table)

    def blank(self, shape) -> list:
        return [np.zeros(shape) for _ in range(1 + self.points)]

    def add(self, units, configs, time, memory=()) -> None:
        shape = tuple(self.n_options[u] for u in units)
        entry = self.tables.setdefault(units, self.blank(shape))
        # One joint option per row of configs; the empty scope has one (a constant).
        index = tuple(configs.T) if units else ()
        for table, value in zip(entry, (time, *memory), strict=False):
            table[index] += value if units else value.sum()

    def combined(self, kind, mask, parts, indicator, trips=1.0) -> None:
        """min over variants of alpha x count + beta x bytes, exact (see module doc);
        `trips`: occurrences of an indicated collective (a loop body's, per trip)."""
        alpha, beta = self.ac.alpha[kind, :, mask], self.ac.beta[kind, :, mask]
        best = [v for v in (0, 1) if alpha[v] <= alpha.min() and beta[v] <= beta.min()]
        variants = best[:1] or [0, 1]
        if not indicator and len(variants) == 1:
            v = variants[0]
            for sc, count, nbytes, calls in parts:
                self.add(sc.units, sc.configs, alpha[v] * (count + calls) + beta[v] * nbytes)
            return
        aux = len(self.n_options)
        self.n_options.append(len(variants) + indicator)
        unary = [0.0] * indicator + [alpha[v] * trips if indicator else 0.0 for v in variants]
        self.add((aux,), np.arange(len(unary))[:, None], np.array(unary))
        for sc, count, nbytes, calls in parts:
            cols = [np.where(count > 0, OFF, 0.0)] if indicator else []
            cols += [
                alpha[v] * ((0.0 if indicator else count) + calls) + beta[v] * nbytes
                for v in variants
            ]
            for o, col in enumerate(cols):
                cfg = np.column_stack([sc.configs, np.full(len(sc.configs), o)])
                self.add((*sc.units, aux), cfg, col)


def _gradient_part(sc: _Scope, key: int, zero: bool) -> tuple:
    """A scope's part of a combined gradient collective: where ZeRO scatters it over data
    (`zero`), less what XLA splits beside data (`_cost/_beside.py`), active while a row of
    it is left."""
    if not zero or sc.split is None:
        return (sc, sc.grad_any[:, key].astype(float), sc.grad_bytes[:, key], 0.0)
    left = (sc.zero_rows - sc.split[1] > 0).astype(float)
    return (sc, left, sc.grad_bytes[:, key] - sc.split[0], 0.0)


def memory_points(lowering: Lowering, T) -> int:
    """How many memory points (peaks the limit bounds) a problem has: one per candidate
    moment and the gradients' reduction where the buffers are scheduled; else the
    backward's peak, the reduction's where its result is a copy (XLA's CPU), and the
    update's where the step holds outputs apart from its arguments."""
    if T.moments is not None:
        return len(T.moments.at) + 1
    return 1 + (not lowering.all_reduce_in_place) + bool(T.output_coef.any())


def _absorb(tables: dict[tuple, list]) -> dict[tuple, list]:
    """Add each scope's tables into a superset scope's: fewer blocks of y variables in the
    MILP and a tighter relaxation, same sums."""
    kept: list[tuple] = []
    out: dict[tuple, list] = {}
    for scope in sorted(tables, key=lambda s: (-len(s), s)):
        host = [k for k in kept if len(k) > len(scope) and set(scope) <= set(k)]
        if not scope or not host:
            kept.append(scope)
            out[scope] = [t.copy() for t in tables[scope]]
            continue
        big = min(host, key=lambda k: (np.prod(out[k][0].shape), k))
        shape = [out[big][0].shape[i] if u in scope else 1 for i, u in enumerate(big)]
        for t_big, t in zip(out[big], tables[scope], strict=True):
            t_big += t.reshape(shape)
    return out


def problem_size(problem: FactorProblem) -> tuple[int, int]:
    """(factors, MILP columns): a binary per allowed option, a y per valid joint option."""
    columns = sum(int(m.sum()) for m in problem.allowed)
    for f in problem.time_factors:
        if len(f.units) >= 2:
            valid = np.isfinite(f.table)
            for axis, u in enumerate(f.units):
                shape = [1] * len(f.units)
                shape[axis] = -1
                valid &= problem.allowed[u].reshape(shape)
            columns += int(valid.sum())
    return len(problem.time_factors), columns
