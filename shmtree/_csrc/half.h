/*
 * IEEE 754 binary16 ("half", numpy float16) and bfloat16 <-> binary32 conversion, portable C.
 *
 * Used by the float16 and bfloat16 reduction kernels (half_kernels.h, half_loops.h), which widen
 * every input to float32, reduce in float32 and round the result back to 16 bits once, two
 * elements at a time (the pair functions at the end).
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

/* half bits (in the low 16 bits of h; the rest zero) -> float.  Exact (every half is a float).
 * Takes and computes in 32-bit lanes, so that a loop over pairs of halves (below) needs no
 * widening or narrowing shuffles. */
static inline float shmt_half32_to_float(uint32_t h)
{
    const uint32_t exp_mask = 0x7c00u << 13;          /* half exponent field, moved to float's */
    uint32_t mag = (h & 0x7fffu) << 13;               /* exponent and mantissa, aligned */
    uint32_t exp = mag & exp_mask;
    uint32_t normal = mag + ((uint32_t)(127 - 15) << 23);       /* rebias the exponent */
    uint32_t infnan = normal + ((uint32_t)(128 - 16) << 23);    /* exponent all ones */
    /* Zero or subnormal: give it the exponent of 2^-14, then subtract 2^-14; the float
     * subtraction renormalises exactly (and 0 - 0 gives +0; the sign is or-ed in below). */
    uint32_t sub = shmt_f32_bits(shmt_f32_from_bits(normal + (1u << 23))
                                 - shmt_f32_from_bits(113u << 23));
    uint32_t out = shmt_select(exp == exp_mask, infnan, shmt_select(exp == 0, sub, normal));
    return shmt_f32_from_bits(out | ((h & 0x8000u) << 16));
}

static inline float shmt_half_to_float(uint16_t h)
{
    return shmt_half32_to_float(h);
}

/* float -> half bits (in the low 16 bits of the result, the rest zero), round to nearest even;
 * overflow gives inf. */
static inline uint32_t shmt_float_to_half32(float f)
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
    return out | sign;
}

static inline uint16_t shmt_float_to_half(float f)
{
    return (uint16_t)shmt_float_to_half32(f);
}

/* bfloat16 ("brain float": float32's sign and exponent, 7 mantissa bits) <-> binary32.  bf16 ->
 * float is exact (the bits, shifted).  float -> bf16 rounds to nearest, ties to even (as torch
 * and ml_dtypes do); overflow rounds to inf by itself (the carry reaches the exponent); NaN stays
 * NaN, quieted, sign and top payload bits kept. */
static inline float shmt_bf16_to_float(uint16_t b)
{
    return shmt_f32_from_bits((uint32_t)b << 16);
}

/* float -> bf16 bits in the low 16 bits of the result (the rest zero).  Rounding adds 0x7fff
 * plus the lowest kept bit (ties to even) and drops the low 16 bits.  A NaN would not survive
 * that (the carry can turn it into inf or flip the sign), so a NaN keeps its top bits with the
 * quiet bit set; the test is the float compare f != f, one instruction in a vector loop. */
static inline uint32_t shmt_float_to_bf16_32(float f)
{
    uint32_t u = shmt_f32_bits(f);
    uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
    return shmt_select(f != f, u | 0x00400000u, rounded) >> 16;
}

static inline uint16_t shmt_float_to_bf16(float f)
{
    return (uint16_t)shmt_float_to_bf16_32(f);
}

/* The same rounding without the NaN select, for results of arithmetic (+, *) on widened bf16.
 * Exact for every float that is not a NaN, and for a quiet NaN whose low 16 bits are zero: then
 * adding at most 0x8000 carries nothing and the top 16 bits, quiet bit set, are kept as they
 * are, which is what shmt_float_to_bf16_32 gives.  A sum or product of widened bf16 has no other
 * NaNs: an IEEE operation returns a quiet NaN, either an operand's (whose low 16 bits are zero,
 * by induction: a widened input's are, a previous result's are) or the default NaN (low bits
 * zero as well).  Min and max pass operands through unchanged, signaling NaNs included, and use
 * shmt_float_to_bf16_32.  Four integer ops instead of nine in a vector loop. */
static inline uint32_t shmt_float_to_bf16_32_arith(float f)
{
    uint32_t u = shmt_f32_bits(f);
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

/* Pairs: two adjacent 16-bit elements loaded and stored as one 32-bit word, the two halves then
 * widened and narrowed in 32-bit lanes of their own.  A vector loop over words needs only shifts
 * and masks that way (element 2k in one set of lanes, 2k+1 in another), none of the shuffles
 * that unpacking uint16 to uint32 and packing back take with SSE2.  The word is read and written
 * with memcpy, which compiles to a plain (unaligned) load or store: a pair starts at any even
 * element, so only 2-byte alignment is known. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define SHMT_FIRST_SHIFT 16     /* the element at the lower address is the word's high half */
#else
#define SHMT_FIRST_SHIFT 0
#endif
#define SHMT_SECOND_SHIFT (16 - SHMT_FIRST_SHIFT)

static inline uint32_t shmt_load_pair(const void *p)
{
    uint32_t w;
    memcpy(&w, p, sizeof w);
    return w;
}

static inline void shmt_store_pair(void *p, uint32_t w)
{
    memcpy(p, &w, sizeof w);
}

/* The word's first (lower address) and second element, widened. */
static inline float shmt_bf16_first(uint32_t w)
{
    return shmt_f32_from_bits((w >> SHMT_FIRST_SHIFT) << 16);
}

static inline float shmt_bf16_second(uint32_t w)
{
    return shmt_f32_from_bits((w >> SHMT_SECOND_SHIFT) << 16);
}

static inline uint32_t shmt_bf16_pair(float first, float second)
{
    return (shmt_float_to_bf16_32(first) << SHMT_FIRST_SHIFT)
           | (shmt_float_to_bf16_32(second) << SHMT_SECOND_SHIFT);
}

static inline uint32_t shmt_bf16_pair_arith(float first, float second)
{
    return (shmt_float_to_bf16_32_arith(first) << SHMT_FIRST_SHIFT)
           | (shmt_float_to_bf16_32_arith(second) << SHMT_SECOND_SHIFT);
}

static inline float shmt_half_first(uint32_t w)
{
    return shmt_half32_to_float((w >> SHMT_FIRST_SHIFT) & 0xffffu);
}

static inline float shmt_half_second(uint32_t w)
{
    return shmt_half32_to_float((w >> SHMT_SECOND_SHIFT) & 0xffffu);
}

static inline uint32_t shmt_half_pair(float first, float second)
{
    return (shmt_float_to_half32(first) << SHMT_FIRST_SHIFT)
           | (shmt_float_to_half32(second) << SHMT_SECOND_SHIFT);
}

#endif /* SHMTREE_HALF_H */
