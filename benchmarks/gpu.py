"""GPU benchmark of the custom all-reduce on one GPU, in simulation mode (n ranks' buffers in one
process and one launch; see native/cuda/custom_ar.h):

- one-shot and two-shot against the device-to-device copy roofline: a copy moving the same bytes
  as the call (staging the input into the registered buffer, then for one-shot reading n buffers
  and writing the output; for two-shot reading n slices, writing one, reading n slices and
  writing the output), over the call's time;
- the fused all-reduce + RMSNorm against the two separate steps (all-reduce, then the norm);
- the quantized all-reduce's error against the exact sum, and its time against two-shot;
- small leaves sent one call each against one call on the buffer they are packed into.

    python benchmarks/gpu.py [--world 2 4 8] [--iters 50]

Writes benchmarks/results/gpu-<device>.md. Needs a GPU and spmd's GPU module.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

from spmd._native_lib import cuda_tables, native_cuda

ALGOS = cuda_tables()["algos"]
CODECS = cuda_tables()["codecs"]
CUSTOM_DTYPE_CODES = cuda_tables()["custom_dtypes"]

SIZES = [256 << 10, 1 << 20, 8 << 20, 32 << 20, 64 << 20]


def _bf16(world: int, count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal(count).astype(ml_dtypes.bfloat16) for _ in range(world)]


def one_shot_bytes(world: int, size: int) -> int:
    """Bytes one rank moves in a one-shot call: staging (read the input, write the buffer), read
    n buffers, write the output."""
    return (2 + world + 1) * size


def two_shot_bytes(world: int, size: int) -> int:
    """Staging, then the reduce-scatter (read n slices, write one) and the all-gather (read n
    slices, write the output)."""
    return 2 * size + (size + size // world) + 2 * size


def quantized_bytes(world: int, size: int, itemsize: int, codec: str) -> int:
    """Encode (read the input, write the codes), reduce the slice (read n slices of codes, write
    one), decode (read the codes, write the output); no staging (the kernel encodes from the
    input). Codes of 32 values: their payload and a float32 scale."""
    values = size // itemsize
    codes = values // 32 * ((16 if codec == "int4" else 32) + 4)
    return size + codes + (codes + codes // world) + codes + size


def roofline(mod, total_bytes: int, iters: int) -> float:
    """Milliseconds a device-to-device copy takes to move ``total_bytes`` (reads plus writes)."""
    return float(mod.copy_time(total_bytes // 2, iters))


def allreduce_table(mod, worlds, iters) -> list[str]:
    rows = [
        "| ranks | size | one-shot | two-shot | one-shot / roofline | two-shot / roofline |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for world in worlds:
        for size in SIZES:
            xs = [x.tobytes() for x in _bf16(world, size // 2)]
            t = {}
            for algo in ("one_shot", "two_shot"):
                _, t[algo] = mod.sim_allreduce(world, CUSTOM_DTYPE_CODES["bfloat16"],
                                               ALGOS[algo], 0, xs, iters)  # fmt: skip
            # Every simulated rank moves its bytes in the same launch: world x per-rank bytes.
            one = roofline(mod, world * one_shot_bytes(world, size), iters)
            two = roofline(mod, world * two_shot_bytes(world, size), iters)
            rows.append(
                f"| {world} | {size >> 10} KiB | {t['one_shot'] * 1e3:.1f} us | "
                f"{t['two_shot'] * 1e3:.1f} us | {one / t['one_shot']:.2f} | "
                f"{two / t['two_shot']:.2f} |"
            )
    return rows


def rmsnorm_table(mod, worlds, iters) -> list[str]:
    rows = ["| ranks | rows x hidden | two steps | fused one-shot | fused two-shot |",
            "|---:|---:|---:|---:|---:|"]  # fmt: skip
    for world in worlds:
        for rows_, hidden in ((8, 4096), (128, 4096), (1024, 8192)):
            rng = np.random.default_rng(1)
            xs = [rng.standard_normal((rows_, hidden)).astype(ml_dtypes.bfloat16).tobytes()
                  for _ in range(world)]  # fmt: skip
            res = rng.standard_normal((rows_, hidden)).astype(ml_dtypes.bfloat16).tobytes()
            w = np.ones(hidden, ml_dtypes.bfloat16).tobytes()
            times = []
            for mode in (0, 1, 2):
                *_, ms = mod.sim_allreduce_rmsnorm(world, CUSTOM_DTYPE_CODES["bfloat16"], mode,
                                                   rows_, hidden, xs, [res] * world, w, 1e-6,
                                                   iters)  # fmt: skip
                times.append(f"{ms * 1e3:.1f} us")
            rows.append(f"| {world} | {rows_} x {hidden} | " + " | ".join(times) + " |")
    return rows


def quantized_table(mod, worlds, iters) -> list[str]:
    rows = ["| ranks | size | codec | time | vs two-shot | / roofline | rel. error (L2) "
            "| max abs error |",
            "|---:|---:|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    size = 32 << 20
    for world in worlds:
        xs = _bf16(world, size // 2)
        raw = [x.tobytes() for x in xs]
        exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
        _, base = mod.sim_allreduce(world, CUSTOM_DTYPE_CODES["bfloat16"], ALGOS["two_shot"], 0,
                                    raw, iters)  # fmt: skip
        for codec in CODECS:
            outs, ms = mod.sim_allreduce(world, CUSTOM_DTYPE_CODES["bfloat16"],
                                         ALGOS["quantized"], CODECS[codec], raw, iters)  # fmt: skip
            got = np.frombuffer(outs[0], ml_dtypes.bfloat16).astype(np.float64)
            rel = np.linalg.norm(got - exact) / np.linalg.norm(exact)
            roof = roofline(mod, world * quantized_bytes(world, size, 2, codec), iters)
            rows.append(
                f"| {world} | {size >> 20} MiB | {codec} | {ms * 1e3:.1f} us | "
                f"{base / ms:.2f}x | {roof / ms:.2f} | {rel:.2e} | "
                f"{np.abs(got - exact).max():.3g} |"
            )
    return rows


def packing_table(mod, worlds, iters) -> list[str]:
    """Small leaves of one fused call (a layer's norm weights and biases), each its own one-shot
    call against one call on the buffer they are packed into, plus the copies in and out that XLA
    makes for the pack (timed as device-to-device copies of the same bytes)."""
    rows = ["| ranks | leaves | per-leaf calls | packed call | copies in and out | speed-up |",
            "|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for world in worlds:
        for leaves, count in ((16, 4096), (64, 4096), (64, 1024)):
            one = [x.tobytes() for x in _bf16(world, count)]
            _, leaf = mod.sim_allreduce(world, CUSTOM_DTYPE_CODES["bfloat16"], ALGOS["one_shot"],
                                        0, one, iters)  # fmt: skip
            flat = [x.tobytes() for x in _bf16(world, leaves * count)]
            _, packed = mod.sim_allreduce(world, CUSTOM_DTYPE_CODES["bfloat16"],
                                          ALGOS["one_shot"], 0, flat, iters)  # fmt: skip
            # Two copies (into the pack, the results out of it) of every rank's bytes, read and
            # written.
            copies = 2 * roofline(mod, world * 2 * leaves * count * 2, iters)
            rows.append(
                f"| {world} | {leaves} x {count * 2 >> 10} KiB | {leaves * leaf * 1e3:.1f} us | "
                f"{packed * 1e3:.1f} us | {copies * 1e3:.1f} us | "
                f"{leaves * leaf / (packed + copies):.1f}x |"
            )
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args(argv)
    mod = native_cuda()
    if mod is None:
        print("spmd was built without its GPU module", file=sys.stderr)
        return 1
    name, _, major, minor, sms = mod.device_info()
    lines = [
        f"# Custom all-reduce on {name} (sm_{major}{minor}, {sms} SMs), simulation mode",
        "",
        "All ranks run as blocks of one launch on one GPU, so the GPU's memory bandwidth is",
        "shared by all of them: each call is compared with a device-to-device copy that moves",
        "the same bytes (the roofline; `/ roofline` is the copy's time over the call's, 1.0 =",
        "memory speed). Above 1.0 the call reads data still in the L2 cache: in simulation every",
        "rank reads the same buffers, which on real GPUs are the peers' over NVLink. So this",
        "measures the kernels, not the one-shot/two-shot trade-off of a real node, whose cost is",
        "the bytes read from peers ((n-1) x size one-shot, 2(n-1)/n x size two-shot).",
        f"Mean of {args.iters} calls after one warm-up; bfloat16. Command: "
        f"`python benchmarks/gpu.py --world {' '.join(map(str, args.world))} "
        f"--iters {args.iters}`.",
        "",
        "## All-reduce kernels against the device-to-device copy roofline",
        "",
        *allreduce_table(mod, args.world, args.iters),
        "",
        "## Fused all-reduce + RMSNorm against the two steps",
        "",
        *rmsnorm_table(mod, args.world, args.iters),
        "",
        "## Quantized all-reduce: error against the exact sum, speed against two-shot",
        "",
        *quantized_table(mod, args.world, args.iters),
        "",
        "## Packing: small leaves of one fused call in one launch",
        "",
        "`allreduce` of a pytree packs the leaves the chain sends one-shot, by dtype, into one",
        "buffer (src/spmd/ops/_gpu_chain.py, `pack_allreduce`): one launch and one barrier",
        "instead of one per leaf. Per-leaf calls: the leaf's call time x leaves; packed: one call",
        "on their bytes plus XLA's copies into the buffer and out of it.",
        "",
        *packing_table(mod, args.world, args.iters),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    tag = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    out = Path(args.out) / f"gpu-{tag}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
