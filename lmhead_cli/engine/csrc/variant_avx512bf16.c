/* kernels.c compiled for AVX-512 with VNNI and BF16 (Cooper Lake, Sapphire Rapids, Zen 4 and later): its public names end in _avx512bf16. */
#include "kernels.h"
#if LMHEAD_X86_VARIANTS
#pragma GCC target("avx2,fma,f16c,bmi2,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16")
#define LMHEAD_VARIANT(name) name##_avx512bf16
#include "kernels.c"
#else
typedef int lmhead_no_avx512bf16_variant; /* not x86-64 with GCC: this variant is not built */
#endif
