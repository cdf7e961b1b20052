"""verify in a fresh Python process: the parent (`verify_in_subprocess`) and the child
(`subprocess_main`).

Virtual CPU devices are fixed when JAX starts, so a plan for more devices than this
process has is verified in a child started with as many, the step rebuilt from the
plan's provenance. The child prints one marked JSON line (the report, or the error and
its type) and the parent turns it back into a `VerifyReport` or the same error.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .. import _errors
from .._capture import rebuild
from .._cluster import Cluster
from .._errors import AutomapError
from .._plan import Plan
from ._compiled import verify
from ._report import VerifyReport
from ._saved import check_saved_plan, reduce_reason


def verify_in_subprocess(
    plan: Plan | str | Path,
    *,
    cluster: Any = None,
    concrete: bool = False,
    timeout: float | None = None,
    target: str | None = None,
    hbm_bytes: float | None = None,
) -> VerifyReport:
    """`verify` in a fresh Python with as many virtual CPU devices as the plan needs.

    The step is rebuilt from the plan's provenance (a zoo model or a `--fn` target);
    `concrete=True` also runs the numerics check on random or seeded arguments; `target`
    compiles for that GPU or TPU instead, `hbm_bytes` its HBM a chip (`verify`'s).
    """
    plan = plan if isinstance(plan, Plan) else Plan.load(plan)
    n = max(plan.devices, 1)
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = plan.save(Path(tmp) / "plan.json")
        # `-c`, not `-m`: the module may already be imported by the package's __init__.
        child = (
            "import sys; from automap._verify import subprocess_main; subprocess_main(sys.argv[1:])"
        )
        cmd = [sys.executable, "-c", child, str(plan_path)]
        if cluster is not None:
            (Path(tmp) / "cluster.json").write_text(json.dumps(cluster.to_dict()))
            cmd += ["--cluster", str(Path(tmp) / "cluster.json")]
        cmd += ["--concrete"] if concrete else []
        cmd += ["--target", target] if target else []
        cmd += ["--hbm", repr(float(hbm_bytes))] if hbm_bytes is not None else []
        flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
        env = {
            **os.environ,
            "XLA_FLAGS": flags.strip(),
            "JAX_PLATFORMS": "cpu",
            "JAX_NUM_CPU_DEVICES": str(n),
        }
        proc = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_MARK):
            result = json.loads(line[len(_MARK) :])
            if "error" in result:
                raise getattr(_errors, result["type"], AutomapError)(result["error"])
            return VerifyReport.from_dict(result)
    if proc.returncode < 0:  # killed by a signal: its stderr is empty or cut off
        name = signal.Signals(-proc.returncode).name
        why = " (out of memory?)" if name == "SIGKILL" else ""
        raise AutomapError(
            f"verify in a subprocess was killed by {name}{why}: verify the plan without "
            "--numerics, or on a machine with more memory."
        )
    raise AutomapError(
        f"verify in a subprocess failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    )


_MARK = "AUTOMAP-VERIFY-REPORT "


def _with_reduced_numerics(report: VerifyReport, plan: Plan) -> VerifyReport:
    """`report` with the numbers of `plan`'s pattern on a reduced variant of its model."""
    check = check_saved_plan(plan)
    if not check.get("checked", True):
        return dataclasses.replace(report, notes=(*report.notes, check["reason"]))
    note = f"numerics on a reduced variant ({check['reason']}): " + ", ".join(
        f"{k}={v}" for k, v in check["overrides"].items()
    )
    return dataclasses.replace(
        report,
        numerics_ok=bool(check["equal"]),
        max_abs_err=float(check["max_abs_err"]),
        notes=(*report.notes, note),
    )


def subprocess_main(argv: list[str]) -> None:
    """Child side of verify_in_subprocess: one JSON line on stdout, errors included."""

    try:
        plan = Plan.load(argv[0])
        cluster = (
            Cluster.from_file(argv[argv.index("--cluster") + 1]) if "--cluster" in argv else None
        )
        target = argv[argv.index("--target") + 1] if "--target" in argv else None
        concrete = "--concrete" in argv
        hbm = float(argv[argv.index("--hbm") + 1]) if "--hbm" in argv else None
        fn, args, _ = rebuild(plan.provenance, abstract=True)
        if concrete and reduce_reason(plan, args, plan.devices):
            # Too big to run here: XLA's collectives on the full-size program, the numbers
            # on a reduced variant, as `apply --check` does.
            report = verify(fn, plan, *args, cluster=cluster, target=target, hbm_bytes=hbm)
            result = _with_reduced_numerics(report, plan).to_dict()
        else:
            fn, args, _ = rebuild(plan.provenance, abstract=not concrete)
            result = verify(fn, plan, *args, cluster=cluster, target=target, hbm_bytes=hbm)
            result = result.to_dict()
    except AutomapError as e:
        result = {"error": str(e), "type": type(e).__name__}
    print(_MARK + json.dumps(result))
