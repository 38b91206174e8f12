"""The HTML view's data without a browser: the score reading's top-k alternatives against transformers,
the view document against the Score, the JSON that sits in a page, and the page's JSON routes and their
errors (tests/test_page.py drives the same in chromium)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import nan_checkpoint

from lmhead_cli.errors import BadValue
from lmhead_cli.readings.score import MAX_ALTERNATIVES, score_text
from lmhead_cli.render import safe_text
from lmhead_cli.render.html import score_html, score_view, script_json, token_pieces

TEXT = "The keys on the table are on the table. Café 日本語 \x1b[2J\x07 </script><b>x</b>"


@pytest.fixture(scope="module")
def loaded(tiny):
    from lmhead_cli.loading.sources import load_model

    return load_model(str(tiny[0]), threads=1)


def test_alternatives_are_transformers_top_k(loaded, tiny):
    """Every scored position keeps the K most probable tokens and their log p, as transformers has them;
    across window boundaries too (stride < context)."""
    model = tiny[1]
    ids = torch.tensor(list(loaded.tokenizer.encode_long(TEXT)))
    s = score_text(loaded, TEXT, alternatives=4, chunk=3)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids[None]).logits[0].float(), -1)  # (T, V)
    want = torch.topk(logp[:-1], 4, dim=-1)  # position p predicts token p + 1
    assert s.alt_ids.shape == (len(ids), 4)
    assert s.alt_ids[0].tolist() == [-1] * 4 and bool(s.alt_logprob[0].isnan().all())  # token 0: unscored
    assert torch.equal(s.alt_ids[1:], want.indices)
    torch.testing.assert_close(s.alt_logprob[1:], want.values, atol=1e-4, rtol=0)
    assert torch.equal(s.alt_ids[1:, 0], s.top_id[1:])  # the first alternative is the model's top-1


def test_alternatives_bounded(loaded):
    with pytest.raises(BadValue, match=f"between 0 and {MAX_ALTERNATIVES}"):
        score_text(loaded, TEXT, alternatives=MAX_ALTERNATIVES + 1)
    assert score_text(loaded, TEXT).alt_ids is None  # nothing kept unless asked


def test_view_matches_the_score(loaded):
    s = score_text(loaded, TEXT, alternatives=5)
    view = score_view(s)
    assert len(view["tokens"]) == len(s.ids)
    for i, (tid, piece, token, rank, logprob, entropy, varentropy, margin, alts) in enumerate(view["tokens"]):
        t = s.token(i)
        assert (tid, rank, logprob, entropy) == (t.id, t.rank, t.logprob, t.entropy)
        assert (varentropy, margin) == (t.varentropy, t.margin)  # the hover's figures: score --json's
        assert [a[0] for a in alts] == ([] if not t.scored else s.alt_ids[i].tolist())
    assert "".join(token_pieces(s)) == safe_text(TEXT, keep="\n\t")
    assert [b["count"] for b in view["buckets"]] == s.bucket_counts()
    assert view["summary"]["perplexity"] == s.perplexity and view["summary"]["bits_per_byte"] == s.bits_per_byte


def test_page_json_cannot_close_its_script(loaded):
    s = score_text(loaded, TEXT, alternatives=5)
    text = script_json(score_view(s))
    assert "<" not in text and ">" not in text and "&" not in text
    assert json.loads(text)["tokens"][1][0] == s.token(1).id
    page = score_html(s)
    assert page.count("<script") == 2 and page.count("</script>") == 2  # the data and the view's script
    assert "Content-Security-Policy" in page and "http://" not in page and "https://" not in page
    assert "\x1b" not in page and "\x07" not in page


# ---- score --html and the API's to_html ---------------------------------------------------------------

def test_score_html_file_is_the_api_view(tiny, tmp_path):
    import lmhead_cli
    from typer.testing import CliRunner

    from lmhead_cli.cli import app

    path = tmp_path / "view.html"
    got = CliRunner().invoke(app, ["score", TEXT, "--model", str(tiny[0]), "--html", str(path), "--json"])
    assert got.exit_code == 0, got.stderr
    assert json.loads(got.stdout)["text"] == TEXT  # --html adds a file; stdout is as without it
    result = lmhead_cli.load(str(tiny[0]), threads=1).score(TEXT, alternatives=5)
    assert path.read_text(encoding="utf-8") == result.to_html()
    fragment = result._repr_html_()
    assert "<html" not in fragment and script_json(score_view(result.reading)) in fragment


@pytest.mark.parametrize("args,message", [
    (["--file", "-"], "--html shows one text; it cannot be combined with --file"),
    (["x y", "--html", "/no/such/folder/x.html"], "--html needs a file in a folder that exists"),
])
def test_score_html_bad_use(tiny, args, message):
    from typer.testing import CliRunner

    from lmhead_cli.cli import app

    argv = ["score", *args, "--model", str(tiny[0])]
    if "--html" not in args:
        argv += ["--html", "out.html"]
    got = CliRunner().invoke(app, argv)
    assert got.exit_code == 2 and message in got.stderr


def _score_html(tiny, path, *more):
    from typer.testing import CliRunner

    from lmhead_cli.cli import app

    return CliRunner().invoke(app, ["score", TEXT, "--model", str(tiny[0]), "--html", str(path), *more])


def test_score_html_replaces_a_link_never_its_target(tiny, tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    link = tmp_path / "link.html"
    link.symlink_to(target)
    got = _score_html(tiny, link)
    assert got.exit_code == 0, got.stderr
    assert target.read_text() == "keep me"  # the link's target is as it was
    assert not link.is_symlink() and link.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.html", "precious.txt"]  # no temporary file left


def test_score_html_replaces_a_file_whole_with_open_s_permissions(tiny, tmp_path):
    import os

    path = tmp_path / "view.html"
    path.write_text("x" * 10_000_000)  # longer than the page: a write through the old file would leave a tail
    got = _score_html(tiny, path)
    assert got.exit_code == 0, got.stderr
    page = path.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and page.endswith("</html>\n") and "xxx" not in page
    mask = os.umask(0o22)
    os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask  # not mkstemp's 0600


@pytest.mark.parametrize("make, kind", [
    (lambda p: __import__("os").mkfifo(p), "a FIFO (named pipe)"),
    (lambda p: __import__("socket").socket(__import__("socket").AF_UNIX).bind(str(p)), "a socket"),
])
def test_score_html_refuses_a_fifo_or_socket_before_any_work_without_blocking(tiny, tmp_path, monkeypatch, make, kind):
    from lmhead_cli.api import model as api_model

    path = tmp_path / "out.html"
    make(path)
    monkeypatch.setattr(api_model, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    got = _score_html(tiny, path)
    assert got.exit_code == 2 and "Traceback" not in got.output
    assert got.stderr.strip() == (f"lmhead: error: --html '{path}' is {kind}, not a regular file; give a new "
                                  "file's name (lmhead replaces only a regular file or a link)")


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    import os

    from lmhead_cli import outputs
    from lmhead_cli.errors import LmheadError

    path = tmp_path / "view.html"
    path.write_text("old")

    def full(*a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(LmheadError, match=f"cannot write '{path}': No space left on device"):
        outputs.write_atomically(str(path), "new", "--html")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["view.html"]


# ---- the page's routes ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(tiny):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    import lmhead_cli
    from lmhead_cli.serve.page import router

    app = FastAPI()
    app.include_router(router(lmhead_cli.load(str(tiny[0]), threads=1)))
    return TestClient(app)


def test_routes_serve_the_package_files(client):
    from lmhead_cli.page import asset

    for path, name in (("/", "index.html"), ("/page/page.css", "page.css"), ("/page/page.js", "page.js")):
        got = client.get(path)
        assert got.status_code == 200 and got.text == asset(name)
        assert "default-src 'self'" in got.headers["content-security-policy"]
    assert "http" not in asset("index.html").replace('http-equiv', '')  # no CDN, no font service


def test_score_route(client, loaded):
    got = client.post("/api/score", json={"text": TEXT})
    assert got.status_code == 200
    want = score_view(score_text(loaded, TEXT, alternatives=5))
    assert got.json() == json.loads(json.dumps(want))


@pytest.mark.parametrize("path,body,status,message", [
    ("/api/score", {"text": ""}, 400, "empty"),
    ("/api/score", {"text": 3}, 400, "text must be a string (got an integer)"),
    ("/api/score", {"text": "ab " * 200_000}, 413, "the page scores at most"),
    ("/api/inspect", {"prompt": "x", "top_k": 0}, 400, "top_k must be at least 1 (got 0)"),
    ("/api/inspect", {"prompt": "x", "top_k": 101}, 400, "top_k must be at most 100 (got 101)"),
    ("/api/inspect", {"prompt": "x", "targets": "a"}, 400, "targets must be an array of at most 100 strings"),
    ("/api/diff", {"a": "x"}, 400, "b is required"),
])
def test_route_errors(client, path, body, status, message):
    got = client.post(path, json=body)
    assert got.status_code == status and message in got.json()["error"]["message"]


def test_route_body_limit(client):
    from lmhead_cli.serve.page import MAX_BODY_BYTES

    got = client.post("/api/score", content=b'{"text": "' + b"a" * MAX_BODY_BYTES + b'"}',
                      headers={"content-type": "application/json"})
    assert got.status_code == 413 and "over the server's limit of 8,388,608 bytes" in got.json()["error"]["message"]


def test_route_bad_json(client):
    got = client.post("/api/score", content=b"{not json", headers={"content-type": "application/json"})
    assert got.status_code == 400 and got.json()["error"]["message"].startswith("the body is not valid JSON: ")


def test_model_error_is_an_answer(tiny, tmp_path):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    import lmhead_cli
    from lmhead_cli.serve.page import router

    app = FastAPI()
    app.include_router(router(lmhead_cli.load(str(nan_checkpoint(tiny[0], tmp_path)), threads=1)))
    got = TestClient(app).post("/api/score", json={"text": "The keys on the table"})
    assert got.status_code == 500 and "non-finite" in got.json()["error"]["message"]


def test_calibrate_route_is_calibrates_figures_and_its_html_diagrams(client, tiny):
    """/api/calibrate: calibrate's own figures and bins (`calibrate --json`, computed here through the
    API), and the two reliability diagrams that `calibrate --html` draws, as SVG text."""
    import lmhead_cli
    from lmhead_cli.render.calibrate import diagrams

    text = "The keys on the table are on the table. The keys on the table are here, and the dog is asleep."
    got = client.post("/api/calibrate", json={"text": text})
    assert got.status_code == 200, got.text
    view = got.json()
    result = lmhead_cli.load(str(tiny[0]), threads=1).calibrate(text)
    doc = result.to_dict()
    for key in ("positions", "bins", "ece", "brier", "nll", "temperature", "ece_at_temperature", "nll_at_temperature"):
        assert view[key] == doc[key], key
    assert view["svg"] == diagrams(result.reading) and len(view["svg"]) == 2
    assert all(svg in result.to_html() for svg in view["svg"])  # the --html page's very diagrams
    for b in doc["bins"]:
        if b["count"]:
            assert (f"({b['lo']:.3f}, {b['hi']:.3f}]: {b['count']:,} positions, confidence {b['confidence']:.4f}, "
                    f"accuracy {b['accuracy']:.4f}") in view["svg"][0]


@pytest.mark.parametrize("body,status,message", [
    ({"text": "x"}, 400, "the text is one token ('x'), and the first token has nothing before it"),
    ({"text": ""}, 400, "empty"),
    ({"text": "ab " * 200_000}, 413, "the page scores at most"),
    ({"text": 3}, 400, "text must be a string (got an integer)"),
])
def test_calibrate_route_refuses_as_score_does(client, body, status, message):
    got = client.post("/api/calibrate", json=body)
    assert got.status_code == status and message in got.json()["error"]["message"], got.text
    assert got.json() == client.post("/api/score", json=body).json()  # the same refusal, word for word
