"""BOS as the model's tokenizer says: a Llama whose tokenizer puts <s> before every text gets it in
every reading (inspect, lens, attribute, generate, score, serve), as transformers and llama.cpp do;
GPT-2 is unchanged; `--bos` / `--no-bos` wins where a reading has it.

The model is a random-weight LlamaForCausalLM saved by transformers beside a Llama tokenizer (BPE with
byte fallback) trained by the `tokenizers` library, or by the `sentencepiece` package where it is
installed (tests/llama_tokenizers.py). The oracle is transformers' own: AutoTokenizer's ids, and
LlamaForCausalLM's forward on them.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import build_checkpoint, cli, serving, web
from llama_tokenizers import train_sentencepiece, train_tokenizers_llama

import lmhead_cli

PROMPT = "And it came to pass in those days"


def _llama_folder(folder, train):
    from transformers import LlamaConfig, LlamaForCausalLM

    train(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
                         eos_token_id=2, initializer_range=0.2)
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=["tokenizers", "sentencepiece"])
def llama(request, tmp_path_factory):
    """A Llama folder whose tokenizer adds BOS, with transformers' model and tokenizer of it."""
    if request.param == "sentencepiece":
        pytest.importorskip("sentencepiece")
    from transformers import AutoTokenizer, LlamaForCausalLM

    train = train_sentencepiece if request.param == "sentencepiece" else train_tokenizers_llama
    folder = _llama_folder(tmp_path_factory.mktemp(f"bos-{request.param}"), train)
    return folder, AutoTokenizer.from_pretrained(folder), LlamaForCausalLM.from_pretrained(folder).eval()


def test_inspect_reads_the_prompt_after_bos_as_transformers_does(llama):
    """lmhead's top 5 and whole distribution are transformers' forward on transformers' ids (which begin
    with <s>): before the fix, without BOS, they were 0.58 nats apart (KL) and the top 5 differed."""
    folder, tok, model = llama
    ids = tok(PROMPT).input_ids
    assert ids[0] == tok.bos_token_id == 1
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0, -1].double().log_softmax(-1)
    m = lmhead_cli.load(str(folder), device="cpu")
    assert m.adds_bos and m.bos_token_id == 1
    doc = m.inspect(PROMPT, top_k=5).to_dict()
    assert [t["id"] for t in doc["prompt_tokens"]] == ids
    assert [t["id"] for t in doc["top"]] == ref.topk(5).indices.tolist()
    mine = torch.tensor([t["logprob"] for t in doc["top"]], dtype=torch.float64)
    assert torch.allclose(mine, ref.topk(5).values, atol=1e-5)
    with torch.no_grad():
        logits = m.loaded.engine.last_logits(torch.tensor([ids]))[0].double().log_softmax(-1)
    assert float((ref.exp() * (ref - logits)).sum()) < 1e-8  # KL over the whole vocabulary


def test_every_reading_reads_bos_first(llama):
    folder, tok, model = llama
    ids = tok(PROMPT).input_ids
    m = lmhead_cli.load(str(folder), device="cpu")
    assert [t["id"] for t in m.lens(PROMPT).to_dict()["prompt_tokens"]] == ids
    att = m.attribute(PROMPT, " the").reading
    assert [t.id for t in att.prompt_tokens] == ids
    with torch.no_grad():
        z = model(torch.tensor([ids])).logits[0, -1]
    assert att.logit == pytest.approx(float(z[att.target.id]), abs=1e-4)  # the logit transformers computes
    gen = m.generate(PROMPT, greedy=True, max_new_tokens=3).to_dict()
    assert gen["prompt_ids"] == ids
    with torch.no_grad():  # transformers' greedy continuation of the same ids
        want = model.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False)[0, len(ids):].tolist()
    assert gen["generated_ids"] == want
    # score: the first token is scored after <s> by default; --no-bos wins
    score = m.score(PROMPT)
    assert score.reading.bos and len(score.reading.ids) == len(ids) - 1
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    got = score.to_dict()
    assert got["bos"] is True
    assert torch.allclose(torch.tensor([t["logprob"] for t in got["tokens"]], dtype=torch.float64), want, atol=1e-4)
    assert not m.score(PROMPT, bos=False).reading.bos
    out = cli("score", PROMPT, "--model", str(folder), "--no-bos", "--json")
    assert out.exit_code == 0 and json.loads(out.stdout)["bos"] is False, out.output
    out = cli("score", PROMPT, "--model", str(folder), "--json")
    assert out.exit_code == 0 and json.loads(out.stdout)["bos"] is True, out.output


def test_the_server_reads_a_completion_prompt_after_bos(llama):
    folder, tok, model = llama
    ids = tok(PROMPT).input_ids
    with serving(folder) as s:
        doc = web.post(s.url + "/v1/completions", timeout=120, json={
            "model": "m", "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1}).json()
        tokenized = web.post(s.url + "/tokenize", timeout=60, json={"prompt": PROMPT}).json()["tokens"]
        plain = web.post(s.url + "/tokenize", timeout=60,  # lm-evaluation-harness's remote tokenizer asks so
                         json={"prompt": PROMPT, "add_special_tokens": False}).json()["tokens"]
    assert tokenized == ids and plain == ids[1:]
    lp = doc["choices"][0]["logprobs"]
    assert doc["usage"]["prompt_tokens"] == len(ids)
    assert lp["tokens"][0] == "<s>" and lp["token_logprobs"][0] is None
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    for i, got in enumerate(lp["token_logprobs"][1:], start=1):
        assert got == pytest.approx(float(ref[i - 1, ids[i]]), abs=1e-4)


def test_tokenizer_config_add_bos_token_false_wins(llama, tmp_path):
    """tokenizer_config.json's add_bos_token: false turns BOS off, as llama.cpp's converter reads it
    (it writes tokenizer.ggml.add_bos_token from that key). transformers 5.25 still adds <s> here when
    tokenizer.json's post-processor does (its add_bos_token then reads False): a folder whose two files
    disagree; lmhead follows the key."""
    import shutil

    folder = tmp_path / "no-bos"
    shutil.copytree(llama[0], folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"add_bos_token": False}))
    ids = llama[1](PROMPT, add_special_tokens=False).input_ids
    m = lmhead_cli.load(str(folder), device="cpu")
    assert not m.adds_bos
    assert [t["id"] for t in m.inspect(PROMPT).to_dict()["prompt_tokens"]] == ids
    assert not m.score(PROMPT).reading.bos


def test_gpt2_is_unchanged(tmp_path):
    """GPT-2's tokenizer adds nothing: no BOS in inspect, score's first token unscored unless --bos."""
    folder = tmp_path / "gpt2"
    build_checkpoint(folder)
    m = lmhead_cli.load(str(folder), device="cpu")
    assert not m.adds_bos
    assert [t["id"] for t in m.inspect(PROMPT).to_dict()["prompt_tokens"]] == m.encode(PROMPT)
    assert not m.score(PROMPT).reading.bos and m.score(PROMPT, bos=True).reading.bos


def test_a_prompt_that_tokenizes_to_nothing_is_one_line(tmp_path):
    """A tokenizer whose normalizer drops every character of a prompt: one line, exit 2, not torch's
    "Expected tensor for argument #1 'indices'"."""
    from tokenizers import Regex, Tokenizer, normalizers

    folder = tmp_path / "drops"
    build_checkpoint(folder)
    tok = Tokenizer.from_file(str(_gpt2_json(folder)))
    tok.normalizer = normalizers.Replace(Regex("[xyz]"), "")
    tok.save(str(folder / "tokenizer.json"))
    out = cli("inspect", "xyzzy", "--model", str(folder))
    assert out.exit_code == 2, out.output
    assert out.stderr == "lmhead: error: the prompt (5 characters) encodes to no tokens with this model's tokenizer; " \
                         "give text that it keeps\n", out.output
    from lmhead_cli.errors import NoTokens

    with pytest.raises(NoTokens):
        lmhead_cli.load(str(folder), device="cpu").inspect("xyzzy")


def _gpt2_json(folder):
    """GPT-2's tokenizer as one tokenizer.json in `folder` (from its vocab.json and merges.txt)."""
    from lmhead_cli.loading.tokenizer import GPT2Tokenizer

    path = folder / "tokenizer.json"
    GPT2Tokenizer.from_folder(folder).tok.save(str(path))
    return path
