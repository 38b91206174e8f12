"""The benchmark's Llama, made as people make their files: a LlamaForCausalLM with TinyLlama-1.1B's
dimensions (22 layers, 2,048 wide, 32 heads, 4 key/value heads, a 5,632-wide MLP, 32,000 tokens) and
seeded random weights, saved by transformers (bfloat16, as TinyLlama's own checkpoint) with a
SentencePiece tokenizer trained by the `sentencepiece` package on the repository's prose
(tests/llama_tokenizers.py), converted by llama.cpp's convert_hf_to_gguf.py to F16 and quantised by
llama-quantize (Q8_0, Q4_K_M, and F32 when asked).

    python benchmarks/llama_checkpoint.py                # builds what is missing (a few minutes), prints the files
    python benchmarks/llama_checkpoint.py F32 Q4_K_M     # those types only

The folder is benchmarks/.cache/tinyllama-random; the GGUF files lie beside the GPT-2 ones in
llama.cpp's cache (benchmarks/llamacpp.py): gguf/tinyllama-random-{F16,Q8_0,Q4_K_M}.gguf. Random
weights have the same shapes, bytes and speed as trained ones, and need no network.

`sentencepiece` is never imported here nor by lmhead's measured processes (its wheel brings a second
OpenMP runtime): the tokenizer's training and the converter, which reads tokenizer.model with it, run in
processes of their own with a folder holding it on their path: $LMHEAD_BENCH_SITE, else the cache's
site/ (filled by `pip install --target` the first time).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import llamacpp  # noqa: E402

CACHE = HERE / ".cache"
NAME = "tinyllama-random"
SEED = 0
TYPES = ("F16", "Q8_0", "Q4_K_M")  # F16 from the converter; the others (and F32 when asked) from llama-quantize
TOKENIZER_VOCAB = 8000  # SentencePiece's pieces; the converter pads the table to the model's 32,000 ([PAD{i}])
TINYLLAMA = {  # TinyLlama-1.1B's config.json, the weights' dtype and tokenizer ids included
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 2048,
    "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


def site(install: bool = True) -> Path | None:
    """A folder holding the `sentencepiece` package for the training and converting processes, filled by
    pip the first time (with `install`; else None where it is not there)."""
    folder = Path(os.environ.get("LMHEAD_BENCH_SITE") or llamacpp.cache() / "site")
    if not (folder / "sentencepiece").is_dir():
        if not install:
            return None
        llamacpp._run([sys.executable, "-m", "pip", "install", "-q", "--target", str(folder), "sentencepiece"])
    return folder


def _with_site(paths: list[Path]) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in [*paths, site()])}


def checkpoint(folder: Path | None = None, config: dict | None = None, tokenizer: Path | None = None,
               vocab: int = TOKENIZER_VOCAB, seed: int = SEED) -> Path:
    """The folder holding the checkpoint (config.json, model.safetensors, tokenizer.model and
    transformers' LlamaTokenizer files), built if it is not there: the model by transformers from
    TinyLlama's config updated by `config`, its weights drawn from `seed`; the tokenizer trained on the
    repository's prose, or copied from the checkpoint folder `tokenizer`."""
    folder = folder or CACHE / NAME
    if (folder / "model.safetensors").is_file() and (folder / "tokenizer.model").is_file():
        return folder
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    train = ("import sys; from pathlib import Path; from llama_tokenizers import train_sentencepiece; "
             "train_sentencepiece(Path(sys.argv[1]), int(sys.argv[2]))")
    if tokenizer is None:
        llamacpp._run([sys.executable, "-c", train, str(tmp), str(vocab)], env=_with_site([HERE.parent / "tests"]))
    else:
        for f in tokenizer.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(f, tmp / f.name)
    torch.manual_seed(seed)
    config = {**TINYLLAMA, **(config or {})}
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"}))
    model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
    del model
    tmp.rename(folder)  # complete or absent: an interrupted build is never mistaken for a checkpoint
    return folder


def ggufs(folder: Path, types: tuple[str, ...] = TYPES, out: Path | None = None) -> dict[str, Path]:
    """The checkpoint in `folder` as GGUF files {type: path}: F16 by llama.cpp's convert_hf_to_gguf.py,
    every other type from it by llama-quantize (each as people run it: the type's name, default
    options). Cached in `out` (llama.cpp's cache's gguf/ by default); made again when the checkpoint is
    newer."""
    root = llamacpp.cache()
    tree, quantize = llamacpp.source_tree(root), llamacpp.binary("llama-quantize", root)
    if tree is None or quantize is None:
        raise llamacpp.Unavailable(f"llama.cpp is not built in {root} (python benchmarks/llamacpp.py build)")
    out = out or root / "gguf"
    out.mkdir(parents=True, exist_ok=True)
    weights = folder / "model.safetensors"
    files = {t: out / f"{folder.name}-{t}.gguf" for t in ("F16", *types)}
    fresh = lambda p: p.is_file() and p.stat().st_mtime >= weights.stat().st_mtime  # noqa: E731
    if not fresh(files["F16"]):
        tmp = files["F16"].with_suffix(".partial")
        llamacpp._run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(folder), "--outtype", "f16",
                       "--outfile", str(tmp)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                      env=_with_site([tree / "gguf-py"]))
        tmp.rename(files["F16"])
    for t in types:
        if t != "F16" and (not fresh(files[t]) or files[t].stat().st_mtime < files["F16"].stat().st_mtime):
            tmp = files[t].with_suffix(".partial")
            llamacpp._run([str(quantize), str(files["F16"]), str(tmp), t], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
            tmp.rename(files[t])
    return {t: files[t] for t in types}


def main(argv: list[str]) -> int:
    types = tuple(argv) or TYPES
    try:
        for t, p in ggufs(checkpoint(), types).items():
            print(f"{t}: {p} ({p.stat().st_size / 1e6:,.0f} MB)")
    except llamacpp.Unavailable as e:
        llamacpp.log(f"llama_checkpoint: {e}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
