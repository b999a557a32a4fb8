/*
 * The Accumulator's element loops (accum_loops.h: what each computes), compiled for the build's
 * baseline instruction set and, on x86-64 with GCC or clang, once more for AVX2, used where
 * __builtin_cpu_supports("avx2") says so (as half_kernels.h does for the 16-bit kernels).  The
 * same C source, integer and exact-double arithmetic only: the same results bit for bit.
 *
 * shmt_acc_set_isa(isa): 1 AVX2 (where compiled in and the CPU has it; returns whether it took),
 * 0 the baseline.  shmt_acc_isa: the one in use.
 */
#ifndef SHMTREE_ACCUM_FAST_H
#define SHMTREE_ACCUM_FAST_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifndef SHMT_QNONE
#define SHMT_QNONE 32767
#endif
#ifndef SHMT_MASK
#define SHMT_MASK ((1ULL << 52) - 1)
#endif
#ifndef SHMT_CAT
#define SHMT_CAT2(a, b) a##b
#define SHMT_CAT(a, b) SHMT_CAT2(a, b)
#endif

#define SHMT_ISA base
#define SHMT_ATTR
#include "accum_loops.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SHMT_ACC_AVX2 1
#define SHMT_ISA avx2
#define SHMT_ATTR __attribute__((target("avx2")))
#include "accum_loops.h"
#else
#define SHMT_ACC_AVX2 0
#endif

static int shmt_acc_isa = 0;

static int shmt_acc_set_isa(int isa)
{
#if SHMT_ACC_AVX2
    if (isa == 1 && __builtin_cpu_supports("avx2")) {
        shmt_acc_isa = 1;
        return 1;
    }
#endif
    shmt_acc_isa = 0;
    return isa == 0;
}

#if SHMT_ACC_AVX2
#define SHMT_ACC_CALL(name, ...) \
    (shmt_acc_isa ? SHMT_CAT(name, avx2)(__VA_ARGS__) : SHMT_CAT(name, base)(__VA_ARGS__))
#else
#define SHMT_ACC_CALL(name, ...) SHMT_CAT(name, base)(__VA_ARGS__)
#endif

static inline int64_t shmt_acc_ulp_quanta(const double *x, int16_t *negq, ptrdiff_t n)
{ return SHMT_ACC_CALL(shmt_acc_ulp_quanta_, x, negq, n); }
static inline int64_t shmt_acc_ulp_limbs(const double *x, const int16_t *negq_g, int extra,
                                         int64_t *out, ptrdiff_t n)
{ return SHMT_ACC_CALL(shmt_acc_ulp_limbs_, x, negq_g, extra, out, n); }
static inline int64_t shmt_acc_round_sums(const int64_t *s, const int16_t *negq_g, double *out,
                                          ptrdiff_t n)
{ return SHMT_ACC_CALL(shmt_acc_round_sums_, s, negq_g, out, n); }
static inline int64_t shmt_acc_align2(const int16_t *q, const int64_t *limbs, const int16_t *qg,
                                      int extra, int64_t *out, ptrdiff_t n)
{ return SHMT_ACC_CALL(shmt_acc_align2_, q, limbs, qg, extra, out, n); }
static inline void shmt_acc_carry2(int64_t *limbs, int16_t *q, ptrdiff_t n)
{ SHMT_ACC_CALL(shmt_acc_carry2_, limbs, q, n); }

#endif /* SHMTREE_ACCUM_FAST_H */
