"""The `automap` command line: a thin Typer shell over the Python API (`automap/_api.py`)
and the tool stages (`_report`, `_bench`, `_verify`). Input: argv. Output: text or JSON
on stdout, progress and notes on stderr. README, "Plan your own model".

The entry point is `main`. The search commands (`plan`, `compare`) register first and the
tools (`models`, `capture`, `apply`, `verify`, `report`, `bench`, `calibrate`) after
them, so that `automap --help` lists the search commands first.
"""

# isort: off
from ._main import app as app
from ._main import main as main
from ._app import choose_devices as choose_devices
from ._app import sigterm_as_interrupt as sigterm_as_interrupt
from . import _tools  # noqa: F401  (registers the tool commands on the app, after _main's)
# isort: on
