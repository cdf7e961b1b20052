"""Ctrl-C while a step is captured (issue 28): the command ends with its one line and
exit code 130, every time. Two ways it went wrong: the KeyboardInterrupt landed in JAX's
garbage-collection callback, where Python drops it, and the run planned on and exited 0;
and the interpreter's teardown after an interrupted JAX call crashed (a segfault after
the message, 3 runs in 10)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _child import child_env

# The step marks two moments: "built", before the model is built, and "tracing", when
# the capture traces it, which then waits (up to 60 s) for the interrupt to land there.
STEP = """\
import time
from pathlib import Path
from automap._zoo import get_model

def make_step():
    Path("built").write_text("x")
    spec = get_model("gpt-1.3b", layers=4, hidden=64, heads=4, batch=8, seq=32, vocab=128,
                     dtype="float32")

    def step(*args):
        Path("tracing").write_text("x")
        time.sleep(60)  # inside the capture's trace: the interrupt lands here
        return spec.step_fn(*args)

    return step, spec.concrete_args(0)
"""


GC_CALLBACK = """\
import gc, signal, time
from automap._cli import sigterm_as_interrupt

fired = []

def callback(phase, info):
    if phase == "start" and not fired:
        fired.append(1)
        signal.raise_signal(signal.SIGINT)  # handled here, inside the callback

with sigterm_as_interrupt() as seen:
    gc.callbacks.append(callback)
    try:
        gc.collect()
        time.sleep(5)  # the signal, sent again, lands here
        print("lost")
    except KeyboardInterrupt:
        print("interrupted" if fired and seen["interrupted"] else "unrecorded")
    finally:
        gc.callbacks.remove(callback)
"""


def test_ctrl_c_inside_a_gc_callback_is_not_lost():
    # In a process of its own: Python reports the interrupt it drops in the callback as an
    # unraisable exception, which pytest's own hook would count against whichever test
    # runs when it is collected (and the re-sent signal may land in a weakref callback of
    # the test runner's own objects).
    env = child_env()
    done = subprocess.run(
        [sys.executable, "-c", GC_CALLBACK], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.stdout.strip() == "interrupted", done.stderr


@pytest.mark.parametrize("moment", ["built", "tracing"])
def test_ctrl_c_during_capture_exits_130_with_one_line(tmp_path, moment):
    # At each marked moment, not after a delay: a delay raced the capture, which on a fast
    # machine had ended and found a plan by then (the run then saved it, rightly).
    (tmp_path / "user_step_int.py").write_text(STEP)
    env = child_env()
    args = ["plan", "--fn", "user_step_int:make_step", "--cluster", "cpu", "--devices", "8"]
    proc = subprocess.Popen(
        [sys.executable, "-c", "from automap._cli import main; main()", *args, "--budget", "60"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        marker = Path(tmp_path / moment)
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), f"the step never reached {moment!r}: {proc.poll()}"
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert stdout == ""
    assert stderr.strip() == "interrupted before any feasible plan was found; nothing saved."


def test_ctrl_c_whose_raise_was_lost_before_the_search_keeps_no_plan():
    # The race CI met once: Ctrl-C during the capture, its KeyboardInterrupt dropped in one
    # of JAX's callbacks, so only STOP recorded it; the experts then ran (they poll
    # nothing) and an expert's plan was saved as the "best so far" of a search that had
    # not begun. Held here without the race: STOP set before the search.
    import automap as am
    from automap._search import STOP
    from automap._zoo import get_model

    spec = get_model("mlp", layers=2, batch=16, dtype="float32")
    STOP.set()
    try:
        with pytest.raises(KeyboardInterrupt):
            am.plan(
                spec.step_fn, *spec.abstract_args(), cluster=am.Cluster.preset("cpu", devices=8)
            )
    finally:
        STOP.clear()
