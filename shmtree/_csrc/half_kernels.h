/*
 * The float16 and bfloat16 reduction kernels (see half_loops.h for what one computes), for the
 * baseline instruction set of the build and, on x86-64 with GCC or clang, once more for AVX2
 * (eight 32-bit lanes instead of SSE2's four), which _kernels.pyx puts in its table when the CPU
 * has it.  The AVX2 copies are plain C compiled with a target attribute, not intrinsics: the
 * same source, so the same results bit for bit (no FMA is enabled, and the loops have no
 * multiply-add to contract anyway).  The build stays portable: nothing outside these functions
 * uses AVX2, and they are only called where __builtin_cpu_supports("avx2") says so.
 *
 * shmt_half_kernel(isa, type, op): the kernel, or NULL if that instruction set was not compiled
 * in or the CPU lacks it.  isa: SHMT_ISA_BASE, SHMT_ISA_AVX2; type: 0 float16, 1 bfloat16;
 * op: 0 sum, 1 prod, 2 min, 3 max.
 */
#ifndef SHMTREE_HALF_KERNELS_H
#define SHMTREE_HALF_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "half.h"

/* Pairs per block of the more-than-four-sources path: two float32 accumulators each, 8 KiB in
 * all, on the stack, in L1. */
#define SHMT_HALF_PAIRS 1024

/* The ops on floats, as _kernels.pyx defines them for float32: min/max propagate NaN (a NaN in
 * either operand gives a NaN) and order -0.0 below +0.0 in either operand order (the ordinary
 * min/max, then the sign bit fixed: see _fix_min_sign and _fix_max_sign there). */
/* Sum and product: when a is a NaN, a's NaN quieted (a op a), whatever b is: which NaN an op on
 * two NaNs gives is otherwise the compiler's choice of operand order, which differs between
 * loops (see _nan_pick in _kernels.pyx); so the result's bits depend on the operands and their
 * order only.  (b is replaced by a where a is a NaN: a compare and a blend.) */
static inline float shmt_nan_pick(float a, float b)
{
    uint32_t m = a != a ? 0xffffffffu : 0u;     /* (a lane-wide mask: this form vectorizes) */
    return shmt_f32_from_bits((shmt_f32_bits(b) & ~m) | (shmt_f32_bits(a) & m));
}

static inline float shmt_op_sum(float a, float b) { return a + shmt_nan_pick(a, b); }
static inline float shmt_op_prod(float a, float b) { return a * shmt_nan_pick(a, b); }

static inline float shmt_op_min(float a, float b)
{
    float r = (a < b) | (a != a) ? a : b;
    return shmt_f32_from_bits(shmt_f32_bits(r) | (shmt_f32_bits(a) & 0x80000000u));
}

static inline float shmt_op_max(float a, float b)
{
    float r = (a > b) | (a != a) ? a : b;
    return shmt_f32_from_bits(shmt_f32_bits(r) & (shmt_f32_bits(a) | 0x7fffffffu));
}

#define SHMT_CAT2(a, b) a##b
#define SHMT_CAT(a, b) SHMT_CAT2(a, b)

typedef void (*shmt_half_fn)(void *dst, const void **srcs, int nsrc, ptrdiff_t n);

enum { SHMT_ISA_BASE = 0, SHMT_ISA_AVX2 = 1, SHMT_N_ISA = 2 };

#define SHMT_ISA base
#define SHMT_ATTR
#include "half_isa.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SHMT_HAVE_AVX2 1
#define SHMT_ISA avx2
#define SHMT_ATTR __attribute__((target("avx2")))
#include "half_isa.h"
#else
#define SHMT_HAVE_AVX2 0
#endif

#define SHMT_HALF_ROW(isa) {                                                                \
    { SHMT_CAT(shmt_f16_sum_, isa), SHMT_CAT(shmt_f16_prod_, isa),                          \
      SHMT_CAT(shmt_f16_min_, isa), SHMT_CAT(shmt_f16_max_, isa) },                         \
    { SHMT_CAT(shmt_bf16_sum_, isa), SHMT_CAT(shmt_bf16_prod_, isa),                        \
      SHMT_CAT(shmt_bf16_min_, isa), SHMT_CAT(shmt_bf16_max_, isa) } }

static shmt_half_fn shmt_half_kernel(int isa, int type, int op)
{
    static const shmt_half_fn base[2][4] = SHMT_HALF_ROW(base);
#if SHMT_HAVE_AVX2
    static const shmt_half_fn avx2[2][4] = SHMT_HALF_ROW(avx2);
#endif
    if (type < 0 || type > 1 || op < 0 || op > 3)
        return NULL;
    if (isa == SHMT_ISA_BASE)
        return base[type][op];
#if SHMT_HAVE_AVX2
    if (isa == SHMT_ISA_AVX2 && __builtin_cpu_supports("avx2"))
        return avx2[type][op];
#endif
    return NULL;
}

#endif /* SHMTREE_HALF_KERNELS_H */
