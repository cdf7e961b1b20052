"""Korthikanti et al.'s table (sequence parallelism and selective recomputation against
full recomputation), priced by Auto-MAP, and Auto-MAP's own plans for the same rows.

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
(MLSys 2023), Table 5: each row priced with its published configuration twice (full
recomputation; sequence parallelism + selective recomputation), the iteration times and
the speedup set beside the published ones; with `--plan SECONDS`, the planner also runs on
each row in a fresh process. The rows and the markdown are `automap._bench`'s
(`korthikanti_table`, `korthikanti_lines`): the section `automap bench
--megatron-plan-s` writes into BENCHMARKS.md is this script's output.

    python benchmarks/bench_korthikanti.py                  # price every row
    python benchmarks/bench_korthikanti.py --rows 22B --plan 60 --json-out k.json

Planning uses abstract shapes only: no weights are allocated.
"""

from __future__ import annotations

import argparse
import json
import sys

from automap._bench import korthikanti_lines, korthikanti_table, select_korthikanti_rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", type=float, default=0.0, help="planner budget per row (s); 0: skip")
    ap.add_argument("--searcher", default="auto")
    ap.add_argument("--rows", default="", help="comma-separated row names (22B,175B,530B,1T)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    rows = select_korthikanti_rows([r for r in args.rows.split(",") if r])
    if not rows:
        ap.error(f"--rows {args.rows!r} names no row of the table (e.g. --rows 22B,1T)")

    def step(what: str) -> None:
        print(what, file=sys.stderr, flush=True)

    section = korthikanti_table(rows, args.plan, args.searcher, step)
    print("\n".join(korthikanti_lines(section)))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(section, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
