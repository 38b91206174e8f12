"""`Model.calibrate`: is the model's top-1 probability honest on a text (readings/calibrate.py), and the
entropy rate of its own samples beside it. Its own module, so that the Model's file stays about the
one model."""

from __future__ import annotations

from typing import Callable

from lmhead_cli.api import checks, results
from lmhead_cli.errors import BadValue, UnsupportedModel


def calibrate(model, text: str, *, stride: int | None = None, bos: bool = False, chunk: int | None = None,
              progress: Callable[[int, int], None] | None = None, generations: int = 0, max_new_tokens: int = 64,
              seed: int | None = None, preset: str | None = None, greedy: bool = False,
              **knobs) -> results.CalibrateResult:
    """Model.calibrate (its docstring says what): the reading over `text`, then with `generations` = N the
    N sampled continuations, one batch through model.generate."""
    import secrets
    from dataclasses import asdict

    from lmhead_cli.readings.calibrate import Generations, calibrate_text, entropy_rate

    model.check_score(text, stride=stride, chunk=chunk)
    if isinstance(generations, bool) or not isinstance(generations, int) or generations < 0:
        raise BadValue("generations", f"must be a whole number, at least 0 (got {generations!r})")
    # checked with or without generations: a wrong or unknown setting is never passed over in silence
    settings = checks.generation(preset=preset, greedy=greedy, ignore_eos=True, seed=seed,
                                 max_new_tokens=max_new_tokens, **knobs)
    if generations:
        checks.generations_fit(model.loaded, generations, settings)
        if model.bos_token_id is None:
            raise UnsupportedModel(f"{model.source} declares no beginning-of-text token to sample after")
    reading = calibrate_text(model.loaded, text, bos=bos, stride=stride, chunk=chunk, progress=progress)
    if generations:
        prompt = model.decode([model.bos_token_id])
        base = settings.seed if settings.seed is not None else secrets.randbelow(2**31)
        # one batch of `generations` choices: choice i draws with seed base + i, as it would alone
        made = [r.reading for r in model.generate([prompt], n=generations, max_new_tokens=settings.max_new_tokens, seed=base,
                                                 preset=preset, greedy=greedy, ignore_eos=True, **knobs)]
        tokens, rate = entropy_rate(made)
        on = {k: v for k, v in asdict(settings.knobs).items() if v is not None}
        reading.generations = Generations(count=generations, prompt=prompt, max_new_tokens=settings.max_new_tokens,
                                          seed=base, settings=on | ({"greedy": True} if settings.greedy else {}),
                                          tokens=tokens, entropy_rate=rate, cross_entropy=reading.nll,
                                          texts=[g.text for g in made])
    return results.CalibrateResult(reading)
