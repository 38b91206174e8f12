"""HTML: the GLTR-style scored-text view (`score --html`, `Score.to_html()`, the page of `lmhead serve`)
and the documents the page's script draws from. Nothing here computes a figure: the view documents
carry the readings' own numbers.

Data is untrusted here as on the terminal. The documents hold every text already made visible by
`safe_text` (control characters as \\x1b, …), the script sets them only as text (textContent, never
innerHTML), and the JSON inside a page has `<`, `>` and `&` escaped, so `</script>` in a token or a
prompt cannot close the script element that holds it. The exported file also carries a Content
Security Policy that allows no network request at all.
"""

from __future__ import annotations

import json
import math

from lmhead_cli.readings.ranks import BUCKETS, ENTROPY_BUCKETS
from lmhead_cli.render import _plain, safe_text, show_token

ALTERNATIVES = 5  # the model's top-k in each token's tooltip (`score --html`, the page): Score(alternatives=5)
# Nothing may be fetched: styles and the script are inline, images only data: URLs.
EXPORT_CSP = ("default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:; "
              "base-uri 'none'; form-action 'none'")


def token_pieces(score) -> list[str]:
    """The text as one piece per token, in order, terminal-safe (newline and tab kept). Tokens that
    share one UTF-8 character (byte-level tokens can split one) give it to the last of them and are
    empty before it, so the pieces joined are the text."""
    pieces: list[str] = []
    buf, start, n = b"", 0, len(score.ids)
    for i in range(n):
        buf += score.token_bytes(int(score.ids[i]))
        try:
            piece = buf.decode("utf-8")
        except UnicodeDecodeError as e:
            if e.reason == "unexpected end of data" and len(buf) - e.start < 4 and i + 1 < n:
                continue  # the character goes on in the next token
            piece = buf.decode("utf-8", errors="backslashreplace")
        pieces.extend([""] * (i - start))
        pieces.append(safe_text(piece, keep="\n\t"))
        buf, start = b"", i + 1
    return pieces


def score_view(score) -> dict:
    """What the page draws for a Score: per token [id, piece, token, rank, logprob, entropy, varentropy,
    margin, alternatives] (the figures null where unscored, the margin null where no second token was
    possible; alternatives [[id, token, logprob], …] most probable first), the rank buckets' legend with
    counts, the entropy buckets' (the other colouring) and the summary. Texts are made visible; figures
    are exact: score --json's own."""
    pieces = token_pieces(score)
    ids, scored, rank = score.ids.tolist(), score.scored.tolist(), score.rank.tolist()
    logprob, entropy = score.logprob.tolist(), score.entropy.tolist()
    varentropy, margin = score.varentropy.tolist(), score.margin.tolist()
    alt_ids = score.alt_ids.tolist() if score.alt_ids is not None else None
    alt_lp = score.alt_logprob.tolist() if score.alt_logprob is not None else None
    names: dict[int, str] = {}

    def name(tid: int) -> str:
        if tid not in names:
            names[tid] = show_token(score.token_text(tid))
        return names[tid]

    rows = []
    for i, tid in enumerate(ids):
        if not scored[i]:
            rows.append([tid, pieces[i], name(tid), None, None, None, None, None, []])
            continue
        alts = [] if alt_ids is None else [[a, name(a), lp] for a, lp in zip(alt_ids[i], alt_lp[i]) if a >= 0]
        gap = margin[i] if math.isfinite(margin[i]) else None  # as score --json has it
        rows.append([tid, pieces[i], name(tid), rank[i], logprob[i], entropy[i], varentropy[i], gap, alts])
    counts = score.bucket_counts()
    return {
        "kind": "score",
        "model": safe_text(score.model),
        "random_weights": score.random_weights,
        "tokens": rows,
        "buckets": [{"name": name, "max": None if math.isinf(top) else top, "count": c}
                    for (top, name), c in zip(BUCKETS, counts)],
        "entropy_buckets": [{"name": name, "max": None if math.isinf(top) else top, "count": c}
                            for (top, name), c in zip(ENTROPY_BUCKETS, score.entropy_counts())],
        "summary": {"tokens": len(score.ids), "scored_tokens": score.scored_tokens, "nll": score.nll,
                    "mean_nll": score.mean_nll, "perplexity": score.perplexity, "bytes": score.bytes,
                    "bits_per_byte": score.bits_per_byte, "windows": score.windows, "window": score.window,
                    "stride": score.stride, "bos": score.bos},
    }


def inspect_view(ins) -> dict:
    """What the next-token panel draws: the prompt's tokens, the top-k with probabilities and the targets.
    `append` and each top token's `raw` are the token's own text (what one click adds to the prompt; the
    page sets it as the prompt box's value, never as markup)."""
    return {
        "kind": "inspect",
        "model": safe_text(ins.model),
        "random_weights": ins.random_weights,
        "prompt_tokens": [[t.id, show_token(t.text)] for t in ins.prompt_tokens],
        "truncated": ins.truncated,
        "top": [{"rank": t.rank, "id": t.id, "token": show_token(t.token), "prob": t.prob, "logprob": t.logprob,
                 "logit": t.logit, "raw": t.token} for t in ins.top],
        "targets": [{"token": show_token(t.token), "id": t.id, "pieces": [show_token(p) for p in t.pieces],
                     "rank": t.rank, "prob": t.prob, "logit": t.logit} for t in ins.targets],
        "entropy": ins.entropy, "entropy_bits": ins.entropy_bits,
        "append": ins.top[0].token if ins.top else "",
    }


def diff_view(d) -> dict:
    """What the diff view draws: each side's top tokens with their rank on the other side, the divergences."""
    def side(s):
        return {"prompt": safe_text(s.prompt), "entropy_bits": s.entropy_bits, "truncated": s.truncated,
                "top": [{"rank": t.rank, "id": t.id, "token": show_token(t.token), "prob": t.prob,
                         "other_rank": t.other_rank} for t in s.top]}

    return {"kind": "diff", "model": safe_text(d.model), "random_weights": d.random_weights,
            "a": side(d.a), "b": side(d.b), "kl_ab_bits": d.kl_ab_bits, "kl_ba_bits": d.kl_ba_bits,
            "js_bits": d.js_bits, "tv": d.tv,
            "risers": [{"token": show_token(m.token), "id": m.id, "delta": m.delta} for m in d.risers],
            "fallers": [{"token": show_token(m.token), "id": m.id, "delta": m.delta} for m in d.fallers]}


def script_json(doc) -> str:
    """A document as JSON for a <script type="application/json"> element: `<`, `>`, `&` and the line
    separators as \\u escapes, so no text in it can end the element or start markup."""
    text = json.dumps(_plain(doc), ensure_ascii=False, separators=(",", ":"))
    for ch in "<>&\u2028\u2029":
        text = text.replace(ch, f"\\u{ord(ch):04x}")
    return text


def _escape_attr(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def score_html(score, *, fragment: bool = False) -> str:
    """The scored-text view as one self-contained HTML file (inline style and script, the data as JSON,
    no network). With `fragment`, a <div> for a notebook cell instead of a whole document."""
    from lmhead_cli.page import asset

    css, js = asset("page.css"), asset("page.js")
    data = script_json(score_view(score))
    body = (f'<div class="lmhead-view" data-lmhead-view>\n<script type="application/json" class="lmhead-data">{data}'
            f'</script>\n<noscript>The scored view needs JavaScript.</noscript>\n</div>\n')
    if fragment:
        return f"<div class=\"lmhead\">\n<style>{css}</style>\n{body}<script>{js}</script>\n</div>\n"
    title = _escape_attr("lmhead score: " + safe_text(score.model))
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<meta http-equiv=\"Content-Security-Policy\" content=\"{EXPORT_CSP}\">\n"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
            f"<title>{title}</title>\n<style>{css}</style>\n</head>\n<body class=\"lmhead\">\n{body}"
            f"<script>{js}</script>\n</body>\n</html>\n")


def write_html(score, path: str) -> None:
    """`score --html FILE`: the self-contained view, written as UTF-8."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(score_html(score))
