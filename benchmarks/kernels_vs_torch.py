"""lmhead's compiled kernels against torch's own products for the same work, side by side in one run.

    python benchmarks/kernels_vs_torch.py [--reps 200] [--threads N]

One position (a decoding step) times GPT-2 small's matrices (c_attn 768x2304, c_fc 768x3072,
mlp.c_proj 3072x768, the head 50257x768):

- int8 weights: lmhead's kernel (engine/csrc: exact activations through VNNI, or widened weights)
  against `torch._weight_int8pack_mm` (torch's weight-only int8 product, float32 activations) and
  lmhead's torch path (`torch._int_mm` over the activations' digits, engine/int8.py);
- bfloat16 weights: lmhead's kernel against `F.linear` (oneDNN's bfloat16 gemm) and `torch.addmv`
  (torch's bfloat16 gemv, the form lmhead runs without the kernels).

Each product is timed as the best of --reps calls (interleaved: every round runs every contender
once), so a busy machine's slow calls are not what is compared; the figures are microseconds per
product and GB/s of weights read. The load average is printed beside them.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

SHAPES = {"c_attn": (2304, 768), "c_fc": (3072, 768), "mlp.c_proj": (768, 3072), "head": (50257, 768)}


def best_times(contenders: dict, reps: int) -> dict[str, float]:
    """The best wall time (s) of each contender over `reps` interleaved rounds."""
    best = {name: float("inf") for name in contenders}
    for fn in contenders.values():
        fn()  # first-call set-up
    for _ in range(reps):
        for name, fn in contenders.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def loaded_kernels(threads: int | None, what: str = ""):
    """The compiled kernels, with torch's threads set to `threads` (None: its own count); a line says which
    variant, how many threads, `what` else, and the load average. SystemExit where they are unavailable."""
    if threads:
        torch.set_num_threads(threads)
    from lmhead_cli.engine import kernels

    k = kernels.load()
    if k is None:
        raise SystemExit(f"the compiled kernels are unavailable: {kernels.unavailable()}")
    print(f"kernels: {k.variant}; torch {torch.__version__}, {torch.get_num_threads()} threads; {what}"
          f"load average {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)\n")
    return k


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    from lmhead_cli.engine import int8

    k = loaded_kernels(args.threads)
    g = torch.Generator().manual_seed(0)
    print("| matrix | dtype | contender | µs per product | GB/s of weights | kernel's speed-up |")
    print("|---|---|---|---:|---:|---:|")
    for name, (N, K) in SHAPES.items():
        w = torch.randn(N, K, generator=g) * 0.02
        x = torch.randn(1, K, generator=g)
        q, s = int8.quantise(w)
        xb, wb = x.bfloat16(), w.bfloat16().contiguous()
        contenders = {
            ("int8", "lmhead kernel"): lambda: k.int8_times(x, q, s, None),
            ("int8", "torch._weight_int8pack_mm"): lambda: torch._weight_int8pack_mm(x, q, s),
            ("int8", "torch._int_mm over digits"): lambda: _int_mm_path(x, q, s),
            ("bfloat16", "lmhead kernel"): lambda: k.bf16_times(xb, wb, None),
            ("bfloat16", "F.linear (oneDNN)"): lambda: F.linear(xb, wb),
            ("bfloat16", "torch.mv (gemv)"): lambda: torch.mv(wb, xb[0]),
        }
        best = best_times(contenders, args.reps)
        for dtype, width in (("int8", 1), ("bfloat16", 2)):
            ours = best[(dtype, "lmhead kernel")]
            for (dt, who), t in best.items():
                if dt == dtype:
                    print(f"| {name} {N}x{K} | {dtype} | {who} | {t * 1e6:.1f} | {N * K * width / t / 1e9:.1f} | "
                          f"{t / ours:.2f}× |")


def _int_mm_path(x, q, s):
    """engine/int8.py's product without the compiled kernel: torch._int_mm over the activations' digits."""
    from lmhead_cli.engine import int8

    a, c = int8.digits(x.float())
    acc = torch._int_mm(q, a).float()
    return torch.mv(acc, int8._BYTES / c[0])[None].mul_(s)


if __name__ == "__main__":
    main()
