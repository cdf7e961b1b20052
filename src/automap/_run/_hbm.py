"""A TPU program compiled for a chip with less HBM than the generation's.

XLA's TPU compiler plans within the HBM it is told a chip has, and spends what the program
leaves free. Its latency-hiding scheduler moves work to overlap collectives while memory
allows: on a float32 GPT under ZeRO-1 (v5p 2x2x1, data 4, 32 sequences a chip, full
remat) it runs every weight-gradient matmul inside the asynchronous all-gathers of the
updated parameter shards, after the whole input-gradient chain, and holds each layer's
recomputed activations until then: 601 MiB by its buffer assignment, where the same
program scheduled within 420 MiB holds 311 MiB and runs each layer's weight gradients
with its backward (priced: 269 MiB; `benchmarks/read_buffer_assignment.py --matmuls`
lists where each matmul runs). A model of 0.3% of a chip's 95 GiB is scheduled as no
model that fills a chip can be, and the plans a planner returns fill the chip.
`verify(hbm_bytes=...)` compiles a plan as if it filled the chip: XLA's scheduler held to
`hbm_bytes` a chip. A pipeline stage's programs run beside what the runtime holds on its
chips, so the runtime's abstract walk (`_executors.Dry`) gives each what that leaves.

Pressed, XLA also recomputes values of its own (its rematerialization pass) to fit: 18%
more FLOPs on a bf16 Llama under ZeRO-3 held to 1.15x its priced peak. That is another
program than the plan's, so it is turned off here: the program is the plan's, scheduled
to fit, or XLA says it cannot fit it (`CompiledOutOfMemoryError`). Pressed, XLA also
packs its HBM tighter, with fewer gaps between buffers, and a program of tens of MiB
keeps as much of itself in the chip's VMEM, which the HBM figures leave out, as when
free: a bf16 Llama's ZeRO-3 plans at 2 sequences a chip on v5p 4x4x4 come to 1.14-1.32x
their priced peaks held, 0.96-1.05x free (plan 3: 33.8 MiB of HBM temporaries held, 41.1
free, 35 MiB in VMEM either way); at 8 a chip, 1.01-1.03x held.
"""

from __future__ import annotations

import math
import re

from .._errors import ApplyError, CompiledOutOfMemoryError

MIB = 2**20
# libtpu's flags, taken as compile options (`Lowered.compile(compiler_options)`): the HBM
# a chip has, and the least size of a value XLA's rematerialization may recompute (none
# is this large, so it recomputes nothing).
_LIMIT = "xla_tpu_max_hbm_size_mib"
_NO_REMAT = {"xla_tpu_rematerialization_min_size_in_bytes": 1 << 50}

# libtpu 0.0.42's words when a program does not fit: after its placement ("Ran out of
# memory in memory space hbm. Used 58.72M of 53.00M hbm."), or before it, when the
# temporaries alone are over ("the total memory required for HLO temporaries (4.62M)
# exceeds available HBM (2.00M)"). Either way, at least that much is needed.
_USED = re.compile(
    r"Used ([\d.]+)([KMGT]) of [\d.]+[KMGT] hbm"
    r"|required for HLO temporaries \(([\d.]+)([KMGT])\) exceeds available HBM"
)
_UNIT = {"K": 2**10, "M": MIB, "G": 2**30, "T": 2**40}


def hbm_options(hbm_bytes: float) -> dict[str, int]:
    """The compile options that give each chip `hbm_bytes` of HBM, XLA's
    rematerialization off."""
    if not hbm_bytes > 0:
        raise ApplyError(f"hbm_bytes={hbm_bytes}: give the HBM a chip has, in bytes (> 0)")
    return {_LIMIT: math.ceil(hbm_bytes / MIB), **_NO_REMAT}


def no_room(hbm_bytes: float, besides: float) -> CompiledOutOfMemoryError:
    """A pipeline stage that holds `besides` between its programs, no less than the
    chip's `hbm_bytes`: no program fits beside it."""
    return CompiledOutOfMemoryError(
        f"this plan cannot fit in {hbm_bytes / MIB:.1f} MiB of HBM a chip: a pipeline "
        f"stage holds {besides / MIB:.1f} MiB between its programs; give more HBM, or a "
        "plan that holds less (more stages, fewer microbatches in flight, ZeRO, remat)",
        used_bytes=besides,
        limit_bytes=hbm_bytes,
    )


def out_of_hbm(
    error: Exception, hbm_bytes: float, besides: float = 0.0
) -> CompiledOutOfMemoryError | None:
    """XLA's error that the program does not fit in `hbm_bytes`, as one line a user can
    act on; None for any other error. `besides`: what the chip holds beside the program
    (a pipeline stage's values between its programs), which XLA was given less HBM for."""
    found = _USED.search(str(error))
    if "RESOURCE_EXHAUSTED" not in str(error) or found is None:
        return None
    size, unit = (found.group(1), found.group(2)) if found.group(1) else found.group(3, 4)
    used = float(size) * _UNIT[unit] + besides
    return CompiledOutOfMemoryError(
        f"XLA's TPU compiler cannot fit this plan in {hbm_bytes / MIB:.1f} MiB of HBM a "
        f"chip: it needs at least {used / MIB:.1f} MiB with its own rematerialization off; "
        "give more HBM, or a plan that holds less (ZeRO, remat, more model parallelism)",
        used_bytes=used,
        limit_bytes=hbm_bytes,
    )
