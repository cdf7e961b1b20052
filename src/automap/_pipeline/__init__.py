"""What a staged plan means: which stage and phase each op of a step belongs to
(`partition`), layers no stage can cut between
(`scanned_layers`), where stages may start (`cut_candidates`), the Plan for a set of cuts, and
the pipeline schedules (GPipe, 1F1B, interleaved 1F1B, ZB-H1 with its backward split by
`split_backward`: `PipelineSchedule` objects found by name with
`pipeline_schedule`) that the runtime, the cost model, the stage DP and the report all read,
and the `Phase` of a step's work that they all name it by.

Input: a Graph, its Groups and the stage cuts. Output: a `Partition`, a pipeline Plan, the
schedule's order and timing. DESIGN.md, "Pipeline".
"""

from ._partition import SUMS as SUMS
from ._partition import Partition as Partition
from ._partition import ScannedStack as ScannedStack
from ._partition import forward_ops as forward_ops
from ._partition import once_programs as once_programs
from ._partition import op_programs as op_programs
from ._partition import partition as partition
from ._partition import scanned_layers as scanned_layers
from ._phase import Phase as Phase
from ._plans import crossing_bytes as crossing_bytes
from ._plans import cut_candidates as cut_candidates
from ._plans import cut_runs as cut_runs
from ._plans import pipeline_plan as pipeline_plan
from ._plans import uniform_cuts as uniform_cuts
from ._registry import check_remat as check_remat
from ._registry import chunked_variant as chunked_variant
from ._registry import pipeline_schedule as pipeline_schedule
from ._registry import plan_schedule as plan_schedule
from ._registry import register_schedule as register_schedule
from ._registry import schedule_names as schedule_names
from ._registry import split_variant as split_variant
from ._registry import unregister_schedule as unregister_schedule
from ._schedule import PipelineSchedule as PipelineSchedule
from ._schedule import Task as Task
from ._schedule import Timed as Timed
from ._schedule import Unit as Unit
from ._split import split_backward as split_backward
