"""llama.cpp for the benchmark: built from llama-cpp-python's source distribution (its vendored
llama.cpp), cached, and the benchmark's GPT-2 checkpoint converted by llama.cpp's own converter.

    python benchmarks/llamacpp.py build      # download, configure, build, once (over an hour on a loaded 2-core machine)
    python benchmarks/llamacpp.py convert    # the checkpoint as GGUF F32, BF16 and Q8_0 (~1 min, once)
    python benchmarks/llamacpp.py where      # what is cached, one line each

The cache folder is $LMHEAD_BENCH_LLAMACPP, else ~/.cache/lmhead-bench/llamacpp:

    src/llama_cpp_python-VERSION.tar.gz and its unpacked tree (vendor/llama.cpp: convert_hf_to_gguf.py, gguf-py)
    build/bin/llama-bench, llama-perplexity, llama-quantize, llama-server
    gguf/gpt2-small-random-{F32,BF16,Q8_0}.gguf

Optional: without cmake or a C/C++ compiler (or without the network for the first download) it says
so in one line and the benchmark leaves llama.cpp's rows out. Nothing here is committed but this
script; the build is llama.cpp's own CMake build (Release, GGML_NATIVE: llama.cpp as its users build
it on their machine).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
VERSION = "0.3.36"  # llama-cpp-python's sdist; its vendor/llama.cpp is what is built
TOOLS = ("llama-bench", "llama-perplexity", "llama-quantize", "llama-server")
TYPES = ("F32", "BF16", "Q8_0")  # the GGUF weight types set against lmhead's float32, bfloat16 and int8
LMHEAD_DTYPE = {"F32": "float32", "BF16": "bfloat16", "Q8_0": "int8"}


class Unavailable(Exception):
    """llama.cpp cannot be had here (no cmake, no compiler, no sdist): the message says why, in one line."""


def cache() -> Path:
    return Path(os.environ.get("LMHEAD_BENCH_LLAMACPP") or Path.home() / ".cache" / "lmhead-bench" / "llamacpp")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def source_tree(root: Path | None = None) -> Path | None:
    """The unpacked vendored llama.cpp (the folder holding convert_hf_to_gguf.py), None if not there."""
    root = root or cache()
    found = sorted((root / "src").glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    return found[-1].parent if found else None


def binary(name: str, root: Path | None = None) -> Path | None:
    exe = (root or cache()) / "build" / "bin" / name
    return exe if exe.is_file() and os.access(exe, os.X_OK) else None


def ready(root: Path | None = None, tools: tuple[str, ...] = TOOLS) -> bool:
    return source_tree(root) is not None and all(binary(t, root) for t in tools)


def version(root: Path | None = None) -> str:
    """Which llama.cpp: the sdist it came from and llama-bench's own version line."""
    tree = source_tree(root)
    sdist = tree.parents[1].name.replace("llama_cpp_python-", "llama-cpp-python ") if tree else "unknown source"
    exe = binary("llama-bench", root)
    r = subprocess.run([str(exe), "--version"], capture_output=True, text=True) if exe else None
    line = next((x for x in ((r.stdout + r.stderr).splitlines() if r else []) if x.startswith("version")), "")
    return f"{sdist}'s vendored llama.cpp" + (f" ({line.strip()})" if line else "")


def _run(cmd: list[str], **kw) -> None:
    log("  $ " + " ".join(str(c) for c in cmd))
    r = subprocess.run(cmd, **kw)
    if r.returncode:
        raise Unavailable(f"{Path(str(cmd[0])).name} exited {r.returncode}: {' '.join(str(c) for c in cmd)}")


def download(root: Path) -> Path:
    """llama-cpp-python's sdist (VERSION, else the newest pip finds) unpacked under root/src."""
    src = root / "src"
    src.mkdir(parents=True, exist_ok=True)
    if source_tree(root):
        return source_tree(root)
    sdists = sorted(src.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        pip = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", str(src)]
        r = subprocess.run([*pip, f"llama-cpp-python=={VERSION}"])
        if r.returncode:
            log(f"llamacpp: llama-cpp-python=={VERSION} not found; trying the newest")
            _run([*pip, "llama-cpp-python"])
        sdists = sorted(src.glob("llama_cpp_python-*.tar.gz"))
        if not sdists:
            raise Unavailable("pip downloaded no llama-cpp-python source distribution")
    with tarfile.open(sdists[-1]) as tar:
        tar.extractall(src, filter="data")
    tree = source_tree(root)
    if tree is None:
        raise Unavailable(f"{sdists[-1].name} holds no vendor/llama.cpp/convert_hf_to_gguf.py")
    return tree


def build(root: Path | None = None, tools: tuple[str, ...] = TOOLS) -> Path:
    """Build (once) llama.cpp's `tools` into root/build/bin; the bin folder. Raises Unavailable (one
    line) without cmake or a compiler."""
    root = root or cache()
    if ready(root, tools):
        return root / "build" / "bin"
    missing = [t for t in ("cmake",) if not shutil.which(t)]
    if not (shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")):
        missing.append("C++ compiler (c++, g++ or clang++)")
    if missing:
        raise Unavailable(f"llama.cpp is left out: no {' and no '.join(missing)} here")
    tree = download(root)
    build_dir = root / "build"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    jobs = str(max(1, min(os.cpu_count() or 1, 4)))
    if not (build_dir / "CMakeCache.txt").is_file():
        _run(["cmake", "-S", str(tree), "-B", str(build_dir), *generator, "-DCMAKE_BUILD_TYPE=Release",
              "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
              "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF",
              "-DLLAMA_USE_PREBUILT_UI=OFF", "-DBUILD_SHARED_LIBS=OFF"])
    _run(["cmake", "--build", str(build_dir), "--config", "Release", "-j", jobs, "--target", *tools])
    if not ready(root, tools):
        raise Unavailable(f"the build finished but {build_dir / 'bin'} lacks one of {', '.join(tools)}")
    return build_dir / "bin"


def _stage(folder: Path, stage: Path) -> Path:
    """The checkpoint as convert_hf_to_gguf.py reads it: transformers 5 writes no `n_ctx` into GPT-2's
    config.json (the converter's GPT-2 class requires it; the hub's gpt2 has it = n_positions), so a
    folder of links to the weights and tokenizer with a config.json that adds it."""
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    for f in folder.iterdir():
        if f.name != "config.json":
            (stage / f.name).symlink_to(f.resolve())
    config = json.loads((folder / "config.json").read_text())
    config.setdefault("n_ctx", config["n_positions"])
    (stage / "config.json").write_text(json.dumps(config, indent=2))
    return stage


def convert(folder: Path, root: Path | None = None) -> dict[str, Path]:
    """The checkpoint in `folder` as GGUF files {"F32", "BF16", "Q8_0"}: F32 by llama.cpp's
    convert_hf_to_gguf.py (its own gguf-py), BF16 and Q8_0 from it by llama-quantize. Cached; made
    again when the checkpoint is newer."""
    root = root or cache()
    tree, quantize = source_tree(root), binary("llama-quantize", root)
    if tree is None or quantize is None:
        raise Unavailable(f"llama.cpp is not built in {root} (python benchmarks/llamacpp.py build)")
    out = root / "gguf"
    out.mkdir(parents=True, exist_ok=True)
    weights = folder / "model.safetensors"
    files = {t: out / f"{folder.name}-{t}.gguf" for t in TYPES}
    fresh = lambda p: p.is_file() and p.stat().st_mtime >= weights.stat().st_mtime  # noqa: E731
    if not fresh(files["F32"]):
        stage = _stage(folder, out / f"{folder.name}.stage")
        tmp = files["F32"].with_suffix(".partial")
        _run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(stage), "--outtype", "f32", "--outfile",
              str(tmp)], stdout=subprocess.DEVNULL)
        tmp.rename(files["F32"])
        shutil.rmtree(stage, ignore_errors=True)
    for t in TYPES[1:]:
        if not fresh(files[t]) or files[t].stat().st_mtime < files["F32"].stat().st_mtime:
            tmp = files[t].with_suffix(".partial")
            _run([str(quantize), str(files["F32"]), str(tmp), t], stdout=subprocess.DEVNULL,
                 stderr=subprocess.DEVNULL)
            tmp.rename(files[t])
    return files


def weight_bytes(gguf_file: Path) -> dict:
    """Bytes of weights one decoding step reads from a GGUF file: every tensor once, except the lookups
    (position_embd's one row; token_embd's one row when an output.weight is stored; tied, token_embd
    is the head and is read whole). Also the bytes by tensor type."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(gguf_file)).tensors}
    lookups = {"position_embd.weight"} | ({"token_embd.weight"} if "output.weight" in tensors else set())
    read = [t for name, t in tensors.items() if name not in lookups]
    by_type: dict[str, int] = {}
    for t in read:
        by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + int(t.n_bytes)
    return {"bytes": sum(by_type.values()), "by_type": by_type, "tied": "output.weight" not in tensors}


def main(argv: list[str]) -> int:
    what = argv[0] if argv else "where"
    try:
        if what == "build":
            log(f"llama.cpp built: {build()}")
        elif what == "convert":
            sys.path.insert(0, str(HERE))
            from checkpoint import gpt2_small

            for t, p in convert(gpt2_small()).items():
                log(f"{t}: {p} ({weight_bytes(p)['bytes'] / 1e6:.0f} MB read per token)")
        elif what == "where":
            root = cache()
            log(f"cache: {root}")
            log(f"source: {source_tree(root) or 'not there'}")
            for t in TOOLS:
                log(f"{t}: {binary(t, root) or 'not built'}")
        else:
            log(f"usage: python benchmarks/llamacpp.py build|convert|where (not {what!r})")
            return 2
    except Unavailable as e:
        log(f"llamacpp: {e}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
