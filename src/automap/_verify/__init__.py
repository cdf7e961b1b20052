"""Verify: a plan held against what XLA really compiles, and against one device.

Input: a step function, a Plan and arguments (or a saved plan to rebuild). Output: a
`VerifyReport`: the cost model's collectives next to the compiled HLO's, its peak memory
and FLOPs per device next to XLA's buffer assignment and cost analysis (`_flops.py`,
`_stages.py` for pipelines), and numerics against the unsharded step; which collectives the compiled schedule
overlaps with compute (`_schedule.py`); with a GPU
target, the same plan compiled for that GPU (`_gpu.py`) or TPU topology (`_tpu.py`)
without one. DESIGN.md, "Collectives: the bytes convention".
"""

from ._compare import as_on_cpu as as_on_cpu
from ._compare import compare_collectives as compare_collectives
from ._compare import compiled_memory as compiled_memory
from ._compare import live_peak as live_peak
from ._compare import predicted_bytes as predicted_bytes
from ._compare import predicted_memory as predicted_memory
from ._compiled import compile_plan as compile_plan
from ._compiled import verify as verify
from ._flops import compiled_flops as compiled_flops
from ._flops import predicted_flops as predicted_flops
from ._flops import predicted_stage_flops as predicted_stage_flops
from ._flops import xla_counted_flops as xla_counted_flops
from ._gpu import gpu_devices as gpu_devices
from ._gpu import target_config as target_config
from ._hlo import axis_of as axis_of
from ._hlo import comm_bytes as comm_bytes
from ._hlo import parse_collectives as parse_collectives
from ._hlo import parse_replica_groups as parse_replica_groups
from ._hlo import shape_bytes as shape_bytes
from ._numerics import compare_outputs as compare_outputs
from ._numerics import margins as margins
from ._numerics import reordered as reordered
from ._report import VerifyReport as VerifyReport
from ._saved import check_saved_plan as check_saved_plan
from ._schedule import ScheduledCollective as ScheduledCollective
from ._schedule import matmul_instructions as matmul_instructions
from ._schedule import overlapped_bytes as overlapped_bytes
from ._schedule import scheduled_collectives as scheduled_collectives
from ._subprocess import subprocess_main as subprocess_main
from ._subprocess import verify_in_subprocess as verify_in_subprocess
from ._tpu import is_tpu_target as is_tpu_target
from ._tpu import target_cluster as target_cluster
from ._tpu import target_devices as target_devices
from ._tpu import tpu_devices as tpu_devices
