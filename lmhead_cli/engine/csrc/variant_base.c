/* kernels.c as portable C, for any CPU (the compiler's baseline; SSE2 on x86-64): names end in _base. */
#define LMHEAD_VARIANT(name) name##_base
#include "kernels.c"
