"""Apply: a plan runs on a device mesh with the unsharded step's numbers.

Input: a step function and a Plan. Output: a callable that runs the step under
`jax.jit` shardings (one stage), or as per-stage jitted programs fed microbatch by
microbatch (pipelines), on one host or several. DESIGN.md, "Specs" and "Pipeline".
"""

from ._apply import Prepared as Prepared
from ._apply import apply as apply
from ._apply import make_mesh as make_mesh
from ._compiler import TPU_OVERLAP_FLAGS as TPU_OVERLAP_FLAGS
from ._compiler import compiler_options as compiler_options
from ._distributed import move as move
from ._distributed import rows_in_process_order as rows_in_process_order
from ._distributed import send as send
from ._distributed import send_program as send_program
from ._executors import SegmentProgram as SegmentProgram
from ._hbm import hbm_options as hbm_options
from ._hbm import out_of_hbm as out_of_hbm
from ._interpret import eval_graph as eval_graph
from ._interpret import run_graph as run_graph
from ._pipelined import apply_pipeline as apply_pipeline
from ._recompute import eval_recomputing as eval_recomputing
from ._shared import other_program as other_program
from ._shared import placed as placed
from ._shared import validate_plan as validate_plan
from ._state_layout import input_formats as input_formats
