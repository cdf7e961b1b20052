"""TPU fidelity at pod scale: random plans on a TPU slice of 64-256 chips, compiled by
XLA's TPU compiler without a TPU, against the cost model as it prices that slice.

Issue 27's criterion: on random TPU plans (64-256 chips, ZeRO, remat and pipelines
drawn) at least 95% have the collectives XLA's TPU compile inserts and at least 90% a
peak memory within 15% of its buffer assignment. This prints both.

For each model and target, plans are drawn as `bench_memory.py` draws them (`draw_plan`),
but from the shard space of the target's slice (`automap._verify.target_cluster`: by
default the tpu-v5p preset on 4x4x4 and on 4x8x8, 64 and 256 chips, the ends of the
issue's range; the verdict is over both): a random mesh factorization of its chips, a random
axis or none per splittable group, ZeRO 1-3 on a share `--zero` of the one-stage plans,
remat on or off, and a share `--pipelines` of pipelines (2 or 4 stages, 1, 2 or 4
microbatches, GPipe or 1F1B, the stage mesh data or data x model). Each plan goes
through `automap._verify.verify(..., target=...)`: compiled for the slice's compile-only
chips through libtpu (the `tpu-compile` extra, `automap._verify._tpu`), its collectives
held kind@axis against the priced ones (within 5% in bytes, under 1% of the traffic
trivial) and the priced peak per chip against XLA's buffer assignment. Prints one line
per plan, the fractions, the most common collective disagreements and the worst memory
ones. Deterministic by seed.

Which buffer assignment: XLA's TPU compiler schedules within the HBM it is told a chip
has (`automap._run._hbm`). Given a whole v5p chip, of which these programs fill under
2%, its scheduler spends the rest on overlap (a float32 gpt's weight-gradient matmuls run
inside the update's all-gathers, after the whole backward, every recomputed activation
held until then); held to less, it schedules to fit. So each plan is also
compiled with each chip's HBM held to its priced peak / 0.85 (`verify(hbm_bytes=...)`,
XLA's own rematerialization off, so the program is the plan's: its FLOPs x1.000), as a
plan that fills its chip is compiled. Price / 0.85 is the most a buffer assignment the
price is within 15% of can hold: a program that fits there is within 15% from below. A plan is within 15% (`memory_in`) where the priced
peak is within 15% of XLA's buffer assignment in either compile: XLA's peak for the plan
lies between the two with the HBM it is given. Out: priced under what XLA needs even when
pressed (or XLA cannot fit it in the priced peak / 0.85), or over what it holds with the
whole chip. A pipeline's programs are each held to the HBM its stage leaves them beside
what the runtime holds there (its largest stage's priced peak / 0.85 a chip). Both figures
are printed apart too.

Models, sized so a chip holds MiB-scale arrays and one compile takes ~20-60 s on two
cores: "gpt" (the zoo's GPT, 4 layers, hidden 512, seq 128, float32) and "llama" (the
zoo's Llama, 4 layers, hidden 512, 8 heads of which 2 key/value, SwiGLU 1536, bfloat16
compute over float32 parameters), both with a global batch of 2 sequences per chip.

    python benchmarks/bench_tpu_fidelity.py                       # 12 a model, 64 and 256 chips
    python benchmarks/bench_tpu_fidelity.py --target v5p:4x4x4    # 64 chips alone
    python benchmarks/bench_tpu_fidelity.py --plans 2 --models gpt --target v5p:2x2x2
    python benchmarks/bench_tpu_fidelity.py --target v4:4x4x8     # 128 v4 chips, 256 cores
    python benchmarks/bench_tpu_fidelity.py --sequences 8         # 4x the batch, the same draws
    python benchmarks/bench_tpu_fidelity.py --dump /tmp/d         # and XLA's HBM and VMEM read
    python benchmarks/bench_tpu_fidelity.py --size chip --plans 6 --target v5p:4x4x4
    python benchmarks/bench_tpu_fidelity.py --size chip --plans 6 --attention flash

Figures, plan by plan, and what each run found: `bench_tpu_fidelity_log.md` beside
this script and BENCHMARKS.md ("Random plans compiled for 64- and 256-chip TPU v5p slices").
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fidelity import shape_of  # noqa: E402
from bench_memory import WITHIN, summarize, verify_drawn  # noqa: E402

from automap._zoo import get_model  # noqa: E402

BLOCKS = dict(layers=4, hidden=512, heads=8, seq=128, vocab=4096)
MODELS = {
    "gpt": ("gpt2-xl", dict(BLOCKS, dtype="float32")),
    "llama": ("llama", dict(BLOCKS, kv_heads=2, ffn=1536, dtype="bfloat16")),
}
# `--size chip`: the same layers at the widths a run on such a slice trains (rows of 1024
# keys, a real vocabulary), arrays of GiB a chip, beside which XLA's fixed bytes per
# program (tens of MiB in VMEM, a 16 KiB slot per tuple) are under a percent: what the
# small models' figures say of plans a user runs. A compile takes ~30-120 s.
CHIP = dict(hidden=2048, heads=16, seq=1024, vocab=32000)
# per `--size`, each model's widths over MODELS' own
SIZES = {"small": {}, "chip": {"gpt": CHIP, "llama": dict(CHIP, kv_heads=4, ffn=5632)}}
CRITERION = {"collectives": 0.95, "memory": 0.90}  # issue 27: the shares of plans to hold
# The slices drawn on by default: the two ends of issue 27's range of 64-256 chips.
TARGETS = ("v5p:4x4x4", "v5p:4x8x8")


def program(name: str, devices: int, sequences: int = 2, size: str = "small"):
    """(step, abstract args): the zoo model with `sequences` per chip at the widths of
    `size` (`SIZES`), the step jitted with its parameters and optimizer state donated,
    as a training loop runs it."""
    zoo_name, overrides = MODELS[name]
    overrides = overrides | SIZES[size].get(name, {})
    spec = get_model(zoo_name, batch=sequences * devices, **overrides)
    return jax.jit(spec.step_fn, donate_argnums=(0, 1)), spec.abstract_args()


def bench_model(
    name: str,
    target: str,
    plans: int,
    seed: int,
    pipelines: float,
    zero: float,
    sequences: int,
    only: int | None = None,
    dump: str | None = None,
    size: str = "small",
    attention: str = "written",
):
    """Every drawn plan of `name` verified on `target` (`only`: that one draw), `sequences`
    per chip: bench_memory's rows, with the collectives' bytes per kind@axis on both sides
    (`dump`: and what each one-program plan's buffer assignment holds, `dumped`). Each
    one-stage plan runs its attention as `attention` says (`flash`: the kernel, as the
    planner runs it on a TPU; a pipeline's stays written, which flash cannot be)."""
    from automap._verify import target_cluster, target_devices

    cluster = target_cluster(target, target_devices(target))
    step, args = program(name, cluster.devices, sequences, size)

    def show(plan, report) -> dict | None:
        for why in report.mismatches:
            print(f"{'':>13}{why}", flush=True)
        read = dumped(dump, report, plan) if dump else {}
        held = held_to_priced(step, args, plan, report, target)
        if dump:  # the held compile's modules: not read, removed
            dumped(dump, None, plan)
        return {**held, **read}

    def adjust(plan):
        return plan if plan.pipelined else dataclasses.replace(plan, attention=attention)

    draws = (seed, pipelines, zero)
    rows = verify_drawn(name, step, args, plans, draws, target, cluster, show, only, adjust)
    return {"model": name, "target": target, "rows": rows}


def dumped(folder: str, report, plan) -> dict:
    """What XLA's dump of the compile just made holds (`--dump`, read and then removed):
    for a one-program plan, the arguments with HBM's temporaries at their busiest step
    (XLA's HBM live peak, which libtpu's own figure is not where VMEM's peak is higher:
    `automap._verify.live_peak`), VMEM's at that step (the values made there or moved
    there out of HBM, and apart the copies it prefetched there of values HBM holds too),
    and the arguments with HBM's temporaries and VMEM's own values at the step they hold
    most together, which is what a model that prices one memory for every buffer
    prices (`read_buffer_assignment.py`, `apart`). None of it for a pipeline, whose
    stage peak combines its programs with what the runtime holds between them. `report`
    None: the files are removed unread."""
    import read_buffer_assignment as reader

    root = Path(folder)
    files = sorted(root.glob(f"*{reader.SUFFIX}"))
    tpu = [f for f in files if ".cpu_" not in f.name]  # the compile-only chips' programs
    out = {}
    if report is not None and not plan.pipelined and not tpu:
        print(f"{'':>13}dumped: nothing in {folder} (XLA read its flags before --dump)")
    if report is not None and tpu and not plan.pipelined:
        # the step's program: the one with the largest HBM temporaries, as `read` picks
        hbm, vmem = reader.read(root), reader.read(root, space=reader.VMEM)
        # VMEM's values made or moved there, not its copies of values HBM holds too
        made = reader.apart(hbm, vmem)
        step, live = hbm.busiest()
        both = reader.together(hbm, made)
        xla = report.xla_memory_breakdown
        held = xla["arguments"] + xla["outputs"] - xla["aliased"]
        tuples = [v for v in hbm.values if v.shape.startswith("(")]
        out = dict(
            xla_hbm_live=held + live,
            xla_vmem_at_hbm_peak=float(made.live_bytes(step)),
            xla_vmem_copies_at_hbm_peak=float(vmem.live_bytes(step) - made.live_bytes(step)),
            xla_both_live=held + both[1] + both[2],
            # the allocation, and how many tuple-shaped values it holds (an async start's,
            # a multi-output fusion's: each a few pointers in a 16 KiB slot of its own,
            # docs/DESIGN.md "TPU slices"), which set most of its excess over the live bytes
            xla_hbm_allocation=float(hbm.temp_size),
            xla_tuple_slots=len(tuples),
        )
        price = report.predicted_memory_bytes
        print(
            f"{'':>13}dumped: HBM live {out['xla_hbm_live'] / 2**20:.1f} MiB = "
            f"{price / out['xla_hbm_live']:.2f} (VMEM {out['xla_vmem_at_hbm_peak'] / 2**20:.1f} "
            f"MiB of its own beside it, {out['xla_vmem_copies_at_hbm_peak'] / 2**20:.1f} of "
            f"copies of HBM's); both memories at once {out['xla_both_live'] / 2**20:.1f} "
            f"MiB = {price / out['xla_both_live']:.2f}",
            flush=True,
        )
    for f in root.iterdir():
        shutil.rmtree(f) if f.is_dir() else f.unlink()
    return out


def held_to_priced(step, args, plan, report, target: str) -> dict:
    """The plan compiled again with each chip's HBM held to its priced peak / 0.85
    (`verify(hbm_bytes=...)`, XLA's own rematerialization off): XLA's buffer assignment
    there, the priced peak's ratio to it, and XLA's FLOPs over the free compile's (1: the
    same program). A program XLA cannot fit there needs more than price / 0.85, so the
    price is under it by more than 15%: ratio None. (Until 2026-12-06 the hold was the
    price x 1.15, which asked a ratio of at least 0.87 where the whole-chip compile
    asks 0.85.)"""
    from automap import CompiledOutOfMemoryError
    from automap._verify import verify

    hbm = report.predicted_memory_bytes / (1 - WITHIN)
    try:
        held = verify(step, plan, *args, target=target, hbm_bytes=hbm)
    except CompiledOutOfMemoryError as e:
        print(f"{'':>13}held to {hbm / 2**20:.1f} MiB: {e}", flush=True)
        return dict(held_memory=None, held_ratio=None, held_needs=e.used_bytes)
    ratio = report.predicted_memory_bytes / held.xla_memory_bytes
    flops = held.xla_flops / report.xla_flops if report.xla_flops else None
    print(
        f"{'':>13}held to {hbm / 2**20:.1f} MiB: XLA {held.xla_memory_bytes / 2**20:.3f} MiB"
        f" = {ratio:.2f}, FLOPs x{flops or 0:.3f}",
        flush=True,
    )
    return dict(held_memory=held.xla_memory_bytes, held_ratio=ratio, held_flops=flops)


def _within(ratio: float | None) -> bool:
    return ratio is not None and abs(ratio - 1) <= WITHIN


def memory_in(row: dict) -> bool:
    """The criterion's test of one plan: the priced peak within 15% of XLA's buffer
    assignment with the chip's whole HBM, or with it held to the priced peak / 0.85
    (`held_to_priced`). XLA's peak for a plan moves with the HBM it
    is given, between those two (its scheduler spends what is free on overlap, and
    under pressure schedules to fit); a price within 15% of one of them is a schedule
    XLA makes. Out: priced under what XLA needs even when pressed (or it cannot fit the
    plan in the priced peak / 0.85 at all), or over what it holds even with a whole chip."""
    return _within(row["memory_ratio"]) or _within(row.get("held_ratio"))


def verdict(results: list[dict]) -> dict:
    """The criterion's two shares over every plan that compiled (an error counts against
    both), each memory figure's alone, and the most common collective disagreements."""
    rows = [r for res in results for r in res["rows"]]
    ok = [r for r in rows if "error" not in r]
    n = max(len(rows), 1)
    shapes = collections.Counter(shape_of(w) for r in ok for w in r["mismatches"])
    held = [r for r in ok if "held_ratio" in r]
    return dict(
        plans=len(rows),
        errors=len(rows) - len(ok),
        collectives=sum(bool(r["collectives"]) for r in ok) / n,
        memory=sum(memory_in(r) for r in ok) / n,
        memory_whole_chip=sum(_within(r["memory_ratio"]) for r in ok) / n,
        memory_held=(sum(_within(r["held_ratio"]) for r in held), len(held)),
        disagreements=shapes.most_common(8),
    )


def report(results: list[dict]) -> dict:
    targets = sorted({res["target"] for res in results})
    # a model's line per slice where several are drawn: "gpt@256", its chips
    several = len(targets) > 1
    summarize([{**res, "model": _label(res)} if several else res for res in results])
    v = verdict(results)
    print(f"\nmost common collective disagreements on {', '.join(targets)}:")
    for why, count in v["disagreements"]:
        print(f"  {count:>3} x {why}")
    live = [r["live_ratio"] for res in results for r in res["rows"] if r.get("live_ratio")]
    inside = sum(abs(x - 1) <= WITHIN for x in live)
    print(
        f"memory within 15% of XLA's live peak (before its placement; not the criterion): "
        f"{inside} of {len(live)}"
    )
    for key, what in (("xla_hbm_live", "HBM's"), ("xla_both_live", "HBM's and VMEM's")):
        priced = [
            r["predicted_memory"] / r[key] for res in results for r in res["rows"] if r.get(key)
        ]
        if priced:  # --dump: read in the buffer assignments
            print(
                f"memory within 15% of what {what} temporaries hold alive at once with the "
                f"arguments (one-program plans, dumped; not the criterion): "
                f"{sum(abs(x - 1) <= WITHIN for x in priced)} of {len(priced)}"
            )
    print(
        f"memory within 15% of XLA's buffer assignment with the chip's whole HBM: "
        f"{v['memory_whole_chip']:.0%} of {v['plans']}; with the HBM held to the priced "
        f"peak / 0.85: {v['memory_held'][0]} of {v['memory_held'][1]} plans"
    )
    if several:  # each slice's shares apart, then the criterion's over all of them
        v["per_target"] = {t: verdict([r for r in results if r["target"] == t]) for t in targets}
        for t, each in v["per_target"].items():
            print(
                f"on {t}: collectives {each['collectives']:.0%}, memory {each['memory']:.0%} "
                f"of {each['plans']} plans"
            )
    for key in ("collectives", "memory"):
        held = "holds" if v[key] >= CRITERION[key] else "fails"
        label = "collectives matched" if key == "collectives" else "memory within 15%"
        print(
            f"{label:<20} {v[key]:6.0%} of {v['plans']} plans ({v['errors']} errors): "
            f"issue 27 asks {CRITERION[key]:.0%}, {held}"
        )
    return v


def _label(res: dict) -> str:
    from automap._verify import target_devices

    return f"{res['model']}@{target_devices(res['target'])}"


def _target(text: str) -> str:
    from automap._verify import is_tpu_target, target_devices

    try:
        if is_tpu_target(text):
            target_devices(text)  # a topology libtpu's names parse as
            return text
    except Exception as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    raise argparse.ArgumentTypeError(f"{text!r}: give a TPU topology, e.g. v5p:4x4x4, v4:4x4x8")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", type=int, default=12, help="random plans per model")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument(
        "--target",
        type=_target,
        nargs="+",
        default=list(TARGETS),
        help="TPU topologies, each drawn --plans times a model",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pipelines", type=float, default=0.25, help="share of pipelines")
    parser.add_argument("--zero", type=float, default=0.5, help="share of one-stage ZeRO 1-3")
    parser.add_argument(
        "--sequences", type=int, default=2, help="sequences per chip (the global batch / chips)"
    )
    parser.add_argument(
        "--size",
        choices=tuple(SIZES),
        default="small",
        help="the models' widths: small (MiB a chip), or chip (GiB a chip, SIZES)",
    )
    parser.add_argument(
        "--attention",
        choices=("written", "flash"),
        default="written",
        help="how each one-stage plan runs its attention: written out, or by the flash "
        "kernel as the planner runs it on a TPU (the draws are the same)",
    )
    parser.add_argument("--only", type=int, help="compile that draw alone (0-based)")
    parser.add_argument("--json", help="write every plan's row to this file")
    parser.add_argument(
        "--dump",
        help="an empty folder: each compile's buffer assignment is dumped there, read "
        "(HBM's and VMEM's live temporaries, `dumped`) and removed",
    )
    opts = parser.parse_args(argv)
    if opts.dump:
        Path(opts.dump).mkdir(parents=True, exist_ok=True)
        if any(Path(opts.dump).iterdir()):
            parser.error(f"--dump {opts.dump}: give an empty folder (its files are removed)")
        # read when the first backend starts, which nothing has yet
        os.environ["XLA_FLAGS"] = (
            f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={opts.dump} --xla_dump_hlo_as_text"
        )
    if opts.only is not None and not 0 <= opts.only < opts.plans:
        parser.error(f"--only {opts.only}: give a draw from 0 to {opts.plans - 1} (of --plans)")
    draw = (opts.plans, opts.seed, opts.pipelines, opts.zero, opts.sequences)
    results = [
        bench_model(
            m, t, *draw, only=opts.only, dump=opts.dump, size=opts.size, attention=opts.attention
        )
        for t in opts.target
        for m in opts.models
    ]
    v = report(results)
    if opts.json:
        with open(opts.json, "w") as f:
            header = dict(
                target=opts.target,
                sequences=opts.sequences,
                size=opts.size,
                attention=opts.attention,
                verdict=v,
            )
            json.dump({**header, "results": results}, f, indent=2)
    return v


if __name__ == "__main__":
    main()
