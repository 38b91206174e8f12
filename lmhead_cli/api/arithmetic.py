"""The API's answers that need no loaded model: `params --config` (a bundled config counted by
arithmetic) and `toy` (the last step on a four-word table), and the parameter account's result, which
Model.params builds too. No torch: `lmhead params` and `lmhead toy` start instantly."""

from __future__ import annotations

from typing import Iterable

from lmhead_cli.api import checks, results
from lmhead_cli.api.checks import kinds
from lmhead_cli.errors import BadType, UnsupportedModel

COUNTS = {"batch": int, "seq": int, "vocab": int}  # the kinds (api.checks.typed) of the account's sizes


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


@kinds(temperature=float, seed=int, draws=int)
def toy(hidden: str | Iterable[float] | None = None, temperature: float = 1.0, seed: int = 0, draws: int = 20):
    """`lmhead toy`: the whole last step on a four-word table (readings.toy.ToyExample); `hidden` is
    3 numbers, or their text "0.5,1,2" (default 1,0,1). Arithmetic only: no torch."""
    from lmhead_cli.readings import toy as reading

    if hidden is None:
        h = reading.HIDDEN
    elif isinstance(hidden, str):
        h = reading.parse_hidden(hidden)
    elif isinstance(hidden, Iterable) and not isinstance(hidden, (bytes, bytearray)):
        h = reading.parse_hidden(",".join(str(float(checks.typed("hidden", v, float))) for v in hidden))
    else:
        raise BadType("hidden", f"must be numbers, or their text \"0.5,1,2\" (got {type(hidden).__name__})")
    reading.check_temperature(temperature)
    reading.check_draws(draws)
    return reading.toy_example(h, temperature, seed, draws)


@kinds(config=str, **COUNTS)
def params(config: str = "gpt2", batch: int = 1, seq: int | None = None, vocab: int | None = None) -> results.ParamsResult:
    """`lmhead params --config NAME`: a bundled config counted by arithmetic; no torch, no weights."""
    from lmhead_cli.loading.model_configs import load_config
    from lmhead_cli.readings import params as count

    return params_result(config, "config", count.account_from_config(load_config(config)), batch, seq, vocab)
