"""The engine contract: everything the rest of lmhead may ask of a model, and nothing else.

Two engines implement it in full: `LeanGPT2` (engine/lean.py, plain torch, GPT-2 checkpoints) and
`TransformersEngine` (engine/hf.py, any transformers causal LM). Callers hold an `Engine` and never
check which one it is. Neither knows about rich or typer.

Shapes: B batch, T positions, D width, V vocabulary, L layers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn


# GPT-2's config keys, each with the names other transformers configs give it.
CONFIG_ALIASES = {
    "n_positions": ("n_positions", "max_position_embeddings"),
    "n_layer": ("n_layer", "num_hidden_layers", "num_layers"),  # num_layers: GPT-Neo's config.json
    "n_embd": ("n_embd", "hidden_size"),
}


def config_value(config: dict, key: str, default=None):
    """A config's `key` under GPT-2's name or another architecture's (n_layer or num_hidden_layers);
    `default` when it has neither (or only zero)."""
    return next((config[name] for name in CONFIG_ALIASES[key] if config.get(name)), default)


def position_ids(attention_mask: torch.Tensor, T: int) -> torch.Tensor:
    """Positions of the last T tokens of left-padded rows, (B, S) mask -> (B, T) long: each row counts
    its real tokens from 0, so a padded prompt sees the positions it would see alone (pads get 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]


@dataclass(frozen=True)
class TieNames:
    """The parameter names of the head's and the embedding's weights, as the model itself names them."""

    head: str  # e.g. "lm_head.weight"
    embedding: str  # e.g. "transformer.wte.weight" or "model.embed_tokens.weight"


@dataclass(frozen=True)
class NormLinearisation:
    """The final norm N(x) = γ ⊙ C(x) / σ(x) + β with σ held at its value for one residual vector x, which
    makes it linear in x: N(Σ parts) = Σ γ ⊙ C(part) / σ + β, exactly, for that x.

    LayerNorm: C centres (x − mean x), σ = √(var x + eps), β its bias. RMSNorm: C is the identity,
    σ = √(mean x² + eps), no β.
    """

    centred: bool
    gamma: torch.Tensor  # (D,), the effective gain (Gemma's RMSNorm multiplies by 1 + weight)
    beta: torch.Tensor | None  # (D,), or None
    eps: float

    def sigma(self, x: torch.Tensor) -> torch.Tensor:
        """σ of residual vectors x (..., D) -> (..., 1), in x's dtype."""
        if self.centred:
            return (x.var(-1, unbiased=False, keepdim=True) + self.eps).sqrt()
        return (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()

    def apply(self, part: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """γ ⊙ C(part) / σ for parts (..., D) and the scale σ of the vector they sum to (broadcastable)."""
        if self.centred:
            part = part - part.mean(-1, keepdim=True)
        return self.gamma.to(part.dtype) * part / sigma


def linearise_norm(norm: nn.Module) -> NormLinearisation | None:
    """The linearisation of a final-norm module: nn.LayerNorm, or an RMSNorm (by class name), else None."""
    if isinstance(norm, nn.LayerNorm):
        return NormLinearisation(centred=True, gamma=norm.weight.detach(),
                                 beta=None if norm.bias is None else norm.bias.detach(), eps=norm.eps)
    if type(norm).__name__.endswith("RMSNorm") and getattr(norm, "weight", None) is not None:
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        if eps is None:
            return None
        gamma = norm.weight.detach()
        # Gemma's RMSNorm scales by (1 + weight), its weights stored around 0.
        return NormLinearisation(centred=False, gamma=gamma + 1 if "Gemma" in type(norm).__name__ else gamma,
                                 beta=None, eps=float(eps))
    return None


@dataclass
class Components:
    """The residual stream at the last position as a sum of named parts, and the final norm linearised.

    embed[name] + Σ_l (Σ_h heads[:, l, h] + attn_bias[l]) + Σ_l mlp[:, l] = resid, up to float rounding.
    Shapes: B batch, L layers, H heads, D width; all in the model's dtype.
    """

    embed: dict[str, torch.Tensor]  # "token" and, where the model has a position table, "position": (B, D) each
    heads: torch.Tensor  # (B, L, H, D): each head's write, its slice of the output projection's input times its rows
    attn_bias: torch.Tensor  # (L, D): the attention output projection's bias (zeros when it has none)
    mlp: torch.Tensor  # (B, L, D): each layer's MLP output
    resid: torch.Tensor  # (B, D): the final residual as the forward computed it, before the final norm
    norm: NormLinearisation


@dataclass(frozen=True)
class LayerTaps:
    """Where one layer writes into the residual stream: the attention output projection and the MLP."""

    out_proj: nn.Module  # its input is the heads' outputs side by side, (..., H·hd)
    weight: torch.Tensor  # the projection as (H·hd, D): x @ weight (+ bias)
    bias: torch.Tensor | None  # (D,)
    mlp: nn.Module  # its output is added to the residual stream
    # The MLP's output projection (GPT-2's c_proj, Llama's down_proj): its input is the N neurons'
    # activations (..., N), and mlp(x) = activations @ values (+ mlp_bias). None where it is not found.
    mlp_out: nn.Module | None = None
    values: torch.Tensor | None = None  # (N, D): each neuron's value vector, a row
    mlp_bias: torch.Tensor | None = None  # (D,)


def capture_components(run: Callable[[], Any], n_head: int, taps: list[LayerTaps], blocks: nn.ModuleList,
                       norm: NormLinearisation, position_table: tuple[nn.Module, nn.Module] | None) -> Components:
    """Run the model's own forward (`run`) once with hooks and read the parts off it, last position only.

    position_table: (token embedding, position embedding) modules whose outputs are the two embedding
    parts; None to take the first block's input as the one "token" part (models without a position
    table, or that scale the embeddings). Memory: O(L·H·D) per row, whatever the prompt's length.
    """
    got: dict[str, Any] = {"attn_in": {}, "mlp": {}}

    def last(t: torch.Tensor) -> torch.Tensor:  # (B, T, D) or (T, D) -> (B, D)
        return t[..., -1, :].reshape(-1, t.shape[-1])

    def output(t):
        return t[0] if isinstance(t, tuple) else t

    handles = []
    try:
        if position_table is None:
            handles.append(blocks[0].register_forward_pre_hook(
                lambda _m, args, kwargs: got.__setitem__("token", last(args[0] if args else kwargs["hidden_states"])),
                with_kwargs=True))
        else:
            for name, module in zip(("token", "position"), position_table):
                handles.append(module.register_forward_hook(
                    lambda _m, _i, o, name=name: got.__setitem__(name, last(o))))
        for i, tap in enumerate(taps):
            handles.append(tap.out_proj.register_forward_pre_hook(
                lambda _m, args, i=i: got["attn_in"].__setitem__(i, last(args[0]))))
            handles.append(tap.mlp.register_forward_hook(lambda _m, _i, o, i=i: got["mlp"].__setitem__(i, last(output(o)))))
        handles.append(blocks[-1].register_forward_hook(lambda _m, _i, o: got.__setitem__("resid", last(output(o)))))
        run()
    finally:
        for h in handles:
            h.remove()

    heads = []
    for i, tap in enumerate(taps):
        y = got["attn_in"][i]  # (B, H·hd): the heads' outputs side by side
        B, width = y.shape
        w = tap.weight.reshape(n_head, width // n_head, -1)  # (H, hd, D): each head's rows of the projection
        heads.append(torch.einsum("bhk,hkd->bhd", y.reshape(B, n_head, -1), w))  # (B, H, D)
    B = got["resid"].shape[0]
    embed = {name: got[name].expand(B, -1) for name in ("token", "position") if name in got}
    zeros = torch.zeros_like(got["resid"][0])
    return Components(embed=embed, heads=torch.stack(heads, 1),
                      attn_bias=torch.stack([zeros if t.bias is None else t.bias.detach() for t in taps]),
                      mlp=torch.stack([got["mlp"][i] for i in range(len(taps))], 1), resid=got["resid"], norm=norm)


def module_name(root: nn.Module, module: nn.Module) -> str:
    """`module`'s path inside `root` as the model names it, e.g. "model.norm" or "lm_head"."""
    return next(name for name, m in root.named_modules() if m is module)


@dataclass(frozen=True)
class GreedyRun:
    """Greedy steps of one row run in one call (Engine.greedy_run), m of them: step i ran the token chosen
    before it (the first, the caller's token; then the top-1 of the step before) and made its record."""

    top_ids: torch.Tensor  # (m,) int64 each step's top-1; the last -1 where a logit not finite spoilt its record
    figures: torch.Tensor  # (3, m) float32 each step's top-1 log p, entropy and top-1 logit (step_logits' record)
    logits: torch.Tensor  # (1, V) float32 the last step's logits


@dataclass
class Engine(ABC):
    """What the rest of lmhead needs from a model.

    body(ids, cache, attention_mask) -> hidden states after the final norm, (B, T, D)
    residuals(ids) -> the residual stream after the embeddings and after each block, L + 1 × (B, T, D)
    components(ids) -> the last position's final residual as named parts (heads split), see Components
    final_norm(x) -> the model's own final norm (LayerNorm, RMSNorm, ...), (..., D); final_norm_module, its module
    head(h) -> logits, (..., V), with whatever the model itself does after its head (own_stages)
    new_cache(B, T_max) / reorder_cache(cache, rows) -> the KV cache, and beam search's reordering
    """

    name: str
    config: dict
    module: nn.Module
    # Whether step_rows steps a part of the cache's rows (the others wait); else every row steps together.
    steps_rows: ClassVar[bool] = False
    # Stages the model applies to its own logits before anyone sees them, e.g. Gemma-2's
    # {"softcap": 30.0}. Empty for GPT-2.
    own_stages: dict[str, Any] = field(default_factory=dict)

    # -- weights ----------------------------------------------------------------------------
    @property
    @abstractmethod
    def embedding_weight(self) -> torch.Tensor:
        """The input embedding table E, (V, D)."""

    @property
    @abstractmethod
    def head_weight(self) -> torch.Tensor:
        """The output matrix W_out, (V, D); the very same object as E when the model is tied."""

    @property
    @abstractmethod
    def head_module(self) -> nn.Module:
        """The module that computes the head (lmhead's LMHead, or the model's own lm_head)."""

    @property
    @abstractmethod
    def tie_names(self) -> TieNames:
        """The head's and the embedding's parameter names in this model."""

    # -- the forward pass -------------------------------------------------------------------
    @abstractmethod
    def body(self, ids: torch.Tensor, cache: Any = None, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after the final norm for the new positions `ids` (B, T) -> (B, T, D); fills `cache`."""

    @abstractmethod
    def residuals(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Iterator[torch.Tensor]:
        """The residual stream after the embeddings and after each block, before the final norm: L + 1 × (B, T, D)."""

    @abstractmethod
    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The model's own final norm, (..., D) -> (..., D)."""

    @property
    @abstractmethod
    def final_norm_module(self) -> nn.Module | None:
        """The module behind `final_norm` (nn.LayerNorm, LlamaRMSNorm, ...), or None if the model has none."""

    @abstractmethod
    def components(self, ids: torch.Tensor) -> Components:
        """The residual stream at the last position of `ids` (B, T) split into its parts (embeddings, each
        layer's heads, attention bias and MLP) and the final norm's linearisation: see `Components`.
        Raises UnsupportedModel, naming what is missing, for a model whose layers it cannot find."""

    def layer_taps(self) -> list[LayerTaps]:
        """Each layer's taps (attention output projection, MLP, the MLP's value vectors). Raises
        UnsupportedModel, naming what is missing, for a model whose layers it cannot find."""
        from lmhead_cli.errors import UnsupportedModel

        raise UnsupportedModel(f"the {self.name} engine cannot split its layers into parts")

    @abstractmethod
    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits z = h · W_outᵀ (plus whatever the model's own head adds): (..., D) -> (..., V)."""

    # -- the KV cache ----------------------------------------------------------------------
    @abstractmethod
    def new_cache(self, batch: int, max_len: int) -> Any:
        """An empty KV cache for `batch` rows and up to `max_len` positions."""

    @abstractmethod
    def reorder_cache(self, cache: Any, rows: torch.Tensor) -> Any:
        """Keep batch rows `rows` of `cache` (beam search); returns the cache to use from now on."""

    def join_caches(self, parts: list[tuple[Any, int]], max_len: int) -> Any:
        """One cache for the rows of several: each part is (cache, first column kept); every part's
        columns from there to its end are right-aligned in a new cache of `max_len` positions, its
        length the longest part's, left-padded with zeros (an attention mask hides them). Rows keep
        their order, part after part. Continuous batching (decoding/batch.py) joins new rows to a
        running batch with it; None where the engine's cache cannot be joined (the loop then admits
        rows only into an empty batch)."""
        return None

    def step_rows(self, ids: torch.Tensor, cache: Any, attention_mask: torch.Tensor, runs: list[tuple[int, int]],
                  record: bool = False) -> tuple[torch.Tensor, tuple | None] | None:
        """step_logits for some rows of `cache` only, the rows in `runs` ((start, stop) each, in order),
        their tokens ids (n, 1) run by run; attention_mask (R, S + 1) for every row, 0 in the new column
        for a row that does not run (the cache still moves one column on for every row: that row's
        column stays zero, hidden by the mask). The logits (n, V) and records as step_logits' for those
        rows. None where the engine cannot step a part of its cache's rows (`steps_rows` False:
        decoding/batch.py then steps every row); an engine that can also implements `compact_cache`."""
        return None

    def greedy_run(self, token: int, cache: Any, n: int, eos: int | None) -> GreedyRun | None:
        """Up to n greedy steps of a one-row `cache` (no mask) in one call: step_logits with `record` run on
        `token`, then on each step's top-1 in turn, stopping after a step whose top-1 is `eos` (None: no
        such token) or whose record a logit that is not finite spoilt; the cache advanced by the steps run.
        What a decoding loop of plain greedy steps does, without its own work between the steps: the
        tokens are the same. None where the engine does not run steps so (nothing done: the caller
        steps)."""
        return None

    def compact_cache(self, cache: Any, keep: torch.Tensor, max_len: int) -> Any:
        """A new cache of `max_len` positions (at least the longest row) where each row holds only its
        columns that `keep` (R, S) bool marks, right-aligned and left-padded with zeros: the columns that
        rows which waited a step (`step_rows`) left empty are dropped. None where the engine has no
        `step_rows`."""
        return None

    # -- derived: the same for every engine -------------------------------------------------
    def last_logits(self, ids: torch.Tensor, cache: Any = None, attention_mask: torch.Tensor | None = None,
                    lengths: torch.Tensor | None = None) -> torch.Tensor:
        """The body on every position of `ids` (R, T) (filling `cache` if given), the head on each row's
        last position only: logits (R, V) float32. `lengths` (R,): each row's real length when rows are
        padded on the right (default: the last column)."""
        hidden = self.body(ids, cache, attention_mask)  # (R, T, D)
        if lengths is None:
            return self.head(hidden[:, -1:, :])[:, 0].float()  # (R, 1, D) -> (R, V)
        last = hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]  # (R, D)
        return self.head(last).float()  # (R, V)

    def step_logits(self, ids: torch.Tensor, cache: Any, attention_mask: torch.Tensor | None = None,
                    record: bool = False) -> tuple[torch.Tensor, tuple | None]:
        """A decoding step's logits (R, V), as last_logits with the cache, and with `record` each row's
        greedy record where the engine computes it with them: (top_id (R,) int64, (3, R) float32: the
        top-1's log p, the entropy, the top-1's logit), else None (the decoding loop computes it)."""
        return self.last_logits(ids, cache, attention_mask), None

    @property
    def device(self) -> torch.device:
        return self.head_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.head_weight.dtype

    @property
    def weight_format(self) -> str:
        """How the weights are stored: "float32", "bfloat16", "float16", or "int8" (quantised, computing in float32)."""
        return str(self.dtype).removeprefix("torch.")

    def head_rows(self, ids) -> torch.Tensor:
        """Rows `ids` of W_out in the compute dtype, (n, D) (int8 weights: dequantised)."""
        return self.head_weight[ids]

    # -- how the products run: forms the thread chooser may time (engine/threads.py) ------------
    def runs_on(self, kernels) -> str:
        """What this engine's products run on, for the places that report speed, given the compiled
        kernels loaded (engine/kernels.py) or None: "compiled kernels (VARIANT)" or "torch's products"."""
        return f"compiled kernels ({kernels.variant})" if kernels is not None else "torch's products"

    @property
    def forms(self) -> tuple[str, ...]:
        """The product forms this engine can run in on its device; () for one fixed way."""
        return ()

    def use_form(self, form: str) -> None:
        """Run the products in `form` (one of `forms`) from now on."""

    @property
    def n_ctx(self) -> int:
        return int(config_value(self.config, "n_positions", 1024))

    @property
    def vocab_size(self) -> int:
        return int(self.head_weight.shape[0])

    @property
    def n_layer(self) -> int:
        return int(config_value(self.config, "n_layer"))

    @property
    def eos_token_id(self) -> int | None:
        eos = self.config.get("eos_token_id")
        return eos[0] if isinstance(eos, list) else eos

    @property
    def tied(self) -> bool:
        """The head's weight is the embedding's weight object."""
        return self.head_weight is self.embedding_weight


class WholeSteps:
    """For an engine whose step_logits runs a decoding step token to logits in one compiled call (LeanGPT2,
    LeanLlama): last_logits sends it one new position of a few rows with a cache; greedy_run runs several
    of those steps in one call (`_greedy_run`, the engine's plan), where the engine is as built."""

    def _as_built(self) -> bool:
        """Neither `body` nor `head` replaced on the instance: a caller that wraps them (a reading) must see
        every step run through them, so the compiled whole step stands aside."""
        return "body" not in self.__dict__ and "head" not in self.__dict__

    def greedy_run(self, token: int, cache: Any, n: int, eos: int | None) -> GreedyRun | None:
        """Engine.greedy_run: the whole compiled step run up to n times in one call (`_greedy_run`), n kept
        within the context and the cache (preallocated: its keys (L, B, K, T_max, hd)), the cache's length
        advanced by the steps run; None where the engine is not as built or its plan does not take it."""
        n = min(n, min(self.n_ctx, cache.k.shape[3]) - cache.length)
        run = self._greedy_run(token, cache, n, eos) if n >= 1 and self._as_built() else None
        if run is not None:
            cache.length += run.top_ids.shape[0]
        return run

    def _greedy_run(self, token: int, cache: Any, n: int, eos: int | None) -> GreedyRun | None:
        """n steps (n fits) in the engine's compiled plan, the cache's length left to greedy_run; None where
        the plan does not take them."""
        return None

    def last_logits(self, ids: torch.Tensor, cache: Any = None, attention_mask: torch.Tensor | None = None,
                    lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Engine.last_logits; a decoding step (one new position with a cache) through `step_logits`."""
        if cache is not None and lengths is None and ids.shape[1] == 1:
            return self.step_logits(ids, cache, attention_mask)[0]
        return super().last_logits(ids, cache, attention_mask, lengths)
