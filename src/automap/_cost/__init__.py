"""The cost model: predicted step time, collectives and peak memory of a plan.

Input: a Graph, its Groups, a Cluster and a Plan. Output: a `Cost` (`_plan.py`); for a
pipeline plan, its stage times, bubble, sends and memory per stage too
(`estimate_pipeline`). The tables and kernels behind them are exported for the exact
searchers, which evaluate many assignments at once. DESIGN.md, "Collectives: the bytes
convention" and "Pipeline".
"""

from ._beside import scope_split as scope_split
from ._beside import split_compute as split_compute
from ._buffers import step_buffers as step_buffers
from ._collectives import AG as AG
from ._collectives import AR as AR
from ._collectives import CP as CP
from ._collectives import KINDS as KINDS
from ._collectives import RS as RS
from ._collectives import AxisCosts as AxisCosts
from ._collectives import ring_allreduce_time as ring_allreduce_time
from ._collectives import tree_allreduce_time as tree_allreduce_time
from ._deferred import deferred_beyond as deferred_beyond
from ._deferred import deferred_holds as deferred_holds
from ._deferred import deferred_weight_bytes as deferred_weight_bytes
from ._flash import causal_share as causal_share
from ._gemm import GemmShape as GemmShape
from ._gemm import gemm_shape as gemm_shape
from ._gemm import matmul_seconds as matmul_seconds
from ._gemm import tile_efficiency as tile_efficiency
from ._kernel import collective_rows as collective_rows
from ._kernel import combine_slots as combine_slots
from ._kernel import combined_times as combined_times
from ._kernel import partial_slots as partial_slots
from ._kernel import set_axes as set_axes
from ._model import CostModel as CostModel
from ._outputs import held_by_kind as held_by_kind
from ._overlap import gather_beta as gather_beta
from ._peaks import reduction_copy as reduction_copy
from ._pipelined import PipelineCost as PipelineCost
from ._pipelined import estimate_pipeline as estimate_pipeline
from ._pipelined import leaf_bytes as leaf_bytes
from ._pipelined import op_costs as op_costs
from ._pipelined import pipeline_decisions as pipeline_decisions
from ._pipelined import plan_op_costs as plan_op_costs
from ._pipelined import stage_costs as stage_costs
from ._residuals import barrier_inputs as barrier_inputs
from ._residuals import stage_residuals as stage_residuals
from ._residuals import stored_residuals as stored_residuals
from ._rows import PARTIAL_SETS as PARTIAL_SETS
from ._rows import RESHARD_SETS as RESHARD_SETS
from ._rows import RowTable as RowTable
from ._sends import PipeLinks as PipeLinks
from ._sends import Sends as Sends
from ._sends import cut_links as cut_links
from ._sends import link_between as link_between
from ._sends import sends as sends
from ._seqpar import gathered_copies as gathered_copies
from ._seqpar import seqpar_terms as seqpar_terms
from ._seqpar_layout import layout_rate as layout_rate
from ._stage_comm import split_alone as split_alone
from ._terms import Layout as Layout
from ._terms import SetCoefs as SetCoefs
from ._terms import compute_time as compute_time
from ._terms import early_outputs as early_outputs
from ._terms import gathers as gathers
from ._terms import gradient_trips as gradient_trips
from ._terms import memory_terms as memory_terms
from ._terms import moments_held as moments_held
from ._terms import prefetch_sides as prefetch_sides
from ._terms import reduction_shares as reduction_shares
from ._terms import update_reductions as update_reductions
from ._tiles import PADDED_MOST as PADDED_MOST
from ._tiles import minor_split as minor_split
from ._tiles import row_padding as row_padding
from ._tiles import tiled_bytes as tiled_bytes
from ._torus import axis_links as axis_links
from ._torus import axis_torus_dims as axis_torus_dims
from ._zero import split_sums as split_sums
from ._zero import update_sums as update_sums
from ._zero import zero_leaves as zero_leaves
from ._zero import zero_shares as zero_shares
