"""Kernels on one real H200: GEMMs by shape, attention fused or written out, and where a
training step's GPU time goes, kernel by kernel.

`bench_h200.py` found the cost model's matmul rate right for large products and too fast
for mid-size ones, and steps running 1.08-1.25x their price with part of the gap outside
the GEMMs. This takes the measurements that a shape term for the GEMMs and a breakdown of
the gap are built from:

- **GEMMs by shape**: bf16 products (random operands, bf16 result, ten to a program) over a
  grid of M = N and K from 256 to 16384, thin products (M = 16384, N = 1024-4096) and
  batched attention shapes, each the median of repeats.
- **Attention**: `jax.nn.dot_product_attention` forward and forward + backward, cuDNN's
  fused kernel (`implementation="cudnn"`) against XLA's written-out one
  (`implementation="xla"`), at gpt-1.3b's, bert-large's and Llama 3 8B's shapes: seconds
  and the compiled program's temporary bytes (`memory_analysis()`).
- **Steps, kernel by kernel**: configurations of `benchmarks/h200/predicted.json` run by
  `am.apply` under `jax.profiler.trace`; the GPU's kernels summed by name and by kind
  (GEMM, fused attention, XLA fusion, copy or transpose, other), beside the step's time.

    python benchmarks/bench_h200_kernels.py measure OUT.json        # on the GPU, ~7 min
    python benchmarks/bench_h200_kernels.py measure OUT.json --profiles-only  # ~3 min
    python benchmarks/bench_h200_kernels.py report OUT.json         # anywhere

Measured 2026-12-04 on a lent H200 (jax 0.11.2, the image's; at b51ef79's parent, so
`am.apply` still placed every argument each call), two calls on one machine: the
attention and the GEMMs in the first, the profiles in the second (the first's ran beside
this process holding JAX's preallocated memory: Llama ran out of it). What the GPU wrote
is `benchmarks/h200/kernels.json`; `report` prints it.

| configuration | step measured | GPU kernels | GEMMs | XLA fusions | copies, transposes | GPU idle | priced |
|---|--:|--:|--:|--:|--:|--:|--:|
| gpt-1.3b b8 full | 0.531 | 0.479 | 0.263 | 0.193 | 0.017 | 0.051 | 0.474 |
| bert-large b32 none | 0.142 | 0.097 | 0.054 | 0.030 | 0.012 | 0.045 | 0.121 |
| llama 8L b2 full | 0.427 | 0.411 | 0.214 | 0.085 | 0.107 | 0.017 | 0.339 |

- gpt-1.3b's price is its GPU kernel time within 1% (0.474 against 0.479 s); the step's
  other 0.051 s is the GPU waiting for the host. The host's profile names it: per step,
  `am.apply`'s call 115 ms of host time, 70 ms of it `jax.device_put` of the parameters
  and Adam moments the loop fed back already placed (bert-large: 78 ms of 120), and 19 ms
  its structure key. b51ef79 places only what is not laid out as planned; not
  re-measured (the lease was spent).
- bert-large's kernels run 0.097 s where 0.121 is priced: its memory-bound kernels are
  priced slower than they run (`bench_h200.py` found the same from its GEMMs).
- Llama's 0.107 s of copies and transposes are unpriced: `loop_transpose_fusion` 58 ms,
  a convert-transpose fusion 19 ms, two more transposes 12 ms each a step. These are the
  grouped-query attention's score layout copies that XLA's buffer assignment showed
  (BENCHMARKS.md, "One H200, measured": f32 [2, 8, 4, 4096, 4096] transposed between the
  dot's layout and the einsum's); without them its kernels are 0.304 s, priced 0.339.
- Attention, forward + backward (ms; temporaries GB): gpt-1.3b's shape 16.09 written
  out (10.74) against 1.88 fused by cuDNN (0.27), 8.6x; bert-large's 2.06 (1.34) against
  0.81 (0.14); Llama 3 8B's 16.06 (10.76) against 2.51 (0.40). The cost model prices
  attention written out, as the zoo runs it; a fused kernel is not in its space yet.
- GEMMs: on this machine a random bf16 8192^3 product ran 586-603 TFLOP/s (all-ones
  operands 672), where the machine of `bench_h200.py`'s run took large products at
  782-863 (all ones) and the device notes record 769-798 on random data: machines differ
  by ~20% in isolated GEMM rate while the three steps above ran within 1% of that run's.
  Within this grid the rate climbs with the product's work, not with K alone: M = N =
  8192 reaches 0.61-0.65 of 989 from K = 1024, M = N = 4096 only at K = 8192 (0.67),
  1024 x 1024 stays under 0.35 at K = 16384; the smallest products cost ~20 us whatever
  their size. Not yet a cost-model term.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SQUARE = (1024, 2048, 4096, 8192)
DEPTHS = (256, 512, 1024, 2048, 4096, 8192, 16384)
THIN = tuple((16384, n, k) for n in (1024, 2048, 4096) for k in (1024, 4096, 16384))
# (batch of heads, M, N, K): attention's score and value products at heads of 64 and 128.
BATCHED = (
    (256, 2048, 2048, 64),
    (256, 2048, 64, 2048),
    (64, 4096, 4096, 128),
    (64, 4096, 128, 4096),
)
# (name, batch, sequence, heads, key/value heads, head dim, causal)
ATTENTION = (
    ("gpt-1.3b b8", 8, 2048, 32, 32, 64, True),
    ("bert-large b32", 32, 512, 16, 16, 64, False),
    ("llama-8b b2", 2, 4096, 32, 8, 128, True),
)
PROFILED = ("gpt-1.3b b8 full", "bert-large b32 none", "llama 8L b2 full")
DEADLINE_S = 500  # the lease is counted in minutes: later parts stop at this
START = time.perf_counter()


def _late() -> bool:
    return time.perf_counter() - START > DEADLINE_S


def _timed(fn, *args, repeats: int = 10) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gemm_seconds(batch: int, m: int, n: int, k: int) -> float:
    """Median seconds of one bf16 product, several to a program so that dispatch is
    not what is timed, each on its own slice of the left operand (XLA cannot merge them)."""
    import jax
    import jax.numpy as jnp

    flops = 2 * batch * m * n * k
    products = max(1, min(10, int(2e12 // flops)))
    keys = jax.random.split(jax.random.key(0), 2)
    a = jax.random.normal(keys[0], (products, batch, m, k), jnp.bfloat16)
    b = jax.random.normal(keys[1], (batch, k, n), jnp.bfloat16)
    run = jax.jit(lambda a, b: [jnp.einsum("bmk,bkn->bmn", a[i], b) for i in range(products)])
    return _timed(run, a, b) / products


def gemm_grid() -> list[tuple[int, int, int, int]]:
    shapes = [(1, s, s, k) for s in SQUARE for k in DEPTHS]
    shapes += [(1, m, n, k) for m, n, k in THIN]
    return shapes + list(BATCHED)


def attention_row(batch, seq, heads, kv, d, causal, implementation) -> dict:
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (batch, seq, heads, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (batch, seq, kv, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (batch, seq, kv, d), jnp.bfloat16)

    def forward(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=implementation)
        return out.astype(jnp.float32).sum()

    both = jax.jit(jax.value_and_grad(forward, argnums=(0, 1, 2)))
    fwd = jax.jit(forward)
    row = {}
    for name, fn in (("forward", fwd), ("forward_backward", both)):
        compiled = fn.lower(q, k, v).compile()
        row[name + "_s"] = _timed(compiled, q, k, v)
        row[name + "_temp_bytes"] = compiled.memory_analysis().temp_size_in_bytes
    return row


def kind_of(kernel: str) -> str:
    """A GPU kernel's kind, by the names cuBLAS, cuDNN and XLA give them."""
    name = kernel.lower()
    if any(s in name for s in ("gemm", "nvjet", "xmma", "cutlass", "cublas", "triton_gemm")):
        return "gemm"
    if any(s in name for s in ("cudnn", "flash", "fmha", "sdpa")):
        return "attention"
    if any(s in name for s in ("copy", "transpose")):
        return "copy"
    if "fusion" in name or "reduce" in name or "loop" in name or "input" in name:
        return "fusion"
    return "other"


def gpu_kernels(trace_dir: str, steps: int) -> dict:
    """Kernel seconds per step on the GPU in a profile: by kind, and the top 60 by name
    with the thread (stream) each ran on. Only streams' threads are summed by kind (the
    others hold XLA's op and module annotations over the same time), or every GPU
    thread where none is named a stream."""
    paths = glob.glob(os.path.join(trace_dir, "**", "*perfetto_trace.json.gz"), recursive=True)
    with gzip.open(paths[0]) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    meta = [e for e in events if e.get("ph") == "M"]
    processes = {
        e["pid"]: e["args"].get("name", "") for e in meta if e.get("name") == "process_name"
    }
    gpu = {pid for pid, name in processes.items() if "gpu" in name.lower()}
    threads = {
        (e["pid"], e["tid"]): e["args"].get("name", "")
        for e in meta
        if e.get("name") == "thread_name" and e["pid"] in gpu
    }
    by_name: dict[tuple[str, str], float] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu:
            key = (threads.get((e["pid"], e.get("tid")), "?"), e["name"])
            by_name[key] = by_name.get(key, 0.0) + e["dur"] * 1e-6 / steps
    streams = {t for t, _ in by_name if "stream" in t.lower()} or {t for t, _ in by_name}
    kinds: dict[str, float] = {}
    for (thread, name), seconds in by_name.items():
        if thread in streams:
            kinds[kind_of(name)] = kinds.get(kind_of(name), 0.0) + seconds
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:60]
    anywhere: dict[tuple[str, str], float] = {}
    for e in events:
        if e.get("ph") == "X":
            key = (processes.get(e.get("pid"), "?"), e["name"])
            anywhere[key] = anywhere.get(key, 0.0) + e["dur"] * 1e-6 / steps
    return {
        "processes": sorted(processes.values()),
        "anywhere": [
            (p, n, s) for (p, n), s in sorted(anywhere.items(), key=lambda kv: -kv[1])[:40]
        ],
        "threads": sorted(set(threads.values())),
        "kinds": kinds,
        "top": [(thread, name, seconds) for (thread, name), seconds in top],
    }


def profile_step(config: dict, steps: int = 3) -> dict:
    """One configuration's plan timed as `bench_h200.py` times it, then `steps` more
    steps under the profiler: its GPU kernels' seconds per step."""
    sys.path.insert(0, str(HERE))
    from bench_h200 import run_step

    with tempfile.TemporaryDirectory() as trace_dir:
        timing = run_step(config, trace_dir=trace_dir, traced=steps)
        return {**timing, **gpu_kernels(trace_dir, steps)}


def profiles(result: dict, save) -> None:
    """Each profiled configuration in a process of its own, before this process touches
    the GPU: JAX's allocator takes most of the memory at its first use and keeps it."""
    configs = json.loads((HERE / "h200" / "predicted.json").read_text())["configs"]
    result["profiles"] = {}
    for index, config in enumerate(configs):
        if config["name"] not in PROFILED or _late():
            continue
        done = subprocess.run(
            [sys.executable, __file__, "profile", str(index)],
            capture_output=True,
            text=True,
            timeout=max(30, DEADLINE_S + 60 - (time.perf_counter() - START)),
            env={**os.environ, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"},
        )
        lines = done.stdout.strip().splitlines()
        result["profiles"][config["name"]] = (
            json.loads(lines[-1])
            if done.returncode == 0 and lines
            else {"error": done.stderr[-3000:]}
        )
        print(config["name"], str(result["profiles"][config["name"]])[:900], flush=True)
        save()


def kernels(result: dict, save) -> None:
    """Attention fused and written out, then the GEMM grid, in this process."""
    import jax

    result.update(device=str(jax.devices()[0].device_kind), jax=jax.__version__)
    result["attention"] = {}
    for name, *shape in ATTENTION:
        for impl in ("xla", "cudnn"):
            try:
                result["attention"][f"{name}:{impl}"] = attention_row(*shape, impl)
            except Exception as e:  # cuDNN may refuse a shape: keep the others
                result["attention"][f"{name}:{impl}"] = {"error": str(e)[:300]}
            print(name, impl, result["attention"][f"{name}:{impl}"], flush=True)
            save()
    result["gemms"] = {}
    for shape in gemm_grid():
        if _late():
            break
        key = "x".join(map(str, shape))
        try:
            result["gemms"][key] = gemm_seconds(*shape)
        except Exception as e:
            result["gemms"][key] = None
            print(key, "failed:", e, flush=True)
        save()
    print("gemms", len(result["gemms"]), flush=True)


def measure(out: Path, profiles_only: bool = False) -> None:
    result: dict = {}
    save = lambda: out.write_text(json.dumps(result, indent=1))  # noqa: E731
    profiles(result, save)
    if not profiles_only:
        kernels(result, save)


def report(path: Path) -> None:
    got = json.loads(path.read_text())
    peak = 989e12
    print(f"device: {got.get('device')}, jax {got.get('jax')}\n")
    print("| GEMM batch x M x N x K | ms | TFLOP/s | of 989 |")
    print("|---|--:|--:|--:|")
    for key, seconds in got.get("gemms", {}).items():
        if seconds:
            b, m, n, k = (int(x) for x in key.split("x"))
            rate = 2 * b * m * n * k / seconds
            print(f"| {key} | {seconds * 1e3:.3f} | {rate / 1e12:.0f} | {rate / peak:.2f} |")
    print("\n| attention | fwd ms | fwd+bwd ms | fwd+bwd temp GB |")
    print("|---|--:|--:|--:|")
    for key, row in got.get("attention", {}).items():
        if "error" in row:
            print(f"| {key} | error: {row['error'][:80]} | | |")
            continue
        print(
            f"| {key} | {row['forward_s'] * 1e3:.2f} | {row['forward_backward_s'] * 1e3:.2f} "
            f"| {row['forward_backward_temp_bytes'] / 1e9:.2f} |"
        )
    profiles_table(got.get("profiles", {}))


def profiles_table(profiles: dict) -> None:
    """Each profiled step: measured, its GPU kernels by kind, and the cost model's price
    of the same plan (`benchmarks/h200/predicted.json`)."""
    priced = {
        c["name"]: c for c in json.loads((HERE / "h200" / "predicted.json").read_text())["configs"]
    }
    print(
        "\n| configuration | step measured (s) | GPU kernels (s) | GEMMs | XLA fusions "
        "| copies and transposes | other | GPU idle | step priced (s) |"
    )
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|")
    for name, prof in profiles.items():
        if "kinds" not in prof:
            print(f"| {name} | error | | | | | | | |")
            continue
        kinds, busy = prof["kinds"], sum(prof["kinds"].values())
        cells = [kinds.get(k, 0.0) for k in ("gemm", "fusion", "copy")]
        cells.append(busy - sum(cells))
        print(
            f"| {name} | {prof['step_s']:.3f} | {busy:.3f} | "
            + " | ".join(f"{c:.3f}" for c in cells)
            + f" | {prof['step_s'] - busy:.3f} | {priced[name]['step_s']:.3f} |"
        )
    for name, prof in profiles.items():
        print(f"\n{name}: the longest kernels, seconds a step")
        for _, kernel, seconds in prof.get("top", [])[:8]:
            print(f"    {seconds:.4f}  {kind_of(kernel):9s} {kernel[:90]}")


def main(argv: list[str]) -> int:
    if argv[:1] == ["measure"]:
        measure(Path(argv[1]), profiles_only="--profiles-only" in argv)
    elif argv[:1] == ["profile"]:
        configs = json.loads((HERE / "h200" / "predicted.json").read_text())["configs"]
        print(json.dumps(profile_step(configs[int(argv[1])])))
    elif argv[:1] == ["report"]:
        report(Path(argv[1]))
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
