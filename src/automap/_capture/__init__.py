"""Capture: a training step becomes a `Graph` (`_graph.py`).

Input: a step function and its arguments (arrays or ShapeDtypeStructs). Output: the
Graph (ops, tensors, exact FLOPs and bytes, input roles), and what is derived from it
alone: the tensors kept for the backward pass (`find_residuals`), and where a step comes
from (a zoo model or a `module:function`, `rebuild`). DESIGN.md, "Identifiers" and "Roles".
"""

from ._donation import donated_leaves as donated_leaves
from ._donation import donates as donates
from ._flops import ELEMENTWISE as ELEMENTWISE
from ._flops import RULES as RULES
from ._flops import is_known as is_known
from ._flops import op_cost as op_cost
from ._flops import while_trip_count as while_trip_count
from ._origin import load_fn as load_fn
from ._origin import load_zoo as load_zoo
from ._origin import rebuild as rebuild
from ._residuals import Residuals as Residuals
from ._residuals import find_residuals as find_residuals
from ._residuals import loss_boundary as loss_boundary
from ._trace import CaptureWarning as CaptureWarning
from ._trace import capture as capture
