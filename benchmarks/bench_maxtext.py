"""MaxText's published TPU v5p table, priced by Auto-MAP, and Auto-MAP's own plans.

MaxText's `configs/v5p/README.md` (32B, 64B and 128B on one v5p slice, `32b.sh`,
`64b.sh`, `128b.sh`): each row priced with MaxText's configuration (ICI fsdp as ZeRO-3 on
the data axis, ICI tensor as tensor parallelism on the model axis, `remat_policy=minimal`
as our "selective") on the slice's torus, and its TFLOP/s per chip, by MaxText's count
(`calculate_tflops_training_per_device`), compared with the published one; with
`--plan SECONDS`, the planner also runs on each row (in a fresh process: its wall time and
peak RSS are its own) and its plan's predicted step time is set beside MaxText's. The
rows and the markdown are `automap._bench`'s (`maxtext_table`, `maxtext_lines`); the
mapping and the count's version are in `automap/_bench/_maxtext.py`'s docstring.

    python benchmarks/bench_maxtext.py                  # price every row
    python benchmarks/bench_maxtext.py --plan 120       # and plan each row in 120 s
    python benchmarks/bench_maxtext.py --rows 32B --plan 60 --json-out m.json

Planning uses abstract shapes only: no weights are allocated.
"""

from __future__ import annotations

import argparse
import json
import sys

from automap._bench import maxtext_lines, maxtext_table, select_maxtext_rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", type=float, default=0.0, help="planner budget per row (s); 0: skip")
    ap.add_argument("--searcher", default="auto")
    ap.add_argument("--rows", default="", help="comma-separated row names to run (32B,64B,128B)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    if args.plan < 0:
        ap.error(f"--plan {args.plan:g} is negative: give a budget in seconds, or 0 to skip")
    rows = select_maxtext_rows([r for r in args.rows.split(",") if r])
    if not rows:
        ap.error(f"--rows {args.rows!r} names no row of the table (e.g. --rows 32B,128B)")

    def step(what: str) -> None:
        print(what, file=sys.stderr, flush=True)

    section = maxtext_table(rows, args.plan, args.searcher, step)
    print("\n".join(maxtext_lines(section)))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(section, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
