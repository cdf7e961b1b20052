"""Reports: a plan as a person reads it, in the terminal (Rich tables) and as an HTML
page with pictures.

Input: a Plan (and a captured Graph for capture summaries). Output: text, tables and an
HTML file. README, "How to read a plan".
"""

from ._data import memory_bars as memory_bars
from ._data import pipeline_ops as pipeline_ops
from ._data import read_curve as read_curve
from ._data import sharding_rows as sharding_rows
from ._data import stage_times as stage_times
from ._format import human_bytes as human_bytes
from ._format import human_count as human_count
from ._format import human_time as human_time
from ._format import spec_text as spec_text
from ._page import render_report as render_report
from ._page import write_report as write_report
from ._plots import PHASE_COLORS as PHASE_COLORS
from ._plots import mesh_layout as mesh_layout
from ._text import answer_line as answer_line
from ._text import capture_summary as capture_summary
from ._text import groups_summary as groups_summary
from ._text import models_table as models_table
from ._text import plan_dict as plan_dict
from ._text import print_capture as print_capture
from ._text import print_check as print_check
from ._text import print_plan as print_plan
