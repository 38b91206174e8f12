/* kernels.c compiled for AVX2 with FMA (x86-64-v3: Haswell, Zen and later): its public names end in _avx2. */
#include "kernels.h"
#if LMHEAD_X86_VARIANTS
#pragma GCC target("avx2,fma,f16c,bmi2")
#define LMHEAD_VARIANT(name) name##_avx2
#include "kernels.c"
#else
typedef int lmhead_no_avx2_variant; /* not x86-64 with GCC: this variant is not built */
#endif
