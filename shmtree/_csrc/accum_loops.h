/*
 * The Accumulator's element loops for one instruction set: no include guard on purpose.  The
 * includer (accum_fast.h) defines SHMT_ISA (the suffix of the names) and SHMT_ATTR; this file
 * #undefs both at the end.  Plain C, branch-free in the loop bodies (selects, not jumps), so
 * that the compiler can vectorize them: AVX2's per-lane shifts (vpsllvq, vpsrlvq) are what the
 * variable alignments need.  Every loop computes each element alone: the same bits whichever
 * copy runs.
 */

/* ulp_quanta: for every x[e], -(the exponent of its unit in the last place) as int16 (a finite
 * nonzero x is m * 2**q, m its 53-bit integer significand, q = max(biased exponent, 1) - 1075),
 * or -QNONE for a zero or a non-finite x.  Returns how many x are NaN, an infinity or -0.0 (the
 * terms the fast path leaves to the general one). */
SHMT_ATTR static int64_t SHMT_CAT(shmt_acc_ulp_quanta_, SHMT_ISA)(
    const double *x, int16_t *negq, ptrdiff_t n)
{
    int64_t special = 0;
    for (ptrdiff_t e = 0; e < n; e++) {
        uint64_t u;
        memcpy(&u, &x[e], 8);
        int64_t ex = (int64_t)((u >> 52) & 0x7ff);
        int64_t q = (ex > 0 ? ex : 1) - 1075;
        int64_t none = ((u << 1) == 0) | (ex == 0x7ff);
        special += (ex == 0x7ff) | (u == 0x8000000000000000ULL);
        negq[e] = (int16_t)(none ? -SHMT_QNONE : -q);
    }
    return special;
}

/* ulp_limbs: every x[e] (finite, as ulp_quanta read it) at the group's quantum qg = -negq_g[e]
 * (<= its own q, or the x is zero), in two normalised limbs: out[2e] in [0, 2**52), out[2e+1]
 * signed, value = out[2e] + out[2e+1] * 2**52.  An x more than 49 - extra bits above qg does
 * not fit so (a sum of 2**extra such limbs must stay below 2**51 in the top limb): counted,
 * and the count returned (0: every element was written). */
SHMT_ATTR static int64_t SHMT_CAT(shmt_acc_ulp_limbs_, SHMT_ISA)(
    const double *x, const int16_t *negq_g, int extra, int64_t *out, ptrdiff_t n)
{
    int64_t bad = 0;
    const int64_t limit = 49 - extra;
    for (ptrdiff_t e = 0; e < n; e++) {
        uint64_t u;
        memcpy(&u, &x[e], 8);
        int64_t ex = (int64_t)((u >> 52) & 0x7ff);
        uint64_t m = (u & SHMT_MASK) | ((uint64_t)(ex != 0) << 52);
        int64_t q = (ex > 0 ? ex : 1) - 1075;
        int64_t d = q + (int64_t)negq_g[e];
        int64_t nz = (u << 1) != 0;
        bad += nz & (d > limit);
        d = d < 0 ? 0 : d;
        d = d > 52 ? 52 : d;
        uint64_t lo = (m << d) & SHMT_MASK;
        uint64_t hi = m >> (52 - d);
        uint64_t sgn = (uint64_t)0 - (u >> 63);         /* (all ones for a negative x) */
        uint64_t l0 = ((lo ^ sgn) - sgn) & SHMT_MASK;
        uint64_t l1 = ((hi ^ sgn) - sgn) - (sgn & (uint64_t)(lo != 0));
        out[2 * e] = (int64_t)l0;
        out[2 * e + 1] = (int64_t)l1;
    }
    return bad;
}

/* round_sums: every element's column sum of ulp_limbs (s[2e]: a uint64 sum of limbs below
 * 2**52, s[2e+1] a signed one) times 2**qg, qg = -negq_g[e], rounded once to nearest even into
 * a float64 (the integer's two limbs are exact doubles and their one IEEE addition is the
 * integer rounded; the power of two scales it exactly when the result is a normal double).
 * Returns how many elements are not that case (a subnormal or infinite result, or a qg below
 * -1022): their out[e] is not the result, and the caller rounds them the general way. */
SHMT_ATTR static int64_t SHMT_CAT(shmt_acc_round_sums_, SHMT_ISA)(
    const int64_t *s, const int16_t *negq_g, double *out, ptrdiff_t n)
{
    int64_t bad = 0;
    for (ptrdiff_t e = 0; e < n; e++) {
        uint64_t u0 = (uint64_t)s[2 * e];
        uint64_t l0 = u0 & SHMT_MASK;
        uint64_t l1 = (uint64_t)s[2 * e + 1] + (u0 >> 52);
        uint64_t b0 = 0x4330000000000000ULL | l0;           /* 2**52 + l0, exactly */
        uint64_t b1 = 0x4338000000000000ULL + l1;           /* 1.5 * 2**52 + l1 (|l1| < 2**51) */
        double d0, d1, sc, r;
        memcpy(&d0, &b0, 8);
        memcpy(&d1, &b1, 8);
        d0 -= 4503599627370496.0;
        d1 -= 6755399441055744.0;
        double v = d1 * 4503599627370496.0 + d0;
        int64_t be = 1023 - (int64_t)negq_g[e];             /* qg's biased exponent */
        uint64_t bs = (uint64_t)(be < 1 ? 1 : (be > 2046 ? 2046 : be)) << 52;
        memcpy(&sc, &bs, 8);
        r = v * sc;
        double a = r < 0 ? -r : r;
        int64_t ok = (v == 0.0) | ((be >= 1) & (be <= 2046) & (a >= 2.2250738585072014e-308)
                                   & (a <= 1.7976931348623157e308));
        bad += 1 - ok;
        out[e] = v == 0.0 ? 0.0 : r;
    }
    return bad;
}

/* align2: a normalised state of two limbs (q[e], limbs[2e], limbs[2e+1]) at the group's
 * quantum qg[e] <= q[e], normalised, into out, where the shift d is at most 49 - extra and
 * |top limb| * 2**(d + extra) < 2**49: then the shifted top limb stays below 2**(50 - extra),
 * and a sum of 2**extra of them below 2**50.  QNONE elements get zeros.  An element not
 * written so has INT64_MIN in its top limb (no written one has); returns how many (the
 * caller's general loop takes them).  (The test is written as shifts of the limb, not of a
 * constant: that form is the one GCC vectorizes.) */
SHMT_ATTR static int64_t SHMT_CAT(shmt_acc_align2_, SHMT_ISA)(
    const int16_t *restrict q, const int64_t *restrict limbs, const int16_t *restrict qg,
    int extra, int64_t *restrict out, ptrdiff_t n)
{
    int64_t bad = 0;
    const int64_t dmax = 49 - extra;
    for (ptrdiff_t e = 0; e < n; e++) {
        int64_t qe = q[e];
        int64_t d = qe - (int64_t)qg[e];
        uint64_t dd = d < 0 ? 0 : (d > 49 ? 49 : d);
        uint64_t l0 = (uint64_t)limbs[2 * e], l1 = (uint64_t)limbs[2 * e + 1];
        uint64_t s1 = (uint64_t)0 - (l1 >> 63);
        uint64_t a1 = ((l1 ^ s1) - s1) << extra;              /* |top limb| * 2**extra */
        uint64_t none = (uint64_t)0 - (uint64_t)(qe == SHMT_QNONE);
        uint64_t okm = none | ((uint64_t)0 - (uint64_t)((d <= dmax) & ((a1 >> (49 - dd)) == 0)));
        bad += 1 - (int64_t)(okm & 1);
        uint64_t n0 = (l0 << dd) & SHMT_MASK;
        uint64_t n1 = (l1 << dd) + (l0 >> (52 - dd));
        out[2 * e] = (int64_t)(n0 & ~none);
        out[2 * e + 1] = (int64_t)(((n1 & ~none) & okm) | (0x8000000000000000ULL & ~okm));
    }
    return bad;
}

/* carry2: after a column sum of two-limb rows (the engine's int64 sum): every low limb into
 * [0, 2**52) (read as a uint64 sum), its carry into the top one, in place; an element that
 * summed to zero gets q[e] = QNONE. */
SHMT_ATTR static void SHMT_CAT(shmt_acc_carry2_, SHMT_ISA)(
    int64_t *restrict limbs, int16_t *restrict q, ptrdiff_t n)
{
    for (ptrdiff_t e = 0; e < n; e++) {
        uint64_t u = (uint64_t)limbs[2 * e];
        uint64_t l1 = (uint64_t)limbs[2 * e + 1] + (u >> 52);
        uint64_t l0 = u & SHMT_MASK;
        limbs[2 * e] = (int64_t)l0;
        limbs[2 * e + 1] = (int64_t)l1;
        q[e] = (l0 | l1) == 0 ? (int16_t)SHMT_QNONE : q[e];
    }
}

#undef SHMT_ISA
#undef SHMT_ATTR
