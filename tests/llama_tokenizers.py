"""Llama-style tokenizers for tests, made as people make them, from text in the repository.

* `train_sentencepiece(folder)`: a SentencePiece BPE model trained by the `sentencepiece` package with
  Llama 2's settings (byte fallback, digits split, white space kept), turned into transformers'
  LlamaTokenizer (its pieces and the merges their scores imply, as transformers' extractor does) and saved (tokenizer.model, tokenizer.json, tokenizer_config.json). Needs
  `sentencepiece` (the [test] extra); callers skip without it.
* `train_tokenizers_llama(folder)`: the same kind of vocabulary trained by the `tokenizers` library
  (BPE with byte fallback over SentencePiece's "▁" spaces), handed to transformers' LlamaTokenizer
  and saved: no sentencepiece needed.
* `spm_gguf_vocab(folder)`: the tokenizer.ggml.* metadata llama.cpp's convert_hf_to_gguf.py writes
  for it (tokens, scores, token types; gguf-py's own SentencePieceVocab reads tokenizer.model when
  there is one, as the converter does).

The training text is the repository's own prose: README.md and docs/*.md.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPECIALS = ["<unk>", "<s>", "</s>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]


def training_text(limit: int = 300_000) -> str:
    """README.md and docs/*.md, in name order, at most `limit` characters."""
    parts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return "\n".join(p.read_text(encoding="utf-8") for p in parts)[:limit]


def train_sentencepiece(folder: Path, vocab_size: int = 1000) -> Path:
    """A SentencePiece BPE model (Llama 2's trainer settings) and transformers' LlamaTokenizer of it,
    saved in `folder`."""
    import sentencepiece as spm
    from transformers import LlamaTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    text = folder / "train.txt"
    text.write_text(training_text(), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(folder / "tokenizer"), vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, split_digits=True, allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", unk_id=0, bos_id=1, eos_id=2, pad_id=-1, character_coverage=0.9995,
        num_threads=1, minloglevel=2)
    text.unlink()
    (folder / "tokenizer.vocab").unlink()
    # transformers' SentencePiece extraction, without the protobuf it needs to parse the file itself:
    # the pieces by id, and the merges their scores imply (SentencePiece BPE merges by score).
    from transformers.tokenization_utils_base import generate_merges

    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    scores = {sp.id_to_piece(i): sp.get_score(i) for i in range(sp.get_piece_size())}
    LlamaTokenizer(vocab=vocab, merges=generate_merges(vocab, scores), add_bos_token=True).save_pretrained(str(folder))
    return folder


def train_tokenizers_llama(folder: Path, vocab_size: int = 1000) -> Path:
    """A Llama-style BPE vocabulary (<unk> <s> </s>, the 256 byte tokens, then merges) trained by the
    `tokenizers` library, as transformers' LlamaTokenizer, saved in `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaTokenizer

    trained = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS + BYTES, show_progress=False,
                                  limit_alphabet=200)
    trained.train_from_iterator(training_text().splitlines(), trainer)
    model = json.loads(trained.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    folder.mkdir(parents=True, exist_ok=True)
    LlamaTokenizer(vocab=model["vocab"], merges=merges, add_bos_token=True).save_pretrained(str(folder))
    return folder


def spm_gguf_vocab(folder: Path) -> dict:
    """tokenizer.ggml.* of a Llama tokenizer folder, as convert_hf_to_gguf.py writes a SentencePiece one:
    from tokenizer.model through gguf-py's SentencePieceVocab where there is one, else from
    tokenizer.json (scores: minus the token's rank, SentencePiece BPE's own)."""
    from gguf import GGUFValueType

    if (folder / "tokenizer.model").exists():
        from gguf.vocab import SentencePieceVocab

        rows = list(SentencePieceVocab(folder).all_tokens())
        tokens = [t.decode("utf-8") for t, _, _ in rows]
        scores = [float(s) for _, s, _ in rows]
        types = [int(k) for _, _, k in rows]
    else:
        vocab = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"]
        tokens = sorted(vocab, key=vocab.get)
        types = [2 if t == "<unk>" else 3 if t in SPECIALS else 6 if t in BYTES else 1 for t in tokens]
        scores = [0.0 if k != 1 else -float(i) for i, k in enumerate(types)]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": (scores, GGUFValueType.ARRAY, GGUFValueType.FLOAT32),
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.add_eos_token": False}
