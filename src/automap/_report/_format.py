"""Numbers and specs as a person reads them: the formatting every text view of a plan
shares (CLI tables, the HTML report, the benchmark pages)."""

from __future__ import annotations

from .._plan import Spec


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


def human_count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def human_time(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def spec_text(spec: Spec) -> str:
    if not any(spec):
        return "replicated"
    parts = ["+".join(e) if isinstance(e, tuple) else (e or "·") for e in spec]
    return "[" + ", ".join(parts) + "]"
