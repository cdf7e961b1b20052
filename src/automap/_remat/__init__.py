"""What a plan recomputes in its backward (Megatron's full recomputation): the layers, the
program's repeating unit found from its structure (`_units.py`), what each reads and makes
again (`Recompute`), and what that leaves in memory (`remat_residuals`). One-stage plans
(`_run/_apply.py`, `_cost/_model.py`) and pipelines (`_run/_segments.py`,
`_cost/_pipelined.py`) read the same objects.

Input: a Graph and its Groups. Output: a `Recompute`, the `Residuals` under it.
DESIGN.md, "Rematerialization".
"""

from ._flash import BLOCK as BLOCK
from ._flash import FlashCore as FlashCore
from ._flash import flash_cores as flash_cores
from ._fsdp import LayerGathers as LayerGathers
from ._fsdp import layer_gathers as layer_gathers
from ._policy import aligned_cuts as aligned_cuts
from ._policy import full_remat as full_remat
from ._policy import plan_recompute as plan_recompute
from ._policy import remat_key as remat_key
from ._policy import stage_layer_counts as stage_layer_counts
from ._recompute import Recompute as Recompute
from ._recompute import layer_residuals as layer_residuals
from ._recompute import made_after as made_after
from ._recompute import made_in_forward as made_in_forward
from ._recompute import megatron_recompute as megatron_recompute
from ._recompute import recompute_plan as recompute_plan
from ._recompute import recompute_units as recompute_units
from ._recompute import remat_residuals as remat_residuals
from ._remake import Remake as Remake
from ._remake import generated as generated
from ._remake import remake_residuals as remake_residuals
from ._selective import attention_cores as attention_cores
from ._units import block_ops as block_ops
from ._units import layer_ops as layer_ops
from ._units import layer_spans as layer_spans
from ._units import period as period
