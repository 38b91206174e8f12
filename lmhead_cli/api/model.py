"""`lmhead_cli.load()` and the Model it returns: the one door to every reading.

    >>> import lmhead_cli
    >>> m = lmhead_cli.load("random:gpt2")            # doctest: +SKIP
    >>> m.inspect("The keys on the table", top_k=3).to_dict()["top"][0]["token"]   # doctest: +SKIP

Each method checks its values (api/checks.py; lmhead_cli.errors on a bad one), runs one reading and
returns a result (api/results.py) whose to_dict() is the CLI's --json document for the same call.
torch is imported by load(), not by importing this module.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

from lmhead_cli.api import checks, results
from lmhead_cli.api.serving import Serving
from lmhead_cli.errors import BadValue, UnsupportedModel


def load(source: str = "gpt2", *, device: str = "auto", dtype: str = "float32", engine: str = "auto",
         threads: int | None = None, allow_pickle: bool = False, ignore_memory: bool = False,
         announce: Callable[[str], None] | None = None) -> Model:
    """Load `source` (a hub id, a local folder or random:NAME) and return a Model.

    device: auto, cpu, cuda or mps; dtype: float32, bfloat16, float16 or int8 (weights only, quantised at
    load; the lean engine's); engine: auto, lean or transformers; threads: torch's CPU threads (None: chosen by timing the work); allow_pickle: accept
    pytorch_model.bin checkpoints; ignore_memory: load even when the estimate exceeds what is free.
    `announce(line)` hears the loader's notices (a large model; default: one dim line on stderr).
    """
    from lmhead_cli.engine.threads import prepare

    threads = prepare(threads)  # OpenMP's wait policy is read when torch is imported: before that
    from lmhead_cli.loading.sources import load_model

    if announce is None:
        from lmhead_cli.render import notice as announce
    return Model(load_model(source, device=device, dtype=dtype, engine=engine, allow_pickle=allow_pickle,
                            threads=threads, ignore_memory=ignore_memory, announce=announce))


class Model(Serving):
    """A loaded model and its tokenizer. Methods: inspect, explain, score, compare, generate, diff, attribute,
    lens, tie, params (each returns a result with to_dict(), _repr_html_ and __rich__)."""

    def __init__(self, loaded):
        self.loaded = loaded  # loading.sources.Loaded: for the readings; front ends use the methods

    # ---- what the model is ------------------------------------------------------------------------
    @property
    def source(self) -> str:
        return self.loaded.source

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.loaded.engine.vocab_size

    @property
    def n_ctx(self) -> int:
        """The context length: the most tokens the model reads at once."""
        return self.loaded.engine.n_ctx

    @property
    def random_weights(self) -> bool:
        return self.loaded.random_weights

    @property
    def own_softcap(self) -> float | None:
        """The c a model soft-caps its own logits at (Gemma-2), or None."""
        return self.loaded.engine.own_stages.get("softcap")

    @property
    def provenance(self) -> results.Provenance:
        ld, eng = self.loaded, self.loaded.engine
        return results.Provenance(model=ld.source, random_weights=ld.random_weights, engine=eng.name,
                                  device=str(eng.device), dtype=eng.weight_format,
                                  kind=ld.kind, path=ld.path, seed=ld.seed)

    def __repr__(self) -> str:
        return f"<lmhead Model {self.source!r} engine={self.loaded.engine.name} n_ctx={self.n_ctx}>"

    # ---- one prompt -------------------------------------------------------------------------------
    def inspect(self, prompt: str, top_k: int = 10, targets: Iterable[str] = (), *,
                stages=None) -> results.InspectResult:
        """The next-token distribution after `prompt`: the top `top_k` tokens, each target's rank and
        probability, entropy. `stages` (decoding.stages.Knobs, from api.checks.stages) also follows the
        top tokens through the decoding stages (`inspect --stages`)."""
        from lmhead_cli.readings.inspect import inspect_prompt

        checks.one_prompt(prompt, targets, top_k)
        reading = inspect_prompt(self.loaded, prompt, top_k, list(targets))
        table = None
        if stages is not None:
            from lmhead_cli.decoding.stages import stage_table

            table = stage_table(reading.logits, stages, top_k, self.tokenizer.token_text)
        return results.InspectResult(reading, self.loaded.tie, table, self.own_softcap)

    def explain(self, prompt: str, token: str, top_k: int = 10, targets: Iterable[str] = ()) -> results.ExplainResult:
        """One token's logit taken apart: z = e·h = |e|·|h|·cos θ (`inspect --explain`)."""
        from lmhead_cli.readings.explain import explain_logit

        checks.one_prompt(prompt, targets, top_k)
        return results.ExplainResult(explain_logit(self.loaded, prompt, token, top_k, list(targets)))

    def diff(self, a: str, b: str, top_k: int = 10, targets: Iterable[str] = (), movers: int = 5) -> results.DiffResult:
        """Two prompts' next-token distributions side by side: KL, JS, total variation, movers."""
        from lmhead_cli.readings.diff import diff_prompts

        checks.one_prompt(a, targets, top_k)
        checks.one_prompt(b, targets, top_k)
        if movers < 0:
            raise BadValue("movers", f"must be at least 0 (got {movers})")
        return results.DiffResult(diff_prompts(self.loaded, a, b, top_k, list(targets), movers))

    def attribute(self, prompt: str, target: str, vs: str | None = None, heads: bool = False) -> results.AttributeResult:
        """Direct logit attribution of `target`'s logit (or z(target) - z(vs)) over the model's parts.
        Every head's share is always computed; `heads` is what a table shows and is kept for the caller."""
        from lmhead_cli.readings.attribute import attribute_logit

        checks.attribution(prompt, target, vs)
        return results.AttributeResult(attribute_logit(self.loaded, prompt, target, vs))

    def lens(self, prompt: str, position: int | None = -1, targets: Iterable[str] = (), top_k: int = 8) -> results.LensResult:
        """Logit lens: what the head predicts from the residual stream after each block, at `position`
        (-1 or None: the last token)."""
        from lmhead_cli.readings.lens import lens_prompt

        checks.one_prompt(prompt, targets, top_k)
        return results.LensResult(lens_prompt(self.loaded, prompt, list(targets), top_k, position))

    # ---- explore's session: one prompt at a time, with the session's settings -------------------------
    def explore_reading(self, prompt: str, settings):
        """The top-k table (and targets) after the stages `settings` (readings.explore.Settings) turn on:
        a readings.explore.Reading."""
        from lmhead_cli.readings.explore import read

        return read(self.loaded, prompt, settings)

    def explore_generate(self, prompt: str, n: int, settings, on_text: Callable[[str], None]):
        """`n` tokens after `prompt`, sampled with the session's stages and seed (decoding.generate.Generation)."""
        from lmhead_cli.readings.explore import generate_after

        return generate_after(self.loaded, prompt, n, settings, on_text)

    def warm_up(self) -> int:
        """A few forwards, so the first prompt is answered as fast as the rest; torch's thread count kept."""
        from lmhead_cli.readings.explore import warm_up

        return warm_up(self.loaded)

    # ---- the model itself -------------------------------------------------------------------------
    def tie(self) -> results.TieResult:
        """Is the head the very same tensor as the embedding table?"""
        return results.TieResult(self.loaded.tie, self.provenance)

    def params(self, batch: int = 1, seq: int | None = None, vocab: int | None = None) -> results.ParamsResult:
        """The parameter account of this model's tensors (GPT-2 family), the head's cost and the logits'
        memory for batch × seq × vocab (seq: n_positions, vocab: the model's, by default)."""
        from lmhead_cli.readings import params as count

        if self.loaded.engine.name != "lean":
            gpt2_only(self.source, self.loaded.config.get("model_type"))
        acc = count.account_from_tensors(self.loaded.module.named_parameters(remove_duplicate=False))
        return params_result(self.source, "tensors", acc, batch, seq, vocab)

    # ---- text ------------------------------------------------------------------------------------
    def score(self, text: str, *, stride: int | None = None, bos: bool = False, chunk: int | None = None,
              top_logprobs: int = 0, progress: Callable[[int, int], None] | None = None,
              on_rows=None, alternatives: int = 0) -> results.ScoreResult:
        """Every token of `text`: log-probability, rank, entropy; perplexity and bits per byte.
        Texts longer than the context go in windows of n_ctx tokens that begin every `stride` tokens.
        `progress(done, total)` and `on_rows(ids, logprobs, top_ids, top_logprobs)` hear each chunk.
        `alternatives` = K (at most 20) keeps the model's K most probable tokens at every position,
        which the HTML view (`to_html()`) shows in each token's tooltip."""
        from lmhead_cli.readings.score import score_text

        self.check_score(text, stride=stride, chunk=chunk, top_logprobs=top_logprobs, alternatives=alternatives)
        return results.ScoreResult(score_text(self.loaded, text, bos=bos, stride=stride, chunk=chunk,
                                              progress=progress, top_logprobs=top_logprobs, on_rows=on_rows,
                                              alternatives=alternatives))

    def check_score(self, text: str | None = None, *, stride: int | None = None, chunk: int | None = None,
                    top_logprobs: int = 0, alternatives: int = 0) -> None:
        """score's values, without scoring (a front end calls it before it writes anything)."""
        from lmhead_cli.readings.score import check_alternatives

        checks.settings({"top_logprobs": top_logprobs})
        check_alternatives(alternatives)
        if text is not None:
            checks.text(text)
        checks.chunk(chunk)
        checks.stride(stride, self.n_ctx)

    def compare(self, text: str, base=None, *, base_dtype: str = "float32", bos: bool = False,
                stride: int | None = None, chunk: int | None = None,
                progress: Callable[[int, int], None] | None = None):
        """This model (Q) against `base` over every token of `text`: llama-perplexity --kl-divergence's
        statistics (api/compare.py). `base`: a Model, a source, or None / "same" for this model's own
        source, loaded in `base_dtype`."""
        from lmhead_cli.api.compare import compare

        return compare(self, text, base, base_dtype=base_dtype, bos=bos, stride=stride, chunk=chunk,
                       progress=progress)

    def score_lines(self, lines: Iterable, *, bos: bool = False, stride: int | None = None,
                    chunk: int | None = None) -> results.LineResults:
        """score_text over many texts, lazily, one at a time: `lines` are texts (numbered from 1) or
        the lines of a file (readings.score.read_lines). Yields a readings.score.FileItem per line
        (empty and one-token lines skipped and counted); `totals` (readings.score.Corpus) counts what
        has been yielded. api.files.score_file runs a whole file with it."""
        from lmhead_cli.readings.score import Corpus, Line, score_lines

        self.check_score(stride=stride, chunk=chunk)
        numbered = (line if isinstance(line, Line) else Line(n, line if line.strip() else None)
                    for n, line in enumerate(lines, 1))
        totals = Corpus()
        return results.LineResults(score_lines(self.loaded, numbered, totals, bos=bos, stride=stride, chunk=chunk),
                                   totals)

    def inspect_lines(self, lines: Iterable, top_k: int = 10, targets: Iterable[str] = (),
                      batch_size: int = 32) -> results.LineResults:
        """inspect over many prompts, `batch_size` a forward pass: `lines` are prompts (numbered from 1)
        or a file's readings.batch.PromptLine. Yields each batch's [(line, InspectResult)]; `totals`
        (readings.batch.BatchStats) counts what has been yielded."""
        from lmhead_cli.readings.batch import BatchStats, PromptLine, inspect_stream

        targets = checks.prompt_file(top_k, batch_size, targets)
        numbered = (line if isinstance(line, PromptLine) else PromptLine(n, line) for n, line in enumerate(lines, 1))
        tie, stats = self.loaded.tie, BatchStats(batch_size, targets)
        return results.LineResults(([(line, results.InspectResult(r, tie)) for line, r in batch]
                                    for batch in inspect_stream(self.loaded, numbered, top_k, targets, batch_size,
                                                                stats)), stats)

    def generate(self, prompt: str, *, max_new_tokens: int | None = None, beams: int = 1, seed: int | None = None,
                 greedy: bool = False, ignore_eos: bool = False, stop=(), show_steps: int = 0, top_logprobs: int = 0,
                 logprobs: str = "raw", preset: str | None = None, mode: str = "generate",
                 on_start: Callable[[list[int], int, object], None] | None = None,
                 on_text: Callable[[str], None] | None = None, **stages) -> results.GenerateResult:
        """Continue `prompt` token by token through the stages (softcap -> temperature -> top-k -> top-p
        -> min-p -> softmax -> choose; `stages` takes each stage of the registry by its key, e.g.
        temperature=0.8, top_p=0.95). Samples (seeded by `seed`, or a drawn seed that is reported) unless
        greedy, temperature=0 or beams > 1. None = not given (a preset's value, or the stage off). `stop`:
        strings that end the text (not included). `mode`: generate, greedy, sample or softcap, as the CLI's
        commands. `on_start(prompt_ids, tokens_dropped, settings)` runs before the first token (the
        prompt's ids as read: its last n_ctx); `on_text(piece)` sees the text as made."""
        from lmhead_cli.decoding.generate import generate
        from lmhead_cli.readings.inspect import check_prompt, encode_prompt

        settings = checks.generation(mode=mode, preset=preset, greedy=greedy, beams=beams, ignore_eos=ignore_eos,
                                     seed=seed, stop=stop, show_steps=show_steps, max_new_tokens=max_new_tokens,
                                     top_logprobs=top_logprobs, logprobs=logprobs, **stages)
        text = check_prompt(prompt)
        ids, dropped = encode_prompt(self.loaded, text)
        checks.generation_fits(self.loaded, len(ids), settings)  # before on_start prints anything
        if on_start is not None:
            on_start(ids, dropped, settings)
        g = generate(self.loaded, ids, settings, on_text=on_text)
        tok = self.tokenizer
        return results.GenerateResult(g, self.provenance, text, preset, tok.token_text, tok.token_bytes)


def params_result(model: str, counted_from: str, acc, batch: int = 1, seq: int | None = None,
                  vocab: int | None = None) -> results.ParamsResult:
    """A ParamsResult from an account (readings.params): the head's cost and the logits' memory."""
    from lmhead_cli.readings import params as count

    for key, value in (("batch", batch), ("seq", seq), ("vocab", vocab)):
        if value is not None:
            checks.at_least_one(key, value)
    return results.ParamsResult(model, counted_from, acc, count.head_cost(acc.n_embd, acc.vocab_size),
                                count.logits_memory(batch, seq or acc.n_positions, vocab or acc.vocab_size))


def gpt2_only(source: str, kind: str | None) -> None:
    """UnsupportedModel unless `kind` (a config's model_type) is GPT-2's: params counts its tensors by name."""
    if kind != "gpt2":
        raise UnsupportedModel(f"params counts GPT-2-family tensors (wte, wpe, h.N, ln_f); {source} is a "
                               f"{kind!r} model")


def model_params(source: str, batch: int = 1, seq: int | None = None, vocab: int | None = None, *,
                 allow_pickle: bool = False) -> results.ParamsResult:
    """`lmhead params --model SOURCE`: a GPT-2-family model's real tensors counted (loaded on the CPU by
    the lean engine); another architecture is refused from its config, before any weight is read."""
    from lmhead_cli.loading.sources import model_type

    gpt2_only(source, model_type(source, allow_pickle))
    return load(source, device="cpu", engine="lean", allow_pickle=allow_pickle).params(batch, seq, vocab)


def toy(hidden: str | Iterable[float] | None = None, temperature: float = 1.0, seed: int = 0, draws: int = 20):
    """`lmhead toy`: the whole last step on a four-word table (readings.toy.ToyExample); `hidden` is
    3 numbers, or their text "0.5,1,2" (default 1,0,1). Arithmetic only: no torch."""
    from lmhead_cli.readings import toy as reading

    if hidden is None:
        h = reading.HIDDEN
    elif isinstance(hidden, str):
        h = reading.parse_hidden(hidden)
    else:
        h = reading.parse_hidden(",".join(str(float(v)) for v in hidden))
    reading.check_temperature(temperature)
    reading.check_draws(draws)
    return reading.toy_example(h, temperature, seed, draws)


def params(config: str = "gpt2", batch: int = 1, seq: int | None = None, vocab: int | None = None) -> results.ParamsResult:
    """`lmhead params --config NAME`: a bundled config counted by arithmetic; no torch, no weights."""
    from lmhead_cli.loading.model_configs import load_config
    from lmhead_cli.readings import params as count

    return params_result(config, "config", count.account_from_config(load_config(config)), batch, seq, vocab)
