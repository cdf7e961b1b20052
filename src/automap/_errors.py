"""Errors a user can cause, each with a message that names the problem and the fix.

The CLI prints these as one line (no traceback); the Python API raises them as they are.
"""

from __future__ import annotations


class AutomapError(Exception):
    """Base class: something the user gave Auto-MAP cannot be used as it is."""


class CaptureError(AutomapError):
    """The step function could not be traced into a program Auto-MAP can read."""


class PlanError(AutomapError):
    """A plan is corrupt, of an unknown version, or made for another program or mesh."""


class ApplyError(AutomapError):
    """A plan cannot run here: a dimension not divisible by its axis, too few devices..."""


class ClusterError(AutomapError):
    """An unknown preset, a malformed cluster file, or a device count that does not fit."""


class InfeasibleError(AutomapError):
    """No plan in the space fits the devices' memory; `proved` says whether the search
    covered the whole space (no budget would help) or ran out of budget first."""

    def __init__(self, message: str, *, proved: bool = False):
        super().__init__(message)
        self.proved = proved


class ModelError(AutomapError):
    """An unknown zoo model or a bad override."""


class PriceWarning(UserWarning):
    """A plan the cost model prices but does not price as XLA compiles it (the figures may
    be off; the warning says how and what to change)."""


class SaveWarning(UserWarning):
    """A file a search writes on the side (the DQN's search state or trained agent) could
    not be written, a full disk say: the search and its plan stand, that file does not."""


class CompiledOutOfMemoryError(ApplyError):
    """XLA could not fit a plan's program in the memory per device it was given
    (`verify(hbm_bytes=...)`): `used_bytes` is what a chip needs at least (XLA's figure
    for the program, with what a pipeline stage holds beside it), `limit_bytes` the HBM a
    chip was given; None where not known (the error rebuilt from its
    message in the process that ran verify in a subprocess)."""

    def __init__(
        self, message: str, *, used_bytes: float | None = None, limit_bytes: float | None = None
    ):
        super().__init__(message)
        self.used_bytes = used_bytes
        self.limit_bytes = limit_bytes
