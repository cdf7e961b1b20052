"""The cluster presets: each device's published figures (peak FLOP/s, HBM size and
bandwidth, link bandwidths and latencies), our efficiency factors, and the lowering its
compiler applies, cited where each figure is taken from (`Cluster.preset` reads them)."""

from __future__ import annotations

from typing import Any

from ._lowering import Lowering

GB = 1e9

# Public figures from the brief; per-direction link bandwidths are half the
# both-directions NVLink figure; network per device is the node's NICs / 8 GPUs.
#
# Matmuls on GPUs: `matmul_efficiency` is the maximum achievable matmul FLOP/s (MAMF) a
# brute-force search of bf16 GEMM shapes measured, over the dense peak (S. Bekman,
# "Machine Learning Engineering", compute/accelerator/README.md, "Maximum Achievable
# Matmul FLOPS comparison table", mamf-finder.py): A100 SXM 267.9 of 312 TFLOP/s
# (0.859), H100 SXM 792.1 of 989 (0.801), GH200 (the H200's die and HBM3e) 821.0 of 989
# (0.830); no V100 figure is given, so it keeps the default. OpenXLA's GPU cost model
# measured the same on H100 (`xla/service/gpu/model/matmul_interpolator_data.h`, sm_90:
# a bf16 4096^3 product at 783 TFLOP/s, 0.79 of peak). `matmul_tile`: Tensor Cores
# are used most efficiently at multiples of 8 fp16 elements, on A100 and later of 64
# (128 bytes) (NVIDIA, "Matrix Multiplication Background User's Guide", Tensor Core
# requirements).
_GPU_TILE = 64
# Matmuls on TPUs: `matmul_tile` is the MXU's systolic array, 128 x 128 on v4, v5e and
# v5p, 256 x 256 on v6e (J. Austin et al., "How to Scale Your Model", part 2, "How to
# Think About TPUs": the MXU multiplies bf16[8,128] @ bf16[128,128] every 8 cycles).
# `matmul_efficiency` on v5e and v5p is XLA's own bf16 matmul timed on a TPU v5e in JAX's
# Pallas TPU guide ("Matrix Multiplication", docs/pallas/tpu/matmul.ipynb, "XLA matmul"
# cell, `jnp.matmul` timed by `timeit` with dispatch included, so a lower bound on the
# rate): 8192^3 at 181.8 TFLOP/s, 0.923 of the v5e's 197 (4096^3 at 0.843, 1024^3 at
# 0.091, too small to fill the MXUs), the largest product measured, as Bekman's MAMF is
# the GPUs' best. It carries to v5p: the same TPU v5 generation's TensorCore, four
# 128 x 128 MXUs each (v5e one TensorCore a chip, v5p two, run as one), and the 8192^3
# product is compute-bound on both (2,730 FLOP per byte it moves at least, over ridges of
# 240 on v5e and 166 on v5p), so the rate over peak is the MXUs' and the compiler's, not
# HBM's. Not derived from any training run's MFU. v4 (an older MXU) and v6e (256 x 256)
# keep the generic 0.6: no measured rate over peak is published for them that we found
# (Bekman's MAMF table has no TPU; the scaling book's profiling part times one matmul on
# a TPU v2; Google's accelerator-microbenchmarks publish Ironwood's only).
_TPU_V5_MATMUL = 0.923
_TPU_MXU = 128
PRESETS: dict[str, dict[str, Any]] = {
    "v100": dict(
        peak_flops=125e12,
        hbm_bytes=32 * GB,
        hbm_bandwidth=0.9e12,
        intra_bandwidth=150 * GB,
        inter_bandwidth=4 * 100e9 / 8 / 8,
        matmul_tile=8,
    ),
    "a100": dict(
        peak_flops=312e12,
        hbm_bytes=80 * GB,
        hbm_bandwidth=2.0e12,
        intra_bandwidth=300 * GB,
        inter_bandwidth=8 * 200e9 / 8 / 8,
        matmul_efficiency=0.859,
        matmul_tile=_GPU_TILE,
    ),
    "h100": dict(
        peak_flops=989e12,
        hbm_bytes=80 * GB,
        hbm_bandwidth=3.35e12,
        intra_bandwidth=450 * GB,
        inter_bandwidth=8 * 400e9 / 8 / 8,
        matmul_efficiency=0.801,
        matmul_tile=_GPU_TILE,
        lowering=Lowering.hopper(),
    ),
    "h200": dict(
        peak_flops=989e12,
        hbm_bytes=141 * GB,
        hbm_bandwidth=4.8e12,
        intra_bandwidth=450 * GB,
        inter_bandwidth=8 * 400e9 / 8 / 8,
        matmul_efficiency=0.830,
        matmul_tile=_GPU_TILE,
        lowering=Lowering.hopper(),
    ),
    # TPUs: one slice is one "node" (its chips talk over ICI, a 2-D or 3-D torus; see
    # `_cost/_torus.py` for how a mesh axis is priced on it); `inter_bandwidth` is the
    # data-centre network (DCN) per chip between slices. Per-chip figures from Google
    # Cloud's TPU system-architecture pages (cloud.google.com/tpu/docs/v4, /v5e, /v5p,
    # /v6e): peak bf16, HBM size and bandwidth, ICI ports per chip and the chip's
    # bidirectional ICI bandwidth, split evenly over its ports and two directions into
    # `ici_link_bandwidth` (per link, per direction). `intra_bandwidth`, what a flat axis
    # without a torus is priced at, is a ring over one torus dimension: both directions
    # of one link. Compiled by XLA's TPU pipeline (`Lowering.tpu()`: the GPU's rewrites,
    # arrays in tiles), as `_verify/_tpu.py` compiles for these without a TPU.
    #
    # v4: 275 TFLOP/s, 32 GiB at 1200 GB/s, 3-D torus, 6 ports. Google's v4 page gives no
    # ICI figure; 45 GB/s per link and direction is "How to Scale Your Model" (the JAX
    # scaling book, jax-ml.github.io/scaling-book, part 2) and DCN 25 GB/s per chip the
    # figure this preset always had. libtpu shows each chip's two TensorCores as two JAX
    # devices unless they run as one (megacore): these figures are per chip.
    "tpu-v4": dict(
        peak_flops=275e12,
        hbm_bytes=32 * 2**30,
        hbm_bandwidth=1.2e12,
        ici_link_bandwidth=45 * GB,
        ici_ports=6,
        intra_bandwidth=2 * 45 * GB,
        inter_bandwidth=25 * GB,
        devices_per_node=4096,
        matmul_tile=_TPU_MXU,
        lowering=Lowering.tpu(),
    ),
    # v5e: 197 TFLOP/s, 16 GB at 819 GB/s, 2-D torus, 4 ports, 400 GB/s bidirectional ICI
    # per chip (50 GB/s per link and direction); DCN 6.4 Tbps per 256-chip pod, 2 x 100
    # Gbps NICs per 8-chip host (25 GB/s / 8 = 3.125 GB/s per chip).
    "tpu-v5e": dict(
        peak_flops=197e12,
        hbm_bytes=16 * GB,
        hbm_bandwidth=819 * GB,
        ici_link_bandwidth=50 * GB,
        ici_ports=4,
        intra_bandwidth=2 * 50 * GB,
        inter_bandwidth=2 * 100e9 / 8 / 8,
        devices_per_node=256,
        matmul_efficiency=_TPU_V5_MATMUL,
        matmul_tile=_TPU_MXU,
        lowering=Lowering.tpu(),
    ),
    # v5p: 459 TFLOP/s, 95 GiB at 2765 GB/s, 3-D torus, 6 ports, 1200 GB/s bidirectional
    # ICI per chip (100 GB/s per link and direction); DCN 50 Gbps per chip.
    "tpu-v5p": dict(
        peak_flops=459e12,
        hbm_bytes=95 * 2**30,
        hbm_bandwidth=2765 * GB,
        ici_link_bandwidth=100 * GB,
        ici_ports=6,
        intra_bandwidth=2 * 100 * GB,
        inter_bandwidth=50e9 / 8,
        devices_per_node=8960,
        matmul_efficiency=_TPU_V5_MATMUL,
        matmul_tile=_TPU_MXU,
        lowering=Lowering.tpu(),
    ),
    # v6e (Trillium): 918 TFLOP/s, 32 GB at 1638 GB/s, 2-D torus, 4 ports, 800 GB/s
    # bidirectional ICI per chip (100 GB/s per link and direction); DCN: 8 chips per host,
    # taken as v5e's 2 x 100 Gbps NICs per host (Google's page gives no v6e figure).
    "tpu-v6e": dict(
        peak_flops=918e12,
        hbm_bytes=32 * GB,
        hbm_bandwidth=1638 * GB,
        ici_link_bandwidth=100 * GB,
        ici_ports=4,
        intra_bandwidth=2 * 100 * GB,
        inter_bandwidth=2 * 100e9 / 8 / 8,
        devices_per_node=256,
        matmul_tile=2 * _TPU_MXU,
        lowering=Lowering.tpu(),
    ),
    # The local CPU (virtual devices): modest figures, recalibrate with `automap calibrate`.
    "cpu": dict(
        peak_flops=50e9,
        hbm_bytes=4 * GB,
        hbm_bandwidth=10 * GB,
        intra_bandwidth=5 * GB,
        inter_bandwidth=5 * GB,
        devices_per_node=4096,
        matmul_efficiency=0.5,
        memory_efficiency=0.5,
        comm_efficiency=0.5,
        lowering=Lowering.cpu(),
    ),
}
