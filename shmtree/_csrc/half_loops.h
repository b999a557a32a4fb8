/*
 * One float16 or bfloat16 reduction kernel, instantiated by half_kernels.h once per (type, op,
 * instruction set): no include guard on purpose.  The includer defines
 *
 *   SHMT_NAME          the kernel's name (a reduce_fn of _kernels.pxd: dst, srcs, nsrc, n)
 *   SHMT_ATTR          attributes of every function here (empty, or a target("avx2") attribute)
 *   SHMT_OP(a, b)      the op on two floats
 *   SHMT_FIRST(w), SHMT_SECOND(w)   a pair's first / second element widened to float
 *   SHMT_PACK(x, y)    two floats rounded and packed into a pair
 *   SHMT_TO_FLOAT(h), SHMT_FROM_FLOAT(f)   one element (the odd last one)
 *
 * and this file #undefs SHMT_NAME, SHMT_OP and SHMT_PACK at the end (the rest stay for the next
 * instantiation of the same type and instruction set).
 *
 * The kernel: dst[i] = srcs[0][i] op ... op srcs[nsrc-1][i], nsrc >= 1, every element widened to
 * float32, the sources folded left to right in float32 and the result rounded once.  Pairs of
 * elements are loaded and stored as one 32-bit word (see half.h), so vector lanes stay 32 bits
 * wide.  Two to four sources take one pass; more go through two float32 accumulators (first and
 * second elements of each pair), a block of pairs at a time, in L1: the first two sources
 * widened into them, the middle ones folded in, the last one folded in on the way out.  dst may
 * be srcs[0] (the loops are then called with the same pointer twice, which tells the compiler
 * that they are one array: no run-time overlap check, no scalar fallback) and overlaps no other
 * source.
 */

#define SHMT_FN(suffix) SHMT_CAT(SHMT_NAME, suffix)

#define SHMT_LD(p, k) shmt_load_pair((const uint16_t *)(p) + 2 * (k))
#define SHMT_ST(p, k, w) shmt_store_pair((uint16_t *)(p) + 2 * (k), (w))

SHMT_ATTR static inline void SHMT_FN(_2)(uint16_t *d, const uint16_t *a, const uint16_t *b,
                                         ptrdiff_t npairs)
{
    for (ptrdiff_t k = 0; k < npairs; k++) {
        uint32_t wa = SHMT_LD(a, k), wb = SHMT_LD(b, k);
        SHMT_ST(d, k, SHMT_PACK(SHMT_OP(SHMT_FIRST(wa), SHMT_FIRST(wb)),
                                SHMT_OP(SHMT_SECOND(wa), SHMT_SECOND(wb))));
    }
}

SHMT_ATTR static inline void SHMT_FN(_3)(uint16_t *d, const uint16_t *a, const uint16_t *b,
                                         const uint16_t *c, ptrdiff_t npairs)
{
    for (ptrdiff_t k = 0; k < npairs; k++) {
        uint32_t wa = SHMT_LD(a, k), wb = SHMT_LD(b, k), wc = SHMT_LD(c, k);
        SHMT_ST(d, k, SHMT_PACK(
            SHMT_OP(SHMT_OP(SHMT_FIRST(wa), SHMT_FIRST(wb)), SHMT_FIRST(wc)),
            SHMT_OP(SHMT_OP(SHMT_SECOND(wa), SHMT_SECOND(wb)), SHMT_SECOND(wc))));
    }
}

SHMT_ATTR static inline void SHMT_FN(_4)(uint16_t *d, const uint16_t *a, const uint16_t *b,
                                         const uint16_t *c, const uint16_t *e, ptrdiff_t npairs)
{
    for (ptrdiff_t k = 0; k < npairs; k++) {
        uint32_t wa = SHMT_LD(a, k), wb = SHMT_LD(b, k), wc = SHMT_LD(c, k), we = SHMT_LD(e, k);
        SHMT_ST(d, k, SHMT_PACK(
            SHMT_OP(SHMT_OP(SHMT_OP(SHMT_FIRST(wa), SHMT_FIRST(wb)), SHMT_FIRST(wc)),
                    SHMT_FIRST(we)),
            SHMT_OP(SHMT_OP(SHMT_OP(SHMT_SECOND(wa), SHMT_SECOND(wb)), SHMT_SECOND(wc)),
                    SHMT_SECOND(we))));
    }
}

SHMT_ATTR static inline void SHMT_FN(_widen)(float *acc1, float *acc2, const uint16_t *a,
                                             const uint16_t *b, ptrdiff_t npairs)
{
    for (ptrdiff_t k = 0; k < npairs; k++) {
        uint32_t wa = SHMT_LD(a, k), wb = SHMT_LD(b, k);
        acc1[k] = SHMT_OP(SHMT_FIRST(wa), SHMT_FIRST(wb));
        acc2[k] = SHMT_OP(SHMT_SECOND(wa), SHMT_SECOND(wb));
    }
}

SHMT_ATTR static inline void SHMT_FN(_fold)(float *acc1, float *acc2, const uint16_t *s,
                                            ptrdiff_t npairs)
{
    for (ptrdiff_t k = 0; k < npairs; k++) {
        uint32_t w = SHMT_LD(s, k);
        acc1[k] = SHMT_OP(acc1[k], SHMT_FIRST(w));
        acc2[k] = SHMT_OP(acc2[k], SHMT_SECOND(w));
    }
}

SHMT_ATTR static inline void SHMT_FN(_narrow)(uint16_t *d, const float *acc1, const float *acc2,
                                              const uint16_t *s, ptrdiff_t npairs)
{
    for (ptrdiff_t k = 0; k < npairs; k++) {
        uint32_t w = SHMT_LD(s, k);
        SHMT_ST(d, k, SHMT_PACK(SHMT_OP(acc1[k], SHMT_FIRST(w)),
                                SHMT_OP(acc2[k], SHMT_SECOND(w))));
    }
}

SHMT_ATTR static void SHMT_NAME(void *dst_, const void **srcs_, int nsrc, ptrdiff_t n)
{
    uint16_t *dst = (uint16_t *)dst_;
    const uint16_t **s = (const uint16_t **)srcs_;
    ptrdiff_t npairs = n / 2;
    if (nsrc == 1) {
        if (dst != s[0])
            memcpy(dst, s[0], (size_t)n * 2);
        return;
    }
    if (nsrc == 2) {
        if (dst == s[0])
            SHMT_FN(_2)(dst, dst, s[1], npairs);
        else
            SHMT_FN(_2)(dst, s[0], s[1], npairs);
    } else if (nsrc == 3) {
        if (dst == s[0])
            SHMT_FN(_3)(dst, dst, s[1], s[2], npairs);
        else
            SHMT_FN(_3)(dst, s[0], s[1], s[2], npairs);
    } else if (nsrc == 4) {
        if (dst == s[0])
            SHMT_FN(_4)(dst, dst, s[1], s[2], s[3], npairs);
        else
            SHMT_FN(_4)(dst, s[0], s[1], s[2], s[3], npairs);
    } else {
        float acc1[SHMT_HALF_PAIRS], acc2[SHMT_HALF_PAIRS];
        for (ptrdiff_t start = 0; start < npairs; start += SHMT_HALF_PAIRS) {
            ptrdiff_t m = npairs - start < SHMT_HALF_PAIRS ? npairs - start : SHMT_HALF_PAIRS;
            ptrdiff_t at = 2 * start;
            SHMT_FN(_widen)(acc1, acc2, s[0] + at, s[1] + at, m);
            for (int j = 2; j < nsrc - 1; j++)
                SHMT_FN(_fold)(acc1, acc2, s[j] + at, m);
            SHMT_FN(_narrow)(dst + at, acc1, acc2, s[nsrc - 1] + at, m);
        }
    }
    if (n % 2) {
        float x = SHMT_TO_FLOAT(s[0][n - 1]);
        for (int j = 1; j < nsrc; j++)
            x = SHMT_OP(x, SHMT_TO_FLOAT(s[j][n - 1]));
        dst[n - 1] = SHMT_FROM_FLOAT(x);
    }
}

#undef SHMT_LD
#undef SHMT_ST
#undef SHMT_FN
#undef SHMT_NAME
#undef SHMT_OP
#undef SHMT_PACK
