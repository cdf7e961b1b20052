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

Measured at 6f34526 (prices only, every row; the rows' GPT clips its gradients to a global
norm of 1.0 before Adam, as Megatron-LM's `--clip-grad` default does): the full column at
0.97/0.89/0.91/0.93 of the published time (22B/175B/530B/1T), SP + selective at
0.94/0.96/0.97/1.01, mean absolute error 5.5% (2.9% with the full column as Megatron
recomputes: 1.04/0.97/0.99/1.00); predicted speedups 1.33/1.23/1.23/1.21, as Megatron
recomputes 1.43/1.33/1.32/1.31, against 1.29/1.32/1.30/1.32. The clip, as XLA compiles it
(fused, one combined all-reduce), added 3.5 ms to the 22B step and 0.02-0.04 s to the
pipelined ones: the 22B speedup as Megatron recomputes stays 0.14 over. What Megatron's
optimizer runs apart that XLA fuses (21-35 ms there) and why it would not close that
speedup (the layer without sequence parallelism is priced 22.1 ms against Table 4's 19.6):
docs/DESIGN.md, Rematerialization ("Megatron-LM's full recomputation does more than ours").

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
