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
