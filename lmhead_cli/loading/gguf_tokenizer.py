"""A GGUF file's tokenizer, built from its metadata (tokenizer.ggml.*) as llama.cpp reads it.

llama.cpp keeps no tokenizer.json: the file lists the tokens, their types, and the merges (byte-level
BPE) or the scores (SentencePiece). lmhead builds them with the `tokenizers` library:

* `gpt2` with pre-tokenizer `gpt-2` (or `default`, or none): GPT-2's byte-level BPE, built here as
  GPT-2's own files are built (no transformers import, like the rest of the GPT-2 path);
* `gpt2` with `llama-bpe` (Llama 3), `qwen2` (Qwen 2 and 2.5) and `smollm` (SmolLM, SmolLM2), and
  `llama` (SentencePiece, BPE with byte fallback: Llama 1 and 2, Mistral, TinyLlama): transformers'
  own GGUF converter (transformers.integrations.gguf.convert_gguf_tokenizer), then the few rules in
  which llama.cpp differs from it: `smollm` splits every digit before GPT-2's regex (transformers
  treats it as `gpt-2`), `llama-bpe` takes a word that is one token whole (llama.cpp's
  ignore_merges), and SentencePiece's "▁" prefix goes before every run of text, even one that
  begins with a space, and after each special token (llama.cpp's is_prev_special), as sentencepiece
  itself and the Llama 2 tokenizer.json do; transformers' converter adds it only at the start of a
  text that does not begin with a space.

BOS: `tokenizer.ggml.add_bos_token` when the file says; otherwise llama.cpp's default, on for
SentencePiece and `llama-bpe`, off for the rest. Anything else (another tokenizer.ggml.model or
.pre) is refused in one line naming the field and its value, never approximated.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from lmhead_cli.errors import CorruptCheckpoint, UnsupportedModel
from lmhead_cli.loading.tokenizer import PROBE, GPT2Tokenizer, checked

MODELS = ("gpt2", "llama")  # tokenizer.ggml.model: byte-level BPE, SentencePiece
GPT2_PRE = (None, "default", "gpt-2")  # GPT-2's own regex
CONVERTED_PRE = ("llama-bpe", "llama3", "llama-v3", "qwen2", "smollm")  # the names llama.cpp gives them
LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3")
CONTROL, USER_DEFINED, BYTE = 3, 4, 6  # tokenizer.ggml.token_type values (gguf.TokenType)


def tokenizer_from_gguf(meta, vocab_size: int, path: Path, architecture: str) -> GPT2Tokenizer:
    """The tokenizer a GGUF file describes (`meta.get(key)` reads its metadata), checked before use:
    a model and pre-tokenizer lmhead builds, one token per embedding row (`vocab_size`), no token
    twice, one type per token, every merge two tokens of the table (or one score per token), then
    the probe text encoded without error and decoded back."""
    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    if model not in MODELS:
        raise UnsupportedModel(f"{path}: tokenizer.ggml.model is {str(model)[:40]!r}; lmhead builds GGUF tokenizers "
                               "of 'gpt2' (byte-level BPE) and 'llama' (SentencePiece)")
    if model == "gpt2" and pre not in GPT2_PRE + CONVERTED_PRE:
        raise UnsupportedModel(f"{path}: tokenizer.ggml.pre is {str(pre)[:40]!r}; lmhead builds the byte-level "
                               "pre-tokenizers 'gpt-2', 'llama-bpe', 'qwen2' and 'smollm'")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise CorruptCheckpoint(f"{path}: tokenizer.ggml.tokens is missing or not a list of strings")
    if len(tokens) != vocab_size:
        raise CorruptCheckpoint(f"{path}: tokenizer.ggml.tokens holds {len(tokens):,} tokens but token_embd.weight "
                                f"has {vocab_size:,} rows; each token needs one row")
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        twice = next(t for t, n in Counter(tokens).items() if n > 1)
        raise CorruptCheckpoint(f"{path}: tokenizer.ggml.tokens holds {twice[:40]!r} twice")
    kinds = meta.get("tokenizer.ggml.token_type")
    kinds = [1] * len(tokens) if kinds is None else kinds
    if not isinstance(kinds, list) or len(kinds) != len(tokens) or not all(type(k) is int for k in kinds):
        raise CorruptCheckpoint(f"{path}: tokenizer.ggml.token_type must list one whole-number type per token")
    merges = meta.get("tokenizer.ggml.merges")
    if model == "gpt2" or merges is not None:
        _check_merges(merges, vocab, path)
    scores = meta.get("tokenizer.ggml.scores")
    if model == "llama" and merges is None:  # SentencePiece merges by score: one finite score per token
        if not isinstance(scores, list) or len(scores) != len(tokens) or not all(
                isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) for s in scores):
            raise CorruptCheckpoint(f"{path}: tokenizer.ggml.scores must list one finite score per token (a "
                                    "SentencePiece vocabulary is merged by score)")
    bos, add_bos = _bos(meta, model, pre, vocab_size, path)

    if model == "gpt2" and pre in GPT2_PRE:
        tok = checked(path, lambda: _gpt2(tokens, vocab, merges, kinds))
    else:
        tok = checked(path, lambda: _converted(architecture, model, pre, tokens, kinds, merges, scores, meta))
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise CorruptCheckpoint(f"{path}: the tokenizer built from its metadata holds "
                                f"{tok.get_vocab_size(with_added_tokens=True):,} tokens, not the {vocab_size:,} of "
                                "tokenizer.ggml.tokens (a SentencePiece table without <unk>, <s> and </s>?)")
    probe = PROBE.replace("<|endoftext|>", "") if model == "llama" else PROBE  # not a SentencePiece token
    if tok.decode(tok.encode(probe, add_special_tokens=False).ids, skip_special_tokens=False) != probe:
        raise CorruptCheckpoint(f"{path}: the tokenizer in its metadata does not give the probe text back "
                                f"(tokenizer.ggml.tokens is not a {'SentencePiece' if model == 'llama' else 'byte-level'}"
                                " table)")
    return GPT2Tokenizer(tok, f"{path} (tokenizer.ggml.*)", bos_id=bos, add_bos=add_bos)


def _check_merges(merges, vocab: dict, path: Path) -> None:
    if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
        raise CorruptCheckpoint(f"{path}: tokenizer.ggml.merges is missing or not a list of strings")
    for i, m in enumerate(merges):
        a, sep, b = m.partition(" ")
        if not sep or a not in vocab or b not in vocab or a + b not in vocab:
            raise CorruptCheckpoint(f"{path}: tokenizer.ggml.merges[{i}] {m[:40]!r} is not two tokens of the "
                                    "table whose join is one")


def _bos(meta, model: str, pre, vocab_size: int, path: Path) -> tuple[int | None, bool]:
    """(BOS id, whether the tokenizer puts it before a text), as llama.cpp reads them."""
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if bos is not None and (type(bos) is not int or not 0 <= bos < vocab_size):
        raise CorruptCheckpoint(f"{path}: tokenizer.ggml.bos_token_id is {str(bos)[:20]}, not a token id below "
                                f"{vocab_size:,}")
    add = meta.get("tokenizer.ggml.add_bos_token")
    if add is None:  # llama.cpp's defaults (llama-vocab.cpp)
        add = model == "llama" or pre in LLAMA3_PRE
    elif not isinstance(add, bool):
        raise CorruptCheckpoint(f"{path}: tokenizer.ggml.add_bos_token must be true or false, not {str(add)[:20]}")
    if add and bos is None:
        if model != "llama":
            raise CorruptCheckpoint(f"{path}: tokenizer.ggml.add_bos_token is true but the file names no "
                                    "tokenizer.ggml.bos_token_id")
        bos = 1  # SentencePiece's <s>, llama.cpp's default
    return bos, add


def _gpt2(tokens: list[str], vocab: dict, merges: list[str], kinds: list[int]):
    """GPT-2's byte-level BPE: control tokens (type 3) special, user-defined ones (type 4) added."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([t for t, k in zip(tokens, kinds) if k == CONTROL])
    tok.add_tokens([t for t, k in zip(tokens, kinds) if k == USER_DEFINED])
    return tok


def _converted(architecture: str, model: str, pre, tokens, kinds, merges, scores, meta):
    """transformers' GGUF converter's tokenizer, with llama.cpp's rules where they differ (module doc)."""
    from tokenizers import Regex, pre_tokenizers
    from transformers.integrations.gguf import convert_gguf_tokenizer
    from transformers.utils import logging as hf_logging

    described = {"tokenizer_type": model, "pre_tokenizer_type": pre, "tokens": tokens, "token_type": kinds}
    if merges is not None:
        described["merges"] = merges
    if scores is not None:
        described["scores"] = scores
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its "deriving merges" notes are not lmhead's to print
    try:
        tok, _ = convert_gguf_tokenizer(architecture, described)
    finally:
        hf_logging.set_verbosity(verbosity)
    if pre == "smollm":  # llama.cpp: "\p{N}" split first, then GPT-2's regex (llama-vocab.cpp)
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif pre in LLAMA3_PRE:
        tok.model.ignore_merges = True
    if model == "llama":  # llama.cpp and sentencepiece: " " -> "▁", and a "▁" before every run of text
        from tokenizers import decoders, normalizers

        space = meta.get("tokenizer.ggml.add_space_prefix") is not False
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁")] * space + [normalizers.Replace(" ", "▁")])
        tok.pre_tokenizer = None
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                        + [decoders.Strip(" ", 1, 0)] * space)
    return tok
