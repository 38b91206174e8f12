/* lmhead_cli.engine._kernels: the compiled kernels as a CPython extension module, built by
   `pip install` (setup.py). The module itself holds nothing: engine/kernels.py imports it (so the
   interpreter checks that it was built for this Python), then opens the same file with ctypes and
   calls the functions below and the kernels of the variant it picks. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "kernels.h"
#ifdef _OPENMP
#include <omp.h>
#endif

int lmhead_kernels_abi(void) { return LMHEAD_KERNELS_ABI; }

/* The calling thread's OpenMP helper threads ended (engine/execution.py release_thread_pool): 0 done,
   1 where this OpenMP has no omp_pause_resource_all (before OpenMP 5.0), -1 inside a parallel region. */
int lmhead_release_thread_pool(void) {
#if defined(_OPENMP) && (_OPENMP >= 201811 || (defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 9))
    /* GCC's libgomp has it from GCC 9 on, while its _OPENMP still says 4.5 (201511) */
    return omp_pause_resource_all(omp_pause_hard) ? -1 : 0;
#else
    return 1;
#endif
}
int lmhead_kernels_max_rows(void) { return LMHEAD_MAX_ROWS; }
int lmhead_kernels_f32_max_rows(void) { return LMHEAD_F32_MAX_ROWS; }

/* The variants built into this module, best first, separated by spaces. */
const char *lmhead_kernels_variants(void) {
#if LMHEAD_X86_VARIANTS
    return "avx512bf16 avx512vnni avx512 avx2 base";
#else
    return "base";
#endif
}

/* 1 if this CPU (and its operating system, which must save the wider registers) runs `variant`. */
int lmhead_kernels_supports(const char *variant) {
    if (strcmp(variant, "base") == 0) return 1;
#if LMHEAD_X86_VARIANTS
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2");
    int avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                 && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    int vnni = avx512 && __builtin_cpu_supports("avx512vnni");
    if (strcmp(variant, "avx2") == 0) return avx2;
    if (strcmp(variant, "avx512") == 0) return avx512;
    if (strcmp(variant, "avx512vnni") == 0) return vnni;
    if (strcmp(variant, "avx512bf16") == 0) return vnni && __builtin_cpu_supports("avx512bf16");
#endif
    return 0;
}

static struct PyModuleDef kernels_module = {
    PyModuleDef_HEAD_INIT, "_kernels",
    "lmhead's compiled CPU kernels, called through ctypes by lmhead_cli.engine.kernels.", -1, NULL,
};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&kernels_module); }
