"""lmhead's compiled products over GGUF blocks against torch's path for the same work, side by side in one run.

    python benchmarks/gguf_kernels_vs_torch.py [--reps 50] [--threads N] [--rows 1] [--types Q4_K,Q6_K,Q8_0,Q4_0]
    python benchmarks/gguf_kernels_vs_torch.py --gguf FILE [--reps 20] [--threads N]

Rows of x (a decoding step: --rows 1) times TinyLlama's matrices (2,048 wide: q/o 2048x2048, k/v
256x2048, gate/up 5632x2048, down 2048x5632, the head 32000x2048), each held as a GGUF type's blocks
(random weights quantised by tests/helpers.py's k_quantize, or gguf.quants for Q8_0 and Q4_0):

- the kernel with x rounded per block (llama.cpp's arithmetic, csrc/quants.c lmhead_gguf_matvec);
- the kernel with x unrounded (float32 sums of the blocks' integers; Q8_0's is lmhead_q8_0_matvec);
- torch's path without the kernels (engine/quant.py: dequantise 4 MiB of rows at a time, matmul);
- float32 weights through torch's F.linear (BLAS), the cost the blocks save.

With --gguf, every matrix of a real file (but the token table, which a step only looks rows up in) is
timed once per round with one row of x, in each arithmetic, and the sums are a decoding step's
products: the milliseconds the kernels take per token, to set beside llama-bench's `tg` on the file.

Each is timed as the best of --reps interleaved rounds (torch's dequantising path, being slow, of
--reps // 10 + 1), so a busy machine's slow calls are not what is compared; the figures are
microseconds per product and GB/s of weights read (the blocks' bytes; float32's for F.linear). The load
average is printed before and after.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {"q_proj": (2048, 2048), "k_proj": (256, 2048), "gate_proj": (5632, 2048), "down_proj": (2048, 5632),
          "head": (32000, 2048)}


def best_times(contenders: dict, reps: dict) -> dict[str, float]:
    """The best wall time (s) of each contender over its reps, in interleaved rounds."""
    best = {name: float("inf") for name in contenders}
    for fn in contenders.values():
        fn()  # first-call set-up
    for r in range(max(reps.values())):
        for name, fn in contenders.items():
            if r < reps[name]:
                t = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t)
    return best


def blocks(qtype: str, w: torch.Tensor):
    """w (N, K) float32 as `qtype`'s raw blocks (uint8 (N, bytes per row))."""
    import numpy as np
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize

    if qtype in ("Q4_K", "Q6_K"):
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from helpers import k_quantize

        return torch.from_numpy(k_quantize(w.numpy(), qtype))
    return torch.from_numpy(np.ascontiguousarray(quantize(w.numpy(), GGMLQuantizationType[qtype])))


def one_step(path: str, reps: int) -> None:
    """A decoding step's products over every matrix of the GGUF file at `path`, in each arithmetic."""
    from gguf import GGUFReader

    from lmhead_cli.engine import kernels, quant

    k = kernels.load()  # main() checked it
    mats, nbytes = [], 0
    for t in GGUFReader(path).tensors:
        if len(t.shape) == 2 and t.name != "token_embd.weight" and int(t.tensor_type) in quant.COMPILED:
            K, N = (int(v) for v in t.shape)  # GGUF lists the row length first
            raw = torch.from_numpy(t.data.reshape(N, -1).copy())
            mats.append((int(t.tensor_type), raw, torch.randn(1, K)))
            nbytes += raw.numel()
    for rounded in (True, False):
        best = [float("inf")] * len(mats)
        for _ in range(reps):
            for i, (qt, raw, x) in enumerate(mats):
                s = time.perf_counter()
                if qt == quant.Q8_0 and not rounded:
                    k.q8_0_times(x, raw, None)
                else:
                    k.gguf_times(qt, x, raw, None, rounded=rounded)
                best[i] = min(best[i], time.perf_counter() - s)
        total = sum(best)
        print(f"{'x rounded (llama.cpp)' if rounded else 'x unrounded'}: {len(mats)} matrices, "
              f"{nbytes / 1e6:.0f} MB, {total * 1e3:.1f} ms per token of products ({nbytes / total / 1e9:.1f} GB/s, "
              f"at most {1 / total:.1f} tok/s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0,Q4_0")
    args = ap.parse_args()
    from gguf.constants import GGMLQuantizationType
    from kernels_vs_torch import loaded_kernels

    from lmhead_cli.engine import quant

    k = loaded_kernels(args.threads, "" if args.gguf else f"{args.rows} row(s) of x; ")
    if args.gguf:
        one_step(args.gguf, args.reps)
        print(f"\nload average after: {os.getloadavg()[0]:.2f}")
        return
    print("| matrix | type | contender | µs per product | GB/s of weights | speed-up over torch's path |")
    print("|---|---|---|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for qtype in args.types.split(","):
        t = int(GGMLQuantizationType[qtype])
        for name, (N, K) in SHAPES.items():
            w = torch.randn(N, K, generator=g) * 0.02
            raw = blocks(qtype, w)
            x = torch.randn(args.rows, K, generator=g)
            wf = quant.Blocks(raw, t, K).dequantise()
            layer = quant.QuantLinear(quant.Blocks(raw, t, K))

            def torch_path():
                quant.KERNEL_ROWS, saved = 0, quant.KERNEL_ROWS
                try:
                    layer(x)
                finally:
                    quant.KERNEL_ROWS = saved

            contenders = {
                "kernel, x rounded (llama.cpp's)": lambda: k.gguf_times(t, x, raw, None, rounded=True),
                "kernel, x unrounded": (lambda: k.q8_0_times(x, raw, None)) if qtype == "Q8_0" else
                                       (lambda: k.gguf_times(t, x, raw, None, rounded=False)),
                "torch: dequantise, matmul": torch_path,
                "torch: float32 F.linear": lambda: F.linear(x, wf),
            }
            reps = {c: args.reps for c in contenders} | {"torch: dequantise, matmul": args.reps // 10 + 1}
            best = best_times(contenders, reps)
            base = best["torch: dequantise, matmul"]
            for c, s in best.items():
                nbytes = wf.numel() * 4 if "float32" in c else raw.numel()
                print(f"| {name} {N}x{K} | {qtype} | {c} | {s * 1e6:.0f} | {nbytes / s / 1e9:.1f} | {base / s:.1f}x |")
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
