"""Helpers shared by the tests: the prompt, tiny checkpoints built with transformers (the oracle), and
checks used in several files. Test files import from here, never from each other (conftest.py holds
only fixtures)."""

from __future__ import annotations

import functools
import os
import shutil
from importlib import resources
from pathlib import Path

import pytest
import torch

# Where the user's real Hugging Face cache is, read before any test redirects HF_HOME.
REAL_HF_HOME = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
PROMPT = "The keys on the table"
PROMPT_IDS = [464, 8251, 319, 262, 3084]


def _tokenizer_files(folder: Path) -> None:
    src = resources.files("lmhead_cli.data") / "gpt2-tokenizer"
    for name in ("vocab.json", "merges.txt"):
        with resources.as_file(src / name) as p:
            shutil.copy(p, folder / name)


def build_checkpoint(folder: Path, *, tied: bool = True, n_embd: int = 64, n_layer: int = 2, n_head: int = 2,
                     n_positions: int = 1024, seed: int = 0, **overrides):
    """A GPT-2-architecture checkpoint with random weights, saved by transformers; returns the model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_positions=n_positions,
                        tie_word_embeddings=tied, **overrides)
    model = GPT2LMHeadModel(config).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    _tokenizer_files(folder)
    return model


def with_ln_f(folder, *, seed: int, n_layer: int = 2):
    """(folder, model): a tiny tied GPT-2 whose ln_f has a non-trivial gain and bias, so that normalising
    each vector with its own statistics (and ln_f's affine part) is really exercised."""
    model = build_checkpoint(folder, n_layer=n_layer, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.transformer.ln_f.weight.copy_(torch.rand(64, generator=g) + 0.5)
        model.transformer.ln_f.bias.copy_(torch.randn(64, generator=g) * 0.1)
    model.save_pretrained(folder)
    return folder, model


def perturbed(folder, *, tied: bool, seed: int, n_layer: int = 3):
    """A tiny GPT-2 (n_layer layers, 4 heads) whose biases and layer-norm gains are random, not 0 and 1, so the
    attention output bias, ln_f's β and γ all carry real weight in the decomposition."""
    model = build_checkpoint(folder, tied=tied, n_layer=n_layer, n_head=4, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif ".ln_" in name or name.startswith("transformer.ln_f"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    model.save_pretrained(folder)
    return folder, model


def nan_checkpoint(folder: Path, into: Path) -> Path:
    """A copy of the checkpoint in `folder`, saved in `into`, with one NaN in ln_f's weight: safetensors
    loads it, and every logit comes out NaN."""
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    state["transformer.ln_f.weight"][3] = float("nan")
    for name in ("config.json", "vocab.json", "merges.txt"):
        (into / name).write_bytes((folder / name).read_bytes())
    save_file(state, into / "model.safetensors")
    return into


def assert_rank(rank: int, z: torch.Tensor, i: int, atol: float = 1e-4) -> None:
    """rank = 1 + the tokens scored higher than i, give or take those within float noise of z[i]."""
    higher, close = int((z > z[i] + atol).sum()), int(((z - z[i]).abs() <= atol).sum())
    assert 1 + higher <= rank <= higher + close


def real_gpt2_folder() -> Path | None:
    """The real gpt2 snapshot in the user's HF cache, or None (tests using it are skipped)."""
    for repo in ("models--gpt2", "models--openai-community--gpt2"):
        snapshots = REAL_HF_HOME / "hub" / repo / "snapshots"
        if snapshots.is_dir():
            for snap in sorted(snapshots.iterdir()):
                if (snap / "model.safetensors").exists() and (snap / "config.json").exists():
                    return snap
    return None


# ---- running the command line -----------------------------------------------------------------------
LAUNCH_TIMEOUT = 300  # seconds: a test that hangs fails instead of holding up the suite


def cli(*args: str, input: str | bytes | None = None, env: dict | None = None):
    """The one CLI runner: `lmhead ARGS` in-process (Typer's CliRunner); a click Result with exit_code,
    stdout, stderr and output (both, interleaved)."""
    from typer.testing import CliRunner

    from lmhead_cli.cli import app

    return CliRunner().invoke(app, [str(a) for a in args], input=input, env=env)


def _command_once():
    """Typer builds the click command from the app's signatures on every CliRunner.invoke (~85 ms here);
    `lmhead` builds it once per process, and so do the tests: the first build is kept for the app."""
    import typer.testing

    build = typer.testing._get_command
    if getattr(build, "once", False):
        return
    built: dict[int, object] = {}

    def once(app):
        if id(app) not in built:
            built[id(app)] = (app, build(app))  # the app is kept, so its id is not reused
        return built[id(app)][1]

    once.once = True
    typer.testing._get_command = once


_command_once()


REPO = Path(__file__).resolve().parents[1]


def lmhead_argv(*args: str, torchrun: int = 0) -> list[str]:
    """The argv of `lmhead ARGS` in a fresh interpreter; under torchrun with `torchrun` processes if > 0."""
    import sys

    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={torchrun}"]
                if torchrun else [sys.executable])
    return [*launcher, "-m", "lmhead_cli", *map(str, args)]


def _env(extra: dict | None) -> dict:
    """The current environment, this checkout first on PYTHONPATH, then `extra`."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **(extra or {})}


# ---- `lmhead` in another process: forked from tests/zygote.py, or a fresh interpreter ---------------
# A fresh `lmhead` spends ~2 of its ~3 s of CPU importing torch. tests/zygote.py imports it once per
# test process and forks each `lmhead` from there; the fork runs what a fresh interpreter would, except
# for what an interpreter reads as it starts. So a fresh interpreter is kept for: torchrun, a preexec_fn
# or any Popen argument the launcher does not take, and an environment that differs from the launcher's
# in a setting read at start-up (Python's, the locale's, OpenMP's, torch's, the loader's, the allocator's).
# LMHEAD_TEST_FRESH=1 runs every launch in a fresh interpreter.
FRESH_ENV = "LMHEAD_TEST_FRESH"
START_SETTINGS = ("PYTHON", "LC_", "LANG", "OMP_", "GOMP_", "KMP_", "MKL_", "TORCH", "PYTORCH", "LD_", "MALLOC_",
                  "CUDA", "OPENBLAS")
FORK_TAKES = {"stdin", "stdout", "stderr", "text", "input", "capture_output", "cwd"}
_zygote: dict = {}


def _launcher() -> tuple[str, dict] | None:
    """(socket path, environment) of this process's tests/zygote.py, started on first use; None if it
    cannot start (then every launch is a fresh interpreter)."""
    import atexit
    import subprocess
    import sys
    import tempfile

    z = _zygote.get(os.getpid())
    if z is not None and (z["proc"] is None or z["proc"].poll() is None):
        return None if z["proc"] is None else (z["path"], z["env"])
    folder = tempfile.mkdtemp(prefix="lmhead-zygote-")
    path, env = os.path.join(folder, "socket"), _env(None)
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("zygote.py")), path], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    _zygote[os.getpid()] = z = {"proc": proc, "path": path, "env": env}
    atexit.register(lambda: (proc.kill(), shutil.rmtree(folder, ignore_errors=True)))
    try:
        ready = reader(proc.stdout, timeout=120)() == b"ready\n"
    except AssertionError:
        ready = False
    if not ready:
        proc.kill()
        z["proc"] = None
        return None
    return path, env


def forkable(env: dict, kwargs: dict) -> tuple[str, dict] | None:
    """The launcher to fork `lmhead` from with this environment and these Popen arguments, or None where
    only a fresh interpreter runs it as a user's would (see above)."""
    if env.get(FRESH_ENV, "").strip() not in ("", "0") or set(kwargs) - FORK_TAKES:
        return None
    launcher = _launcher()
    if launcher is None:
        return None
    base = launcher[1]
    for key in set(env) | set(base):
        if key.startswith(START_SETTINGS) and env.get(key) != base.get(key) and key != "PYTHONUNBUFFERED":
            return None
    return launcher


class Forked:
    """A Popen-like handle on an `lmhead` forked by tests/zygote.py: pid, stdin/stdout/stderr (where
    piped), returncode, poll, wait, send_signal, terminate, kill, communicate."""

    def __init__(self, argv: list[str], launcher: tuple[str, dict], env: dict, stdin=None, stdout=None, stderr=None,
                 text: bool = False, cwd=None):
        import io
        import json
        import locale
        import socket
        import struct
        import subprocess

        self.args, self.returncode, self.text = argv, None, text
        self.encoding = locale.getpreferredencoding(False)
        given, parent_ends, close_after = [], {}, []

        def stream(name: str, spec, fd: int, writing: bool) -> int:
            if spec is None:
                return fd
            if spec == subprocess.DEVNULL:
                d = os.open(os.devnull, os.O_RDWR)
                close_after.append(d)
                return d
            if spec == subprocess.PIPE:
                r, w = os.pipe()
                mine, theirs = (r, w) if writing else (w, r)
                parent_ends[name] = mine
                close_after.append(theirs)
                return theirs
            if spec == subprocess.STDOUT:
                return given[1]
            return spec if isinstance(spec, int) else spec.fileno()

        given.append(stream("stdin", stdin, 0, False))
        given.append(stream("stdout", stdout, 1, True))
        given.append(stream("stderr", stderr, 2, True))
        request = json.dumps({"argv": argv, "env": env, "cwd": str(cwd or os.getcwd()),
                              "unbuffered": bool(env.get("PYTHONUNBUFFERED"))}).encode()
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._conn.connect(launcher[0])
            socket.send_fds(self._conn, [struct.pack("!I", len(request)) + request], given)
        finally:
            for d in close_after:
                os.close(d)
        self.pid = self._read()
        for name in ("stdin", "stdout", "stderr"):
            end = parent_ends.get(name)
            f = None
            if end is not None:
                f = os.fdopen(end, "wb" if name == "stdin" else "rb")
                if text:
                    f = io.TextIOWrapper(f, encoding=self.encoding, write_through=name == "stdin")
            setattr(self, name, f)

    def _read(self, timeout: float | None = None) -> int | None:
        import struct

        self._conn.settimeout(timeout)
        data = b""
        try:
            while len(data) < 8:
                more = self._conn.recv(8 - len(data))
                if not more:
                    raise ConnectionError("the launcher went away")
                data += more
        except TimeoutError:
            return None
        return struct.unpack("!q", data)[0]

    def poll(self) -> int | None:
        import select

        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self.returncode = self._read()
            self._conn.close()  # the exit code is the last thing the launcher sends
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        if self.returncode is None:
            code = self._read(timeout)
            if code is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = code
            self._conn.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        import signal

        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)

    def communicate(self, input=None, timeout: float | None = None):
        """(stdout, stderr) as Popen.communicate gives them: input written, the pipes read to their end."""
        import subprocess
        import threading

        out: dict = {}

        def drain(name: str):
            f = getattr(self, name)
            out[name] = f.read()
            f.close()

        readers = [threading.Thread(target=drain, args=(n,), daemon=True) for n in ("stdout", "stderr")
                   if getattr(self, n) is not None]
        for t in readers:
            t.start()
        if self.stdin is not None:
            try:
                if input:
                    self.stdin.write(input)
                self.stdin.close()
            except BrokenPipeError:
                pass
        for t in readers:
            t.join(timeout)
            if t.is_alive():
                self.kill()
                self.wait()
                raise subprocess.TimeoutExpired(self.args, timeout)
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait()
            raise
        return out.get("stdout"), out.get("stderr")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for f in (self.stdin, self.stdout, self.stderr):
            if f is not None and not f.closed:
                f.close()
        self.wait()


def launch(*args: str, env: dict | None = None, torchrun: int = 0, timeout: float = LAUNCH_TIMEOUT, **kwargs):
    """The one subprocess launcher: `lmhead ARGS` in another process (forked by tests/zygote.py where
    that runs what a fresh interpreter would, else a fresh interpreter; killed after `timeout` s; `env`
    is added to the current environment), like subprocess.run. Output is captured unless `stdout` or
    `stderr` is given; other keyword arguments (text, input, preexec_fn) go to subprocess.run."""
    import subprocess

    if "stdout" not in kwargs and "stderr" not in kwargs:
        kwargs.setdefault("capture_output", True)
    full = _env(env)
    launcher = None if torchrun else forkable(full, kwargs)
    if launcher is None:
        return subprocess.run(lmhead_argv(*args, torchrun=torchrun), env=full, timeout=timeout, **kwargs)
    capture = kwargs.pop("capture_output", False)
    data = kwargs.pop("input", None)
    streams = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE} if capture else {}
    streams |= {k: kwargs.pop(k) for k in ("stdin", "stdout", "stderr") if k in kwargs}
    if data is not None:
        streams["stdin"] = subprocess.PIPE
    argv = [str(a) for a in args]
    with Forked(argv, launcher, full, **streams, **kwargs) as proc:
        out, err = proc.communicate(data, timeout=timeout)
    return subprocess.CompletedProcess(lmhead_argv(*args), proc.returncode, out, err)


def start(*args: str, env: dict | None = None, **kwargs):
    """`lmhead ARGS` started in the background (stdin/stdout/stderr piped; forked like `launch` where it
    can be, else subprocess.Popen); read its output with `reader`, never with a bare readline."""
    import subprocess

    for stream in ("stdin", "stdout", "stderr"):
        kwargs.setdefault(stream, subprocess.PIPE)
    full = _env(env)
    launcher = forkable(full, kwargs)
    if launcher is None:
        return subprocess.Popen(lmhead_argv(*args), env=full, **kwargs)
    return Forked([str(a) for a in args], launcher, full, **kwargs)


def reader(stream, timeout: float = LAUNCH_TIMEOUT):
    """A readline for `stream` (a pipe) that gives up: each call returns the next line ("" at the end), or
    fails the test after `timeout` seconds, so a process that never writes cannot hang the suite."""
    import queue
    import threading

    lines: queue.Queue = queue.Queue()

    def pump():
        for line in iter(stream.readline, stream.read(0)):  # read(0): b"" or "", the end-of-file value
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()

    def readline():
        try:
            line = lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no line within {timeout} s") from None
        return stream.read(0) if line is None else line

    return readline


ESC_ID, BEL_ID = 215, 195  # GPT-2's single-byte tokens for ESC (0x1b) and BEL (0x07)


def control_byte_checkpoint(folder: Path) -> str:
    """A GPT-2 checkpoint whose every prediction is a control byte: ln_f maps any x to the same h
    (weight 0, bias 1) and the untied head scores only ESC and BEL (ESC first), so the top tokens are
    ESC and BEL whatever the prompt."""
    from safetensors.torch import save_file

    model = build_checkpoint(folder, tied=False, n_embd=16, n_layer=1, n_head=2, n_positions=64)
    state = {k: v.clone().contiguous() for k, v in model.state_dict().items() if not k.endswith(".attn.bias")}
    state["transformer.ln_f.weight"].zero_()
    state["transformer.ln_f.bias"].fill_(1.0)
    head = torch.zeros_like(state["lm_head.weight"])
    head[ESC_ID], head[BEL_ID] = 2.0, 1.0
    state["lm_head.weight"] = head
    save_file(state, str(folder / "model.safetensors"))
    return str(folder)

# ---- a real server (`lmhead serve`) in its own process ---------------------------------------------

class SystemCall:
    """What a hostile pickle holds: unpickling it calls os.system("echo pwned")."""

    def __reduce__(self):
        return (os.system, ("echo pwned",))


def hostile_pickle_folder(tmp_path: Path, save) -> Path:
    """A model folder (distilgpt2's config) whose pytorch_model.bin is written by `save(payload, path)`,
    `payload` a SystemCall: pickle.dumps of it, or torch.save's zip around it."""
    folder = tmp_path / "pickled"
    folder.mkdir()
    shutil.copy(REPO / "configs" / "distilgpt2.json", folder / "config.json")
    save(SystemCall(), folder / "pytorch_model.bin")
    return folder


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A running `lmhead serve`: its base URL, and its output so far (read by a thread, never blocking)."""

    def __init__(self, proc, url: str, lines: list[str]):
        self.proc, self.url, self.lines = proc, url, lines

    @property
    def output(self) -> str:
        return "".join(self.lines)


class _Web:
    """httpx's get / post / head / stream, every call with one TLS context made once per process.

    httpx builds a TLS context for every call, even to a plain-HTTP URL, and building one loads the
    whole CA bundle (~25 ms of CPU): the suite's ~1,400 requests to 127.0.0.1 spent 35 s of CPU on it
    (a profile of the whole run). Every request here is plain HTTP, so the context is never used; the
    calls are otherwise httpx's own."""

    @functools.cached_property
    def tls(self):
        import ssl

        return ssl.create_default_context()

    def get(self, url, **kw):
        import httpx

        return httpx.get(url, verify=self.tls, **kw)

    def post(self, url, **kw):
        import httpx

        return httpx.post(url, verify=self.tls, **kw)

    def head(self, url, **kw):
        import httpx

        return httpx.head(url, verify=self.tls, **kw)

    def stream(self, method, url, **kw):
        import httpx

        return httpx.stream(method, url, verify=self.tls, **kw)


web = _Web()


def serving(folder, *args: str, timeout: float = 180.0):
    """Context manager: `lmhead serve --model folder --port <free> *args` on 127.0.0.1, ready (its
    /health answers) before the block runs, stopped after it."""
    import contextlib
    import subprocess
    import threading
    import time

    import httpx

    @contextlib.contextmanager
    def run():
        port = free_port()
        env = {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        proc = start("serve", "--model", str(folder), "--port", str(port), *args, env=env, stdin=None,
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: list[str] = []
        threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
        served = Served(proc, f"http://127.0.0.1:{port}", lines)
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"lmhead serve exited with {proc.returncode}:\n{served.output}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"lmhead serve did not answer within {timeout:.0f} s:\n{served.output}")
                try:
                    if web.get(served.url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            yield served
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    return run()


def loud_checkpoint(folder: Path, *, seed: int = 5, fc: float = 5.0, proj: float = 20.0, head: float = 20.0):
    """A tiny untied GPT-2 with its MLPs and head scaled up (returns the model): the MLPs' inputs reach
    the range where gelu_new and exact gelu differ (~1e-3 in the logits, against ~5e-6 of float noise
    between engines), and the next-token distributions are peaked, so two prompts' distributions are
    far apart and KL(p‖q), KL(q‖p) differ clearly. The default tiny model's are near-uniform."""
    model = build_checkpoint(folder, tied=False, seed=seed)
    with torch.no_grad():
        for block in model.transformer.h:
            block.mlp.c_fc.weight.mul_(fc)
            block.mlp.c_proj.weight.mul_(proj)
        model.lm_head.weight.mul_(head)
    model.save_pretrained(folder)
    return model


# ---- a second device, emulated on the CPU ---------------------------------------------------------
# A reading that moves a tensor to the wrong device is only wrong with two devices: a model on a GPU
# and its ids or another model on the CPU. No second device is here, so one is emulated: an `Elsewhere`
# tensor holds a CPU tensor and says it is on ELSEWHERE; torch ops that mix it with a CPU tensor fail
# as a GPU's do ("Expected all tensors to be on the same device"), except indexing by CPU indices and
# copying across, which torch allows between devices. Under `elsewhere()`, `.to(ELSEWHERE)` moves a CPU
# tensor there and `.cpu()` back, and a tensor made with device=ELSEWHERE is made there. A model's engine
# is put there by `EngineElsewhere`; attention runs there as one op (scaled_dot_product_attention).

ELSEWHERE = torch.device("meta")  # the name the emulated device goes by (no meta tensor is ever made)


aten = torch.ops.aten


def _inner(t):
    return t.inner if isinstance(t, Elsewhere) else t


class Elsewhere(torch.Tensor):
    """A CPU tensor (`inner`) on the emulated device."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(), dtype=inner.dtype,
                                                   device=ELSEWHERE, storage_offset=inner.storage_offset())

    def __init__(self, inner: torch.Tensor):
        self.inner = inner

    def __repr__(self) -> str:
        return f"Elsewhere({self.inner!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # attention as one op on the device, as a GPU runs it (its decomposition into torch ops makes
        # helper tensors on the CPU, which a GPU's kernels never do)
        if func is torch.nn.functional.scaled_dot_product_attention:
            return _dispatch(func, args, kwargs or {})
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs or {})


def _target(func, args, kwargs) -> torch.device | None:
    """Where a copy across devices goes (`.to(device)`, `.cpu()`: aten._to_copy, or aten.to's overloads
    under inference mode), or None for any other op."""
    if getattr(func, "overloadpacket", None) not in (aten._to_copy, aten.to):
        return None
    devices = [d for d in (*args[1:], *kwargs.values()) if isinstance(d, (torch.device, str))]
    return torch.device(devices[0]) if devices else None


def _moved(func, args, kwargs, device: torch.device) -> torch.Tensor:
    """The copy made on the CPU (the devices in the call replaced by it), wrapped if it goes ELSEWHERE."""
    cpu = lambda a: torch.device("cpu") if isinstance(a, (torch.device, str)) else a
    out = func(_inner(args[0]), *[cpu(a) for a in args[1:]], **{k: cpu(v) for k, v in kwargs.items()})
    return Elsewhere(out) if device == ELSEWHERE else out


def _dispatch(func, args, kwargs):
    from torch.utils._pytree import tree_flatten, tree_map

    device = _target(func, args, kwargs)
    if device is not None:
        return _moved(func, args, kwargs, device)
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    there = [t for t in tensors if isinstance(t, Elsewhere)]
    here = [t for t in tensors if not isinstance(t, Elsewhere) and t.dim() > 0]  # a 0-d CPU tensor is a scalar
    if there and here and func not in (aten.index.Tensor, aten.copy_.default):
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                           f"{ELSEWHERE} (emulated) and cpu ({func})")
    out = func(*tree_map(_inner, args), **tree_map(_inner, kwargs))
    if not there or (func is aten.copy_.default and not isinstance(args[0], Elsewhere)):
        return out  # all on the CPU, or a copy into a CPU tensor
    own = {id(t.inner): t for t in there}  # an in-place op hands back its own Elsewhere tensor

    def wrap(t):
        if not isinstance(t, torch.Tensor) or isinstance(t, Elsewhere):
            return t
        return own[id(t)] if id(t) in own else Elsewhere(t)

    return tree_map(wrap, out)


def elsewhere():
    """The context in which `.to(ELSEWHERE)` moves a CPU tensor to the emulated device."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Moves(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if _target(func, args, kwargs) == ELSEWHERE and not isinstance(args[0], Elsewhere):
                return _moved(func, args, kwargs, ELSEWHERE)
            if kwargs.get("device") is not None and torch.device(kwargs["device"]) == ELSEWHERE:  # made there
                return Elsewhere(func(*args, **{**kwargs, "device": torch.device("cpu")}))
            return func(*args, **kwargs)

    return Moves()


class EngineElsewhere:
    """A loaded model's engine on the emulated device: its body and head take tensors on that device only
    (a CPU tensor fails, as on a GPU), run on the CPU and hand back tensors on that device."""

    device = ELSEWHERE

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    @staticmethod
    def _arrived(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, Elsewhere):
            raise RuntimeError(f"Expected all tensors to be on the same device: a tensor on {t.device} handed "
                               f"to a model on {ELSEWHERE} (emulated)")
        return t.inner

    def body(self, ids, *args, **kwargs):
        return Elsewhere(self._engine.body(self._arrived(ids), *args, **kwargs))

    def head(self, h):
        return Elsewhere(self._engine.head(self._arrived(h)))


def loaded_elsewhere(loaded):
    """The same model, its engine on the emulated device."""
    from dataclasses import replace

    return replace(loaded, engine=EngineElsewhere(loaded.engine))


PY = __import__("sys").executable


def invoke(args, **kwargs):
    """`cli(*args)` that must not end in the catch-all: no "unexpected" and no traceback on stderr."""
    got = cli(*args, **kwargs)
    assert "unexpected" not in got.stderr and "Traceback" not in got.stderr, got.stderr
    return got


def one_line(got, code: int, *needles: str) -> None:
    """The run ended with `code` and exactly one `lmhead: error:` line holding every needle."""
    assert got.exit_code == code, (got.exit_code, got.output)
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lmhead: error: "), got.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def lmhead(*args, env=None, timeout=120, **kwargs):
    """`lmhead ARGS` in a fresh interpreter, offline, text output (launch with text=True)."""
    return launch(*args, env={"HF_HUB_OFFLINE": "1", **(env or {})}, timeout=timeout, text=True, **kwargs)


# ---- GGUF files (llama.cpp's format), written with the gguf package ---------------------------------

def gpt2_tokens() -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types) of the bundled GPT-2 tokenizer, as convert_hf_to_gguf.py lists them:
    tokens in id order, merges as "a b", <|endoftext|> a control token (3), the rest normal (1)."""
    import json

    src = resources.files("lmhead_cli.data") / "gpt2-tokenizer"
    vocab = json.loads((src / "vocab.json").read_text(encoding="utf-8"))
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    lines = (src / "merges.txt").read_text(encoding="utf-8").splitlines()
    merges = [ln for ln in lines if ln and not ln.startswith("#version")]
    return tokens, merges, [3 if t == "<|endoftext|>" else 1 for t in tokens]


def llama_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rotary halves interleaved for ggml's rope."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_names(cfg) -> list[tuple[str, str, str | None]]:
    """(GGUF name, transformers name, how convert_hf_to_gguf.py lays it out: None as is, "T" transposed,
    "q"/"k" permuted for ggml's rope) for a transformers GPT-2 or Llama config."""
    if cfg.model_type == "gpt2":
        names = [("token_embd.weight", "transformer.wte.weight", None),
                 ("position_embd.weight", "transformer.wpe.weight", None),
                 ("output_norm.weight", "transformer.ln_f.weight", None),
                 ("output_norm.bias", "transformer.ln_f.bias", None)]
        for i in range(cfg.n_layer):
            for g, hf in (("attn_norm", "ln_1"), ("attn_qkv", "attn.c_attn"), ("attn_output", "attn.c_proj"),
                          ("ffn_norm", "ln_2"), ("ffn_up", "mlp.c_fc"), ("ffn_down", "mlp.c_proj")):
                names.append((f"blk.{i}.{g}.weight", f"transformer.h.{i}.{hf}.weight", None if "norm" in g else "T"))
                names.append((f"blk.{i}.{g}.bias", f"transformer.h.{i}.{hf}.bias", None))
    else:
        names = [("token_embd.weight", "model.embed_tokens.weight", None), ("output_norm.weight", "model.norm.weight", None)]
        for i in range(cfg.num_hidden_layers):
            for g, hf in (("attn_norm", "input_layernorm"), ("attn_q", "self_attn.q_proj"),
                          ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
                          ("attn_output", "self_attn.o_proj"), ("ffn_norm", "post_attention_layernorm"),
                          ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj")):
                names.append((f"blk.{i}.{g}.weight", f"model.layers.{i}.{hf}.weight",
                              None if cfg.model_type == "qwen2" else {"attn_q": "q", "attn_k": "k"}.get(g)))
            if cfg.model_type == "qwen2":  # Qwen2: biases on q, k, v; no permutation (ggml's NEOX rope)
                names += [(f"blk.{i}.attn_{x}.bias", f"model.layers.{i}.self_attn.{x}_proj.bias", None) for x in "qkv"]
    if not cfg.tie_word_embeddings:
        names.append(("output.weight", "lm_head.weight", None))
    return names


def _heads(cfg, kind: str) -> int:
    return cfg.num_attention_heads if kind == "q" else cfg.num_key_value_heads


def gguf_tensors(model) -> dict[str, torch.Tensor]:
    """A transformers GPT-2 or Llama's weights under GGUF names and layouts, as convert_hf_to_gguf.py
    writes them: GPT-2's Conv1D weights transposed to [out, in], Llama's q and k permuted."""
    sd = model.state_dict()
    out = {}
    for g, hf, kind in gguf_names(model.config):
        w = sd[hf].detach().float()
        w = w.t() if kind == "T" else llama_permute(w, _heads(model.config, kind)) if kind else w
        out[g] = w.contiguous()
    return out


def from_gguf_layout(model, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of gguf_tensors, for the test's oracle: GGUF names and layouts -> transformers' state
    dict. A permutation is undone by indexing with the permutation of the row numbers (argsort), not
    by a second formula."""
    out = {}
    for g, hf, kind in gguf_names(model.config):
        w = tensors[g]
        if kind == "T":
            w = w.t()
        elif kind:
            rows = llama_permute(torch.arange(w.shape[0], dtype=torch.float64)[:, None],
                                 _heads(model.config, kind))[:, 0].long()  # GGUF row r holds HF row rows[r]
            w = w[torch.argsort(rows)]
        out[hf] = w.contiguous()
    return out


def k_quantize(w, qtype: str):
    """w (rows, cols) float32 quantised to Q4_K or Q6_K blocks (uint8, (rows, cols / 256 × block bytes)), as
    llama.cpp lays them out (quantize_row_q4_K_ref, quantize_row_q6_K_ref), with the simplest scales: each
    sub-block's range mapped onto its quants (no search for the best scale, so a little coarser than
    llama-quantize's; gguf-py cannot quantise to these types)."""
    import numpy as np

    rows, cols = w.shape
    f16 = lambda a: a.astype(np.float16).astype(np.float32)  # noqa: E731
    if qtype == "Q6_K":  # 16 sub-blocks of 16: w = d · sc · (q − 32), sc int8, q 0..63
        b = w.reshape(-1, 16, 16).astype(np.float32)
        scale = np.abs(b).max(-1) / 31  # (blocks, 16)
        d = f16(scale.max(-1, keepdims=True) / 127)
        sc = np.where(d > 0, np.rint(scale / np.where(d > 0, d, 1)), 0).clip(-128, 127)
        step = (d * sc)[..., None]
        q = (np.where(step > 0, np.rint(b / np.where(step > 0, step, 1)), 0).clip(-32, 31) + 32).astype(np.uint8)
        q = q.reshape(-1, 2, 4, 32)  # (blocks, half, quarter, l)
        ql = np.concatenate([(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4),
                             (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)], -1)  # (blocks, 2, 64)
        qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
        out = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8),
                              d.astype(np.float16).view(np.uint8)], -1)
    else:  # Q4_K: 8 sub-blocks of 32: w = d · sc · q − dmin · m, sc and m 6 bits, q 0..15
        b = w.reshape(-1, 8, 32).astype(np.float32)
        lo, hi = np.minimum(b.min(-1), 0), b.max(-1)
        scale, mn = (hi - lo) / 15, -lo
        d, dmin = f16(scale.max(-1, keepdims=True) / 63), f16(mn.max(-1, keepdims=True) / 63)
        sc = np.where(d > 0, np.rint(scale / np.where(d > 0, d, 1)), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dmin > 0, np.rint(mn / np.where(dmin > 0, dmin, 1)), 0).clip(0, 63).astype(np.uint8)
        step = (d * sc)[..., None]
        q = np.where(step > 0, np.rint((b + (dmin * m)[..., None]) / np.where(step > 0, step, 1)), 0)
        q = q.clip(0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)
        qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
        packed = np.zeros((len(b), 12), dtype=np.uint8)  # get_scale_min_k4's packing, undone
        packed[:, 0:4], packed[:, 4:8] = sc[:, :4], m[:, :4]
        packed[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
        packed[:, 0:4] |= (sc[:, 4:] >> 4) << 6
        packed[:, 4:8] |= (m[:, 4:] >> 4) << 6
        out = np.concatenate([d.astype(np.float16).view(np.uint8), dmin.astype(np.float16).view(np.uint8),
                              packed, qs], -1)
    return np.ascontiguousarray(out).reshape(rows, -1)


def k_quant_blocks(qtype: str, rows: int, cols: int, seed: int = 0):
    """Raw Q4_K or Q6_K blocks (uint8, (rows, cols / 256 × block bytes)) with random quants and small
    finite float16 scales: the gguf package dequantises these types but cannot quantise to them."""
    import numpy as np
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    t = GGMLQuantizationType[qtype]
    block, size = GGML_QUANT_SIZES[t]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    scale = rng.uniform(1e-4, 2e-3, size=(len(blocks), 2)).astype(np.float16).view(np.uint8)
    if qtype == "Q4_K":  # d and dmin lead the block
        blocks[:, 0:4] = scale
    else:  # Q6_K: d ends the block
        blocks[:, -2:] = scale[:, :2]
    return blocks.reshape(rows, cols // block * size)


def write_gguf(model, path: Path, qtype: str = "F32", *, tensors: dict | None = None, meta: dict | None = None,
               drop: tuple[str, ...] = (), arch: str | None = None) -> dict[str, tuple[str, object]]:
    """A GGUF file of a transformers GPT-2 or Llama (GPT-2's tokenizer), written with gguf.GGUFWriter:
    matrices in `qtype` where their rows fit its block (else F32), vectors in F32, as llama.cpp's
    quantiser does. F16, BF16, Q8_0, Q4_0 through gguf.quants.quantize; Q4_K and Q6_K through
    k_quantize. `tensors` replaces tensors (GGUF names), `meta` adds or replaces metadata keys (value, or
    (value, GGUFValueType)), `drop` leaves keys or tensors out, `arch` replaces
    general.architecture. Returns what was written:
    name -> (type name, numpy data as stored)."""
    import numpy as np
    from gguf import GGUFWriter
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
    from gguf.quants import quantize

    cfg = model.config
    arch_name, arch = arch, cfg.model_type  # `arch`: general.architecture, when it should lie
    weights = {**gguf_tensors(model), **(tensors or {})}
    tokens, merges, types = gpt2_tokens()
    if arch == "gpt2":
        d, L, ff = cfg.n_embd, cfg.n_layer, cfg.n_inner or 4 * cfg.n_embd
        kv = {"gpt2.context_length": cfg.n_positions, "gpt2.embedding_length": d, "gpt2.block_count": L,
              "gpt2.feed_forward_length": ff, "gpt2.attention.head_count": cfg.n_head,
              "gpt2.attention.layer_norm_epsilon": float(cfg.layer_norm_epsilon)}
    else:  # llama, or qwen2 (the same keys under its own name)
        a = arch
        kv = {f"{a}.context_length": cfg.max_position_embeddings, f"{a}.embedding_length": cfg.hidden_size,
              f"{a}.block_count": cfg.num_hidden_layers, f"{a}.feed_forward_length": cfg.intermediate_size,
              f"{a}.attention.head_count": cfg.num_attention_heads,
              f"{a}.attention.head_count_kv": cfg.num_key_value_heads,
              f"{a}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
              f"{a}.rope.freq_base": float(cfg.rope_parameters["rope_theta"]),
              f"{a}.rope.dimension_count": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads}
    kv |= {"general.name": "tiny", "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
           "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
           "tokenizer.ggml.bos_token_id": 50256, "tokenizer.ggml.eos_token_id": 50256}
    ftypes = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7, "Q4_K": 15, "Q6_K": 18, "BF16": 32}
    kv["general.file_type"] = ftypes[qtype]
    kv |= meta or {}
    w = GGUFWriter(str(path), arch_name or arch)
    for key, value in kv.items():
        if key in drop:
            continue
        if isinstance(value, tuple):
            w.add_key_value(key, value[0], value[1], sub_type=value[2] if len(value) > 2 else None)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, list) and value and isinstance(value[0], str):
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
    written: dict[str, tuple[str, object]] = {}
    t = GGMLQuantizationType[qtype]
    block = GGML_QUANT_SIZES[t][0]
    for name, tensor in weights.items():
        if name in drop:
            continue
        data = tensor.numpy().astype(np.float32) if isinstance(tensor, torch.Tensor) else tensor
        if data.dtype != np.float32 or data.ndim == 1 or data.shape[-1] % block or qtype == "F32":
            if data.dtype == np.uint8:  # raw blocks given in `tensors`
                raise ValueError("give float tensors in `tensors`: write_gguf quantises them")
            w.add_tensor(name, data)
            written[name] = ("F32", data)
        elif qtype in ("Q4_K", "Q6_K"):
            raw = k_quantize(data, qtype)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=t)
            written[name] = (qtype, raw)
        else:
            raw = quantize(data, t)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=None if qtype == "F16" else t)
            written[name] = (qtype, raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def dequantised(written: dict) -> dict[str, torch.Tensor]:
    """What each tensor the writer stored dequantises to, by gguf.quants (the oracle's weights)."""
    import numpy as np
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    return {name: torch.from_numpy(np.array(dequantize(data, GGMLQuantizationType[kind]), dtype=np.float32))
            for name, (kind, data) in written.items()}


def gguf_oracle(model, written: dict):
    """A copy of `model` holding the file's dequantised weights (the head tied or not, as the file)."""
    import copy

    twin = copy.deepcopy(model)
    state = from_gguf_layout(model, dequantised(written))
    with torch.no_grad():
        for name, t in state.items():
            twin.get_parameter(name).copy_(t.reshape(twin.get_parameter(name).shape))
    return twin, state


def agrees_with_oracle(eng, oracle, ids: torch.Tensor, bound: float, exact: bool) -> None:
    """lmhead's engine and transformers' `oracle` (a model holding the file's dequantised weights) on
    ids (1, T), KL(oracle ‖ lmhead) over the whole vocabulary at each position: with `exact` arithmetic
    (x unrounded: the dequantised matrix's products) the top 5 ids equal everywhere and KL <= 1e-5;
    with x rounded per block (llama.cpp's arithmetic, engine/quant.py ROUNDED) 0 < KL <= `bound`."""
    with torch.no_grad():
        want = oracle(ids).logits[0].double()
    got = eng.head(eng.body(ids))[0].double()
    p = want.log_softmax(-1)
    kl = (p.exp() * (p - got.log_softmax(-1))).sum(-1)  # KL(transformers ‖ lmhead) at every position
    if exact:
        assert torch.equal(got.topk(5, -1).indices, want.topk(5, -1).indices)
        assert float(kl.max()) <= 1e-5, float(kl.max())
    else:
        assert 0 < float(kl.max()) <= bound, float(kl.max())


def refused_gguf(model, folder: Path, says: str, error, **kwargs) -> None:
    """A GGUF written with write_gguf(**kwargs) is refused with `error` saying `says`, by load() and by
    the command line in one line (exit 1)."""
    import lmhead_cli

    path = folder / "bad.gguf"
    write_gguf(model, path, "F32", **kwargs)
    with pytest.raises(error) as e:
        lmhead_cli.load(str(path), device="cpu")
    assert says in str(e.value), str(e.value)
    out = cli("inspect", PROMPT, "--model", str(path))
    assert out.exit_code == 1 and says in out.stderr and out.stderr.count("\n") == 1, out.output


def run_against_steps(eng, prompt: list[int], n: int, eos_at: int | None = None):
    """Engine.greedy_run against step_logits one step at a time after the same prompt: n greedy steps each
    way (with `eos_at`, the top-1 of that step named end-of-text, where the run must stop). Asserts the
    run's records, its last logits and the cache it wrote are the steps' bit for bit, and returns the run."""
    with torch.inference_mode():
        caches, firsts = [], []
        for _ in range(2):
            cache = eng.new_cache(1, len(prompt) + n + 1)
            z = eng.head(eng.body(torch.tensor([prompt]), cache)[:, -1:])[:, 0].float()
            caches.append(cache)
            firsts.append(int(z.argmax()))
        token, logits, top_ids, figures = firsts[0], [], [], []
        for _ in range(n):
            z, (top_id, top) = eng.step_logits(torch.tensor([[token]]), caches[0], record=True)
            logits.append(z)
            top_ids.append(int(top_id[0]))
            figures.append(top[:, 0])
            token = top_ids[-1]
        eos = None if eos_at is None else top_ids[eos_at]
        m = n if eos is None else top_ids.index(eos) + 1
        run = eng.greedy_run(firsts[1], caches[1], n, eos)
    assert run is not None and run.top_ids.tolist() == top_ids[:m]
    assert torch.equal(run.figures, torch.stack(figures[:m], dim=1)) and torch.equal(run.logits, logits[m - 1])
    done = len(prompt) + m
    assert caches[1].length == done
    if m == n:
        assert caches[0].length == done
    for a, b in ((caches[0].k, caches[1].k), (caches[0].v, caches[1].v)):
        assert torch.equal(a[:, :, :, :done], b[:, :, :, :done])
    return run
