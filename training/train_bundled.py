"""Train `bundled:tiny`: a small GPT-2 (tied head, the real GPT-2 tokenizer, V=50257) on the King
James Bible, and write it into lmhead_cli/data/bundled-tiny/ (model.safetensors, float16, and
config.json), with its training curve (CSV and SVG) in docs/.

    python training/train_bundled.py            # the shipped model (one thread; see docs/bundled-model.md)
    python training/train_bundled.py --steps 30 --out /tmp/trial --docs /tmp/trial   # a trial

Text: Debian's `bible-kjv-text` (public domain), read through its `bible` program
(`apt-get install bible-kjv`), or --text FILE holding the same dump (`bible -l100000
gen1:1-rev22:21`). Each chapter is one paragraph (its verses joined by spaces, no numbers);
chapters are separated by a blank line. Whole books are held out for evaluation (HELD_OUT).

Deterministic: fixed seed, fixed thread count, a seeded batch order; the same machine and the
same torch build give the same weights. Not part of CI; the model it writes is checked by
tests/test_bundled.py and documented in docs/bundled-model.md.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lmhead_cli.engine.lean import GPT2, init_random_  # noqa: E402
from lmhead_cli.loading.tokenizer import GPT2Tokenizer  # noqa: E402

HELD_OUT = ("Ruth", "Esther", "Jonah", "Philippians", "James")  # narratives, prophecy, two epistles
SEED = 20
EOT = 50256


# --------------------------------------------------------------------------- text

def read_bible(text_file: str | None) -> list[tuple[str, str]]:
    """(book, chapter paragraph) for every chapter of the KJV, in canonical order."""
    if text_file:
        raw = Path(text_file).read_text(encoding="utf-8")
    else:
        raw = subprocess.run(["bible", "-l100000", "gen1:1-rev22:21"], check=True,
                             capture_output=True, text=True).stdout
    chapters: list[tuple[str, list[str]]] = []
    heading = re.compile(r"^(\S.*?) (\d+)$")  # "Genesis 1", "1 Kings 3", "Song of Solomon 2"
    verse = re.compile(r"^\s+\d+ (.*)$")
    for line in raw.splitlines():
        if not line.strip():
            continue
        if m := heading.match(line):
            chapters.append((m.group(1), []))
        elif m := verse.match(line):
            chapters[-1][1].append(m.group(1).strip())
        else:
            raise SystemExit(f"unexpected line in the bible dump: {line[:80]!r}")
    if len(chapters) != 1189:
        raise SystemExit(f"expected the KJV's 1189 chapters, read {len(chapters)}")
    return [(book, " ".join(verses)) for book, verses in chapters]


def token_streams(chapters, tok) -> tuple[torch.Tensor, torch.Tensor]:
    """The training and held-out token streams: chapters separated by "\\n\\n"."""
    train, held = [], []
    sep = tok.encode("\n\n")
    for book, text in chapters:
        ids = tok.encode(text) + sep
        (held if book in HELD_OUT else train).extend(ids)
    return torch.tensor(train, dtype=torch.long), torch.tensor(held, dtype=torch.long)


# --------------------------------------------------------------------------- model: lmhead's own GPT-2

def build_model(cfg: dict, seed: int = SEED) -> GPT2:
    """The very class `bundled:tiny` is loaded into (engine/lean.py's GPT2: GPT-2's key names, the head
    tied to wte), with GPT-2's initialisation (lean.init_random_), so that the recipe and the shipped
    model cannot drift apart. model(ids) is the head's input (B, T, D); model.lm_head of it the logits."""
    model = GPT2(cfg, tied=True)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # the tie: wte's, once
    init_random_(state, cfg["n_layer"], seed)
    return model.train()


class SampledHead:
    """The training loss with a sampled softmax (Jean et al. 2015): every token the training text
    holds is a class of its own, and the partition over the other ~40k tokens is estimated from
    `k` of them drawn afresh each step (their logits raised by log(n_other / k)), so those rows are
    still pushed down as the full softmax would push them, at a fifth of the head's cost. The
    shipped model is an ordinary GPT-2 and every perplexity reported is the full softmax's."""

    def __init__(self, train: torch.Tensor, vocab: int, k: int, generator: torch.Generator):
        present = torch.zeros(vocab, dtype=torch.bool)
        present[train] = True
        self.seen = present.nonzero().squeeze(1)
        self.other = (~present).nonzero().squeeze(1)
        self.index = torch.full((vocab,), -1, dtype=torch.long)
        self.index[self.seen] = torch.arange(len(self.seen))
        self.k, self.gen = min(k, len(self.other)), generator
        self.shift = math.log(len(self.other) / self.k) if self.k else 0.0

    def loss(self, model: GPT2, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """h (N, D), targets (N,) token ids, all among the seen ones -> mean cross-entropy."""
        drawn = self.other[torch.randperm(len(self.other), generator=self.gen)[:self.k]]
        rows = model.wte.weight[torch.cat([self.seen, drawn])]  # (S + k, D)
        logits = h @ rows.T  # (N, S + k)
        logits[:, len(self.seen):] += self.shift
        return F.cross_entropy(logits, self.index[targets])


# --------------------------------------------------------------------------- evaluation, curve

@torch.no_grad()
def held_out_loss(model, held: torch.Tensor, ctx: int, limit: int | None = None) -> float:
    """Mean next-token loss (nats) over the held-out stream, cut into windows of `ctx` tokens that
    each predict their own tokens 2..ctx (every held-out token but the first of a window)."""
    model.eval()
    n = (len(held) - 1) // ctx * ctx if limit is None else min(limit, (len(held) - 1) // ctx * ctx)
    total, count = 0.0, 0
    for s in range(0, n, ctx * 8):
        e = min(s + ctx * 8, n)
        x = held[s:e].view(-1, ctx)
        logits = model.lm_head(model(x))[:, :-1]  # (B, ctx - 1, V)
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum").item()
        count += x[:, 1:].numel()
    model.train()
    return total / count


def write_svg(rows: list[dict], path: Path, title: str) -> None:
    """The training curve as a small standalone SVG: train and held-out loss against tokens seen."""
    W, H, L, R, T, B = 640, 360, 60, 20, 30, 50
    xs = [r["tokens"] for r in rows]
    series = [("train loss (mean since last point)", "#1f77b4", [r["train_loss"] for r in rows]),
              ("held-out loss (8,192 tokens; the last point: all)", "#d62728", [r["held_out_loss"] for r in rows])]
    ys = [v for _, _, vs in series for v in vs if v == v]
    x0, x1 = 0, max(xs)
    y0, y1 = math.floor(min(ys)), math.ceil(max(ys))
    px = lambda x: L + (W - L - R) * (x - x0) / (x1 - x0 or 1)  # noqa: E731
    py = lambda y: T + (H - T - B) * (y1 - y) / (y1 - y0 or 1)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="18" text-anchor="middle" font-size="14">{title}</text>']
    for y in range(y0, y1 + 1):
        out.append(f'<line x1="{L}" x2="{W - R}" y1="{py(y):.1f}" y2="{py(y):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{L - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y}</text>')
    step = 10 ** math.floor(math.log10(x1 or 1))
    step = step / 2 if x1 / step < 4 else step
    for i in range(0, int(x1 // step) + 1):  # ticks every 0.5M or 1M tokens
        x = i * step
        out.append(f'<line x1="{px(x):.1f}" x2="{px(x):.1f}" y1="{H - B}" y2="{H - B + 4}" stroke="black"/>')
        out.append(f'<text x="{px(x):.1f}" y="{H - B + 18}" text-anchor="middle">{x / 1e6:g}M</text>')
    out.append(f'<line x1="{L}" x2="{W - R}" y1="{H - B}" y2="{H - B}" stroke="black"/>')
    out.append(f'<line x1="{L}" x2="{L}" y1="{T}" y2="{H - B}" stroke="black"/>')
    out.append(f'<text x="{(L + W - R) / 2}" y="{H - 12}" text-anchor="middle">training tokens seen</text>')
    out.append(f'<text x="14" y="{(T + H - B) / 2}" text-anchor="middle" transform="rotate(-90 14 {(T + H - B) / 2})">loss (nats/token)</text>')
    for k, (name, colour, vs) in enumerate(series):
        pts = " ".join(f"{px(x):.1f},{py(v):.1f}" for x, v in zip(xs, vs) if v == v)
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{pts}"/>')
        out.append(f'<line x1="{W - R - 310}" x2="{W - R - 290}" y1="{T + 14 + 16 * k}" y2="{T + 14 + 16 * k}" stroke="{colour}" stroke-width="2"/>')
        out.append(f'<text x="{W - R - 284}" y="{T + 18 + 16 * k}">{name}</text>')
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")


# --------------------------------------------------------------------------- training

def train(model: GPT2, train: torch.Tensor, held: torch.Tensor, *, steps: int, batch: int, seq: int, ctx: int,
          lr: float, eval_every: int, sampled: int) -> list[dict]:
    """`steps` AdamW steps of `batch` windows of `seq` tokens drawn from `train` (seeded), the loss the
    sampled softmax's; the held-out loss every `eval_every` steps (all of `held` at the end). The rows
    of the training curve."""
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and n != "wpe.weight"]
    rest = [p for n, p in model.named_parameters() if not (p.dim() == 2 and n != "wpe.weight")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), foreach=False)
    warmup = max(1, steps // 20)
    lr_at = lambda s: lr * min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))  # noqa: E731
    order = torch.Generator().manual_seed(SEED)
    head = SampledHead(train, model.wte.weight.shape[0], sampled, order)
    print(f"classes: {len(head.seen):,} tokens of the training text + {head.k:,} of the other "
          f"{len(head.other):,} drawn per step", flush=True)
    eval_tokens = 32 * ctx  # a fixed held-out sample for the curve; the full split at the end

    rows, running, n_running = [], 0.0, 0
    start, cpu_start = time.perf_counter(), time.process_time()
    for step in range(steps + 1):
        if step % eval_every == 0 or step == steps:
            loss = held_out_loss(model, held, ctx, None if step == steps else eval_tokens)
            rows.append({"step": step, "tokens": step * batch * seq,
                         "train_loss": running / n_running if n_running else float("nan"),
                         "held_out_loss": loss, "held_out_ppl": math.exp(loss),
                         "seconds": round(time.perf_counter() - start, 1),
                         "cpu_seconds": round(time.process_time() - cpu_start, 1)})
            running, n_running = 0.0, 0
            r = rows[-1]
            print(f"step {step:5d}  tokens {r['tokens']:>9,}  train {r['train_loss']:.3f}  held-out {loss:.3f} "
                  f"(ppl {math.exp(loss):.1f})  {r['seconds']:.0f}s "
                  f"(cpu {r['cpu_seconds']:.0f}s)", flush=True)
        if step == steps:
            break
        starts = torch.randint(0, len(train) - seq - 1, (batch,), generator=order)
        x = torch.stack([train[s:s + seq + 1] for s in starts.tolist()])
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        h = model(x[:, :-1])  # (batch, seq, D)
        loss = head.loss(model, h.reshape(-1, h.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running += loss.item()
        n_running += 1
    return rows



# --------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", help="a dump of `bible -l100000 gen1:1-rev22:21` (default: run `bible`)")
    ap.add_argument("--out", default=str(ROOT / "lmhead_cli/data/bundled-tiny"))
    ap.add_argument("--docs", default=str(ROOT / "docs"))
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256, help="training window (= n_positions: every position is trained)")
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=256, help="n_positions")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sampled", type=int, default=1024,
                    help="tokens absent from the training text drawn per step for the sampled softmax")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    tok = GPT2Tokenizer.bundled()
    train_ids, held = token_streams(read_bible(args.text), tok)
    print(f"tokens: train {len(train_ids):,}, held out {len(held):,} ({', '.join(HELD_OUT)})", flush=True)

    cfg = {"vocab_size": 50257, "n_positions": args.ctx, "n_embd": args.width, "n_layer": args.layers,
           "n_head": args.heads}
    model = build_model(cfg)
    start, cpu_start = time.perf_counter(), time.process_time()
    print(f"load average at start: {os.getloadavg()[0]:.1f}", flush=True)
    rows = train(model, train_ids, held, steps=args.steps, batch=args.batch, seq=args.seq, ctx=args.ctx,
                 lr=args.lr, eval_every=args.eval_every, sampled=args.sampled)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start

    ppl = rows[-1]["held_out_ppl"]
    print(f"held-out perplexity {ppl:.2f} on {len(held):,} tokens; trained in {seconds:.0f}s wall, "
          f"{cpu_seconds:.0f}s of CPU time on {args.threads} thread(s) "
          f"({args.steps * args.batch * args.seq / cpu_seconds:.0f} tokens per CPU second); "
          f"load average at the end: {os.getloadavg()[0]:.1f}", flush=True)
    save(model, cfg, Path(args.out))
    docs = Path(args.docs)
    docs.mkdir(parents=True, exist_ok=True)
    with open(docs / "bundled-tiny-curve.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    write_svg(rows, docs / "bundled-tiny-curve.svg",
              f"bundled:tiny on the KJV: held-out perplexity {ppl:.1f}")
    print(write_sums(Path(args.out)), end="", flush=True)


def save(model: GPT2, cfg: dict, out: Path) -> None:
    """model.safetensors (float16, GPT-2's key names, no lm_head: it is wte) and config.json."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()
             if k != "lm_head.weight"}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # safetensors writes 0600; package data is world-readable
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu_new",
              "vocab_size": cfg["vocab_size"], "n_positions": cfg["n_positions"], "n_ctx": cfg["n_positions"],
              "n_embd": cfg["n_embd"], "n_layer": cfg["n_layer"], "n_head": cfg["n_head"], "n_inner": None,
              "layer_norm_epsilon": 1e-5, "initializer_range": 0.02, "tie_word_embeddings": True,
              "bos_token_id": EOT, "eos_token_id": EOT, "torch_dtype": "float16",
              "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_sums(out: Path) -> str:
    """SHA256SUMS beside the files (`sha256sum -c` form); lmhead checks it at every load."""
    text = "".join(f"{hashlib.sha256((out / name).read_bytes()).hexdigest()}  {name}\n"
                   for name in ("config.json", "model.safetensors"))
    (out / "SHA256SUMS").write_text(text)
    return text


if __name__ == "__main__":
    main()
