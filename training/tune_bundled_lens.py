"""Train `bundled:tiny`'s tuned lens (`lmhead lens --tuned bundled`) on the bundled model's own
training text, and measure it on the held-out books.

    python training/tune_bundled_lens.py            # writes lmhead_cli/data/bundled-tiny/tuned-lens.safetensors
    python training/tune_bundled_lens.py --eval-only   # only the held-out table, for the shipped lens

Text: the KJV as training/train_bundled.py reads it (Debian's `bible-kjv`, or --text FILE), chapters
separated by a blank line; the books train_bundled.py holds out (HELD_OUT) are never trained on: they
are the evaluation. The table printed at the end (mean KL(final ‖ layer) in nats over every held-out
token of the held-out split, in windows of n_ctx tokens, for the logit lens and the tuned lens) is the one in
docs/lens.md.
Not part of CI.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "training"))

from train_bundled import HELD_OUT, read_bible  # noqa: E402

OUT = ROOT / "lmhead_cli" / "data" / "bundled-tiny" / "tuned-lens.safetensors"
# What made the shipped file (see docs/lens.md): 90 steps of one window of 128 tokens, Adam at 3e-3.
SETTINGS = dict(steps=90, batch=1, seq=128, lr=3e-3, warmup=5, seed=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", help="a dump of `bible -l100000 gen1:1-rev22:21` (default: run `bible`)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--eval-only", action="store_true", help="measure the lens at --out on the held-out books")
    ap.add_argument("--every", type=int, default=1, help="measure every N-th window of the held-out split (1: all)")
    args = ap.parse_args()

    import lmhead_cli
    from lmhead_cli.readings.tuned_lens import mean_kl_to_final, read_lens

    chapters = read_bible(args.text)
    train = "\n\n".join(text for book, text in chapters if book not in HELD_OUT) + "\n\n"
    held = "\n\n".join(text for book, text in chapters if book in HELD_OUT) + "\n\n"
    model = lmhead_cli.load("bundled:tiny", device="cpu")
    if not args.eval_only:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "train.txt"
            path.write_text(train, encoding="utf-8")
            print(f"training text: {len(train.encode()):,} bytes (held out: {', '.join(HELD_OUT)}); "
                  f"load average {os.getloadavg()[0]:.1f}", flush=True)
            result = model.tune_lens(file=str(path), out=args.out, **SETTINGS)
        t = result.reading
        print(f"trained {t.steps} steps, {t.tokens:,} positions, in {t.seconds:.1f} s wall, {t.cpu_seconds:.1f} s CPU "
              f"({t.threads} threads); load average {t.load_average[0]:.1f} -> {t.load_average[1]:.1f}", flush=True)

    lens = read_lens(args.out)
    ids = model.tokenizer.encode(held)
    n_ctx = model.n_ctx
    start = time.perf_counter()
    sums, count = None, 0
    for s in range(0, len(ids), n_ctx * args.every):
        window = ids[s:s + n_ctx]
        if len(window) < 2:
            continue
        kl = mean_kl_to_final(model.loaded, window, lens)
        n = len(window)
        sums = {k: [a + b * n for a, b in zip(sums[k], v)] if sums else [b * n for b in v] for k, v in kl.items()}
        count += n
    print(f"held out: {count:,} of its {len(ids):,} tokens, every {args.every}-th window of {n_ctx} "
          f"({time.perf_counter() - start:.0f} s)")
    print("| layer | logit lens | tuned lens |")
    print("|---|---:|---:|")
    for layer, (a, b) in enumerate(zip(sums["logit"], sums["tuned"])):
        name = "embeddings" if layer == 0 else f"block {layer}"
        print(f"| {name} | {a / count:.4f} | {b / count:.4f} |")


if __name__ == "__main__":
    main()
