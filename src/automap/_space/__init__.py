"""The plan space a searcher explores, with the pruning that makes it small, and the
expert plans (every one a point of it).

Input: a Graph, its Groups, a Cluster and a CostModel. Output: a `ShardSpace` (meshes,
units, options, masks), the pipelined space's points (`Point`, `stage_counts`,
`microbatch_counts`), and the hand-written plans. DESIGN.md, "The search space".
"""

from ._experts import axis_assignment as axis_assignment
from ._experts import batch_groups as batch_groups
from ._experts import block_groups as block_groups
from ._experts import expert_assignments as expert_assignments
from ._experts import expert_plans_for as expert_plans_for
from ._pipeline_experts import megatron_stage_counts as megatron_stage_counts
from ._pipeline_experts import pipeline_experts as pipeline_experts
from ._pipelined import Point as Point
from ._pipelined import StateBytes as StateBytes
from ._pipelined import microbatch_counts as microbatch_counts
from ._pipelined import stage_counts as stage_counts
from ._pipelined import state_bytes as state_bytes
from ._recipes import Recipe as Recipe
from ._recipes import layer_boundaries as layer_boundaries
from ._recipes import layer_cuts as layer_cuts
from ._recipes import layer_split as layer_split
from ._recipes import recipe_plan as recipe_plan
from ._shard import OPTIONS as OPTIONS
from ._shard import SPACE_TASKS as SPACE_TASKS
from ._shard import Pruning as Pruning
from ._shard import ShardSpace as ShardSpace
from ._shard import candidate_meshes as candidate_meshes
