/* kernels.c compiled for AVX-512 (Skylake-SP): its public names end in _avx512. */
#include "kernels.h"
#if LMHEAD_X86_VARIANTS
#pragma GCC target("avx2,fma,f16c,bmi2,avx512f,avx512bw,avx512vl,avx512dq")
#define LMHEAD_VARIANT(name) name##_avx512
#include "kernels.c"
#else
typedef int lmhead_no_avx512_variant; /* not x86-64 with GCC: this variant is not built */
#endif
