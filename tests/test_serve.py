"""`lmhead serve`: a real server process on 127.0.0.1, talked to with the official `openai` client and
raw HTTP (httpx). transformers is the oracle: echo logprobs are its log_softmax at every position,
greedy text is its generate()."""

from __future__ import annotations

import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from helpers import PROMPT, PROMPT_IDS, serving, web

openai = pytest.importorskip("openai")
from openai.types import Completion  # noqa: E402
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402

KEY = "test-key-1234"
V = 50257


@pytest.fixture(scope="module")
def server(tiny):
    with serving(tiny[0]) as s:
        yield s


@pytest.fixture(scope="module")
def strict(tiny):
    """A server with a key, a queue of 4 rows, batches of one row, a small body limit and a logprobs cap."""
    with serving(tiny[0], "--api-key", KEY, "--max-queue", "4", "--max-batch", "1", "--max-body", "4096",
                 "--max-logprobs", "100") as s:
        yield s


def client(served, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key=key, max_retries=0, timeout=120)


def post(served, path: str, body, **kw) -> httpx.Response:
    return web.post(served.url + path, json=body, timeout=120, **kw)


def oracle_logprobs(model, ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax at every position of `ids`: (T, V)."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def validate_completion(doc: dict) -> Completion:
    """Completion.model_validate, after checking echo's first position is null (OpenAI's legacy API and
    vLLM put null there; the openai package's types declare floats only) and setting it aside."""
    doc = json.loads(json.dumps(doc))
    for c in doc["choices"]:
        lp = c.get("logprobs")
        if lp and lp["token_logprobs"] and lp["token_logprobs"][0] is None:
            assert lp["top_logprobs"][0] is None and lp["top_ids"][0] is None
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset", "top_ids"):
                lp[key] = lp[key][1:]
    return Completion.model_validate(doc)


# ---- what the answers hold -------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", [PROMPT, [PROMPT], PROMPT_IDS, [PROMPT_IDS]])
def test_echo_logprobs_are_transformers_log_softmax(server, tiny, prompt):
    r = client(server).completions.create(model="tiny", prompt=prompt, echo=True, max_tokens=0, logprobs=5)
    (choice,) = r.choices
    assert choice.index == 0 and choice.text == PROMPT and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp.tokens == ["The", " keys", " on", " the", " table"]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [0, 3, 8, 11, 15]
    ref = oracle_logprobs(tiny[1], PROMPT_IDS)
    for i in range(1, len(PROMPT_IDS)):
        assert lp.token_logprobs[i] == pytest.approx(float(ref[i - 1, PROMPT_IDS[i]]), abs=1e-4)
        top = torch.topk(ref[i - 1], 5)
        pairs = lp.model_extra["top_ids"][i]
        assert [p[0] for p in pairs[:5]] == top.indices.tolist()
        assert [p[1] for p in pairs[:5]] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert lp.tokens[i] in lp.top_logprobs[i]  # the chosen token is always in its top dict
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 0


def test_echo_for_several_prompts_sets_each_index(server, tiny):
    prompts = [PROMPT_IDS, [40, 1101, 257], list(range(300, 340))]
    r = post(server, "/v1/completions", {"prompt": prompts, "echo": True, "max_tokens": 0, "logprobs": 0}).json()
    validate_completion(r)
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    for ids, c in zip(prompts, r["choices"]):
        ref = oracle_logprobs(tiny[1], ids)
        want = ref[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        assert c["logprobs"]["token_logprobs"][1:] == pytest.approx(want.tolist(), abs=1e-4)
        assert all(len(top) == 1 for top in c["logprobs"]["top_logprobs"][1:])  # logprobs 0: the chosen token


def test_all_v_logprobs_keep_every_id_apart(server, tiny):
    """logprobs = V at one position: every id once in top_ids (the dict may merge same-text ids), summing to 1."""
    r = post(server, "/v1/completions", {"prompt": PROMPT_IDS[:2], "echo": True, "max_tokens": 0, "logprobs": V}).json()
    pairs = r["choices"][0]["logprobs"]["top_ids"][1]
    assert sorted(p[0] for p in pairs) == list(range(V))
    assert torch.logsumexp(torch.tensor([p[1] for p in pairs], dtype=torch.float64), 0) == pytest.approx(0, abs=1e-4)


def test_greedy_text_is_transformers_generate(server, tiny):
    folder, model = tiny
    out = model.generate(torch.tensor([PROMPT_IDS]), max_new_tokens=12, do_sample=False, pad_token_id=50256)
    from lmhead_cli.loading.tokenizer import GPT2Tokenizer

    want = GPT2Tokenizer.from_folder(folder).decode(out[0, len(PROMPT_IDS):].tolist())
    r = client(server).completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2)
    assert r.choices[0].text == want
    validate_completion(r.model_dump())
    # with echo and max_tokens = 1, as lm-evaluation-harness asks: prompt tokens, then the one generated
    r = post(server, "/v1/completions", {"prompt": [PROMPT_IDS], "echo": True, "max_tokens": 1, "temperature": 0,
                                         "logprobs": 1}).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(PROMPT_IDS) + 1
    assert lp["top_ids"][-1][0][0] == int(out[0, len(PROMPT_IDS)])


def test_processed_logprobs_follow_the_softcap(server, tiny):
    ref = oracle_logprobs(tiny[1], PROMPT_IDS)  # raw
    capped = torch.log_softmax(2.0 * torch.tanh(_logits(tiny[1]) / 2.0), -1)  # Gemma's c·tanh(z/c), c = 2
    for mode, want in (("raw", ref), ("processed", capped)):
        r = post(server, "/v1/completions", {"prompt": PROMPT_IDS, "echo": True, "max_tokens": 0, "logprobs": 1,
                                             "softcap": 2.0, "logprobs_mode": mode}).json()
        got = r["choices"][0]["logprobs"]["token_logprobs"][1:]
        expect = want[:-1].gather(-1, torch.tensor(PROMPT_IDS[1:])[:, None])[:, 0]
        assert got == pytest.approx(expect.tolist(), abs=1e-4)


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([PROMPT_IDS])).logits[0].float()


def test_stream_equals_unstreamed(server):
    c = client(server)
    for body in ({"prompt": PROMPT, "max_tokens": 20, "temperature": 0.9, "top_p": 0.95, "seed": 7, "logprobs": 2},
                 {"prompt": PROMPT, "max_tokens": 20, "temperature": 0, "echo": True, "logprobs": 1},
                 {"prompt": [PROMPT, "Hello"], "max_tokens": 8, "temperature": 1.0, "seed": 3, "n": 2}):
        whole = c.completions.create(model="tiny", **body)
        pieces: dict[int, list[str]] = {}
        tokens: dict[int, list[str]] = {}
        finish = {}
        for chunk in c.completions.create(model="tiny", stream=True, **body):
            for ch in chunk.choices:
                pieces.setdefault(ch.index, []).append(ch.text)
                if ch.logprobs:
                    tokens.setdefault(ch.index, []).extend(ch.logprobs.tokens)
                if ch.finish_reason:
                    finish[ch.index] = ch.finish_reason
        for ch in whole.choices:
            assert "".join(pieces[ch.index]) == ch.text
            assert finish[ch.index] == ch.finish_reason
            if ch.logprobs:
                assert tokens[ch.index] == ch.logprobs.tokens


def test_stream_ends_with_done_and_usage(server):
    with web.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2].removeprefix("data: "))
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def test_stop_strings_end_the_text_before_them(server):
    c = client(server)
    full = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    cut = full[:full.index(stop)]
    r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, stop=[stop, "\x00never"])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = "".join(ch.text for chunk in c.completions.create(model="tiny", prompt=PROMPT, max_tokens=10,
                                                                temperature=0, stop=stop, stream=True)
                       for ch in chunk.choices)
    assert streamed == cut


def test_n_choices_draw_with_seed_plus_index(server):
    c = client(server)
    many = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, n=3, seed=11, temperature=1.0)
    assert [ch.index for ch in many.choices] == [0, 1, 2]
    for j in range(3):
        one = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, seed=11 + j, temperature=1.0)
        assert one.choices[0].text == many.choices[j].text


def test_chat_uses_the_plain_template_and_validates(server):
    c = client(server)
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=6,
                                  temperature=0, logprobs=True, top_logprobs=3)
    raw = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6,
                                                "temperature": 0, "logprobs": True, "top_logprobs": 3}).json()
    ChatCompletion.model_validate(raw)
    assert raw["id"].startswith("chatcmpl-") and isinstance(raw["created"], int)
    same = c.completions.create(model="tiny", prompt="user: Hello\nassistant:", max_tokens=6, temperature=0)
    assert r.choices[0].message.content == same.choices[0].text
    for entry in r.choices[0].logprobs.content:
        assert bytes(entry.bytes).decode("utf-8", "backslashreplace") == entry.token
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob >= entry.logprob - 1e-6
    chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                            max_tokens=6, temperature=0, stream=True))
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk.model_dump())
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == r.choices[0].message.content


def test_models_health_and_tokenizer_endpoints(server, tiny):
    assert [m.id for m in client(server).models.list()] == [tiny[0].name]
    assert web.get(server.url + "/health").json()["status"] == "ok"
    info = web.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>" and info["model_max_length"] == 1024
    assert post(server, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False}).json()["tokens"] == PROMPT_IDS
    assert post(server, "/tokenize", {"prompt": "<|endoftext|>"}).json()["tokens"] == [50256]
    assert post(server, "/detokenize", {"tokens": PROMPT_IDS}).json() == {"prompt": PROMPT}


# ---- many clients ----------------------------------------------------------------------------------

def _requests() -> list[dict]:
    bodies = []
    for i in range(16):
        ids = PROMPT_IDS + list(range(1000 + 37 * i, 1000 + 37 * i + i))  # lengths 5 … 20
        if i % 3 == 0:
            bodies.append({"prompt": [ids], "echo": True, "max_tokens": 1, "temperature": 0, "logprobs": 2})
        elif i % 3 == 1:
            bodies.append({"prompt": ids, "max_tokens": 4 + i, "temperature": 0, "logprobs": 1})
        else:
            bodies.append({"prompt": ids, "max_tokens": 6, "temperature": 0.8, "seed": i, "n": 2})
    return bodies


def _answer(doc: dict) -> list:
    return [(c["text"], c["finish_reason"], c["logprobs"] and c["logprobs"]["tokens"],
             c["logprobs"] and c["logprobs"]["token_logprobs"]) for c in doc["choices"]]


def test_16_concurrent_clients_get_their_one_at_a_time_answers(server):
    bodies = _requests()
    alone = [_answer(post(server, "/v1/completions", b).json()) for b in bodies]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda b: _answer(post(server, "/v1/completions", b).json()), bodies))
    for a, t in zip(alone, together):
        for (text_a, fin_a, tok_a, lp_a), (text_t, fin_t, tok_t, lp_t) in zip(a, t):
            assert (text_t, fin_t, tok_t) == (text_a, fin_a, tok_a)
            if lp_a:  # the same figures, up to float rounding of a padded batch
                assert [x is None for x in lp_t] == [x is None for x in lp_a]
                assert [x for x in lp_t if x is not None] == pytest.approx([x for x in lp_a if x is not None], abs=1e-4)


# What docs/serve.md promises of a greedy request's logprobs beside 15 others, against the same request
# alone, per --dtype: the worst difference measured (docs/serve.md's table) with room for other prompts.
COMPANY_BOUND = {"float32": 1e-4, "bfloat16": 0.05, "int8": 1e-4}


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
@pytest.mark.slow
def test_16_concurrent_clients_keep_their_logprobs_within_the_dtypes_bound(tiny, dtype):
    """Issue 50: with --dtype bfloat16 one greedy request's logprobs moved by up to 0.014-0.032 beside
    15 others (an earlier step's code). docs/serve.md's table says what holds per dtype; this holds it
    (float32: test_16_concurrent_clients_get_their_one_at_a_time_answers)."""
    bodies = _requests()
    with serving(tiny[0], "--dtype", dtype) as s:
        alone = [_answer(post(s, "/v1/completions", b).json()) for b in bodies]
        with ThreadPoolExecutor(16) as pool:
            together = list(pool.map(lambda b: _answer(post(s, "/v1/completions", b).json()), bodies))
    worst = 0.0
    for a, t in zip(alone, together):
        for (text_a, fin_a, tok_a, lp_a), (text_t, fin_t, tok_t, lp_t) in zip(a, t):
            assert (text_t, fin_t, tok_t) == (text_a, fin_a, tok_a)
            if lp_a:
                assert [x is None for x in lp_t] == [x is None for x in lp_a]
                worst = max([worst, *(abs(x - y) for x, y in zip(lp_t, lp_a) if x is not None)])
    print(f"{dtype}: worst |logprob difference| {worst:.2e}")
    assert worst <= COMPANY_BOUND[dtype]


# ---- bad requests ----------------------------------------------------------------------------------

BAD = [
    ("not json", "/v1/completions", b"{prompt: 1", None),
    ("not an object", "/v1/completions", b"[1, 2]", None),
    ("NaN", "/v1/completions", b'{"prompt": "a", "temperature": NaN}', None),
    ("prompt type", "/v1/completions", {"prompt": 5}, "prompt"),
    ("mixed prompt", "/v1/completions", {"prompt": ["a", 1]}, "prompt"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, "prompt"),
    ("id outside vocab", "/v1/completions", {"prompt": [1, 50257]}, "prompt"),
    ("negative id", "/v1/completions", {"prompt": [[1, -1]]}, "prompt"),
    ("negative logprobs", "/v1/completions", {"prompt": "a", "logprobs": -1}, "logprobs"),
    ("logprobs over V", "/v1/completions", {"prompt": "a", "logprobs": V + 1}, "logprobs"),
    ("logprobs type", "/v1/completions", {"prompt": "a", "logprobs": "5"}, "logprobs"),
    ("temperature < 0", "/v1/completions", {"prompt": "a", "temperature": -0.5}, "temperature"),
    ("temperature tiny", "/v1/completions", {"prompt": "a", "temperature": 1e-9}, "temperature"),
    ("top_p 0", "/v1/completions", {"prompt": "a", "top_p": 0}, "top_p"),
    ("top_p > 1", "/v1/completions", {"prompt": "a", "top_p": 1.5}, "top_p"),
    ("max_tokens < 0", "/v1/completions", {"prompt": "a", "max_tokens": -1}, "max_tokens"),
    ("echo type", "/v1/completions", {"prompt": "a", "echo": "yes"}, "echo"),
    ("stop type", "/v1/completions", {"prompt": "a", "stop": [1]}, "stop"),
    ("n 0", "/v1/completions", {"prompt": "a", "n": 0}, "n"),
    ("mode", "/v1/completions", {"prompt": "a", "logprobs_mode": "cooked"}, "logprobs_mode"),
    ("penalty", "/v1/completions", {"prompt": "a", "presence_penalty": 1.0}, "presence_penalty"),
    ("cost", "/v1/completions", {"prompt": [PROMPT_IDS] * 50, "echo": True, "max_tokens": 0, "logprobs": V}, "logprobs"),
    ("chat messages", "/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("chat top without logprobs", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("detokenize", "/detokenize", {"tokens": [1, 99999]}, "tokens"),
]


@pytest.mark.parametrize("name, path, body, param", BAD, ids=[b[0] for b in BAD])
def test_bad_request_is_400_in_openai_shape(server, name, path, body, param):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = web.post(server.url + path, timeout=60, **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param


def test_context_overflow_names_both_numbers(server):
    r = post(server, "/v1/completions", {"prompt": list(range(1000)), "max_tokens": 30})
    assert r.status_code == 400
    assert "1,000 tokens plus max_tokens 30" in r.json()["error"]["message"] and "1,024" in r.json()["error"]["message"]


def test_unknown_path_and_method(server):
    r = web.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"] == "no such path: /v1/nothing"
    assert web.get(server.url + "/v1/completions").status_code == 405
    assert web.get(server.url + "/health").status_code == 200  # none of these stopped the server


def test_key_body_limit_and_logprobs_cap(strict):
    c = client(strict, KEY)
    assert c.completions.create(model="x", prompt=PROMPT, max_tokens=1).choices[0].text
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = web.post(strict.url + "/v1/completions", json={"prompt": "a"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(strict, "wrong").models.list()
    assert web.get(strict.url + "/health").status_code == 200  # open: it says nothing of the model
    auth = {"Authorization": f"Bearer {KEY}"}
    r = web.post(strict.url + "/v1/completions", json={"prompt": "a" * 5000}, headers=auth)
    assert r.status_code == 413 and "4,096 bytes" in r.json()["error"]["message"]
    r = web.post(strict.url + "/v1/completions", json={"prompt": "a", "logprobs": 101}, headers=auth)
    assert r.status_code == 400 and "between 0 and 100" in r.json()["error"]["message"]


@pytest.mark.slow
def test_full_queue_is_503_with_retry_after_and_a_gone_client_stops_its_work(strict):
    auth = {"Authorization": f"Bearer {KEY}"}
    # 4 rows of 1,000 tokens, run one at a time: while the first runs, 3 wait. A 1-row request sent next runs
    # at once beside it (a request with no row running joins a full batch, up to twice --max-batch rows);
    # one more 1-row request then waits: 4 queued, and the queue is full
    long = {"prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "stream": True, "n": 4}
    health = lambda: web.get(strict.url + "/health").json()  # noqa: E731
    send = lambda body: threading.Thread(target=lambda: web.post(  # noqa: E731
        strict.url + "/v1/completions", headers=auth, timeout=300, json=body))
    with web.stream("POST", strict.url + "/v1/completions", json=long, headers=auth, timeout=120) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the response, and so the connection
        next(lines)  # its first row runs
        beside, queued = send({"prompt": PROMPT, "max_tokens": 800}), send({"prompt": PROMPT, "max_tokens": 1})
        beside.start()
        deadline = time.monotonic() + 30
        while health()["running"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        queued.start()
        while health()["queued"] < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        busy = web.post(strict.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1}, headers=auth)
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert busy.json()["error"]["code"] == "overloaded"
    # the stream is closed: its row leaves the batch, the queued request runs, generation stops
    queued.join(timeout=60)
    beside.join(timeout=60)
    assert not queued.is_alive() and not beside.is_alive()
    first = health()["generated"]
    time.sleep(1.0)
    assert health()["generated"] == first < 4000


def test_a_client_that_times_out_stops_its_work(server):
    """8 choices of 1,000 tokens: the tiny model makes 1,000 in about 0.3 s on this machine, so one choice
    could end before the client's 0.5 s (it did once in CI); 8,000 cannot."""
    before = web.get(server.url + "/health").json()["generated"]
    with pytest.raises(httpx.TimeoutException):
        web.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1000, "n": 8,
                                                       "temperature": 0}, timeout=0.5)
    time.sleep(1.0)
    first = web.get(server.url + "/health").json()["generated"]
    time.sleep(1.0)
    assert web.get(server.url + "/health").json()["generated"] == first < before + 8000


def test_non_loopback_host_without_key_warns(tiny):
    import subprocess
    import sys

    from helpers import free_port

    proc = subprocess.Popen([sys.executable, "-m", "lmhead_cli", "serve", "--model", str(tiny[0]), "--host", "0.0.0.0",
                             "--port", str(free_port())], stderr=subprocess.PIPE, text=True)
    try:
        line = _read_line(proc.stderr, timeout=60)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    assert line.startswith("lmhead: warning: serving on 0.0.0.0") and "--api-key" in line


def _read_line(stream, timeout: float) -> str:
    got: list[str] = []
    t = threading.Thread(target=lambda: got.append(stream.readline()), daemon=True)
    t.start()
    t.join(timeout)
    return got[0] if got else ""


def test_math_is_finite_in_json(server):
    """top_p drops tokens: processed logprobs of -inf go out as OpenAI's -9999.0, never as invalid JSON."""
    r = post(server, "/v1/completions", {"prompt": PROMPT_IDS, "echo": True, "max_tokens": 0, "logprobs": 3,
                                         "top_p": 0.001, "logprobs_mode": "processed"})
    lps = r.json()["choices"][0]["logprobs"]["token_logprobs"][1:]
    assert all(math.isfinite(x) for x in lps) and -9999.0 in lps


def test_other_work_runs_on_the_model_thread_between_batches():
    """Worker.call (the page's readings): fn() on the model's thread, its result or its exception back."""
    import asyncio

    from lmhead_cli.serve.worker import Worker

    class Model:
        n_ctx = 16

    worker = Worker(Model())
    try:
        assert asyncio.run(worker.call(lambda: threading.current_thread().name)) == "lmhead-model"
        with pytest.raises(ZeroDivisionError):
            asyncio.run(worker.call(lambda: 1 / 0))
    finally:
        worker.stop()


# ---- lmhead's `uncertainty` field -------------------------------------------------------------------

def _spread(lp: torch.Tensor) -> tuple[float, float, float]:
    """Entropy, varentropy and margin of one distribution's log-probabilities (V,), in float64 here."""
    lp = lp.double()
    p = lp.exp()
    h = float(-(p * lp).nan_to_num(nan=0.0).sum())
    var = float((p * (lp + h) ** 2).nan_to_num(nan=0.0).sum())
    two = torch.topk(lp, 2).values
    return h, var, float(two[0] - two[1])


def test_uncertainty_of_echoed_positions_is_score_s_through_the_openai_client(server, tiny):
    import lmhead_cli

    text = PROMPT + " are on the table, and the keys are mine."
    r = client(server).completions.create(model="tiny", prompt=text, echo=True, max_tokens=0, logprobs=0,
                                          extra_body={"uncertainty": True})
    extra = r.choices[0].logprobs.model_extra
    tokens = lmhead_cli.load(str(tiny[0]), device="cpu").score(text).to_dict()["tokens"]
    assert len(extra["entropy"]) == len(tokens) == len(r.choices[0].logprobs.token_logprobs)
    assert extra["entropy"][0] is extra["varentropy"][0] is extra["margin"][0] is None  # nothing before it
    for k in ("entropy", "varentropy", "margin"):
        assert extra[k][1:] == pytest.approx([t[k] for t in tokens[1:]], abs=1e-5)
    assert min(extra["varentropy"][1:]) > 0 and min(extra["margin"][1:]) > 0
    plain = client(server).completions.create(model="tiny", prompt=text, echo=True, max_tokens=0, logprobs=0)
    assert "entropy" not in (plain.choices[0].logprobs.model_extra or {})  # only when asked


def test_uncertainty_of_generated_tokens_raw_and_processed(server, tiny):
    """Each generated step's figures against transformers' logits at that step: raw, and processed after
    top_k = 2 (two tokens left: entropy of two, margin their gap) and top_k = 1 (one: 0, 0, null)."""
    body = {"prompt": PROMPT_IDS, "max_tokens": 3, "temperature": 0, "logprobs": 1, "uncertainty": True}
    r = post(server, "/v1/completions", body).json()
    lp = r["choices"][0]["logprobs"]
    ids = PROMPT_IDS + [pairs[0][0] for pairs in lp["top_ids"]]
    ref = oracle_logprobs(tiny[1], ids)
    for step in range(3):
        h, var, gap = _spread(ref[len(PROMPT_IDS) - 1 + step])
        assert (lp["entropy"][step], lp["varentropy"][step], lp["margin"][step]) == pytest.approx((h, var, gap), abs=1e-5)
    two = post(server, "/v1/completions", {**body, "top_k": 2, "logprobs_mode": "processed"}).json()
    z = _logits(tiny[1])[-1]
    kept = torch.full_like(z, float("-inf"))
    best = torch.topk(z, 2).indices
    kept[best] = z[best]
    h, var, gap = _spread(torch.log_softmax(kept.double(), -1))
    got = two["choices"][0]["logprobs"]
    assert (got["entropy"][0], got["varentropy"][0], got["margin"][0]) == pytest.approx((h, var, gap), abs=1e-5)
    one = post(server, "/v1/completions", {**body, "top_k": 1, "logprobs_mode": "processed"}).json()
    got = one["choices"][0]["logprobs"]
    assert got["entropy"] == [0.0] * 3 and got["varentropy"] == [0.0] * 3 and got["margin"] == [None] * 3


def test_uncertainty_in_chat_entries_and_its_refusal_without_logprobs(server):
    r = client(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=2, temperature=0, logprobs=True,
                                               extra_body={"uncertainty": True})
    for entry in r.choices[0].logprobs.content:
        assert set(entry.model_extra) == {"entropy", "varentropy", "margin"} and entry.model_extra["entropy"] > 0
    for path, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions",
                                                                 {"messages": [{"role": "user", "content": "Hi"}]})):
        bad = post(server, path, {**body, "max_tokens": 1, "uncertainty": True})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "uncertainty"
        assert "needs logprobs" in bad.json()["error"]["message"]
    wrong = post(server, "/v1/completions", {"prompt": PROMPT, "logprobs": 1, "uncertainty": "yes"})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "uncertainty"


HOSTILE_NAME = "m\x1b]0;retitled\x07\x1b[31m\x9b32m\u2028x"  # OSC retitle, BEL, SGR, C1 CSI, LINE SEPARATOR


@pytest.mark.parametrize("dry_run", [True, False])
def test_the_start_up_line_shows_a_hostile_folder_name_escaped(tiny, tmp_path, monkeypatch, dry_run):
    """`lmhead serve --model` with a folder whose name holds ESC, BEL or C1: the start-up line (and
    --dry-run's) shows them escaped, so the name cannot retitle or recolour the terminal."""
    import shutil

    from helpers import cli

    from lmhead_cli.serve import connections

    folder = tmp_path / HOSTILE_NAME
    shutil.copytree(tiny[0], folder)
    monkeypatch.setattr(connections, "run", lambda app, host, port, sock: sock.close())  # the line comes before it
    got = cli("serve", "--model", str(folder), "--port", "0", *(["--dry-run"] if dry_run else []))
    assert got.exit_code == 0, got.output
    line = (got.stdout if dry_run else got.stderr).splitlines()[0]
    assert line.startswith("would serve " if dry_run else "lmhead serve: ")
    assert "m\\x1b]0;retitled\\x07\\x1b[31m\\x9b32m\\u2028x at http://127.0.0.1:" in line
    assert not any(ch in got.output for ch in "\x1b\x07\x9b\u2028")


@pytest.mark.parametrize("host, url", [("::1", "http://[::1]:8000/v1"), ("127.0.0.1", "http://127.0.0.1:8000/v1"),
                                       ("localhost", "http://localhost:8000/v1"), ("fe80::1%lo", "http://[fe80::1%25lo]:8000/v1")])
def test_an_ipv6_host_is_in_brackets_in_the_url_shown(tiny, host, url):
    """Issue 50: `serve --host ::1 --dry-run` printed http://::1:8000/v1, which no client can parse."""
    from helpers import cli

    from lmhead_cli import serve

    assert serve.url(host, 8000) == url
    got = cli("serve", "--model", str(tiny[0]), "--host", host, "--dry-run")
    assert got.exit_code == 0, got.output
    assert got.stdout.splitlines()[0].startswith(f"would serve {tiny[0].name} at {url} (")


def test_the_command_ends_its_own_thread_pool_before_serving(tiny, monkeypatch):
    """`lmhead serve` loads on the main thread and decodes on the model's thread: the main thread's
    OpenMP helpers are ended before the server runs (libgomp throttles every thread's spin once the
    pools' threads outnumber the cores), and only where the command owns the process."""
    from helpers import cli

    from lmhead_cli.engine import execution
    from lmhead_cli.serve import connections

    seen = []
    monkeypatch.setattr(execution, "release_thread_pool", lambda: seen.append("released") or True)
    monkeypatch.setattr(connections, "run", lambda app, host, port, sock: seen.append("run") or sock.close())
    for owned, want in (([True], ["released", "run"]), ([], ["run"])):  # the `lmhead` command's process; a test's
        monkeypatch.setattr(execution, "_owned", owned)
        seen.clear()
        got = cli("serve", "--model", str(tiny[0]), "--port", "0")
        assert got.exit_code == 0, got.output
        assert seen == want


# ---- one decoding core: the same request gives the same answer at every door ------------------------

DOORS = [  # (settings as keywords, the CLI's flags, the server's fields)
    ({"temperature": 0}, ["--temperature", "0"], {"temperature": 0}),
    ({"temperature": 0.9, "top_k": 40, "seed": 7}, ["--temperature", "0.9", "--top-k", "40", "--seed", "7"],
     {"temperature": 0.9, "top_k": 40, "seed": 7}),
    ({"softcap": 2.0, "top_p": 0.9, "min_p": 0.01, "seed": 3},
     ["--softcap", "2", "--top-p", "0.9", "--min-p", "0.01", "--seed", "3"],
     {"softcap": 2.0, "top_p": 0.9, "min_p": 0.01, "seed": 3}),
]


@pytest.mark.parametrize("keywords, flags, fields", DOORS, ids=["temperature 0", "top-k", "softcap top-p min-p"])
def test_the_same_request_gives_the_same_tokens_and_logprobs_at_every_door(server, tiny, keywords, flags, fields):
    """CLI --json, Model.generate().to_dict() and the server, for one request: the same token ids (the
    server's text and top ids), the same raw and processed log-probabilities; and the server's answer is
    the same alone and beside 15 other requests with other settings."""
    import lmhead_cli
    from helpers import cli

    api = lmhead_cli.load(str(tiny[0]), device="cpu").generate(PROMPT, max_new_tokens=8, ignore_eos=True,
                                                               **keywords).to_dict()
    got = cli("generate", PROMPT, "-n", "8", "--ignore-eos", *flags, "--model", str(tiny[0]), "--json")
    assert got.exit_code == 0, got.output
    doc = json.loads(got.stdout)
    assert doc["generated_ids"] == api["generated_ids"] and doc["text"] == api["text"]
    for a, b in zip(doc["steps"], api["steps"], strict=True):
        assert (a["logprob"], a["raw_logprob"]) == pytest.approx((b["logprob"], b["raw_logprob"]), abs=1e-6)
    body = {"prompt": PROMPT, "max_tokens": 8, "logprobs": 1, **fields}
    answers = {}
    for mode in ("raw", "processed"):
        r = post(server, "/v1/completions", {**body, "logprobs_mode": mode}).json()
        lp = r["choices"][0]["logprobs"]
        ids = api["generated_ids"]
        n = ids.index(50256) + 1 if 50256 in ids else len(ids)  # the server ends at end-of-text
        assert len(lp["token_logprobs"]) == n and r["choices"][0]["text"] == api["text"][:len(r["choices"][0]["text"])]
        if n == len(ids):
            assert r["choices"][0]["text"] == api["text"]
        key = "raw_logprob" if mode == "raw" else "logprob"
        assert lp["token_logprobs"] == pytest.approx([st[key] for st in api["steps"][:n]], abs=1e-4)
        answers[mode] = _answer(r)
    # the same request among 15 others with other settings, all at once
    others = _requests()[:15]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda b: _answer(post(server, "/v1/completions", b).json()),
                                 [{**body, "logprobs_mode": "raw"}] + others))
    (text_a, fin_a, tok_a, lp_a), = answers["raw"]
    (text_t, fin_t, tok_t, lp_t), = together[0]
    assert (text_t, fin_t, tok_t) == (text_a, fin_a, tok_a) and lp_t == pytest.approx(lp_a, abs=1e-4)


# ---- continuous batching: rows join and leave the running batch between two steps ----------------------

def test_a_short_request_finishes_while_a_long_one_runs(server):
    long = {"prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "stream": True}
    with web.stream("POST", server.url + "/v1/completions", json=long, timeout=120) as r:
        lines = r.iter_lines()
        next(lines)  # the long row runs
        short = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0}).json()
        assert short["choices"][0]["finish_reason"] == "length" and short["usage"]["completion_tokens"] == 4
        assert web.get(server.url + "/health").json()["running"] >= 1  # the long one is still going
        assert next(line for line in lines if line).startswith("data: {")  # and still streaming


def test_rows_join_and_leave_a_running_batch_each_equal_to_its_answer_alone(server):
    """Requests sent one after another while a long streamed row runs: each joins the running batch and
    leaves it while the long row goes on, and every answer (the long one too) equals the one it gets alone."""
    long = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "logprobs": 1}
    joiners = [{"prompt": "Hello there", "max_tokens": 6, "temperature": 0, "logprobs": 2},
               {"prompt": PROMPT_IDS[:3], "max_tokens": 8, "temperature": 0.8, "seed": 3, "n": 2, "logprobs": 1},
               {"prompt": "The door", "max_tokens": 5, "temperature": 0.9, "top_k": 40, "seed": 7, "stop": [" "]}]
    alone = [_answer(post(server, "/v1/completions", b).json()) for b in [long] + joiners]
    tokens, logprobs, finish = [], [], None
    with web.stream("POST", server.url + "/v1/completions", json={**long, "stream": True}, timeout=120) as r:
        lines = (json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {"))
        first = next(lines)["choices"][0]  # the long row runs
        tokens += first["logprobs"]["tokens"]
        logprobs += first["logprobs"]["token_logprobs"]
        together = []
        for b in joiners:
            together.append(_answer(post(server, "/v1/completions", b).json()))
        running = web.get(server.url + "/health").json()["running"]
        for chunk in lines:
            c = chunk["choices"][0]
            if c["logprobs"]:
                tokens += c["logprobs"]["tokens"]
                logprobs += c["logprobs"]["token_logprobs"]
            finish = c["finish_reason"] or finish
    assert running >= 1  # the long row was still running when the last joiner had left
    for a, t in zip(alone[1:], together, strict=True):
        for (text_a, fin_a, tok_a, lp_a), (text_t, fin_t, tok_t, lp_t) in zip(a, t, strict=True):
            assert (text_t, fin_t, tok_t) == (text_a, fin_a, tok_a)
            assert lp_t == pytest.approx(lp_a, abs=1e-4)
    (text_a, fin_a, tok_a, lp_a), = alone[0]
    assert (tokens, finish) == (tok_a, fin_a) and "".join(tokens) == text_a and logprobs == pytest.approx(lp_a, abs=1e-4)


@pytest.mark.slow
def test_a_request_with_many_choices_never_holds_a_one_row_request_behind_all_of_its_rows(tiny):
    """Two rows at a time: a request of 8 choices fills both; a 1-row request sent after it takes the next
    free row (round-robin across requests), so it ends while most of the 8 still wait."""
    with serving(tiny[0], "--max-batch", "2") as s:
        done = {}

        def many():
            post(s, "/v1/completions", {"prompt": PROMPT, "max_tokens": 60, "n": 8, "temperature": 0.8, "seed": 1})
            done["many"] = time.monotonic()

        t = threading.Thread(target=many)
        t.start()
        deadline = time.monotonic() + 60
        while web.get(s.url + "/health").json()["running"] < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        one = post(s, "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0})
        done["one"] = time.monotonic()
        queued = web.get(s.url + "/health").json()["queued"]
        t.join(timeout=300)
        assert one.status_code == 200 and done["one"] < done["many"]
        assert queued >= 4  # most of the 8 had not been admitted yet when the 1-row request ended


def test_a_client_that_disconnects_mid_stream_frees_its_row_at_the_next_step(server):
    health = lambda: web.get(server.url + "/health").json()  # noqa: E731
    with web.stream("POST", server.url + "/v1/completions", timeout=120,
                      json={"prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "stream": True}) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert health()["running"] == 1
    deadline = time.monotonic() + 10
    while health()["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert health()["running"] == 0
    first = health()["generated"]
    time.sleep(0.5)
    assert health()["generated"] == first


@pytest.mark.parametrize("route", ["/api/score", "/api/calibrate"])
@pytest.mark.slow
def test_a_completion_passes_the_pages_long_reading(tiny, route):
    """Issue 50: the page's POST /api/calibrate held the model 15 s and a one-token /v1/completions sent
    1 s later waited 14 s; /api/score's 20,000 tokens would hold it ~160 s. The page's reading now gives
    the rows their share at each of its pieces (Worker.interlude): the completion is answered while the
    page's reading still runs, in a fraction of its time."""
    words = "the keys on the table are here and there in the house of my father".split()
    n = 2000 if route == "/api/score" else 300  # calibrate's fit makes up to 30 more passes of the head
    text = " ".join(words[i % len(words)] for i in range(n))
    with serving(tiny[0]) as s:
        page = {}

        def read() -> None:
            start = time.perf_counter()
            page["response"] = web.post(s.url + route, json={"text": text}, timeout=600)
            page["s"] = time.perf_counter() - start

        reader = threading.Thread(target=read)
        reader.start()
        while not web.get(s.url + "/health", timeout=60).json()["busy"]:  # the page's call has begun
            assert reader.is_alive(), page
            time.sleep(0.01)
        start = time.perf_counter()
        one = web.post(s.url + "/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 1}, timeout=600)
        waited = time.perf_counter() - start
        page_running = reader.is_alive()
        reader.join()
    assert one.status_code == 200 and len(one.json()["choices"][0]["text"]) > 0
    assert page["response"].status_code == 200, page["response"].text
    assert page_running and waited < page["s"] / 2, (waited, page["s"])
