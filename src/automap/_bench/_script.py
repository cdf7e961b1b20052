"""The command line the published-table scripts share (`benchmarks/bench_megatron.py`,
`bench_korthikanti.py`, `bench_maxtext.py`): choose rows, price them, plan them with a
budget, print the markdown section and optionally save its JSON."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any


def published_table_main(
    argv: list[str] | None,
    description: str,
    select: Callable[[Sequence[str]], tuple],
    table: Callable[..., dict[str, Any]],
    lines: Callable[[dict], list[str]],
    example: str,
) -> int:
    """One published table's script: `select` rows by the names `--rows` lists (`example`
    shows two), `table` prices (and with `--plan`, plans) them, `lines` renders them."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--plan", type=float, default=0.0, help="planner budget per row (s); 0: skip")
    ap.add_argument("--searcher", default="auto")
    ap.add_argument("--rows", default="", help=f"comma-separated rows to run (e.g. {example})")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    if args.plan < 0:
        ap.error(f"--plan {args.plan:g} is negative: give a budget in seconds, or 0 to skip")
    rows = select([r for r in args.rows.split(",") if r])
    if not rows:
        ap.error(f"--rows {args.rows!r} names no row of the table (e.g. --rows {example})")

    def step(what: str) -> None:
        print(what, file=sys.stderr, flush=True)

    section = table(rows, args.plan, args.searcher, step)
    print("\n".join(lines(section)))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(section, f, indent=2)
    return 0
