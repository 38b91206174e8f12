"""Notebook views: each result's `_repr_html_` as the reading's own picture, not its JSON as a table.

inspect: the top-k table with its probability bars, and the targets; generate: the text, each generated
token with its step's figures and alternatives on hover; diff: the two distributions side by side;
lens: the layers × positions map of each layer's top token, its probability as the shade; (calibrate:
render/calibrate.py's diagrams).

Every figure comes from the result's own document (`to_dict()`), shown rounded in the cell and exact in
its tooltip (`title`); every text is made visible (control characters escaped) and HTML-escaped, so a
token such as `<script>` is shown, never run. Inline styles only: a notebook strips nothing else.
"""

from __future__ import annotations

import html

from lmhead_cli.render import safe_text, show_token

BLUE, RED = "72,120,208", "214,95,95"
BAR_EM = 10  # a bar's full width
CELL = "padding:1px 6px;text-align:right"
LEFT = "padding:1px 6px;text-align:left"
MONO = "font-family:monospace;white-space:pre"


def esc(text: str) -> str:
    return html.escape(safe_text(str(text)), quote=True)


def tok(text: str) -> str:
    """A token as a visible, escaped cell: show_token's form (spaces and controls made visible)."""
    return f"<span style='{MONO}'>{html.escape(show_token(text), quote=True)}</span>"


def num(value, fmt: str) -> str:
    """A figure rounded, with its exact value on hover; null for a missing one."""
    if value is None:
        return "<span title='null'>–</span>"
    return f"<span title='{value!r}'>{value:{fmt}}</span>"


def bar(fraction: float, rgb: str = BLUE) -> str:
    width = max(0.0, min(1.0, fraction)) * BAR_EM
    return (f"<div style='width:{BAR_EM}em;background:rgba({rgb},0.12)'>"
            f"<div style='width:{width:.3f}em;height:0.9em;background:rgb({rgb})'></div></div>")


def _head(doc: dict, title: str) -> str:
    random = (" · <b style='color:#b8860b'>random weights</b>: the arithmetic is real, the predictions are not"
              if doc.get("random_weights") else "")
    return f"<p><b>lmhead {esc(title)}</b> · {esc(doc['model'])}{random}</p>"


def _table(head: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th style='{LEFT}'>{esc(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td style='{CELL}'>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table style='border-collapse:collapse'><tr>{th}</tr>{body}</table>"


def _prompt(tokens: list[dict]) -> str:
    return "".join(f"<span title='id {t['id']}' style='{MONO};border:1px solid #ddd;margin:1px'>"
                   f"{html.escape(show_token(t['text']), quote=True)}</span>" for t in tokens)


def top_rows(top: list[dict], other: bool = False) -> list[list[str]]:
    rows = []
    for t in top:
        rows.append([str(t["rank"]), tok(t["token"]), str(t["id"]), bar(t["prob"]), num(t["prob"], ".4f"),
                     num(t["logprob"], ".3f"), num(t["logit"], ".3f")]
                    + ([num(t.get("other_rank"), ",")] if other else []))
    return rows


TOP_HEAD = ["rank", "token", "id", "", "prob", "logprob", "logit"]


def targets_table(targets: list[dict]) -> str:
    if not targets:
        return ""
    rows = [[tok(t["token"]), str(t["id"]), " ".join(tok(p) for p in t["pieces"]), num(t["rank"], ","),
             bar(t["prob"], RED), num(t["prob"], ".3g"), num(t["logit"], ".3f")] for t in targets]
    return "<p>targets</p>" + _table(["target", "id", "pieces", "rank", "", "prob", "logit"], rows)


def inspect_html(doc: dict) -> str:
    """`inspect`: the prompt's tokens, the top-k table with bars, the targets, the entropy."""
    return (f"<div class='lmhead-inspect'>{_head(doc, 'inspect')}<p>{_prompt(doc['prompt_tokens'])}</p>"
            + _table(TOP_HEAD, top_rows(doc["top"])) + targets_table(doc.get("targets", []))
            + f"<p>entropy {num(doc['entropy'], '.4f')} nats ({num(doc['entropy_bits'], '.4f')} bits)</p></div>")


def generate_html(doc: dict) -> str:
    """`generate`: the prompt, then each generated token, shaded by its probability, with its step's
    figures (and, with show_steps, its alternatives) on hover."""
    parts = [f"<span style='color:#777;{MONO}'>{esc(doc['prompt'])}</span>"]
    for s in doc["steps"]:
        alts = "; ".join(f"{show_token(a['token'])} {a['prob']!r}" for a in s.get("alternatives", []))
        tip = (f"{show_token(s['token'])} (id {s['id']}): prob {s['prob']!r} · logprob {s['logprob']!r} · rank "
               f"{s['rank']} · entropy {s['entropy']!r} nats" + (f" | alternatives: {alts}" if alts else ""))
        parts.append(f"<span class='step' title='{html.escape(safe_text(tip), quote=True)}' style='{MONO};"
                     f"background:rgba({BLUE},{0.1 + 0.5 * s['prob']:.3f})'>{esc(s['token'])}</span>")
    return (f"<div class='lmhead-generate'>{_head(doc, 'generate')}<p>{''.join(parts)}</p>"
            f"<p>{doc['tokens_generated']} tokens · stop: {esc(doc['stop'])} · mean entropy "
            f"{num(doc['mean_entropy'], '.4f')} nats · seed {esc(doc['seed'])}</p></div>")


def diff_html(doc: dict) -> str:
    """`diff`: the two prompts' top tokens side by side (each with its rank on the other side), the
    divergences, the tokens that rose and fell most."""
    def side(key: str) -> str:
        s = doc[key]
        return (f"<div><p><b>{key}</b>: <span style='{MONO}'>{esc(s['prompt'])}</span> · entropy "
                f"{num(s['entropy'], '.4f')} nats</p>"
                + _table(TOP_HEAD + [f"rank in {'b' if key == 'a' else 'a'}"], top_rows(s["top"], other=True))
                + "</div>")

    movers = [[tok(m["token"]), str(m["id"]), num(m["logprob_a"], ".3f"), num(m["logprob_b"], ".3f"),
               num(m["delta"], "+.3f")] for m in doc["risers"] + doc["fallers"]]
    return (f"<div class='lmhead-diff'>{_head(doc, 'diff')}<div style='display:flex;flex-wrap:wrap;gap:2em'>"
            f"{side('a')}{side('b')}</div><p>KL(a‖b) {num(doc['kl_ab'], '.4f')} · KL(b‖a) {num(doc['kl_ba'], '.4f')}"
            f" · JS {num(doc['js'], '.4f')} nats · TV {num(doc['tv'], '.4f')}</p>"
            + _table(["risers and fallers", "id", "logprob a", "logprob b", "Δ"], movers) + "</div>")


def lens_html(doc: dict) -> str:
    """`lens`: the position map, a row per layer (embeddings first) and a column per prompt position
    (`grid_start` on), each cell that layer's top token there, shaded by its probability, the exact
    figure on hover; the column of the position read is marked. Then the layers' rows at that position."""
    start, at = doc["grid_start"] or 0, doc["position"]
    prompt = doc["prompt_tokens"]
    width = len(doc["grid"][0]) if doc["grid"] else 0
    cols = range(start, start + width)
    edge = "border-left:2px solid #d65f5f;border-right:2px solid #d65f5f"
    head = "".join(f"<th style='{LEFT};{MONO}{';' + edge if p == at else ''}' title='position {p}, id "
                   f"{prompt[p]['id']}'>{html.escape(show_token(prompt[p]['text']), quote=True)}</th>" for p in cols)
    rows = []
    for layer, cells in zip(doc["layers"], doc["grid"] or []):
        tds = []
        for p, c in zip(cols, cells):
            tip = esc(f"{layer_label(layer['layer'])}, after {show_token(prompt[p]['text'])} (position {p}): "
                      f"{show_token(c['token'])} (id {c['id']}) {c['prob']!r}")
            tds.append(f"<td class='cell' title='{tip}' data-id='{c['id']}' data-prob='{c['prob']!r}' style='{CELL};"
                       f"{MONO};background:rgba({BLUE},{c['prob']:.3f}){';' + edge if p == at else ''}'>"
                       f"{html.escape(show_token(c['token']), quote=True)}</td>")
        rows.append(f"<tr><th style='{LEFT}'>{esc(layer_label(layer['layer']))}</th>{''.join(tds)}</tr>")
    grid = (f"<table class='lmhead-lens-grid' style='border-collapse:collapse'><tr><th style='{LEFT}'>layer</th>"
            f"{head}</tr>{''.join(rows)}</table>")
    layer_rows = [[esc(layer_label(layer["layer"])), tok(layer["top_token"]), num(layer["top_prob"], ".3f"),
                   num(layer["entropy"], ".3f"), num(layer["kl_to_final"]["logit"], ".4f")]
                  + ([tok(layer["tuned"]["top_token"]), num(layer["kl_to_final"]["tuned"], ".4f")]
                     if layer.get("tuned") else [])
                  + [num(t["prob"], ".3g") for t in layer["targets"]] for layer in doc["layers"]]
    targets = doc["layers"][0]["targets"] if doc["layers"] else []
    layer_head = (["layer", "top token", "prob", "entropy", "KL logit"]
                  + (["tuned top", "KL tuned"] if doc.get("tuned_lens") else [])
                  + [f"{show_token(t['token'])} prob" for t in targets])
    shown = f"positions {start} to {start + width - 1} of {len(prompt)}" if width < len(prompt) else "every position"
    about = (f"<p>each layer's top token after each prompt token ({shown}), through {esc(doc['norm'])} and the "
             f"head; shade: its probability</p>{grid}" if doc["grid"] is not None else
             "<p>(no position map: lens(..., grid=True) adds it)</p>")
    return (f"<div class='lmhead-lens'>{_head(doc, 'lens')}<p>{_prompt(prompt)}</p>{about}"
            f"<p>at position {at}, after {tok(prompt[at]['text'])}:</p>{_table(layer_head, layer_rows)}</div>")


def layer_label(layer: int) -> str:
    return "embeddings" if layer == 0 else f"block {layer}"
