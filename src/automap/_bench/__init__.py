"""Benchmarks and comparisons: every searcher side by side (`compare`), the zoo
benchmark behind BENCHMARKS.md (`run_bench`, `write`), Megatron-LM's published table
(`megatron_table`), MaxText's v5p table (`maxtext_table`), Korthikanti et al.'s table of
sequence parallelism and selective recomputation (`korthikanti_table`), and device
calibration.

Input: models, clusters and budgets. Output: rows, markdown and JSON, a cluster file.
BENCHMARKS.md says how to rerun it.
"""

from ._calibrate import measure as measure
from ._calibrate import to_cluster as to_cluster
from ._calibrate import write_cluster as write_cluster
from ._compare import Row as Row
from ._compare import compare as compare
from ._compare import compare_table as compare_table
from ._compare import make_row as make_row
from ._compare import speedups as speedups
from ._compare import to_json as to_json
from ._isolated import PlanJob as PlanJob
from ._isolated import plan_isolated as plan_isolated
from ._isolated import plan_job_main as plan_job_main
from ._isolated import plan_shape as plan_shape
from ._isolated import train_step as train_step
from ._korthikanti import KORTHIKANTI_TABLE as KORTHIKANTI_TABLE
from ._korthikanti import KorthikantiRow as KorthikantiRow
from ._korthikanti import korthikanti_table as korthikanti_table
from ._korthikanti import select_korthikanti_rows as select_korthikanti_rows
from ._markdown import RECORDED_APART as RECORDED_APART
from ._markdown import korthikanti_lines as korthikanti_lines
from ._markdown import megatron_lines as megatron_lines
from ._markdown import recorded_apart as recorded_apart
from ._markdown import to_markdown as to_markdown
from ._markdown import write as write
from ._maxtext import MAXTEXT_TABLE as MAXTEXT_TABLE
from ._maxtext import MaxTextRow as MaxTextRow
from ._maxtext import maxtext_flops as maxtext_flops
from ._maxtext import maxtext_lines as maxtext_lines
from ._maxtext import maxtext_table as maxtext_table
from ._maxtext import select_maxtext_rows as select_maxtext_rows
from ._megatron import MEGATRON_TABLE as MEGATRON_TABLE
from ._megatron import OPTIMIZER_PASS_BYTES as OPTIMIZER_PASS_BYTES
from ._megatron import MegatronRow as MegatronRow
from ._megatron import job_of as job_of
from ._megatron import megatron_priced as megatron_priced
from ._megatron import megatron_table as megatron_table
from ._megatron import model_flops as model_flops
from ._megatron import optimizer_passes_s as optimizer_passes_s
from ._megatron import select_rows as select_rows
from ._run import FULL as FULL
from ._run import QUICK as QUICK
from ._run import Case as Case
from ._run import Settings as Settings
from ._run import full_settings as full_settings
from ._run import quick_settings as quick_settings
from ._run import run_bench as run_bench
from ._run import select as select
from ._run import within_1pct as within_1pct
from ._script import published_table_main as published_table_main
