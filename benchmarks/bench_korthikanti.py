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

Measured on 2026-12-05 (prices only, every row, 2.4 min on two cores): as `am.apply` runs
them, the full column at 0.89/0.84/0.87/0.90 of the published time (22B/175B/530B/1T)
and SP + selective at 0.96/0.91/0.93/0.98, mean absolute error 8.9%. As Megatron-LM runs
them (`_bench._megatron.megatron_priced`: its full recomputation runs each layer's forward
whole, and its optimizer reads every main gradient for the clip's norm and zeroes the
main-gradient buffer, 8 bytes a parameter, 10-14 ms a step here): the full column at
0.97/0.92/0.95/0.97, SP + selective at 0.97/0.92/0.93/0.98, mean absolute error 4.8% (5.1%
with the recompute alone); predicted speedups 1.29/1.32/1.32/1.31 against
1.29/1.32/1.30/1.32. What is left is named in docs/DESIGN.md, Rematerialization.

Planning uses abstract shapes only: no weights are allocated.
"""

from __future__ import annotations

import sys

from automap._bench import (
    korthikanti_lines,
    korthikanti_table,
    published_table_main,
    select_korthikanti_rows,
)


def main(argv: list[str] | None = None) -> int:
    return published_table_main(
        argv,
        __doc__.splitlines()[0],
        select_korthikanti_rows,
        korthikanti_table,
        korthikanti_lines,
        "22B,1T",
    )


if __name__ == "__main__":
    sys.exit(main())
