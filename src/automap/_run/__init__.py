"""TODO stage docstring."""

from ._apply import Prepared as Prepared
from ._apply import apply as apply
from ._apply import make_mesh as make_mesh
from ._distributed import rows_in_process_order as rows_in_process_order
from ._interpret import eval_graph as eval_graph
from ._interpret import run_graph as run_graph
from ._pipelined import apply_pipeline as apply_pipeline
from ._shared import validate_plan as validate_plan
