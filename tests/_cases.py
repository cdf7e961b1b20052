"""How many generated cases a generated test runs: one knob, AUTOMAP_TEST_CASES.

`full` (what `make test` and CI set) runs every random seed and hypothesis example the
tests were written with; `quick` (the default, and `make test-fast`) a few of each, so
that a development run takes minutes. JAX's JAX_NUM_GENERATED_CASES is the same idea.
The quick cases are the first of the full ones: a quick failure reproduces in full."""

import os

MODES = ("quick", "full")
MODE = os.environ.get("AUTOMAP_TEST_CASES", "quick")


def seeds(full: int, quick: int) -> range:
    """The seeds of a test parametrized over random problems: `range(full)` in full runs."""
    return range(full if MODE == "full" else min(quick, full))


def examples(full: int, quick: int) -> int:
    """A hypothesis test's `max_examples`."""
    return full if MODE == "full" else min(quick, full)
