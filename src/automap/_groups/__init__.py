"""Linkage groups: the tensor dimensions whose sharding must agree, tied by each
primitive's rule, and the layouts an assignment of mesh axes to groups gives.

Input: a Graph. Output: `Groups`, and for an assignment {group: axis} the specs of every
tensor and the Plan (`plan_from_assignment`). DESIGN.md, "Linkage groups".
"""

from ._layouts import Regather as Regather
from ._layouts import assignment_from_specs as assignment_from_specs
from ._layouts import expand_classes as expand_classes
from ._layouts import layouts as layouts
from ._layouts import lookups as lookups
from ._layouts import plan_from_assignment as plan_from_assignment
from ._layouts import regather_plan as regather_plan
from ._layouts import shardable as shardable
from ._layouts import unzero_spec as unzero_spec
from ._layouts import update_region as update_region
from ._layouts import zero_mismatch as zero_mismatch
from ._layouts import zero_pinned_dims as zero_pinned_dims
from ._layouts import zero_region as zero_region
from ._layouts import zero_spec as zero_spec
from ._linkage import Group as Group
from ._linkage import Groups as Groups
from ._linkage import build_groups as build_groups
from ._linkage import group_partners as group_partners
from ._linkage import union_find as union_find
from ._mixed import cast_shards as cast_shards
from ._mixed import distinct_casts as distinct_casts
from ._mixed import gathers_compute as gathers_compute
from ._mixed import narrow_params as narrow_params
from ._mixed import repeated_casts as repeated_casts
from ._rules import ARG_REDUCE as ARG_REDUCE
from ._rules import ELEMENTWISE as ELEMENTWISE
from ._rules import FREE as FREE
from ._rules import KNOWN_PRIMITIVES as KNOWN_PRIMITIVES
from ._rules import LOOPS as LOOPS
from ._rules import REDUCE_SUM_LIKE as REDUCE_SUM_LIKE
from ._rules import body_tensor_groups as body_tensor_groups
from ._rules import dim_ties as dim_ties
from ._rules import reduced_dims as reduced_dims
from ._rules import reshape_ties as reshape_ties
from ._rules import rule as rule
from ._seqpar import KEPT_WHOLE as KEPT_WHOLE
from ._seqpar import residual_group as residual_group
from ._seqpar import sequence_as_recorded as sequence_as_recorded
from ._seqpar import sequence_dims as sequence_dims
from ._seqpar import sequence_parallel as sequence_parallel
from ._state import state_inputs as state_inputs
