"""`lmhead_cli.load()` and the Model it returns: the one door to every reading.

    >>> import lmhead_cli
    >>> m = lmhead_cli.load("random:gpt2")            # doctest: +SKIP
    >>> m.inspect("The keys on the table", top_k=3).to_dict()["top"][0]["token"]   # doctest: +SKIP

Each method checks its values (api/checks.py; lmhead_cli.errors on a bad one), runs one reading and
returns a result (api/results.py) whose to_dict() is the CLI's --json document for the same call.
torch is imported by load(), not by importing this module.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable

from lmhead_cli.api import checks, results
from lmhead_cli.api.arithmetic import COUNTS, gpt2_only, params_result
from lmhead_cli.api.checks import kinds
from lmhead_cli.api.serving import Serving
from lmhead_cli.errors import BadType, BadValue, Param, UnsupportedModel

# The kinds (api.checks.typed) of parameters that several methods share. The decoding settings of the
# registry (max_new_tokens, beams, n, seed, show_steps, top_logprobs and each stage) are not here: the
# registry's one check (decoding.stages.checked) takes them, through decoding/settings.py or checks.settings.
ONE_PROMPT = {"prompt": str, "top_k": int, "targets": list}
WINDOWS = {"stride": int, "chunk": int}  # score's and compare's
SCORING = {"text": str, **WINDOWS, "alternatives": int}
DECODING = {"greedy": bool, "ignore_eos": bool, "preset": str,  # logprobs: decoding.settings.make's check
            "mode": tuple(checks.MODES), "on_start": callable, "on_text": callable}

@kinds(source=str, device=str, dtype=str, engine=str, threads=int, allow_pickle=bool, ignore_memory=bool,
       announce=callable)
def load(source: str | None = None, *, device: str = "auto", dtype: str = "float32", engine: str = "auto",
         threads: int | None = None, allow_pickle: bool = False, ignore_memory: bool = False,
         announce: Callable[[str], None] | None = None) -> Model:
    """Load `source` (a hub id, a local folder, a GGUF file, random:NAME or bundled:NAME) and return a Model.

    source None: gpt2, or bundled:tiny (saying why, through `announce`) when gpt2 is not in the Hugging
    Face cache and the hub is offline or cannot be reached. A source named, "gpt2" included, never
    falls back: offline it fails with ModelNotFound.
    device: auto, cpu, cuda or mps; dtype: float32, bfloat16, float16 or int8 (weights only, quantised at
    load; the lean engine's); engine: auto, lean or transformers; threads: torch's CPU threads (None: chosen by timing the work); allow_pickle: accept
    pytorch_model.bin checkpoints; ignore_memory: load even when the estimate exceeds what is free.
    `announce(line)` hears the loader's notices (a large model; default: one dim line on stderr).

    Neither load() nor any Model method changes the calling process: torch's thread count is the
    model's during a call and the caller's after it; os.environ and the allocator are left alone
    (engine/execution.py). Only the command line, which owns its process, tunes it (`own_process`).
    """
    from lmhead_cli.inputs import check_working_directory

    check_working_directory()  # torch's import dies in a deleted working directory: say so before it
    from lmhead_cli.loading.sources import load_model  # noqa: E402 - after the check: it imports torch

    if announce is None:
        from lmhead_cli.render import notice as announce
    return Model(load_model(source, device=device, dtype=dtype, engine=engine, allow_pickle=allow_pickle,
                            threads=threads, ignore_memory=ignore_memory, announce=announce))


def scoped(method):
    """A Model method run inside the model's execution scope (engine/execution.py): torch's thread
    count is the model's during the call and the caller's again after it."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self.loaded.execution.scope():
            return method(self, *args, **kwargs)

    return call


class Model(Serving):
    """A loaded model and its tokenizer. Methods: inspect, explain, score, calibrate, compare, generate, diff,
    attribute, lens, tie, params (each returns a result with to_dict(), _repr_html_ and __rich__)."""

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
                                  kind=ld.kind, path=ld.path, seed=ld.seed, products=ld.execution.products)

    def __repr__(self) -> str:
        return f"<lmhead Model {self.source!r} engine={self.loaded.engine.name} n_ctx={self.n_ctx}>"

    # ---- one prompt -------------------------------------------------------------------------------
    @scoped
    @kinds(**ONE_PROMPT)
    def inspect(self, prompt: str, top_k: int = 10, targets: Iterable[str] = (), *,
                stages=None) -> results.InspectResult:
        """The next-token distribution after `prompt`: the top `top_k` tokens, each target's rank and
        probability, entropy. `stages` (decoding.stages.Knobs, from api.checks.stages) also follows the
        top tokens through the decoding stages (`inspect --stages`)."""
        from lmhead_cli.readings.inspect import inspect_prompt

        checks.one_prompt(prompt, targets, top_k)
        stages = checks.stage_knobs(stages)
        reading = inspect_prompt(self.loaded, prompt, top_k, list(targets))
        table = None
        if stages is not None:
            from lmhead_cli.decoding.stages import stage_table

            table = stage_table(reading.logits, stages, top_k, self.tokenizer.token_text)
        return results.InspectResult(reading, self.loaded.tie, table, self.own_softcap)

    @scoped
    @kinds(**ONE_PROMPT, token=str)
    def explain(self, prompt: str, token: str, top_k: int = 10, targets: Iterable[str] = ()) -> results.ExplainResult:
        """One token's logit taken apart: z = e·h = |e|·|h|·cos θ (`inspect --explain`)."""
        from lmhead_cli.readings.explain import explain_logit

        checks.one_prompt(prompt, targets, top_k)
        return results.ExplainResult(explain_logit(self.loaded, prompt, token, top_k, list(targets)))

    @scoped
    @kinds(a=str, b=str, top_k=int, targets=list, movers=int)
    def diff(self, a: str, b: str, top_k: int = 10, targets: Iterable[str] = (), movers: int = 5) -> results.DiffResult:
        """Two prompts' next-token distributions side by side: KL, JS, total variation, movers."""
        from lmhead_cli.readings.diff import diff_prompts

        checks.one_prompt(a, targets, top_k)
        checks.one_prompt(b, targets, top_k)
        if movers < 0:
            raise BadValue("movers", f"must be at least 0 (got {movers})")
        return results.DiffResult(diff_prompts(self.loaded, a, b, top_k, list(targets), movers))

    @scoped
    @kinds(prompt=str, target=str, vs=str, heads=bool)
    def attribute(self, prompt: str, target: str, vs: str | None = None, heads: bool = False) -> results.AttributeResult:
        """Direct logit attribution of `target`'s logit (or z(target) - z(vs)) over the model's parts.
        Every head's share is always computed; `heads` is what a table shows and is kept for the caller."""
        from lmhead_cli.readings.attribute import attribute_logit

        checks.attribution(prompt, target, vs)
        return results.AttributeResult(attribute_logit(self.loaded, prompt, target, vs))

    @scoped
    @kinds(**ONE_PROMPT, position=int | None, grid=bool)
    def lens(self, prompt: str, position: int | None = -1, targets: Iterable[str] = (), top_k: int = 8, *,
             tuned=None, grid: bool = True) -> results.LensResult:
        """Logit lens: what the head predicts from the residual stream after each block, at `position`
        (-1 or None: the last token). `tuned`: a tuned-lens file (a path, or "bundled" for bundled:tiny's)
        or a TunedLens (`tune_lens().lens`), read beside the logit lens; each layer's `kl_to_final` then
        has both lenses' KL to the final distribution. `grid`: also the position map (each layer's top
        token at up to 32 positions ending at `position`: the head on each of them, its main cost);
        False leaves it out (`grid` null in the document)."""
        from lmhead_cli.readings.lens import lens_prompt

        checks.one_prompt(prompt, targets, top_k)
        lens = self._tuned_lens(tuned, "tuned") if tuned is not None else None
        return results.LensResult(lens_prompt(self.loaded, prompt, list(targets), top_k, position, lens, grid))

    def tuned_lens(self, where):
        """A tuned lens for this model: `where` is a path, "bundled", or a TunedLens (checked against
        this model either way). WrongLens if it was trained for another model; CorruptCheckpoint if the
        file is damaged; BadType for anything else (a number, bytes, a list)."""
        return self._tuned_lens(where, "where")

    def _tuned_lens(self, where, key: str):
        from lmhead_cli.readings import tuned_lens

        if isinstance(where, tuned_lens.TunedLens):
            return tuned_lens.check_lens(self.loaded, where)
        return tuned_lens.load_lens(self.loaded, checks.lens_file(key, where))

    @scoped
    @kinds(text=str, file=str, out=str, steps=int, batch=int, seq=int, lr=float, warmup=int, seed=int,
           progress=callable)
    def tune_lens(self, text: str | None = None, *, file: str | None = None, out: str | None = None,
                  steps: int = 300, batch: int = 4, seq: int | None = None, lr: float = 1e-3, warmup: int = 20,
                  seed: int = 0, progress: Callable[[int, int, float], None] | None = None) -> results.TuneResult:
        """Train a tuned lens for this model on `text` or the file `file` (read a window at a time):
        `steps` steps of `batch` windows of `seq` tokens (default min(n_ctx, 128)), Adam at `lr` with
        `warmup` steps of warm-up and a linear decay. Writes it to `out` (safetensors) when given.
        `progress(step, steps, mean_kl)` hears each step."""
        from lmhead_cli.readings.tune_lens import TextSource, TuneSettings, tune_lens
        from lmhead_cli.readings.tuned_lens import save_lens

        settings = TuneSettings(steps=steps, batch=batch, seq=seq, lr=lr, warmup=warmup, seed=seed)
        settings.check()
        if text is not None:
            checks.text(text)
        if out is not None:  # before the training, not after it
            from lmhead_cli.outputs import check_target

            check_target(out, Param("out"))
        tuning = tune_lens(self.loaded, TextSource(text, file), settings, progress)
        if out is not None:
            save_lens(tuning.lens, out)
            tuning.lens.name = str(out)
        return results.TuneResult(tuning, self.provenance, out)

    @scoped
    @kinds(prompt=str, layer=int, token=str, target=str, top=int)
    def neurons(self, prompt: str | None = None, *, layer: int | None = None, token: str | None = None,
                target: str | None = None, top: int | None = None,
                neurons: Iterable[int] = ()) -> results.NeuronsResult:
        """What MLP neurons write into the vocabulary (e_k · (γ ⊙ centre(v)), v a value vector):
        - `layer` alone: each neuron of that layer (or of `neurons`, indices) with the `top` (5) tokens it
          promotes and suppresses most;
        - `token`: the `top` (10) neurons of the model (or of `layer`) that write that token most;
        - `prompt` and `target`: attribute at neuron grain, the `top` (10) neurons' shares of the target's
          logit at the last position, with the check that they add up to attribute's MLP parts."""
        from lmhead_cli.readings import neurons as reading

        neurons = checks.indices("neurons", neurons)
        checks.neurons(prompt, layer, token, target, top)
        if prompt is not None:
            result = reading.neuron_shares(self.loaded, prompt, target, top or 10, layer)
        elif token is not None:
            result = reading.token_writers(self.loaded, token, top or 10, layer)
        else:
            result = reading.layer_neurons(self.loaded, layer, top or 5, list(neurons))
        return results.NeuronsResult(result)

    # ---- explore's session: one prompt at a time, with the session's settings -------------------------
    @scoped
    @kinds(prompt=str)
    def explore_reading(self, prompt: str, settings):
        """The top-k table (and targets) after the stages `settings` (readings.explore.State) turn on:
        a readings.explore.Reading."""
        from lmhead_cli.readings.explore import read

        return read(self.loaded, prompt, checks.explore_settings(settings))

    @scoped
    @kinds(prompt=str, n=int, on_text=callable)
    def explore_generate(self, prompt: str, n: int, settings, on_text: Callable[[str], None]):
        """`n` tokens after `prompt`, sampled with the session's stages and seed (decoding.generate.Generation)."""
        from lmhead_cli.readings.explore import generate_after

        return generate_after(self.loaded, prompt, n, checks.explore_settings(settings), on_text)

    @scoped
    def warm_up(self) -> int:
        """A few forwards, so the first prompt is answered as fast as the rest; torch's thread count kept."""
        from lmhead_cli.readings.explore import warm_up

        return warm_up(self.loaded)

    # ---- the model itself -------------------------------------------------------------------------
    def tie(self) -> results.TieResult:
        """Is the head the very same tensor as the embedding table?"""
        return results.TieResult(self.loaded.tie, self.provenance)

    @kinds(**COUNTS)
    def params(self, batch: int = 1, seq: int | None = None, vocab: int | None = None) -> results.ParamsResult:
        """The parameter account of this model's tensors (GPT-2 family), the head's cost and the logits'
        memory for batch × seq × vocab (seq: n_positions, vocab: the model's, by default)."""
        from lmhead_cli.readings import params as count

        gpt2_only(self.source, self.loaded.config.get("model_type"))  # the lean engine runs Llama too
        acc = count.account_from_tensors(self.loaded.module.named_parameters(remove_duplicate=False))
        return params_result(self.source, "tensors", acc, batch, seq, vocab)

    # ---- text ------------------------------------------------------------------------------------
    @scoped
    @kinds(**SCORING, bos=bool, progress=callable, on_rows=callable)
    def score(self, text: str, *, stride: int | None = None, bos: bool | None = None, chunk: int | None = None,
              top_logprobs: int = 0, progress: Callable[[int, int], None] | None = None,
              on_rows=None, alternatives: int = 0) -> results.ScoreResult:
        """Every token of `text`: log-probability, rank, entropy; perplexity and bits per byte.
        Texts longer than the context go in windows of n_ctx tokens that begin every `stride` tokens.
        `progress(done, total)` and `on_rows(ids, logprobs, top_ids, top_logprobs)` hear each chunk.
        `alternatives` = K (at most 20) keeps the model's K most probable tokens at every position,
        which the HTML view (`to_html()`) shows in each token's tooltip."""
        from lmhead_cli.readings.score import score_text

        self.check_score(text, stride=stride, chunk=chunk, top_logprobs=top_logprobs, alternatives=alternatives)
        top_logprobs = top_logprobs or 0  # None: not given
        return results.ScoreResult(score_text(self.loaded, text, bos=self.wants_bos(bos), stride=stride, chunk=chunk,
                                              progress=progress, top_logprobs=top_logprobs, on_rows=on_rows,
                                              alternatives=alternatives))

    @kinds(**SCORING)
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

    @scoped
    @kinds(text=str, **WINDOWS, bos=bool, progress=callable, generations=int, preset=str, greedy=bool)
    def calibrate(self, text: str, *, stride: int | None = None, bos: bool | None = None, chunk: int | None = None,
                  progress: Callable[[int, int], None] | None = None, generations: int = 0,
                  max_new_tokens: int = 64, seed: int | None = None, preset: str | None = None,
                  greedy: bool = False, **knobs) -> results.CalibrateResult:
        """Is the model's top-1 probability honest on `text`? Over score's positions (the same windows,
        `bos` and `stride`): 15 equal-width bins of top-1 probability with each bin's accuracy, ECE, the
        Brier score of the top-1 event, NLL, and the temperature that minimises the NLL, with the NLL and
        ECE there. `generations` = N also samples N continuations of `max_new_tokens` tokens after the
        beginning-of-text token (seeds seed, seed + 1, …; decoding stages as `generate` takes them:
        temperature, top_k, top_p, min_p, softcap, preset, greedy) and reports their entropy rate, the
        mean -log p of the sampled tokens, against the NLL on the text (Braverman et al. 2020)."""
        from lmhead_cli.api.calibrate import calibrate

        return calibrate(self, text, stride=stride, bos=self.wants_bos(bos), chunk=chunk, progress=progress,
                         generations=generations, max_new_tokens=max_new_tokens, seed=seed, preset=preset,
                         greedy=greedy, **knobs)

    @scoped
    @kinds(text=str, **WINDOWS, base_dtype=str, llama_chunks=int, bos=bool, progress=callable)
    def compare(self, text: str, base=None, *, base_dtype: str = "float32", bos: bool | None = None,
                stride: int | None = None, chunk: int | None = None, llama_chunks: int | None = None,
                progress: Callable[[int, int], None] | None = None):
        """This model (Q) against `base` over every token of `text`: llama-perplexity --kl-divergence's
        statistics (api/compare.py). `base`: a Model, a source, or None / "same" for this model's own
        source, loaded in `base_dtype`. `llama_chunks` = n: llama-perplexity's positions (chunks of n
        tokens, the second half of each scored)."""
        from lmhead_cli.api.compare import compare

        checks.text(text)
        checks.chunk(chunk)
        return compare(self, self._base(base, base_dtype), text, bos=self.wants_bos(bos), stride=stride, chunk=chunk,
                       llama_chunks=llama_chunks, progress=progress)

    def _base(self, base, base_dtype: str) -> Model:
        """compare's base as a Model: `base` itself if it is one; else `base` (a source; None or "same":
        this model's own) loaded in `base_dtype` on this model's device; this model itself when that is
        what it already is (same source and dtype): a model against itself, loaded once."""
        from lmhead_cli.api.compare import SAME, check_base
        from lmhead_cli.readings.compare import dtype_name

        if isinstance(base, Model):
            return base
        if base is not None and not isinstance(base, str):
            raise BadType("base", f"must be a model source, {SAME!r} or a loaded Model (got {type(base).__name__})")
        check_base(base, base_dtype)
        source = self.source if base in (None, SAME) else base
        own = self.provenance
        if source == self.source and base_dtype == dtype_name(self.loaded):
            return self
        return load(source, device=own.device.split(":")[0], dtype=base_dtype,
                    engine=own.engine if source == self.source else "auto")

    @kinds(**WINDOWS, bos=bool)
    def score_lines(self, lines: Iterable, *, bos: bool | None = None, stride: int | None = None,
                    chunk: int | None = None) -> results.LineResults:
        """score_text over many texts, lazily, one at a time: `lines` are texts (numbered from 1) or
        the lines of a file (readings.score.read_lines). Yields a readings.score.FileItem per line
        (empty and one-token lines skipped and counted); `totals` (readings.score.Corpus) counts what
        has been yielded. api.files.score_file runs a whole file with it."""
        from lmhead_cli.readings.score import Corpus, Line, score_lines

        lines = many("lines", lines)
        self.check_score(stride=stride, chunk=chunk)
        numbered = (line if isinstance(line, Line) else Line(n, checks.text_item("lines", line, n).strip() and line or None)
                    for n, line in enumerate(lines, 1))
        totals = Corpus()
        lines = score_lines(self.loaded, numbered, totals, bos=self.wants_bos(bos), stride=stride, chunk=chunk)
        return results.LineResults(self.loaded.execution.iterate(lines), totals)

    @kinds(top_k=int, targets=list, batch_size=int)
    def inspect_lines(self, lines: Iterable, top_k: int = 10, targets: Iterable[str] = (),
                      batch_size: int = 32) -> results.LineResults:
        """inspect over many prompts, `batch_size` a forward pass: `lines` are prompts (numbered from 1)
        or a file's readings.batch.PromptLine. Yields each batch's [(line, InspectResult)]; `totals`
        (readings.batch.BatchStats) counts what has been yielded."""
        from lmhead_cli.readings.batch import BatchStats, PromptLine, inspect_stream

        lines = many("lines", lines)
        targets = checks.prompt_file(top_k, batch_size, targets)
        numbered = (line if isinstance(line, PromptLine) else PromptLine(n, checks.text_item("lines", line, n))
                    for n, line in enumerate(lines, 1))
        tie, stats = self.loaded.tie, BatchStats(batch_size, targets)
        batches = inspect_stream(self.loaded, numbered, top_k, targets, batch_size, stats)
        return results.LineResults(self.loaded.execution.iterate(
            [(line, results.InspectResult(r, tie)) for line, r in batch] for batch in batches), stats)

    @scoped
    @kinds(**DECODING)
    def generate(self, prompt: str | Iterable[str], *, n: int = 1, max_new_tokens: int | None = None, beams: int = 1,
                 seed: int | None = None, greedy: bool = False, ignore_eos: bool = False, stop=(), show_steps: int = 0,
                 top_logprobs: int = 0, logprobs: str = "raw", preset: str | None = None, mode: str = "generate",
                 json_schema: dict | str | None = None, regex: str | None = None,
                 on_start: Callable[[list[int], int, object], None] | None = None,
                 on_text: Callable[[str], None] | None = None, settings=None,
                 **stages) -> results.GenerateResult | list[results.GenerateResult]:
        """Continue `prompt` token by token through the stages (softcap -> temperature -> top-k -> top-p
        -> min-p -> softmax -> choose; `stages` takes each stage of the registry by its key, e.g.
        temperature=0.8, top_p=0.95). Samples (seeded by `seed`, or a drawn seed that is reported) unless
        greedy, temperature=0 or beams > 1. None = not given (a preset's value, or the stage off). `stop`:
        strings that end the text (not included). `mode`: generate, greedy, sample or softcap, as the CLI's
        commands. `json_schema` (a dict, or its JSON text) or `regex`: the text must follow it, a mask each
        step after temperature (docs/grammar.md); each step records what it removed. `on_start(prompt_ids, tokens_dropped, settings)` runs before the first token (the
        prompt's ids as read: its last n_ctx); `on_text(piece)` sees the text as made.

        One prompt and n = 1 return one GenerateResult. `n` choices, or a list of prompts, run as one
        batch and return a list, prompt i's choices at i·n … i·n + n - 1; choice j draws with seed + j, so
        each is what generate(that prompt, seed=seed + j) returns alone. on_start and on_text follow a
        single generation only. `settings`: what api.checks.generation made of these values already (a
        front end that checked them before the load), taken as they are instead of the values."""
        from lmhead_cli.decoding.generate import generate_many
        from lmhead_cli.readings.inspect import encode_prompt

        texts, one = checks.prompts(prompt)
        if settings is None:
            settings = checks.generation(mode=mode, preset=preset, greedy=greedy, beams=beams, n=n,
                                         ignore_eos=ignore_eos, seed=seed, stop=stop, show_steps=show_steps,
                                         max_new_tokens=max_new_tokens, top_logprobs=top_logprobs, logprobs=logprobs,
                                         json_schema=json_schema, regex=regex, **stages)
        else:
            checks.decoding_settings(settings)
        single = one and settings.n == 1
        for key, given in (("on_start", on_start), ("on_text", on_text)):
            if given is not None and not single:
                raise BadValue(key, "must be None for a batch: it follows a single generation (one prompt, a "
                                    "string, and n = 1); a batch's results hold each text")
        encoded = [encode_prompt(self.loaded, text) for text in texts]
        # before on_start prints anything
        checks.generation_fits(self.loaded, max(len(ids) for ids, _ in encoded), settings, len(texts))
        if on_start is not None:
            on_start(*encoded[0], settings)
        made = generate_many(self.loaded, [ids for ids, _ in encoded], settings, on_text=on_text)
        tok = self.tokenizer
        out = [results.GenerateResult(g, self.provenance, texts[i // settings.n], preset, tok.token_text,
                                      tok.token_bytes) for i, g in enumerate(made)]
        return out[0] if single else out


def many(key: str, values: Iterable) -> Iterable:
    """An iterable of texts (a list, a file's lines, a generator) as given; one string or bytes is BadType
    (iterating it would give its characters)."""
    if isinstance(values, (str, bytes, bytearray)) or not isinstance(values, Iterable):
        raise BadType(key, f"must be an iterable of texts (a list, a file's lines), not {type(values).__name__}")
    return values


@kinds(source=str, **COUNTS, allow_pickle=bool)
def model_params(source: str, batch: int = 1, seq: int | None = None, vocab: int | None = None, *,
                 allow_pickle: bool = False) -> results.ParamsResult:
    """`lmhead params --model SOURCE`: a GPT-2-family model's real tensors counted (loaded on the CPU by
    the lean engine); another architecture is refused from its config, before any weight is read."""
    from lmhead_cli.loading.sources import model_type

    gpt2_only(source, model_type(source, allow_pickle))
    return load(source, device="cpu", engine="lean", allow_pickle=allow_pickle).params(batch, seq, vocab)


