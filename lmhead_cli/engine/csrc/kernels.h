/* What module.c and kernels.c share: the variants compiled into the extension and their public names. */
#ifndef LMHEAD_KERNELS_H
#define LMHEAD_KERNELS_H

#define LMHEAD_MAX_ROWS 4 /* kernels.c's MAX_ROWS: the most rows of x one product takes */
#define LMHEAD_F32_MAX_ROWS 16 /* the most rows lmhead_f32_matvec takes (more than 4 in one pass of the rows) */

/* x86-64 with GCC: a variant per instruction-set level (variant_*.c), best first; elsewhere (another
   architecture, or a compiler without GCC's target pragma) the portable C variant alone. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LMHEAD_X86_VARIANTS 1
#else
#define LMHEAD_X86_VARIANTS 0
#endif

#endif
