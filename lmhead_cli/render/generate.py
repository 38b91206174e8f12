"""Output for generate / greedy / sample / softcap and `inspect --stages`.

Text streams to stdout as plain writes (never through rich markup: generated text may hold
brackets), terminal-safe (control characters but newline and tab made visible), flushed per piece
so it shows token by token even through a pipe.
"""

from __future__ import annotations

import sys
from dataclasses import asdict

from rich.table import Table
from rich.text import Text

from lmhead_cli.render import fit, knobs_text, notice, out, plural, provenance_json, safe_text, sparkline
from lmhead_cli.render import token_cell as _tok

STOP = {"eos": "end of text", "stop": "a stop string", "max_new_tokens": "--max-new-tokens", "context": "the context limit"}


def _pct(p: float) -> str:
    """A probability as a percentage, or in scientific notation when it would round to 0.00%."""
    return f"{p:.2%}" if p >= 1e-4 or p == 0 else f"{p:.1e}"


def begin(prompt: str) -> None:
    """The prompt, in bold on a terminal, before the generated text."""
    out().print(Text(safe_text(prompt, keep="\n\t"), style="bold"), end="", soft_wrap=True)
    sys.stdout.flush()


def stream(piece: str) -> None:
    """One piece of generated text, terminal-safe, at once."""
    sys.stdout.write(safe_text(piece, keep="\n\t"))
    sys.stdout.flush()


def stop_notice(g, n_ctx: int) -> None:
    """On stderr, when the run stopped because the context was full rather than as asked, and when a
    grammar's text ended before its structure was complete (it is then not valid)."""
    if g.stop == "context":
        notice(f"stopped at the context limit: {len(g.prompt_ids)} prompt tokens + {len(g.generated_ids)} "
               f"new fill the model's {n_ctx} positions")
    if g.settings.grammar is not None and g.stop != "eos":
        notice(f"the text ended at {STOP[g.stop]} before the {g.settings.grammar.describe()} was complete: it does "
               "not follow it (more tokens would finish it)")


def _settings_line(g) -> str:
    parts = [{"beam": f"beam search, {g.settings.beams} beams (deterministic)",
              "greedy": "greedy (temperature 0, deterministic)" if g.settings.zero_temperature else "greedy (deterministic)",
              "sample": "sampled"}[g.mode]]
    parts += [knobs_text(g.settings.knobs, " · ")] if g.settings.knobs.active() else []
    parts += [f"grammar: {g.settings.grammar.describe()}"] if g.settings.grammar is not None else []
    if g.mode == "sample":
        parts.append(f"seed {g.seed} (replay with --seed {g.seed})")
    if g.beam_score is not None:
        parts.append(f"beam score {g.beam_score:.4f} (mean processed log p)")
    return " · ".join(parts)


def end_text() -> None:
    sys.stdout.write("\n")
    sys.stdout.flush()


def summary(g, source=None) -> None:
    """After the text: how many tokens, how fast (on torch's products, where the compiled kernels are
    not in use on the CPU: `source`, an api.results.Provenance, says), how uncertain, how to replay."""
    con = out()
    ent = [s.entropy for s in g.steps]
    on = " (torch's products)" if source is not None and source.device == "cpu" and \
        source.products == "torch's products" else ""
    con.print(f"[dim]──[/] {plural(len(g.generated_ids), 'token')} in {g.elapsed_s:.2f} s · {g.tokens_per_second:.1f} "
              f"tokens/s{on} · mean entropy {g.mean_entropy:.2f} nats · stop: {STOP[g.stop]}")
    if ent:
        lo, hi = f"{min(ent):.2f}", f"{max(ent):.2f}"
        span = f"{lo} nats, every step to 2 decimals" if lo == hi else f"{lo}–{hi} nats"
        con.print(f"[dim]entropy per step[/] [cyan]{sparkline(ent, resolution=0.01)}[/] ({span})")
    con.print(f"[dim]{_settings_line(g)}[/]")


def steps_table(g) -> None:
    """One row per step: the chosen token under the raw and the processed distribution, its rank,
    what the filters removed, both entropies, and the best alternatives (processed)."""
    k = g.settings.show_steps
    out().print(f"steps: the chosen token's raw probability (softmax of the logits) and processed one (after "
                f"the stages: what it was drawn from), its rank by raw logit, the raw probability the filters "
                f"removed, the entropy in nats before (H raw) and after (H) the stages, and the {k} most "
                f"probable tokens (processed)")
    con = out()
    table = _steps(g, "  ")
    if fit.needs(con, table) > con.width:  # narrow: one alternative a line, never a token apart from its p
        table = _steps(g, "\n")
    con.print(table)


def _steps(g, between: str) -> Table:
    table = Table(show_edge=False)
    for name, justify in (("step", "right"), ("chosen", "left"), ("raw p", "right"), ("p", "right"),
                          ("rank", "right"), ("removed", "right"), ("H raw", "right"), ("H", "right"),
                          ("the most probable", "left")):
        table.add_column(name, justify=justify)
    for i, s in enumerate(g.steps, 1):
        alts = Text(between).join(_tok(a.token, "bold" if a.id == s.id else "") + Text(f" {_pct(a.prob)}",
                                  "bold" if a.id == s.id else "") for a in s.alternatives)
        table.add_row(str(i), _tok(s.token), _pct(s.raw_prob), _pct(s.prob), f"{s.rank:,}",
                      _pct(s.removed_mass), f"{s.raw_entropy:.2f}", f"{s.entropy:.2f}", alts)
    return fit.drop_order(table, "H raw", "removed", "rank")  # on a narrow terminal these leave, in this order


def stages_per_step(g) -> None:
    """One row per step: what the grammar and the filters removed of the model's own (raw) probability,
    whether the grammar forced the token, and the chosen token's raw and processed probability."""
    grammar = g.settings.grammar
    out().print("stages: per step, the raw probability (the model's own) of the tokens the grammar forbade"
                + (f" ({grammar.describe()})" if grammar is not None else " (no grammar)")
                + " and of those the filters then dropped; forced: the grammar allowed one token (not drawn; "
                "the forward still ran); p: the chosen token's processed probability, renormalised over what "
                "was kept", soft_wrap=True)
    table = Table(show_edge=False)
    for name, justify in (("step", "right"), ("chosen", "left"), ("raw p", "right"), ("grammar removed", "right"),
                          ("forced", "left"), ("filters removed", "right"), ("p", "right")):
        table.add_column(name, justify=justify)
    for i, s in enumerate(g.steps, 1):
        by_grammar = s.grammar_removed
        table.add_row(str(i), _tok(s.token), _pct(s.raw_prob), "—" if by_grammar is None else _pct(by_grammar),
                      "forced" if s.forced else "", _pct(max(s.removed_mass - (by_grammar or 0.0), 0.0)), _pct(s.prob))
    out().print(table)
    if grammar is not None and g.steps:
        forced = sum(s.forced for s in g.steps)
        mean = sum(s.grammar_removed or 0.0 for s in g.steps) / len(g.steps)
        out().print(f"the grammar removed {_pct(mean)} of the raw probability per step on average; it forced "
                    f"{forced} of {len(g.steps)} tokens", soft_wrap=True)


def beams_table(g) -> None:
    """Beam search: every finished beam's score, its summed transition scores, and the check that
    they add up (the arithmetic transformers #15869 and #16413 asked for)."""
    from lmhead_cli.decoding.generate import LENGTH_PENALTY_RULE

    con = out()
    con.print(f"finished beams, best first; {LENGTH_PENALTY_RULE}. check: the beam's transition scores "
              f"(each token's processed log p) sum to its sum log p")
    t = Table(show_edge=False)
    for name, justify in (("beam", "right"), ("score", "right"), ("sum log p", "right"), ("tokens", "right"),
                          ("check", "left")):
        t.add_column(name, justify=justify)
    t.add_column("text", overflow="fold")  # beams often differ only at the end: show all of it
    for i, b in enumerate(g.beams, 1):
        check = f"adds up (± {b.sum_error:.0e})" if b.adds_up else f"[red]off by {b.sum_error:.1e}[/]"
        t.add_row(str(i), f"{b.score:.4f}", f"{b.logprob:.4f}", str(b.length), check, _tok(b.text))
    con.print(t)


def generation_json(result) -> dict:
    """The documented `--json` document, from an api.results.GenerateResult: enough to replay the run."""
    g, src = result.reading, result.source
    s = g.settings
    return {
        **provenance_json(src, "engine", "device", "dtype"),
        "mode": g.mode,
        "preset": result.preset,
        "settings": {**asdict(s.knobs), "greedy": s.greedy, "beams": s.beams, "max_new_tokens": s.max_new_tokens,
                     "ignore_eos": s.ignore_eos, "stop": list(s.stop),
                     "greedy_because": "temperature 0" if s.zero_temperature else None,
                     "grammar": None if s.grammar is None else s.grammar.to_dict()},
        "seed": g.seed,
        "prompt": result.prompt,
        "prompt_ids": g.prompt_ids,
        "generated_ids": g.generated_ids,
        "text": g.text,
        "stop": g.stop,
        "grammar_complete": None if s.grammar is None else g.stop == "eos",
        "tokens_generated": len(g.generated_ids),
        "elapsed_s": g.elapsed_s,
        "first_token_s": g.first_token_s,
        "tokens_per_second": g.tokens_per_second,
        "decode_tokens_per_second": g.decode_tokens_per_second,
        "products": src.products,
        "mean_entropy": g.mean_entropy,
        "beam_score": g.beam_score,
        "length_penalty": _length_penalty() if g.mode == "beam" else None,
        "beams": [_beam_json(b) for b in g.beams],
        "steps": [_step_json(st, s.show_steps) for st in g.steps],
    }


def _length_penalty() -> dict:
    from lmhead_cli.decoding.generate import LENGTH_PENALTY, LENGTH_PENALTY_RULE

    return {"value": LENGTH_PENALTY, "rule": LENGTH_PENALTY_RULE}


def _beam_json(b) -> dict:
    return {"ids": b.ids, "text": b.text, "stop": b.stop, "length": b.length, "score": b.score,
            "logprob": b.logprob, "transition_scores": b.transition_scores, "sum_error": b.sum_error,
            "adds_up": b.adds_up}


def _step_json(step, show_steps: int) -> dict:
    doc = {"id": step.id, "token": step.token, "prob": step.prob, "logprob": step.logprob, "logit": step.logit,
           "entropy": step.entropy, "rank": step.rank, "raw_logprob": step.raw_logprob,
           "raw_entropy": step.raw_entropy, "removed_mass": step.removed_mass}
    if step.grammar_removed is not None:
        doc.update(grammar_removed=step.grammar_removed, forced=step.forced)
    if show_steps:
        doc["alternatives"] = [asdict(a) for a in step.alternatives]
    return doc


# ---- --format openai -----------------------------------------------------------------------------

FINISH = {"eos": "stop", "stop": "stop", "max_new_tokens": "length", "context": "length"}


def openai_json(result) -> None:
    """The run as one OpenAI chat completion object (render.openai), a token at a time.

    logprobs.content has one entry per token of the content: a final end-of-text is counted in
    usage.completion_tokens but is not content, so it has no entry. Each logprob is from the
    distribution Settings.logprobs names (raw or processed)."""
    from lmhead_cli.render.openai import Completion

    g = result.reading
    raw = g.settings.logprobs == "raw"
    doc = Completion(result, result.source.model, g.text, FINISH[g.stop])
    for st in g.steps[:-1] if g.stop == "eos" else g.steps:
        top = st.top
        doc.entry(st.id, st.raw_logprob if raw else st.logprob, *((top.ids.tolist(), top.logprobs.tolist()) if top
                                                                   else ()))
    doc.end(len(g.prompt_ids), len(g.generated_ids))


# ---- inspect --stages ------------------------------------------------------------------------

def stage_report(table, own_softcap: float | None = None) -> None:
    """The top tokens followed through every stage: value and rank at each, then the probability.
    `own_softcap`: the c a model applies to its own logits (Gemma-2), already in the raw column."""
    con = out()
    if own_softcap:
        con.print(f"raw: the model's logits, already soft-capped by the model itself at c = {own_softcap:g}")
    on = knobs_text(table.knobs) or "none (T = 1)"
    con.print(f"through the stages: {on} → softmax")
    t = Table(show_edge=False)
    t.add_column("token")
    for col in table.columns:
        t.add_column(col, justify="right")
    t.add_column("prob", justify="right")
    for r in table.rows:
        cells = [f"{c.value:.3f} [dim]#{c.rank}[/]" if c.value is not None else "[dim]dropped[/]" for c in r.cells]
        t.add_row(_tok(r.token), *cells, _pct(r.prob))
    con.print(t)
    con.print(f"{table.kept:,} of {table.vocab:,} tokens survive the filters; entropy at the end "
              f"{table.entropy:.4f} nats; #n is the rank at that stage")


def stages_json(table, own_softcap: float | None = None) -> dict:
    return {
        "own_softcap": own_softcap,
        "knobs": asdict(table.knobs),
        "columns": table.columns,
        "kept": table.kept,
        "vocab": table.vocab,
        "entropy": table.entropy,
        "rows": [{"id": r.id, "token": r.token, "prob": r.prob, "logprob": r.logprob,
                  "stages": [asdict(c) for c in r.cells]} for r in table.rows],
    }
