"""The compiled kernels' interface, declared once in lmhead_cli/engine/csrc/kernels.h: engine/kernels.py's
ctypes signatures (argtypes, restype) and structures (_fields_: names, types, order) are compared with
what the header declares, parsed here, so that a mismatch fails this test instead of crashing the
process; the ABI number is written in the header alone. (The C side is held to the header by the
compiler: kernels.c includes it, so a definition that differs from its declaration does not build.)"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import pytest

from lmhead_cli.engine import kernels, quant

C_TYPES = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float, "double": ctypes.c_double,
           "int8_t": ctypes.c_int8, "uint8_t": ctypes.c_uint8, "int16_t": ctypes.c_int16,
           "uint16_t": ctypes.c_uint16}


def _ctype(declared: str):
    """A C type as the header writes it ('const float *', 'int64_t', 'const char *') as ctypes: every
    pointer is a c_void_p (a tensor's data_ptr(), a structure's address), but text (char *)."""
    words = declared.replace("*", " * ").split()
    words = [w for w in words if w != "const"]
    if "*" in words:
        return ctypes.c_char_p if words[0] == "char" else ctypes.c_void_p
    return C_TYPES[" ".join(words)]


def _declarations(text: str) -> str:
    return re.sub(r"/\*.*?\*/", " ", text, flags=re.S)


def header_functions(text: str) -> dict[str, tuple]:
    """{name: (restype, [argtypes])} for every function the header declares; a variant's kernel by its
    plain name (LMHEAD_VARIANT(lmhead_attend) -> lmhead_attend)."""
    found = {}
    pattern = r"^([A-Za-z_][\w \t]*?[\s*]+)(?:LMHEAD_VARIANT\((\w+)\)|(\w+))\(([^;{}]*?)\);"
    for m in re.finditer(pattern, _declarations(text), re.M | re.S):
        params = [p.strip() for p in m[4].split(",")]
        args = [] if params == ["void"] else [_ctype(re.match(r"(.*?)\w+$", p, re.S)[1]) for p in params]
        found[m[2] or m[3]] = (_ctype(m[1]), args)
    return found


def header_structures(text: str) -> dict[str, list[tuple]]:
    """{name: [(field, ctypes type)]} for every `typedef struct {...} name;`, fields in order (an array
    field as ctypes' array type, `const void *w[4]` -> c_void_p * 4; a length may be the header's macro, or
    a macro divided by a number: `[LMHEAD_QK_K / 2]`)."""
    found, numbers = {}, kernels.header_constants(text)
    for m in re.finditer(r"typedef struct \{(.*?)\}\s*(\w+);", _declarations(text), re.S):
        fields = []
        for statement in filter(None, (s.strip() for s in m[1].split(";"))):
            base, first = re.match(r"((?:const\s+)?\w+)\s*(.*)", statement, re.S).groups()
            for declarator in first.split(","):
                star, name, length, per = re.match(r"\s*(\*?)\s*(\w+)\s*(?:\[(\w+)(?:\s*/\s*(\d+))?\])?",
                                                   declarator).groups()
                t = _ctype(base + (" *" if star else ""))
                fields.append((name, t * (int(numbers.get(length, length)) // int(per or 1)) if length else t))
        found[m[2]] = fields
    return found


def _same_type(a, b) -> bool:
    if isinstance(a, type) and issubclass(a, ctypes.Array):
        return isinstance(b, type) and issubclass(b, ctypes.Array) and (a._type_, a._length_) == (b._type_, b._length_)
    return a is b


def _same_signature(a: tuple, b: tuple) -> bool:
    return _same_type(a[0], b[0]) and len(a[1]) == len(b[1]) and all(map(_same_type, a[1], b[1]))


def _shown(t) -> str:
    if isinstance(t, type) and issubclass(t, ctypes.Array):
        return f"{t._type_.__name__} * {t._length_}"
    return t.__name__


def mismatches(text: str, functions: dict, structures: dict) -> list[str]:
    """What differs between the header `text` and kernels.py's `functions` ({name: (restype, argtypes)})
    and `structures` ({C name: ctypes.Structure}), one line each; [] when they agree."""
    declared, problems = header_functions(text), []
    for name in sorted(set(declared) | set(functions)):
        if name not in functions or name not in declared:
            problems.append(f"{name}: declared {'only in the header' if name in declared else 'only in kernels.py'}")
        elif not _same_signature(declared[name], functions[name]):
            problems.append(f"{name}: the header says {_shown(declared[name][0])}"
                            f"({', '.join(map(_shown, declared[name][1]))}), kernels.py {_shown(functions[name][0])}"
                            f"({', '.join(map(_shown, functions[name][1]))})")
    laid = header_structures(text)
    for name in sorted(structures):  # the structures ctypes passes (GGUF's blocks are read by engine/quant.py)
        if name not in laid:
            problems.append(f"struct {name}: declared only in kernels.py")
            continue
        want, got = laid[name], list(structures[name]._fields_)
        if [n for n, _ in want] != [n for n, _ in got] or not all(_same_type(a, b) for (_, a), (_, b) in zip(want, got)):
            problems.append(f"struct {name}: the header lays out {[(n, _shown(t)) for n, t in want]}, kernels.py "
                            f"{[(n, _shown(t)) for n, t in got]}")
    return problems


def python_side() -> tuple[dict, dict]:
    return ({**kernels.MODULE_FUNCTIONS, **kernels.KERNEL_FUNCTIONS},
            {"lmhead_layer": kernels.Layer, "lmhead_model": kernels.Model, "lmhead_llama_layer": kernels.LlamaLayer,
             "lmhead_llama": kernels.Llama, **quant.STRUCTURES})


def test_kernels_py_declares_what_the_header_declares():
    text = kernels.HEADER.read_text(encoding="utf-8")
    functions, structures = python_side()
    # the parser reads the whole header (so that an empty reading cannot pass)
    assert set(header_functions(text)) == set(functions) and len(functions) >= 14
    assert {"lmhead_layer", "lmhead_model", "lmhead_llama_layer", "lmhead_llama", *quant.STRUCTURES} <= set(
        header_structures(text))
    assert [n for n, _ in header_structures(text)["lmhead_model"]][:3] == ["layers", "L", "D"]
    assert kernels.FUNCTIONS == tuple(kernels.KERNEL_FUNCTIONS)
    assert mismatches(text, functions, structures) == []


def test_a_signature_or_a_field_that_differs_from_the_header_fails():
    """Mutants of either side, each named by the comparison."""
    text = kernels.HEADER.read_text(encoding="utf-8")
    functions, structures = python_side()
    restype, args = functions["lmhead_attend"]
    wrong = {**functions, "lmhead_attend": (restype, [*args[:-2], ctypes.c_double, args[-1]])}  # float -> double
    assert [p.split(":")[0] for p in mismatches(text, wrong, structures)] == ["lmhead_attend"]
    fewer = {**functions, "lmhead_step": (functions["lmhead_step"][0], functions["lmhead_step"][1][:-1])}
    assert [p.split(":")[0] for p in mismatches(text, fewer, structures)] == ["lmhead_step"]
    returns = {**functions, "lmhead_score_rows": (ctypes.c_int, functions["lmhead_score_rows"][1])}  # int64_t
    assert [p.split(":")[0] for p in mismatches(text, returns, structures)] == ["lmhead_score_rows"]
    missing = {k: v for k, v in functions.items() if k != "lmhead_decode"}
    assert mismatches(text, missing, structures) == ["lmhead_decode: declared only in the header"]

    class Swapped(ctypes.Structure):  # two fields in the other order
        _fields_ = [kernels.Model._fields_[i] for i in (0, 2, 1, *range(3, len(kernels.Model._fields_)))]

    class Narrow(ctypes.Structure):  # float eps read as a double
        _fields_ = [(n, ctypes.c_double if n == "eps" else t) for n, t in kernels.Model._fields_]

    for bad in (Swapped, Narrow):
        assert [p.split(":")[0] for p in mismatches(text, functions, {**structures, "lmhead_model": bad})] == [
            "struct lmhead_model"]
    # and the header's side: a parameter added there
    grown = text.replace("float scale, int threads);", "float scale, int64_t extra, int threads);")
    assert grown != text and [p.split(":")[0] for p in mismatches(grown, functions, structures)] == ["lmhead_attend"]
    layer = text.replace("const float *s[4];", "const float *s[3];")
    assert layer != text and mismatches(layer, functions, structures)[0].startswith("struct lmhead_layer")


def test_the_abi_number_and_the_step_s_numbers_are_written_in_the_header_alone():
    """kernels.py reads LMHEAD_KERNELS_ABI, LMHEAD_STEP_MAX_ROWS and the step's kinds from the header; no
    C file or Python module writes them again (module.c returns the header's macro)."""
    header = kernels.HEADER.read_text(encoding="utf-8")
    abi = int(re.search(r"#define LMHEAD_KERNELS_ABI (\d+)", header)[1])
    assert kernels.ABI == abi == kernels.header_constants()["LMHEAD_KERNELS_ABI"]
    assert kernels.STEP_MAX_ROWS == int(re.search(r"#define LMHEAD_STEP_MAX_ROWS (\d+)", header)[1])
    assert kernels.STEP_KINDS == {"float32": 0, "bfloat16": 1, "int8": 2}
    csrc = kernels.HEADER.parent
    others = {p.name: p.read_text(encoding="utf-8") for p in [*csrc.glob("*.c"), *csrc.parent.glob("*.py")]}
    assert {"module.c", "step.c", "kernels.py", "step.py"} <= set(others)
    written = {name: re.findall(r"\bABI\b\s*=\s*\d+|LMHEAD_KERNELS_ABI\s+\d+|STEP_MAX_ROWS\s*=?\s*\d+|"
                                r"STEP_(?:F32|BF16|INT8)\s*=\s*\d+", text) for name, text in others.items()}
    assert {name: found for name, found in written.items() if found} == {}
    assert "return LMHEAD_KERNELS_ABI;" in others["module.c"]
    k = kernels.load()
    if k is not None:  # the module built here reports the header's number (load() refuses any other)
        lib = ctypes.CDLL(str(kernels.module_path()))
        lib.lmhead_kernels_abi.restype = ctypes.c_int
        assert lib.lmhead_kernels_abi() == abi


# The header's declarations (comments and spacing aside) as each ABI number left them. Two branches
# once raised the number from 15 to 16 each for its own change, and a module built between the two
# reported 16 with the older lmhead_gguf_matvec: every Q4_K product was refused and fell back to torch
# (about 75x slower) without a word. A change to a declaration without a new number now fails here.
DECLARATIONS = {17: "58d5580e9d4233d8", 18: "02832d323f187945", 19: "25b3db69eb8448ff", 20: "02743f90273cd4f8", 21: "e4cac3e2469318fc",
                22: "30c150f2e3e3c908"}


def declarations_digest(text: str) -> str:
    import hashlib

    return hashlib.sha256(" ".join(_declarations(text).split()).encode()).hexdigest()[:16]


def test_every_change_to_the_interface_raises_the_abi_number():
    header = kernels.HEADER.read_text(encoding="utf-8")
    abi, digest = kernels.ABI, declarations_digest(header)
    assert DECLARATIONS.get(abi) == digest, (
        f"kernels.h's declarations changed under ABI {abi}: raise LMHEAD_KERNELS_ABI and record "
        f"{{{abi + 1}: {digest!r}}} in DECLARATIONS" if abi in DECLARATIONS else
        f"ABI {abi} is new: record {{{abi}: {digest!r}}} in DECLARATIONS")
    # what it guards: a parameter added, with the number left as it was; a comment alone is no change
    grown = header.replace("float scale, int threads);", "float scale, int64_t extra, int threads);")
    assert grown != header and declarations_digest(grown) != digest
    comment = "/* raised when a signature, a structure or a name below changes */"
    assert comment in header and declarations_digest(header.replace(comment, "/* raised */")) == digest


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to measure the structures")
def test_the_structures_have_the_header_s_offsets_and_sizes(tmp_path):
    """The C compiler's offsetof and sizeof of each field of the header's structures equal ctypes' (a
    type of another width, or padding, would move every later field)."""
    fields = python_side()[1]  # the step's structures and GGUF's blocks (engine/quant.py's mirror)
    lines = [f'printf("{s} %zu\\n", sizeof({s}));' for s in fields]
    lines += [f'printf("{s}.{n} %zu\\n", offsetof({s}, {n}));' for s, cls in fields.items() for n, _ in cls._fields_]
    src = tmp_path / "layout.c"
    src.write_text(f'#include <stddef.h>\n#include <stdio.h>\n#include "kernels.h"\nint main(void) {{\n'
                   + "\n".join(lines) + "\nreturn 0;\n}\n")
    exe = tmp_path / "layout"
    subprocess.run(["cc", "-std=c11", f"-I{kernels.HEADER.parent}", "-o", str(exe), str(src)], check=True,
                   capture_output=True)
    got = dict(line.rsplit(" ", 1) for line in subprocess.run([str(exe)], capture_output=True, text=True,
                                                              check=True).stdout.splitlines())
    want = {s: str(ctypes.sizeof(cls)) for s, cls in fields.items()}
    want |= {f"{s}.{n}": str(getattr(cls, n).offset) for s, cls in fields.items() for n, _ in cls._fields_}
    assert got == want
