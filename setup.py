"""The build's one part that pyproject.toml cannot say: the compiled kernels, a C extension module.

`pip install` (and `pip install -e .`) compiles lmhead_cli/engine/csrc into lmhead_cli.engine._kernels
where a C compiler exists; the extension is optional, so without one (or when the build fails) the
package installs all the same and lmhead runs torch's products (engine/kernels.py says so). No
-march=native: the module holds a variant per x86-64 level and picks the CPU's at run time.
"""

import sys

from setuptools import Extension, setup

CSRC = "lmhead_cli/engine/csrc/"
VARIANTS = ["avx512bf16", "avx512vnni", "avx512", "avx2", "base"]

if sys.platform == "win32":  # MSVC has neither GCC's target pragma nor -fopenmp: torch's products there
    ext_modules = []
else:
    ext_modules = [Extension(
        "lmhead_cli.engine._kernels",
        sources=[CSRC + "module.c"] + [f"{CSRC}variant_{v}.c" for v in VARIANTS],
        depends=[CSRC + "kernels.c", CSRC + "step.c", CSRC + "quants.c", CSRC + "llama_step.c",
                 CSRC + "kernels.h"],
        extra_compile_args=["-O3", "-fopenmp", "-std=c11"],
        extra_link_args=["-fopenmp"],
        libraries=["m"],
        optional=True,
    )]

setup(ext_modules=ext_modules)
