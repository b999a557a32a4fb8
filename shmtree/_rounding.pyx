# cython: language_level=3, boundscheck=False, wraparound=False
# cython: cdivision=True, initializedcheck=False
"""Rounding the exact sums of shmtree.Accumulator once (shmtree/_accum.pyx holds them), and the
rank-order fold of deterministic=True (shmtree/repro.py).

rounded(): every element's exact value, an integer of W 52-bit limbs times 2**q, rounded once to
nearest even into a float format (float64, float32, float16, bfloat16), as float64.
fold_rows(): one call of shmtree's reduction kernel on P rows, in rank order.
"""
from libc.stdint cimport int16_t, int64_t, uint8_t, uint64_t
from libc.math cimport INFINITY, NAN, fabs, ldexp
from cpython.mem cimport PyMem_Free, PyMem_Malloc

from shmtree._accum cimport (BITS, MASK, C_QNONE, F_NAN, F_PINF, F_NINF, F_NEGZ, F_OTHER, dbits,
                             shmt_i128, shmt_clz64, _bitlen, _bitlen128, _load2, _decode)
from shmtree._kernels cimport get_kernel, reduce_fn
cimport numpy as cnp

cnp.import_array()


cdef inline uint64_t _bits_at(const int64_t *mag, int W, int start, int count) noexcept nogil:
    """Bits [start, start + count) (count <= 60, start >= 0) of a non-negative normalised
    magnitude (every limb in [0, 2**52) read as 52 bits; the last may hold more)."""
    cdef uint64_t r = 0
    cdef int got = 0, k, sh, take
    while got < count:
        k = (start + got) // BITS
        if k >= W:
            break
        sh = (start + got) % BITS
        take = BITS - sh
        if k == W - 1:
            take = 63 - sh              # (the last limb: all its bits)
        if take > count - got:
            take = count - got
        r |= ((<uint64_t>mag[k] >> sh) & ((<uint64_t>1 << take) - 1)) << got
        got += take
    return r


cdef inline bint _any_below(const int64_t *mag, int W, int end) noexcept nogil:
    """Is any bit below `end` set?"""
    cdef int k
    cdef int full = end // BITS
    if full > W:
        full = W
    for k in range(full):
        if mag[k]:
            return True
    if full < W and end % BITS:
        return (<uint64_t>mag[full] & ((<uint64_t>1 << (end % BITS)) - 1)) != 0
    return False


cdef inline bint _scaled(double v, int q, double *r) noexcept nogil:
    """*r = v * 2**q, where v is an integer rounded once to 53 bits (one IEEE addition of exact
    doubles), when that product is a normal double: then it is exact, and the value rounded
    once.  Returns whether it was (False: *r is not written; the caller rounds the general
    way)."""
    cdef dbits sc
    cdef double got
    if not -1022 <= q <= 1023:
        return False
    sc.u = (<uint64_t>(q + 1023)) << 52
    got = v * sc.f
    if 2.2250738585072014e-308 <= fabs(got) < INFINITY:
        r[0] = got
        return True
    return False


cdef inline double _round64(int64_t v, int q, int p, int emin, double limit,
                            Py_ssize_t *overflow) noexcept nogil:
    """_round128 of a v that fits 63 bits, in 64-bit arithmetic."""
    cdef int64_t sgn = v >> 63
    cdef uint64_t a = <uint64_t>((v ^ sgn) - sgn)
    cdef int nbits = 64 - shmt_clz64(a)
    cdef int lsb = nbits - p
    cdef uint64_t M, rest, half
    cdef dbits b
    cdef int ex
    if q + lsb < emin - p + 1:
        lsb = emin - p + 1 - q
    if lsb <= 0:
        M = a
        lsb = 0
    elif lsb >= 64:
        M = 0
    else:
        M = a >> lsb
        rest = a - (M << lsb)
        half = (<uint64_t>1) << (lsb - 1)
        M += <uint64_t>((rest > half) | ((rest == half) & <int>(M & 1)))
    if M >> 53:
        M >>= 1
        lsb += 1
    if M == 0:
        b.f = 0.0
    else:
        nbits = 64 - shmt_clz64(M)
        ex = q + lsb + nbits - 1
        if -1022 <= ex <= 1023:
            b.u = ((<uint64_t>(ex + 1023)) << 52) | ((M << (53 - nbits)) & MASK)
        else:
            b.f = ldexp(<double>M, q + lsb)
        if b.f >= limit:
            b.f = INFINITY
            overflow[0] += 1
    b.u |= (<uint64_t>(sgn & 1)) << 63
    return b.f


cdef inline double _round128(shmt_i128 v, int q, int p, int emin, double limit,
                             Py_ssize_t *overflow) noexcept nogil:
    """v * 2**q (v != 0, |v| < 2**126) rounded to nearest even into p bits, exponents down to
    emin (subnormals below), below limit = 2**(emax + 1) (beyond: an infinity, counted)."""
    cdef shmt_i128 sgn = v >> 127                 # (0 or -1: branch-free |v|)
    cdef shmt_i128 a = (v ^ sgn) - sgn
    cdef uint64_t neg = <uint64_t>(sgn & 1)
    cdef int nbits = _bitlen128(a)
    cdef int lsb = nbits - p
    cdef uint64_t M
    cdef shmt_i128 rest
    cdef double r
    cdef dbits b
    cdef int ex
    cdef shmt_i128 half
    if q + lsb < emin - p + 1:
        lsb = emin - p + 1 - q
    if lsb < 0:
        lsb = 0                           # (exact: every bit kept)
    if lsb >= 127:                        # (below half the least subnormal: zero)
        M = 0
    else:                                 # (branch-free: lsb 0 keeps every bit, rest 0)
        M = <uint64_t>(a >> lsb)
        rest = a - ((<shmt_i128>M) << lsb)
        half = ((<shmt_i128>1) << lsb) >> 1
        M += <uint64_t>(((rest > half) | ((rest == half) & <int>(M & 1))) & (lsb > 0))
    if M >> 53:                           # (rounded up to 2**53: the same value)
        M >>= 1
        lsb += 1
    # M * 2**(q + lsb) as a double: its bits when it is a normal double, else ldexp
    nbits = _bitlen(M)
    ex = q + lsb + nbits - 1
    if M == 0:
        r = 0.0
    elif -1022 <= ex <= 1023:
        b.u = ((<uint64_t>(ex + 1023)) << 52) | ((M << (53 - nbits)) & MASK)
        r = b.f
    else:
        r = ldexp(<double>M, q + lsb)
    if r >= limit:
        r = INFINITY
        overflow[0] += 1
    b.f = r
    b.u |= neg << 63                              # (the sign, branch-free)
    return b.f


def rounded(const int16_t[::1] q, const int64_t[:, ::1] limbs, const uint8_t[::1] flags,
            int p, int emin, int emax, double[::1] out):
    """Every element's exact value rounded once to nearest even into a format of p bits of
    precision and exponents emin..emax (float64: 53, -1022, 1023; subnormals below emin),
    written as float64 (exactly: the rounded value).  Non-finite terms: both infinities
    (counted) or a NaN give NaN; one infinity gives it; a zero sum is -0.0 when every term was -0.0,
    else +0.0; a value beyond the format's range is an infinity of its sign.  Returns (number
    of elements where +inf met -inf, number that overflowed)."""
    cdef Py_ssize_t n = q.shape[0], e
    cdef int W = limbs.shape[1], k, nbits, lsb, neg
    cdef int64_t mag[64]
    cdef int64_t c
    cdef uint64_t M, guard
    cdef bint sticky, zero
    cdef uint8_t f
    cdef Py_ssize_t invalid = 0, overflow = 0
    cdef double inf = INFINITY, nan = NAN
    cdef shmt_i128 v128
    cdef double limit = ldexp(1.0, emax + 1), v
    if W > 64:
        raise ValueError(f"shmtree: an accumulator of {W} limbs (at most 64)")
    with nogil:
        for e in range(n):
            f = flags[e]
            if f & (F_NAN | F_PINF | F_NINF):       # (math.fsum's order: both infinities
                if (f & F_PINF) and (f & F_NINF):     # are an error even beside a NaN)
                    out[e] = nan
                    invalid += 1
                elif f & F_NAN:
                    out[e] = nan
                else:
                    out[e] = inf if f & F_PINF else -inf
                continue
            zero = q[e] == C_QNONE
            neg = 0
            if not zero and W <= 2 and p == 53:
                # float64: the value's two limbs are exact doubles, and their sum, one IEEE
                # addition, is the value rounded to 53 bits (to nearest even); times 2**q it
                # is the result where that is a normal double (else: below)
                v = <double>limbs[e, 0]
                if W == 2:
                    v = <double>limbs[e, 1] * 4503599627370496.0 + v      # (2**52)
                if _scaled(v, q[e], &out[e]):
                    continue
                if v == 0.0:
                    zero = True
            if not zero and W <= 2:               # (|value| < 2**103: in 128 bits)
                v128 = _load2(&limbs[e, 0], W)
                if (v128 >> 62) == 0 or (v128 >> 62) == -1:        # (it fits 63 bits)
                    if v128 != 0:
                        out[e] = _round64(<int64_t>v128, q[e], p, emin, limit, &overflow)
                        continue
                elif v128 != 0:
                    out[e] = _round128(v128, q[e], p, emin, limit, &overflow)
                    continue
                zero = True
            if not zero:
                zero = True
                for k in range(W):
                    mag[k] = limbs[e, k]
                    if mag[k]:
                        zero = False
                if not zero and mag[W - 1] < 0:           # |value|: negate the multiword
                    neg = 1
                    c = 1
                    for k in range(W - 1):
                        mag[k] = ((~mag[k]) & MASK) + c
                        c = mag[k] >> BITS
                        mag[k] &= MASK
                    mag[W - 1] = (~mag[W - 1]) + c
            if zero:
                out[e] = -0.0 if (f & F_NEGZ) and not (f & F_OTHER) else 0.0
                continue
            k = W - 1
            while mag[k] == 0:
                k -= 1
            nbits = BITS * k + _bitlen(<uint64_t>mag[k])     # the value is < 2**(q + nbits)
            # the result's lowest bit: p bits below the top, or the format's subnormal quantum
            lsb = nbits - p
            if q[e] + lsb < emin - p + 1:
                lsb = emin - p + 1 - q[e]
            if lsb <= 0:
                M = _bits_at(mag, W, 0, nbits)
                out[e] = ldexp(<double>M, q[e])
            else:
                M = _bits_at(mag, W, lsb, nbits - lsb)
                guard = _bits_at(mag, W, lsb - 1, 1)
                sticky = _any_below(mag, W, lsb - 1)
                if guard and (sticky or (M & 1)):
                    M += 1
                out[e] = ldexp(<double>M, q[e] + lsb)
            if out[e] >= limit:
                out[e] = inf
                overflow += 1
            if neg:
                out[e] = -out[e]
    return invalid, overflow



def sum_rows(const double[:, ::1] rows, double[::1] out):
    """out[e] = the exact sum of rows[:, e] (P float64 terms per element) rounded once to
    nearest even: the bits of Accumulator.of(rows).result(), in 128-bit integers and without
    an Accumulator, where every term is finite and not -0.0, the terms of an element lie
    within 125 - 53 - ceil(log2 P) bits of each other, and no sum overflows.  Returns how many
    elements are not that case (0: out is the result; else out is not all written and the
    caller takes the general way, which also raises as math.fsum does)."""
    cdef Py_ssize_t P = rows.shape[0], n = rows.shape[1], e, r
    cdef int k, qm, neg, extra = 0, top
    cdef uint64_t mm
    cdef uint8_t flag
    cdef shmt_i128 acc, t
    cdef int64_t hi, lo
    cdef Py_ssize_t bad = 0, overflow = 0
    cdef double limit = ldexp(1.0, 1024)
    if out.shape[0] != n:
        raise ValueError("shmtree: sum_rows: out does not hold an element per column")
    with nogil:
        while (<Py_ssize_t>1 << extra) < P:
            extra += 1
        for e in range(n):
            qm = 32767
            top = -32768
            for r in range(P):                   # (the least quantum, the highest bit)
                neg = _decode(rows[r, e], &mm, &k, &flag)
                if neg < 0:
                    if flag != F_OTHER:          # (NaN, an infinity, -0.0)
                        qm = -32768
                        break
                    continue
                qm = k if k < qm else qm         # (selects: random data would mispredict)
                top = k + _bitlen(mm) if k + _bitlen(mm) > top else top
            if qm == -32768 or (qm != 32767 and top - qm + extra > 125):
                bad += 1
                continue
            if qm == 32767:                      # (every term +0.0)
                out[e] = 0.0
                continue
            acc = 0
            for r in range(P):
                neg = _decode(rows[r, e], &mm, &k, &flag)
                if neg >= 0:                     # (+-m, the sign without a branch)
                    t = (<shmt_i128>mm) << (k - qm)
                    acc += (t ^ (-(<shmt_i128>neg))) + neg
            if acc == 0:
                out[e] = 0.0
                continue
            hi = <int64_t>(acc >> 53)            # (floor: lo in [0, 2**53); both exact
            lo = <int64_t>(acc & ((<shmt_i128>1 << 53) - 1))    # doubles where |acc| <
            if -(<int64_t>1 << 52) <= hi < (<int64_t>1 << 52) and \
                    _scaled(<double>hi * 9007199254740992.0 + <double>lo, qm, &out[e]):  # 2**105)
                continue
            out[e] = _round128(acc, qm, 53, -1022, limit, &overflow)
    return bad + overflow


def fold_rows(cnp.ndarray dst, cnp.ndarray rows, int opc, int dtc):
    """dst[...] = rows[0] op rows[1] op ... op rows[P-1], in one kernel call (shmtree's
    reduction kernels: the rule of a flat tree's root), with the GIL released.  rows: a
    C-contiguous array of P rows of dst's items (any shape whose first axis is the rows); dst:
    C-contiguous, writable, clear of rows; (opc, dtc) the parse's codes (a kernel exists)."""
    cdef reduce_fn fn = get_kernel(opc, dtc)
    cdef Py_ssize_t P, n = cnp.PyArray_SIZE(dst), stride, j
    cdef const void *small[16]
    cdef const void **ptrs = small
    cdef char *base
    if fn == NULL:
        raise TypeError("shmtree: fold_rows: no kernel for this op and dtype")
    if not (cnp.PyArray_IS_C_CONTIGUOUS(dst) and cnp.PyArray_IS_C_CONTIGUOUS(rows)) or \
            cnp.PyArray_NDIM(rows) < 1:
        raise ValueError("shmtree: fold_rows: C-contiguous arrays only")
    P = cnp.PyArray_DIMS(rows)[0]
    if P == 0 or cnp.PyArray_SIZE(rows) != P * n or \
            cnp.PyArray_ITEMSIZE(rows) != cnp.PyArray_ITEMSIZE(dst):
        raise ValueError("shmtree: fold_rows: rows do not hold P rows of dst's items")
    if n == 0:
        return dst
    stride = n * cnp.PyArray_ITEMSIZE(rows)
    base = <char *>cnp.PyArray_DATA(rows)
    if P > 16:
        ptrs = <const void **>PyMem_Malloc(P * sizeof(void *))
        if ptrs == NULL:
            raise MemoryError()
    try:
        for j in range(P):
            ptrs[j] = <const void *>(base + j * stride)
        with nogil:
            fn(cnp.PyArray_DATA(dst), ptrs, <int>P, n)
    finally:
        if ptrs != small:
            PyMem_Free(ptrs)
    return dst
