"""The benchmark's own arithmetic (benchmarks/: bandwidth.py, stream_read.c, llamacpp.py,
versus_llamacpp.py), each figure checked against an independent computation. The measurements
themselves (timings) are never asserted."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import bandwidth  # noqa: E402
import llamacpp  # noqa: E402
import versus_llamacpp  # noqa: E402
import versus_llamacpp_report  # noqa: E402


# ---- the compiled streaming read ---------------------------------------------------------------

@pytest.mark.skipif(bandwidth.compiler() is None, reason="no C compiler")
@pytest.mark.parametrize("mib, threads", [(1, 2), (3, 5)])
def test_stream_read_reads_every_byte_once_by_every_method(tmp_path, mib, threads):
    exe = bandwidth.build(tmp_path)
    out = json.loads(subprocess.run([str(exe), str(mib), str(threads), "2"], capture_output=True, text=True,
                                    check=True).stdout)
    n = mib * 2**20 // 4  # floats in the buffer, float i holding i mod 8
    expected = n // 8 * sum(range(8))
    assert out["bytes"] == mib * 2**20
    seen = {(r["method"], r["threads"]) for r in out["rates"]}
    assert seen == {("slices", 1), ("prefetch", 1)} | {(m, t) for t in range(2, threads + 1)
                                                      for m in ("slices", "interleaved", "prefetch")}
    for r in out["rates"]:
        assert r["sum"] == expected, r  # a slice read twice or left out changes the sum
        assert r["gbs"] > 0


@pytest.mark.skipif(bandwidth.compiler() is None, reason="no C compiler")
@pytest.mark.parametrize("args", [["0", "2", "1"], ["1", "0", "1"], ["1", "257", "1"], ["1", "2"]])
def test_stream_read_refuses_bad_arguments_in_one_line(tmp_path, args):
    exe = bandwidth.build(tmp_path)
    r = subprocess.run([str(exe), *args], capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1


def test_build_without_a_compiler_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bandwidth, "compiler", lambda: None)
    assert bandwidth.build(tmp_path) is None
    assert "no C compiler" in capsys.readouterr().err


# ---- the bound: the best of the methods ---------------------------------------------------------

C_PROBE = {"bytes": 536870912, "rates": [{"method": "slices", "threads": 1, "gbs": 12.0},
                                         {"method": "slices", "threads": 2, "gbs": 30.0},
                                         {"method": "interleaved", "threads": 2, "gbs": 31.5}]}
TORCH_PROBE = {"buffer_mb": 629.1, "read_gbs_1": 13.5, "read_gbs_2": 25.9, "read_gbs": 25.9, "copy_gbs": 28.0}


def test_best_of_takes_the_fastest_method_and_the_fastest_on_one_thread():
    b = bandwidth.best_of(C_PROBE, TORCH_PROBE)
    assert (b["read_gbs"], b["method"], b["threads"]) == (31.5, "C interleaved", 2)
    assert (b["read_gbs_1"], b["method_1"]) == (13.5, "torch sum")  # torch's 1-thread sum beat C's here
    assert len(b["methods"]) == 5 and b["compiled"] and b["buffer_mb"] == 536.870912
    alone = bandwidth.best_of(None, TORCH_PROBE)
    assert (alone["read_gbs"], alone["compiled"]) == (25.9, False)
    with pytest.raises(ValueError, match="no bandwidth measured"):
        bandwidth.best_of(None, None)


def test_merge_keeps_each_methods_best_over_the_points():
    slower = {"bytes": C_PROBE["bytes"], "rates": [{**r, "gbs": r["gbs"] / 2} for r in C_PROBE["rates"]]}
    faster_torch = {**TORCH_PROBE, "read_gbs_2": 40.0}
    points = [bandwidth.best_of(slower, faster_torch), bandwidth.best_of(C_PROBE, TORCH_PROBE)]
    m = bandwidth.merge(points)
    assert (m["read_gbs"], m["method"], m["points"]) == (40.0, "torch sum", 2)
    by = {(x["method"], x["threads"]): x["gbs"] for x in m["methods"]}
    assert by == {("C slices", 1): 12.0, ("C slices", 2): 30.0, ("C interleaved", 2): 31.5,
                  ("torch sum", 1): 13.5, ("torch sum", 2): 40.0}


# ---- llama.cpp's side: bytes of weights one step reads from a GGUF file -------------------------

def _gguf(path: Path, tensors: dict) -> None:
    gguf = pytest.importorskip("gguf")
    import numpy as np

    w = gguf.GGUFWriter(str(path), "gpt2")
    for name, (shape, kind) in tensors.items():
        data = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        if kind == "Q8_0":
            w.add_tensor(name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_weight_bytes_tied_reads_token_embd_as_the_head_and_skips_position_embd(tmp_path):
    V, D, P = 96, 64, 16
    _gguf(tmp_path / "m.gguf", {"token_embd.weight": ((V, D), "F32"), "position_embd.weight": ((P, D), "F32"),
                                "blk.0.attn_qkv.weight": ((3 * D, D), "Q8_0"), "blk.0.attn_qkv.bias": ((3 * D,), "F32"),
                                "output_norm.weight": ((D,), "F32")})
    got = llamacpp.weight_bytes(tmp_path / "m.gguf")
    q8 = 3 * D * D // 32 * 34  # Q8_0: a float16 scale and 32 int8 values per block of 32
    assert got["tied"] is True
    assert got["by_type"] == {"F32": (V * D + 3 * D + D) * 4, "Q8_0": q8}
    assert got["bytes"] == (V * D + 3 * D + D) * 4 + q8


def test_weight_bytes_untied_reads_output_and_looks_token_embd_up(tmp_path):
    V, D = 96, 64
    _gguf(tmp_path / "m.gguf", {"token_embd.weight": ((V, D), "F32"), "output.weight": ((V, D), "F32"),
                                "position_embd.weight": ((8, D), "F32")})
    got = llamacpp.weight_bytes(tmp_path / "m.gguf")
    assert (got["tied"], got["bytes"]) == (False, V * D * 4)


def test_the_converter_stage_adds_n_ctx_and_links_the_rest(tiny, tmp_path):
    folder, model = tiny
    stage = llamacpp._stage(folder, tmp_path / "stage")
    config = json.loads((stage / "config.json").read_text())
    assert config["n_ctx"] == model.config.n_positions
    assert (stage / "model.safetensors").resolve() == (folder / "model.safetensors").resolve()
    assert "n_ctx" not in json.loads((folder / "config.json").read_text())  # the checkpoint itself untouched


def test_without_cmake_the_build_says_so_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(llamacpp.shutil, "which", lambda name: None)
    with pytest.raises(llamacpp.Unavailable) as e:
        llamacpp.build(tmp_path)
    assert str(e.value) == "llama.cpp is left out: no cmake and no C++ compiler (c++, g++ or clang++) here"


# ---- scoring: the same positions as llama-perplexity --------------------------------------------

@pytest.mark.parametrize("T, n_ctx, stride", [(4096, 1024, 512), (4096, 1024, 1024), (100, 32, 16), (33, 32, 7),
                                              (10, 32, 16)])
def test_windows_forwarded_counts_lmheads_windows(T, n_ctx, stride):
    from lmhead_cli.readings.score import windows

    assert versus_llamacpp.windows_forwarded(T, n_ctx, stride) == sum(w.end - w.begin for w in windows(T, n_ctx,
                                                                                                       stride))


def test_score_probe_perplexity_of_the_second_halves_matches_transformers(tmp_path):
    from helpers import build_checkpoint

    n_ctx = 32
    folder = tmp_path / "ck"
    model = build_checkpoint(folder, n_positions=n_ctx, seed=3)
    text = " ".join(["the keys on the table near the door of the garden"] * 12)
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    got = versus_llamacpp.score_probe(str(folder), str(tmp_path / "t.txt"))
    from lmhead_cli.loading.tokenizer import GPT2Tokenizer

    ids = torch.tensor(GPT2Tokenizer.bundled().encode(text))
    nll, n = 0.0, 0
    with torch.inference_mode():  # llama-perplexity's scheme: chunks of n_ctx, the second half of each scored
        for c in range(len(ids) // n_ctx):
            chunk = ids[c * n_ctx:(c + 1) * n_ctx]
            logp = torch.log_softmax(model(chunk[None]).logits[0].double(), -1)  # (n_ctx, V)
            for p in range(n_ctx // 2 + 1, n_ctx):  # logits n_ctx/2 .. n_ctx-2 predict these
                nll -= float(logp[p - 1, chunk[p]])
                n += 1
    assert (got["tokens"], got["halves"], got["window"]) == (len(ids), n, n_ctx)
    assert got["halves_ppl"] == pytest.approx(math.exp(nll / n), rel=1e-4)
    assert got["forwarded"] == versus_llamacpp.windows_forwarded(len(ids), n_ctx, n_ctx // 2)
    assert got["scored"] == len(ids) - 1 and got["s"] > 0


def test_every_serving_request_brings_a_prompt_the_server_has_not_seen():
    """llama-server reads only what follows a slot's cached prompt: a prompt sent again (the warm-up's,
    or one client count's again for the next) was read at one position's cost by llama.cpp, at full
    cost by lmhead. The warm-up, every client count's requests and the first-token probes differ."""
    for per_client in ({1: 4, 4: 2, 16: 2}, {1: 2, 4: 2, 16: 1}):  # the full run's and --quick's
        sent = versus_llamacpp.serve_prompts(1)  # the warm-up
        for clients, prompts in versus_llamacpp.throughput_prompts(per_client).items():
            assert len(prompts) == clients * per_client[clients]
            sent += prompts
        sent += versus_llamacpp.serve_prompts(20, versus_llamacpp.FIRST_PROMPTS)  # first tokens
        assert len(set(sent)) == len(sent)
    with pytest.raises(ValueError, match="first-token"):
        versus_llamacpp.throughput_prompts({1: 40, 4: 10, 16: 5})


# ---- the report ----------------------------------------------------------------------------------

def test_summary_is_the_best_idle_and_the_median_busy_with_a_failed_run_as_zero():
    assert versus_llamacpp_report.summary([10.0, 30.0, 20.0], busy=False) == 30.0
    assert versus_llamacpp_report.summary([10.0, None, 20.0], busy=True) == 10.0
    assert versus_llamacpp_report.summary([], busy=True) is None


def _figures() -> dict:
    run = lambda *xs: [{"tps": x} for x in xs]  # noqa: E731
    return {
        "machine": {"cpu": "CPU", "cores": 2, "os": "Linux"}, "threads": 2, "date": "2026-12-02 17:00 UTC",
        "elapsed_s": 600.0, "loads": [["start", 1.0]], "quiet": {"waited_s": 3.0, "repeated": 0, "noisy": 1},
        "args": {"new_tokens": 128, "rounds": 2, "busy_rounds": 3, "serve_tokens": 64, "write": True},
        "llamacpp": {"version": "llama-cpp-python 0.3.36's vendored llama.cpp"},
        "bandwidth": {"read_gbs": 50.0, "method": "C slices", "threads": 2, "read_gbs_1": 20.0, "method_1": "C slices",
                      "compiled": True, "buffer_mb": 536.9, "points": 3, "methods": []},
        "bytes": {"lmhead": {"float32": 500e6}, "llama": {"F32": {"bytes": 495e6}}},
        "decode": {"F32": {"lmhead": run(30.0, 40.0), "llama": run(80.0, 60.0)}},
        "busy": {"F32": {"lmhead": run(30.0, 31.0, 29.0), "llama": [{"tps": 20.0}, {"tps": None, "error": "timeout"},
                                                                   {"tps": 25.0}]}},
        "serve": {"lmhead": [{"clients": c, "requests": 4, "tps": t} for c, t in ((1, 30.0), (4, 60.0), (16, 120.0))],
                  "llama": [{"clients": c, "requests": 4, "tps": t} for c, t in ((1, 60.0), (4, 100.0), (16, 100.0))],
                  "first_token": {"lmhead": {"n": 20, "best_s": 0.020, "median_s": 0.025},
                                  "llama": {"n": 20, "best_s": 0.018, "median_s": 0.030}}},
    }


def test_report_computes_every_ratio_and_fraction_from_the_runs():
    text = versus_llamacpp.report(_figures())
    f32 = next(line for line in text.splitlines() if line.startswith("| float32 | F32 |"))
    cells = [c.strip() for c in f32.strip("|").split("|")]
    # idle: best of (30, 40) against best of (80, 60); busy: median (30, 31, 29) against median (20, 0, 25)
    assert cells[2:8] == ["40.0", "80.0", f"❌ {40 / 80:.2f}×", "30.0", "20.0", f"✅ {30 / 20:.2f}×"]
    assert cells[9:11] == [f"{40 * 500e6 / 50e9:.2f}", f"{80 * 495e6 / 50e9:.2f}"]  # fractions of 50 GB/s
    assert "timeout" in text
    achieved = 80 * 495e6 / 1e9  # 39.6 GB/s, under the probe's 50: the bound holds
    assert f"{achieved:.1f} GB/s" in text and "✅ the probe reads at least as fast" in text
    serve16 = next(line for line in text.splitlines() if line.startswith("| 16 |"))
    assert f"✅ {120 / 100:.2f}×" in serve16 and f"{120 / 30:.2f}×" in serve16
    first = next(line for line in text.splitlines() if line.startswith("A lone request's first token"))
    assert "20.0 ms best (25.0 median)" in first and "18.0 ms best (30.0 median)" in first
    assert first.endswith(f"❌ {0.018 / 0.020:.2f}×.")  # llama-server's 18 ms over lmhead's 20: a shortfall
    kept = _figures()
    del kept["serve"]["first_token"]  # figures kept before the measure existed
    assert "A lone request's first token" not in versus_llamacpp.report(kept)


def test_report_flags_a_bound_that_llamacpp_beat():
    R = _figures()
    R["bandwidth"]["read_gbs"] = 30.0
    assert "❌ the probe did not reach the machine's limit" in versus_llamacpp.report(R)


def test_splice_replaces_the_section_and_keeps_the_rest(tmp_path):
    md = tmp_path / "RESULTS.md"
    md.write_text("# results\n\nbefore\n", encoding="utf-8")
    one = versus_llamacpp.report(_figures())
    versus_llamacpp.splice(md, one)
    assert md.read_text().startswith("# results\n\nbefore\n\n" + versus_llamacpp.BEGIN)
    R = _figures()
    R["date"] = "2026-12-03 09:00 UTC"
    md.write_text(md.read_text() + "\nafter\n")
    versus_llamacpp.splice(md, versus_llamacpp.report(R))
    text = md.read_text()
    assert text.count(versus_llamacpp.BEGIN) == 1 and "2026-12-03 09:00" in text and "2026-12-02 17:00" not in text
    assert text.endswith("\nafter\n")
    kept = versus_llamacpp.section_in(text)  # what benchmarks/run.py --write carries into its new report
    assert kept == versus_llamacpp.report(R) and versus_llamacpp.section_in("# no section\n") is None



def _score_figures() -> dict:
    ours = {"s": 12.0, "wall_s": 14.0, "tokens": 4096, "scored": 4095, "window": 1024, "stride": 512,
            "forwarded": 7168, "halves": 2044, "halves_ppl": 600.0}
    return {"tokens": 4096, "lmhead": [ours], "llama": [{"s": 8.0, "wall_s": 9.0, "forwarded": 4096, "chunks": 4,
                                                         "scored": 2044, "ppl": 600.5}]}


def _part(section: str, heading: str) -> str:
    """One subsection of a written section: from its heading to the next heading or the targets."""
    return section.split(heading, 1)[1].split("\n### ", 1)[0].split("\nTargets: ", 1)[0]


def test_a_write_of_some_parts_keeps_the_others_from_the_section_in_results_md(tmp_path, monkeypatch):
    import argparse

    monkeypatch.setattr(versus_llamacpp, "HERE", tmp_path)  # its RESULTS.md and .cache
    md = tmp_path / "RESULTS.md"
    full = {**_figures(), "score": _score_figures()}  # a whole run, 2026-12-02 17:00
    md.write_text("# results\n\nbefore\n\n" + versus_llamacpp.report(full) + "\nafter\n", encoding="utf-8")
    old = versus_llamacpp.section_in(md.read_text())
    first = "`python benchmarks/versus_llamacpp.py --write` on 2026-12-02 17:00 UTC"

    decode = _figures()  # --only decode on 2026-12-03: idle decoding measured again, nothing else
    del decode["busy"], decode["serve"]
    decode["date"], decode["args"]["only"] = "2026-12-03 09:00 UTC", "decode"
    decode["decode"]["F32"]["lmhead"] = [{"tps": 50.0}, {"tps": 45.0}]
    versus_llamacpp.emit(decode, argparse.Namespace(write=True))
    text = md.read_text(encoding="utf-8")
    assert text.startswith("# results\n\nbefore\n\n") and text.endswith("\nafter\n")
    section = versus_llamacpp.section_in(text)
    assert section.count(versus_llamacpp.BEGIN) == 1
    assert "`python benchmarks/versus_llamacpp.py --write --only decode` on 2026-12-03 09:00 UTC" in section
    f32 = next(line for line in section.splitlines() if line.startswith("| float32 | F32 |"))
    cells = [c.strip() for c in f32.strip("|").split("|")]
    # idle from this run (best of 50, 45 against 80); busy kept from the first (median 30 against 20)
    assert cells[2:8] == ["50.0", "80.0", f"❌ {50 / 80:.2f}×", "30.0", "20.0", f"✅ {30 / 20:.2f}×"]
    greedy = _part(section, "### Greedy decoding")
    assert f"The busy columns are kept from an earlier run (this run did not measure them): {first}" in greedy
    for heading in ("### Scoring", "### Serving"):  # not run: kept whole, figures and all, and said so
        kept = _part(section, heading)
        assert f"Kept from an earlier run (this run did not measure it): {first}" in kept
        body = _part(old, heading)
        assert all(line in kept for line in body.splitlines() if line)
    for figure in ("| scored tokens/s | 341 | 256 |", "| 16 | 4 | 120.0 tok/s | 100.0 tok/s |",
                   "lmhead serve 20.0 ms best (25.0 median)"):
        assert figure in section  # what the README quotes stays in RESULTS.md
    assert ("This run measured greedy decoding idle; greedy decoding's busy columns, scoring and serving are kept "
            "from earlier runs") in section.split("###", 1)[0]

    score = {**_figures(), "score": _score_figures()}  # --only score on 2026-12-04: decode is kept in turn
    for k in ("decode", "busy", "serve"):
        del score[k]
    score["date"], score["args"]["only"] = "2026-12-04 10:00 UTC", "score"
    versus_llamacpp.emit(score, argparse.Namespace(write=True))
    section = versus_llamacpp.section_in(md.read_text(encoding="utf-8"))
    greedy = _part(section, "### Greedy decoding")
    assert ("Kept from an earlier run (this run did not measure it): `python benchmarks/versus_llamacpp.py "
            "--write --only decode` on 2026-12-03 09:00 UTC") in greedy
    assert f"The busy columns are kept from an earlier run (this run did not measure them): {first}" in greedy
    assert "| float32 | F32 | 50.0 | 80.0 |" in greedy
    serving = _part(section, "### Serving")  # kept twice: still the first run's, said once
    assert serving.count("Kept from an earlier run") == 1 and first in serving
    assert "Kept from" not in _part(section, "### Scoring") and "2026-12-04 10:00 UTC" in section

    busy = _figures()  # --only busy on 2026-12-05: the idle columns and the check of the bound are kept
    del busy["decode"], busy["serve"]
    busy["date"], busy["args"]["only"] = "2026-12-05 11:00 UTC", "busy"
    busy["busy"]["F32"]["lmhead"] = [{"tps": 36.0}, {"tps": 35.0}, {"tps": 34.0}]
    versus_llamacpp.emit(busy, argparse.Namespace(write=True))
    greedy = _part(versus_llamacpp.section_in(md.read_text(encoding="utf-8")), "### Greedy decoding")
    assert "Kept from an earlier run" not in greedy  # measured in part by this run
    assert f"| float32 | F32 | 50.0 | 80.0 | ❌ {50 / 80:.2f}× | 35.0 | 20.0 | ✅ {35 / 20:.2f}× |" in greedy
    assert ("The idle columns and the check of the bound are kept from an earlier run (this run did not measure "
            "them): `python benchmarks/versus_llamacpp.py --write --only decode` on 2026-12-03 09:00 UTC") in greedy
    assert "Check of the bound: llama.cpp's fastest achieved read rate here is 39.6 GB/s" in greedy


def test_llama_score_reads_llama_perplexitys_own_clock(monkeypatch):
    log = ("0.02.685.618 I perplexity: tokenizing the input ..\n"
           "0.02.703.620 I perplexity: calculating perplexity over 2 chunks, n_ctx=1024, batch_size=1024, n_seq=1\n"
           "0.23.813.168 I perplexity: 21.11 seconds per pass - ETA 0.70 minutes\n[1]51447.7748,[2]51896.6609,\n"
           "1.03.235.726 I Final estimate: PPL = 51896.6609 +/- 1051.26197\n")  # as llama-perplexity writes it
    monkeypatch.setattr(versus_llamacpp, "run", lambda cmd: (70.0, 0.0, log))
    got = versus_llamacpp.llama_score(Path("m.gguf"), Path("t.txt"), 1024, 2)
    assert got["s"] == pytest.approx((60 + 3.235726) - (2.703620))
    assert (got["chunks"], got["forwarded"], got["scored"], got["ppl"]) == (2, 2048, 2 * 511, 51896.6609)
    monkeypatch.setattr(versus_llamacpp, "run", lambda cmd: (1.0, 0.0, "error: failed to load model\n"))
    with pytest.raises(RuntimeError, match="lacks its chunk count"):
        versus_llamacpp.llama_score(Path("m.gguf"), Path("t.txt"), 1024, 2)


# ---- batching_bench.py ----------------------------------------------------------------------------

def test_batching_clock_and_section_from_two_health_readings(tmp_path):
    import batching_bench

    before = {"timing": {"rounds": 10, "prefill_s": 1.0, "step_s": 2.0, "firsts": 3, "queue_s": 0.3, "first_token_s": 0.9}}
    after = {"timing": {"rounds": 30, "prefill_s": 3.0, "step_s": 3.0, "firsts": 15, "queue_s": 0.9, "first_token_s": 3.3}}
    c = batching_bench.clock(before, after)
    assert c == {"requests": 12, "rounds": 20, "queue_s": pytest.approx(0.6 / 12),
                 "first_token_s": pytest.approx(2.4 / 12), "prefill_s_per_round": pytest.approx(0.1),
                 "step_s_per_round": pytest.approx(0.05)}
    assert batching_bench.clock({"status": "ok"}, {"status": "ok"}) is None  # a server without the clock
    r = {"quick": False, "base": "main", "load_end": 2.5,
         "greedy": {"load": 1.0, "old_tok_s": 20.0, "new_tok_s": 18.0, "ratio": 0.9},
         "short_beside_long": {"load": 1.1, "alone_s": 0.5, "beside_s": 1.0, "ratio": 2.0},
         "one_beside_many": {"load": 1.15, "alone_s": 1.0, "beside_s": 6.8, "ratio": 6.8},
         "arrivals": {"load": 1.2, "one_ttft_s": 0.2, "p90_ttft_s": 1.2, "ratio": 6.0, "server": c},
         "throughput": {"load": 1.3, "one_tok_s": 10.0, "sixteen_tok_s": 45.0, "ratio": 4.5}}
    text = batching_bench.report(r)
    rows = [line for line in text.splitlines() if line.startswith("| ") and "x |" in line]
    assert [("✅" in row, row.split(" | ")[-1].rstrip(" |")) for row in rows] == [
        (True, "1.10"), (False, "1.15"), (False, "1.20"), (True, "1.30"), (False, "1.00")]
    # 2 <= 4, 6.8 > 4, 6 > 5, 4.5 >= 4, 0.9 < 0.95
    assert "0.200 s from queued to first token on average, 0.050 s of it in the queue" in text
    md = tmp_path / "RESULTS.md"
    md.write_text("# results\n\n" + versus_llamacpp.report(_figures()), encoding="utf-8")
    versus_llamacpp.splice(md, text, batching_bench.BEGIN, batching_bench.END)
    versus_llamacpp.splice(md, text, batching_bench.BEGIN, batching_bench.END)  # in place: once
    kept = md.read_text()
    assert kept.count(batching_bench.BEGIN) == 1 and versus_llamacpp.section_in(kept) == versus_llamacpp.report(_figures())
    assert versus_llamacpp.section_in(kept, batching_bench.BEGIN, batching_bench.END) == text


# ---- grammar_bench.py -----------------------------------------------------------------------------

def _grammar_figures(llama: bool) -> dict:
    import grammar_bench

    runs = {("lmhead", "greedy", "free"): [20.0, 10.0], ("lmhead", "greedy", "schema"): [18.0, 9.5],
            ("llama", "greedy", "free"): [25.0, 30.0], ("llama", "greedy", "schema"): [12.0, 15.0]}
    runs = {k: [{"rate": v, "tokens": 48 - i, "ids": [1, 2]} for i, v in enumerate(vs)] for k, vs in runs.items()}
    mode = {**grammar_bench.rates(runs, "lmhead", "greedy"),
            "llama": grammar_bench.rates(runs, "llama", "greedy") if llama else None}
    if llama:
        mode["versus_llama"] = 1.4
    return {"quick": False, "new_tokens": 48, "rounds": 2, "load_start": 1.5, "load_end": 2.25, "source": "src",
            "threads": 2, "modes": {"greedy": mode}, "mask_us": 42.0,
            "llama_server": "g.gguf, `llama-server -t 2`" if llama else "not run: llama-server is not built"}


def test_grammar_rates_are_medians_and_ratios_medians_of_the_pairs():
    import grammar_bench

    r = _grammar_figures(True)["modes"]["greedy"]
    assert r["free_tok_s"] == 15.0 and r["schema_tok_s"] == 13.75
    assert r["pair_ratios"] == [0.9, 0.95] and r["ratio"] == pytest.approx(0.925)
    assert r["llama"]["ratio"] == pytest.approx((12 / 25 + 15 / 30) / 2) and r["llama"]["schema_tokens"] == [48, 47]
    assert grammar_bench.span([3.0, 1.25, 2.0]) == "1.2-3.0"
    assert grammar_bench.mark(0.85, 0.85).startswith("✅") and grammar_bench.mark(0.84, 0.85).startswith("❌")


def test_grammar_report_has_lmheads_and_llama_servers_rows_and_the_load():
    import grammar_bench

    text = grammar_bench.report(_grammar_figures(True))
    assert text.startswith(grammar_bench.BEGIN) and text.endswith(grammar_bench.END + "\n")
    assert "Load average (1 min) 1.50 at the start, 2.25 at the end" in text
    assert "| greedy | 15.0 | 13.8 | 0.925x | 0.90-0.95 | ✅ >= 0.85x | 48, 47 |" in text
    assert "| greedy | 27.5 | 13.5 | 0.490x | 25.0-30.0; 12.0-15.0 | 1.400x | ✅ >= 1.0x |" in text
    assert "llama-server: g.gguf, `llama-server -t 2`;" in text and "42 µs" in text
    bare = grammar_bench.report(_grammar_figures(False))
    assert "llama-server: not run: llama-server is not built." in bare and "llama-server free tok/s" not in bare
