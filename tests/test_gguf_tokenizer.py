"""GGUF tokenizers built from the file's metadata (loading/gguf_tokenizer.py): SentencePiece
(`tokenizer.ggml.model` llama) and byte-level BPE with the pre-tokenizers gpt-2, llama-bpe, qwen2 and
smollm; BOS, EOS and add_bos_token from the metadata; one line for what lmhead does not build.

Files are written with gguf-py's GGUFWriter (tests/helpers.py write_gguf) around Llama tokenizers
trained here (tests/llama_tokenizers.py: by the `tokenizers` library always, by the `sentencepiece`
package where it is installed) and GPT-2's own vocabulary. The oracles: transformers' own GGUF
loading (AutoTokenizer.from_pretrained(folder, gguf_file=...)), sentencepiece's own encode, and
llama.cpp's llama-server /tokenize where the benchmark has built it (benchmarks/llamacpp.py).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import PROMPT, build_checkpoint, cli, free_port, refused_gguf, web, write_gguf
from llama_tokenizers import spm_gguf_vocab, train_sentencepiece, train_tokenizers_llama

import lmhead_cli
from lmhead_cli.errors import CorruptCheckpoint, UnsupportedModel
from lmhead_cli.loading.gguf import read_gguf

# Texts a tokenizer gets wrong first. None begins with white space, and no real control token of the
# vocabulary is followed by more text: there transformers' converter and llama.cpp part (SPACED, below).
HOSTILE = ["runs of     spaces  and trailing   ", "tabs\tand\t\t\ttabs", "new\nlines\n\n\nand\r\nCRLF\n",
           "digits 1234567890 3.14159 -0.5e10 007", "accents: café naïve résumé Ångström e\u0301", "CJK: 日本語のテキスト、中文，한국어",
           "emoji: 🤖 🏳️‍🌈 👍🏽", "bytes: \u0000\u0007\x7f\u200b\ufeff 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀",
           "looks special: <s x> </s > <unk <0x41> [INST] <|endoftext|> <|im_start|>user",
           "ends with the real one</s>", "don't 'tis we'll 'S I'M", "a" * 300, "\\n literal [bold]markup[/bold] %s {x}"]
SPACED = [" leading space", "   three", "x</s>y", "a <s> b", "<unk>z"]  # llama.cpp's rules differ here
LLAMA = dict(vocab_size=1000, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)


def _llama_gguf(folder: Path, train) -> tuple[Path, object]:
    """A random Llama (V=1000) and its tokenizer trained by `train`, written as folder/m.gguf."""
    from transformers import LlamaConfig, LlamaForCausalLM

    train(folder)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA)).eval().requires_grad_(False)
    write_gguf(model, folder / "m.gguf", "F32", meta=spm_gguf_vocab(folder), drop=("tokenizer.ggml.merges",))
    return folder / "m.gguf", model


@pytest.fixture(scope="module", params=["tokenizers", "sentencepiece"])
def spm(request, tmp_path_factory):
    if request.param == "sentencepiece":
        pytest.importorskip("sentencepiece")
    train = train_sentencepiece if request.param == "sentencepiece" else train_tokenizers_llama
    return _llama_gguf(tmp_path_factory.mktemp(f"gguf-spm-{request.param}"), train)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf-bpe")
    return folder, build_checkpoint(folder, n_inner=256, n_positions=128, seed=4).requires_grad_(False)


def _transformers(path: Path):
    """transformers' own tokenizer of the GGUF file (its converter, its reader)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _ids(tok, text: str) -> list[int]:
    """lmhead's ids for a prompt: BOS first where the file's tokenizer adds it."""
    return ([tok.bos_id] if tok.add_bos else []) + tok.encode(text)


# ---- SentencePiece -------------------------------------------------------------------------------

def test_sentencepiece_ids_are_transformers_gguf_ids_on_hostile_text(spm):
    path, _ = spm
    tok, hf = read_gguf(path).tokenizer, _transformers(path)
    assert tok.add_bos and tok.bos_id == 1 and tok.vocab_size == len(hf) == 1000
    for text in HOSTILE:
        assert _ids(tok, text) == hf(text).input_ids, text
        assert tok.decode(tok.encode(text)) == hf.decode(hf(text, add_special_tokens=False).input_ids), text


def test_sentencepiece_ids_are_sentencepiece_s_own(spm):
    """The model's own tokenizer: sentencepiece's encode, with BOS, on every text without a control token,
    including those that begin with white space (where transformers' converter drops the "▁" prefix)."""
    sentencepiece = pytest.importorskip("sentencepiece")
    path, _ = spm
    if not (path.parent / "tokenizer.model").exists():
        pytest.skip("a tokenizer trained by the tokenizers library has no tokenizer.model")
    sp = sentencepiece.SentencePieceProcessor(model_file=str(path.parent / "tokenizer.model"))
    tok = read_gguf(path).tokenizer
    for text in HOSTILE[:-5] + HOSTILE[-3:] + SPACED[:2]:
        assert _ids(tok, text) == [sp.bos_id()] + sp.encode(text), text


def test_llama_cpp_s_tokenizer_gives_the_same_ids(spm, gpt2, tmp_path):
    """llama-server's /tokenize (with BOS) on every text, SentencePiece and llama-bpe files alike;
    skipped where benchmarks/llamacpp.py has not built llama.cpp."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import llamacpp

    server = llamacpp.binary("llama-server")
    if server is None:
        pytest.skip(f"llama.cpp is not built ({llamacpp.cache()}: python benchmarks/llamacpp.py build)")
    bpe = tmp_path / "bpe.gguf"
    write_gguf(gpt2[1], bpe, "F32", meta={"tokenizer.ggml.pre": "llama-bpe"})
    for path in (spm[0], bpe):
        tok = read_gguf(path).tokenizer
        port = free_port()
        proc = subprocess.Popen([str(server), "-m", str(path), "--port", str(port), "-c", "128", "-t", "1"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            for _ in range(600):
                try:
                    if web.get(url + "/health", timeout=2).status_code == 200:
                        break
                except Exception:  # noqa: BLE001 - not listening yet
                    pass
                time.sleep(0.1)
            for text in HOSTILE + SPACED:
                got = web.post(url + "/tokenize", json={"content": text, "add_special": True, "parse_special": True},
                               timeout=30).json()["tokens"]
                assert _ids(tok, text) == got, (path.name, text)
        finally:
            proc.terminate()
            proc.wait(30)


def test_a_sentencepiece_llama_gguf_reads_as_transformers_reads_it(spm):
    """inspect on the file: the ids transformers' GGUF tokenizer gives (BOS first), and the top 5 of
    transformers' forward on them (the F32 file is the checkpoint)."""
    path, model = spm
    ids = _transformers(path)(PROMPT).input_ids
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0, -1].double().log_softmax(-1)
    doc = lmhead_cli.load(str(path), device="cpu").inspect(PROMPT, top_k=5).to_dict()
    assert [t["id"] for t in doc["prompt_tokens"]] == ids and ids[0] == 1
    assert [t["id"] for t in doc["top"]] == ref.topk(5).indices.tolist()
    assert [t["logprob"] for t in doc["top"]] == pytest.approx(ref.topk(5).values.tolist(), abs=1e-5)


def test_add_bos_token_false_in_the_metadata_turns_bos_off(spm, tmp_path):
    path, model = spm
    off = tmp_path / "off.gguf"
    write_gguf(model, off, "F32", meta=spm_gguf_vocab(path.parent) | {"tokenizer.ggml.add_bos_token": False},
               drop=("tokenizer.ggml.merges",))
    tok = read_gguf(off).tokenizer
    assert not tok.add_bos and tok.bos_id == 1
    doc = lmhead_cli.load(str(off), device="cpu").inspect(PROMPT).to_dict()
    assert [t["id"] for t in doc["prompt_tokens"]] == tok.encode(PROMPT)


# ---- byte-level BPE: gpt-2, llama-bpe, qwen2, smollm -----------------------------------------------

@pytest.mark.parametrize("pre, bos", [("gpt-2", False), ("llama-bpe", True), ("qwen2", False)])
@pytest.mark.slow
def test_byte_level_ids_are_transformers_gguf_ids_on_hostile_text(gpt2, tmp_path, pre, bos):
    """GPT-2's vocabulary under each pre-tokenizer's regex; BOS by llama.cpp's default for it (on for
    llama-bpe); `<|endoftext|>` inside a text stays one control token."""
    path = tmp_path / f"{pre}.gguf"
    write_gguf(gpt2[1], path, "F32", meta={"tokenizer.ggml.pre": pre})
    tok, hf = read_gguf(path).tokenizer, _transformers(path)
    assert tok.add_bos is bos and tok.bos_id == 50256
    for text in HOSTILE + SPACED:
        assert tok.encode(text) == hf(text, add_special_tokens=False).input_ids, (pre, text)
        assert tok.decode(tok.encode(text)) == text, (pre, text)
    assert tok.encode("a<|endoftext|>b")[1] == 50256


def test_smollm_splits_every_digit_as_llama_cpp_does(gpt2, tmp_path):
    """llama.cpp's smollm: each digit its own piece before GPT-2's regex, SmolLM2's own tokenizer.json
    pre-tokenizer (Digits(individual_digits) then ByteLevel); transformers' converter reads smollm as
    gpt-2, which keeps "1234" whole."""
    from tokenizers import pre_tokenizers
    from transformers import GPT2TokenizerFast

    path = tmp_path / "smollm.gguf"
    write_gguf(gpt2[1], path, "F32", meta={"tokenizer.ggml.pre": "smollm"})
    tok = read_gguf(path).tokenizer
    ref = GPT2TokenizerFast.from_pretrained(str(gpt2[0])).backend_tokenizer
    ref.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    for text in HOSTILE + SPACED:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False).ids, text
    assert [tok.token_text(i) for i in tok.encode("in 2024")] == ["in", " ", "2", "0", "2", "4"]


# ---- refusals --------------------------------------------------------------------------------------

def _refused(model, tmp_path, says: str, error=UnsupportedModel, **kwargs) -> None:
    refused_gguf(model, tmp_path, says, error, **kwargs)


def test_an_unknown_tokenizer_model_or_pre_tokenizer_is_one_line_naming_it(gpt2, tmp_path):
    model = gpt2[1]
    _refused(model, tmp_path, "tokenizer.ggml.model is 'bert'; lmhead builds GGUF tokenizers of 'gpt2' (byte-level "
             "BPE) and 'llama' (SentencePiece)", meta={"tokenizer.ggml.model": "bert"})
    _refused(model, tmp_path, "tokenizer.ggml.pre is 'deepseek-llm'; lmhead builds the byte-level pre-tokenizers "
             "'gpt-2', 'llama-bpe', 'qwen2' and 'smollm'", meta={"tokenizer.ggml.pre": "deepseek-llm"})


def test_a_sentencepiece_table_that_does_not_fit_is_one_line(spm, tmp_path):
    path, model = spm
    vocab = spm_gguf_vocab(path.parent)
    scores = vocab["tokenizer.ggml.scores"]
    _refused(model, tmp_path, "tokenizer.ggml.scores must list one finite score per token", CorruptCheckpoint,
             meta=vocab | {"tokenizer.ggml.scores": (scores[0][:-1], *scores[1:])}, drop=("tokenizer.ggml.merges",))
    _refused(model, tmp_path, "tokenizer.ggml.bos_token_id is 5000, not a token id below 1,000", CorruptCheckpoint,
             meta=vocab | {"tokenizer.ggml.bos_token_id": 5000}, drop=("tokenizer.ggml.merges",))
    _refused(build_checkpoint(tmp_path / "g", n_inner=256, n_positions=64), tmp_path,
             "tokenizer.ggml.add_bos_token is true but the file names no tokenizer.ggml.bos_token_id",
             CorruptCheckpoint, meta={"tokenizer.ggml.add_bos_token": True},
             drop=("tokenizer.ggml.bos_token_id",))
