"""decoding/settings.py: one settings object, checked once, and every door's one conversion into it.
The same value means the same at every door (temperature 0 is greedy, top-k 0 is off), the same bad
value is refused with the same reason, and a stage added to the registry reaches every door."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import PROMPT, PROMPT_IDS, cli

import lmhead_cli
from lmhead_cli.decoding import settings as decoding_settings
from lmhead_cli.errors import BadValue, ModeConflict
from lmhead_cli.serve.requests import Limits, RequestError


def sampling(body: dict, limits: Limits):
    """The server's door for a body's decoding fields: its pydantic model (a 400 for a wrong JSON type),
    then its one conversion to the settings object (a 400 naming the field for a bad value)."""
    from types import SimpleNamespace

    from pydantic import ValidationError

    from lmhead_cli.serve.requests import CompletionRequest, validation_error

    try:
        request = CompletionRequest.model_validate({"prompt": "x", **body})
    except ValidationError as e:
        raise validation_error(e.errors()) from None
    return SimpleNamespace(settings=request.settings())


@pytest.fixture(scope="module")
def model(tiny):
    return lmhead_cli.load(str(tiny[0]), device="cpu")


def _ids(doc: dict) -> list[int]:
    return doc["generated_ids"]


def test_temperature_0_is_greedy_at_every_door(model, tiny):
    want = tiny[1].generate(torch.tensor([PROMPT_IDS]), max_new_tokens=6, do_sample=False, pad_token_id=50256)
    want = want[0, len(PROMPT_IDS):].tolist()
    api = model.generate(PROMPT, max_new_tokens=6, temperature=0, ignore_eos=True).to_dict()
    assert _ids(api) == want and api["mode"] == "greedy"
    assert api["settings"]["greedy"] is True and api["settings"]["greedy_because"] == "temperature 0"
    assert api["settings"]["temperature"] is None  # the stage is off: processed = raw
    got = cli("generate", PROMPT, "--temperature", "0", "-n", "6", "--ignore-eos", "--model", str(tiny[0]), "--json")
    assert got.exit_code == 0, got.output
    assert _ids(json.loads(got.stdout)) == want
    human = cli("generate", PROMPT, "--temperature", "0", "-n", "2", "--model", str(tiny[0]))
    assert "greedy (temperature 0, deterministic)" in human.stdout  # said once
    s = sampling({"temperature": 0}, Limits()).settings
    assert s.greedy and s.zero_temperature and s.knobs.temperature is None
    with pytest.raises(ModeConflict):  # sample draws at random: temperature 0 is not a draw
        model.generate(PROMPT, temperature=0, mode="sample")


def test_top_k_0_and_minus_1_are_off_at_every_door(model, tiny):
    base = model.generate(PROMPT, max_new_tokens=4, seed=3, ignore_eos=True).to_dict()
    for off in (0, -1):
        api = model.generate(PROMPT, max_new_tokens=4, seed=3, top_k=off, ignore_eos=True).to_dict()
        assert _ids(api) == _ids(base) and api["settings"]["top_k"] is None
        got = cli("generate", PROMPT, "--top-k", str(off), "-n", "4", "--seed", "3", "--ignore-eos",
                  "--model", str(tiny[0]), "--json")
        assert got.exit_code == 0 and _ids(json.loads(got.stdout)) == _ids(base)
        assert sampling({"top_k": off}, Limits()).settings.knobs.top_k is None


@pytest.mark.parametrize("key, flag, value, reason", [
    ("top_p", "--top-p", 1.5, "must be in (0, 1] (got 1.5)"),
    ("min_p", "--min-p", 1.0, "must be in [0, 1) (got 1.0)"),
    ("temperature", "--temperature", -0.5, "must be 0 (greedy) or a finite number of at least 1e-06 (got -0.5)"),
    ("softcap", "--softcap", 0.0, "must be a finite number between 1e-06 and 1e+06"),
    ("top_k", "--top-k", -2, "must be at least 1 (0 or -1: off) (got -2)"),
])
def test_a_bad_value_is_refused_with_the_same_reason_at_every_door(model, tiny, key, flag, value, reason):
    with pytest.raises(BadValue) as e:
        model.generate(PROMPT, **{key: value})
    assert str(e.value).startswith(f"{key} {reason}")
    got = cli("generate", PROMPT, flag, str(value), "--model", str(tiny[0]))
    assert got.exit_code == 2 and f"lmhead: error: {flag} {reason}" in got.stderr
    with pytest.raises(RequestError) as r:
        sampling({key: value}, Limits())
    assert r.value.status == 400 and r.value.param == key and r.value.message.startswith(f"{key} {reason}")


def test_stop_strings_are_one_check_and_end_the_text_at_every_door(model, tiny):
    full = model.generate(PROMPT, max_new_tokens=12, greedy=True, ignore_eos=True).to_dict()["text"]
    stop = full[4:7]
    api = model.generate(PROMPT, max_new_tokens=12, greedy=True, ignore_eos=True, stop=[stop]).to_dict()
    assert api["text"] == full[:full.index(stop)] and api["stop"] == "stop"
    got = cli("greedy", PROMPT, "-n", "12", "--ignore-eos", "--stop", stop, "--stop", "\x00never", "--model",
              str(tiny[0]), "--json")
    assert got.exit_code == 0 and json.loads(got.stdout)["text"] == api["text"]
    assert json.loads(got.stdout)["settings"]["stop"] == [stop, "\x00never"]
    with pytest.raises(BadValue, match="beam search"):
        model.generate(PROMPT, beams=2, stop=[stop])
    for bad, words in (([""], "must not be empty"), (["x"] * 17, "at most 16")):
        with pytest.raises(BadValue, match=words):
            model.generate(PROMPT, stop=bad)
        with pytest.raises(RequestError, match=words):
            sampling({"stop": bad}, Limits())


def test_unknown_keyword_is_a_type_error(model):
    with pytest.raises(TypeError, match="temprature"):
        model.generate(PROMPT, temprature=0.5)


def test_the_settings_class_follows_the_registry():
    from lmhead_cli.decoding.stages import STAGES, Knobs

    assert [f for f in Knobs.__dataclass_fields__] == [s.key for s in STAGES]
    assert decoding_settings.Settings.__dataclass_fields__["knobs"].type in ("Knobs", Knobs)


def typed_declaration() -> list[tuple[str, str, object]]:
    """(name, annotation, default) of each field of the Knobs that type checkers read: the class declared
    under `if TYPE_CHECKING:` in decoding/stages.py, read from the source as a type checker reads it."""
    import ast

    from lmhead_cli.decoding import stages

    tree = ast.parse(open(stages.__file__, encoding="utf-8").read())
    (block,) = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
                and any(isinstance(c, ast.ClassDef) and c.name == "Knobs" for c in n.body)]
    (cls,) = [c for c in block.body if isinstance(c, ast.ClassDef) and c.name == "Knobs"]
    assert [ast.unparse(d) for d in cls.decorator_list] == ["dataclass(frozen=True)"]
    return [(f.target.id, ast.unparse(f.annotation), ast.literal_eval(f.value) if f.value else ...)
            for f in cls.body if isinstance(f, ast.AnnAssign)]


def test_the_typed_declaration_of_knobs_is_the_registry_field_for_field():
    """Type checkers and IDEs read the Knobs declared under TYPE_CHECKING; the program runs the one built
    from STAGES. They hold the same fields in the same order, each `<the stage's type> | None = None`, and
    the declared methods are the runtime class's. A stage added to the registry alone fails here until
    its line is declared too. Mutants: a field renamed, retyped, reordered or given another default."""
    import dataclasses
    import typing

    from lmhead_cli.decoding.stages import STAGES, Knobs

    declared = typed_declaration()
    assert declared == [(s.key, f"{s.type.__name__} | None", None) for s in STAGES]
    runtime = dataclasses.fields(Knobs)
    assert [(f.name, f.type, f.default) for f in runtime] == [(s.key, typing.Optional[s.type], None) for s in STAGES]
    assert Knobs.__dataclass_params__.frozen
    assert callable(Knobs.pipeline) and callable(Knobs.active)


@pytest.mark.typecheck
def test_a_type_checker_sees_the_stage_fields(tmp_path, monkeypatch):
    """mypy reads Knobs' fields and their types, through Settings.knobs too, and refuses a misspelt stage
    or a value of the wrong type. torch, transformers and numpy are skipped (their types become Any):
    reading torch took mypy ~12 of this test's 15 s, and no figure checked here has a torch type."""
    pytest.importorskip("mypy")
    from mypy import api

    from lmhead_cli.decoding.stages import STAGES

    probe = tmp_path / "probe.py"
    probe.write_text("from lmhead_cli.decoding.settings import make\n"
                     "from lmhead_cli.decoding.stages import Knobs\n"
                     "k = Knobs(temperature=0.5)\n"
                     + "".join(f"reveal_type(k.{s.key})\n" for s in STAGES)
                     + "reveal_type(make(temperature=0.7).knobs.top_p)\n"
                       "Knobs(top_kk=3)\n"
                       "x: str = k.temperature\n")
    # the package is installed editable (an import hook mypy cannot follow): mypy reads it from the repo
    monkeypatch.setenv("MYPYPATH", str(Path(__file__).resolve().parents[1]))
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\n[mypy-torch.*,transformers.*,numpy.*,safetensors.*]\nfollow_imports = skip\n")
    out, _, _ = api.run([str(probe), "--config-file", str(config), "--follow-imports=silent", "--ignore-missing-imports",
                         "--no-incremental", "--cache-dir", str(tmp_path / "cache")])
    revealed = [line.split('Revealed type is "')[1].rstrip('"') for line in out.splitlines() if "Revealed type" in line]
    assert revealed == [f"{s.type.__name__} | None" for s in STAGES] + ["float | None"], out
    assert 'Unexpected keyword argument "top_kk" for "Knobs"' in out
    assert 'expression has type "float | None", variable has type "str"' in out


# A sixth stage, added to the registry's source and nowhere else: `ban` sets one token id to -inf.
SIXTH = '''    Stage("ban", int, Rule("a token id, 0 or more", ge=0), help="Never choose token id N.",
          apply=lambda z, v: z.float().index_fill(-1, __import__("torch").tensor([v], device=z.device), float("-inf")),
          column="filtered", name="ban"),
'''

SCRIPT = r'''
import importlib.util, json, sys
import lmhead_cli.decoding as pkg
path = pkg.__path__[0] + "/stages.py"
src = open(path, encoding="utf-8").read()
anchor = "\n)\nCOLUMNS = "
assert src.count(anchor) == 1
src = src.replace(anchor, "\n" + sys.argv[3] + ")\nCOLUMNS = ")
mod = importlib.util.module_from_spec(importlib.util.spec_from_loader("lmhead_cli.decoding.stages", loader=None))
mod.__file__ = path
sys.modules[mod.__name__] = mod
exec(compile(src, path, "exec"), mod.__dict__)
pkg.stages = mod

folder, banned = sys.argv[1], int(sys.argv[2])
out = {}
from typer.main import get_command
from typer.testing import CliRunner
from lmhead_cli.cli import app
commands = get_command(app).commands
out["flags"] = {n: [p.opts for p in commands[n].params if p.name == "knob_ban"] for n in
                ("generate", "greedy", "sample", "softcap", "inspect")}
r = CliRunner().invoke(app, ["greedy", "The keys on the table", "--ban", str(banned), "-n", "3", "--ignore-eos",
                             "--model", folder, "--json"])
out["cli"] = json.loads(r.stdout) if r.exit_code == 0 else r.output
r = CliRunner().invoke(app, ["greedy", "x", "--ban", "-3", "--model", folder])
out["cli_bad"] = [r.exit_code, r.stderr.strip()]
import lmhead_cli
m = lmhead_cli.load(folder, device="cpu")
out["api"] = m.generate("The keys on the table", greedy=True, ban=banned, max_new_tokens=3, ignore_eos=True).to_dict()
from pydantic import ValidationError
from lmhead_cli.serve.requests import CompletionRequest, validation_error
out["server"] = CompletionRequest.model_validate({"prompt": "x", "ban": banned}).settings().knobs.ban
out["openapi"] = "ban" in CompletionRequest.model_json_schema()["properties"]
from lmhead_cli.serve.requests import RequestError
try:
    CompletionRequest.model_validate({"prompt": "x", "ban": "x"}).settings()
except RequestError as e:
    out["server_bad"] = [e.param, e.message]
from lmhead_cli.api import presets
from lmhead_cli.errors import UsageError
out["preset"] = presets.validate("p", "p.toml", {"ban": 7}).values
try:
    presets.validate("p", "p.toml", {"ban": -3})
except UsageError as e:
    out["preset_bad"] = str(e)
from lmhead_cli.api import checks
t = m.inspect("The keys on the table", top_k=3, stages=checks.stages(ban=banned)).to_dict()
out["table"] = t["stages"]
print(json.dumps(out))
'''


@pytest.mark.slow
def test_a_sixth_stage_reaches_the_cli_the_api_the_server_presets_and_the_stage_table(tiny):
    folder, hf = tiny
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT_IDS])).logits[0, -1]
    best, second = torch.topk(logits, 2).indices.tolist()
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(folder), str(best), SIXTH], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["flags"] == {n: [["--ban"]] for n in ("generate", "greedy", "sample", "softcap", "inspect")}
    cli_doc, api_doc = out["cli"], out["api"]
    assert isinstance(cli_doc, dict), cli_doc
    assert cli_doc["settings"]["ban"] == best == api_doc["settings"]["ban"]
    assert cli_doc["generated_ids"] == api_doc["generated_ids"] and cli_doc["generated_ids"][0] == second
    assert best not in cli_doc["generated_ids"]
    assert out["cli_bad"] == [2, "lmhead: error: --ban must be a token id, 0 or more (got -3)"]
    assert out["server"] == best and out["openapi"] and out["server_bad"] == ["ban", "ban must be an integer (got 'x')"]
    assert out["preset"] == {"ban": 7} and "ban must be a token id, 0 or more (got -3)" in out["preset_bad"]
    assert "ban" in json.dumps(out["table"])
