/*
 * IEEE 754 binary16 ("half", numpy float16) <-> binary32 conversion, portable C.
 *
 * Used by the float16 reduction kernels in _kernels.pyx, which widen every input to float32,
 * reduce in float32 and round the result back to half once.
 *
 * Both directions are pure bit manipulation plus one float add/subtract, written with selects
 * instead of branches so that a loop over them can be vectorized.  They are exact for every
 * input: zeros keep their sign, subnormals are handled in both directions, infinities stay
 * infinite, NaNs stay NaN (float -> half quiets them and keeps the sign and the top payload bits).
 * float -> half rounds to nearest, ties to even (the rounding numpy uses).
 *
 * The subnormal paths rely on float arithmetic rounding to nearest with subnormals enabled
 * (the default floating-point environment; not flush-to-zero / denormals-are-zero mode).
 */
#ifndef SHMTREE_HALF_H
#define SHMTREE_HALF_H

#include <stdint.h>
#include <string.h>

static inline uint32_t shmt_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);   /* type pun without aliasing trouble; compiles to a move */
    return u;
}

static inline float shmt_f32_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* cond ? a : b as mask arithmetic.  A plain ?: lets GCC sink the float add/subtract feeding an
 * arm into a branch, and a branch with floating-point operations in it is not vectorized. */
static inline uint32_t shmt_select(int cond, uint32_t a, uint32_t b)
{
    uint32_t mask = (uint32_t)0 - (uint32_t)(cond != 0);
    return (a & mask) | (b & ~mask);
}

/* half bits -> float.  Exact (every half is a float). */
static inline float shmt_half_to_float(uint16_t h)
{
    const uint32_t exp_mask = 0x7c00u << 13;          /* half exponent field, moved to float's */
    uint32_t mag = ((uint32_t)h & 0x7fffu) << 13;     /* exponent and mantissa, aligned */
    uint32_t exp = mag & exp_mask;
    uint32_t normal = mag + ((uint32_t)(127 - 15) << 23);       /* rebias the exponent */
    uint32_t infnan = normal + ((uint32_t)(128 - 16) << 23);    /* exponent all ones */
    /* Zero or subnormal: give it the exponent of 2^-14, then subtract 2^-14; the float
     * subtraction renormalises exactly (and 0 - 0 gives +0; the sign is or-ed in below). */
    uint32_t sub = shmt_f32_bits(shmt_f32_from_bits(normal + (1u << 23))
                                 - shmt_f32_from_bits(113u << 23));
    uint32_t out = shmt_select(exp == exp_mask, infnan, shmt_select(exp == 0, sub, normal));
    return shmt_f32_from_bits(out | (((uint32_t)h & 0x8000u) << 16));
}

/* float -> half bits, round to nearest even; overflow gives inf. */
static inline uint16_t shmt_float_to_half(float f)
{
    uint32_t u = shmt_f32_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t mag = u & 0x7fffffffu;
    /* |f| >= 65520 (largest half plus half an ulp) rounds to inf; NaN stays NaN (quiet). */
    uint32_t big = shmt_select(mag > 0x7f800000u, 0x7e00u | ((mag >> 13) & 0x3ffu), 0x7c00u);
    /* |f| < 2^-14: the half is subnormal or zero.  Adding 0.5 puts the float's ulp at 2^-24,
     * the half subnormal ulp, so the float adder does the rounding (to nearest even). */
    const uint32_t half_magic = 126u << 23;           /* 0.5f */
    uint32_t sub = shmt_f32_bits(shmt_f32_from_bits(mag) + shmt_f32_from_bits(half_magic))
                   - half_magic;
    /* Normal: rebias, then round the 13 dropped bits to nearest even (0xfff + lowest kept bit
     * carries into the kept bits exactly when the dropped part is above half, or exactly half
     * with an odd kept part); a carry out of the mantissa bumps the exponent, as it should. */
    uint32_t odd = (mag >> 13) & 1u;
    uint32_t normal = (mag - ((uint32_t)(127 - 15) << 23) + 0xfffu + odd) >> 13;
    uint32_t small_or_normal = shmt_select(mag < (113u << 23), sub, normal);
    uint32_t out = shmt_select(mag >= 0x477ff000u, big, small_or_normal);
    return (uint16_t)(out | sign);
}

/* bfloat16 ("brain float": float32's sign and exponent, 7 mantissa bits) <-> binary32.  bf16 ->
 * float is exact (the bits, shifted).  float -> bf16 rounds to nearest, ties to even (as torch
 * and ml_dtypes do); overflow rounds to inf by itself (the carry reaches the exponent); NaN stays
 * NaN, quieted, sign and top payload bits kept. */
static inline float shmt_bf16_to_float(uint16_t b)
{
    return shmt_f32_from_bits((uint32_t)b << 16);
}

static inline uint16_t shmt_float_to_bf16(float f)
{
    uint32_t u = shmt_f32_bits(f);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t nan = (u >> 16) | 0x40u;
    return (uint16_t)shmt_select((u & 0x7fffffffu) > 0x7f800000u, nan, rounded);
}

#endif /* SHMTREE_HALF_H */
