# cython: language_level=3, boundscheck=False, wraparound=False
# cython: cdivision=True, initializedcheck=False
"""Exact sums of floats as fixed-point integers: the kernels of shmtree.Accumulator.

An element's exact sum is held as an integer of W limbs times a power of two:

    value = sum(limbs[k] * 2**(q + 52*k) for k in range(W))

q (int16) is the element's quantum: the lowest bit any of its terms has (a float's trailing
zeros are not counted, so float32 terms give a coarser q than float64 ones).  The limbs are
int64; in the normalised form every limb but the last holds 52 bits, 0 <= limb < 2**52, and the
last is signed (two's complement: the value's sign), |last| < 2**51.  Every term of every
element is taken exactly: no rounding happens before result(), which rounds the exact integer
once, to nearest even.  Sums of integers are associative, so the value - and result()'s bits -
cannot depend on the order of the terms, nor on how they were split between accumulators.

Why 52-bit limbs: P normalised limb columns summed as uint64 (the engine's int64 sum wraps
modulo 2**64) stay below P * 2**52 <= 2**64 for P <= 4096 (the most ranks a group has), so a
sum of accumulators aligned to one q is exact limb by limb, and normalize() then carries.

Non-finite terms and zeros are not limbs: flags per element say what was seen (FLAG_NAN,
FLAG_PINF, FLAG_NINF, FLAG_NEGZ: a -0.0 term, FLAG_OTHER: a term that is not -0.0), merged by
bitwise or.  An element with no finite nonzero term has q = QNONE and zero limbs.

Every function takes C-contiguous arrays and releases the GIL.
"""
from libc.stdint cimport int16_t, int32_t, int64_t, uint8_t, uint16_t, uint64_t
from libc.string cimport memset
from libc.math cimport INFINITY, NAN, fabs, ldexp
from cpython.mem cimport PyMem_Free, PyMem_Malloc

from shmtree._kernels cimport get_kernel, reduce_fn
cimport numpy as cnp

cnp.import_array()

import numpy as np

cdef extern from *:
    """
    typedef __int128 shmt_i128;
    #define SHMT_BITS 52
    #define SHMT_MASK ((1ULL << 52) - 1)
    static inline int shmt_ctz64(unsigned long long x) { return __builtin_ctzll(x); }
    static inline int shmt_clz64(unsigned long long x) { return __builtin_clzll(x); }
    """
    ctypedef long long shmt_i128      # (Cython sees a 64-bit int; C compiles __int128)
    const int BITS "SHMT_BITS"
    const uint64_t MASK "SHMT_MASK"
    int shmt_ctz64(unsigned long long x) nogil
    int shmt_clz64(unsigned long long x) nogil

QNONE = 32767
LIMB_BITS = 52
FLAG_NAN = 1
FLAG_PINF = 2
FLAG_NINF = 4
FLAG_NEGZ = 8
FLAG_OTHER = 16
SPECIAL = FLAG_NAN | FLAG_PINF | FLAG_NINF | FLAG_NEGZ   # flags that a result depends on

cdef enum:
    C_QNONE = 32767
    F_NAN = 1
    F_PINF = 2
    F_NINF = 4
    F_NEGZ = 8
    F_OTHER = 16

ctypedef union dbits:
    double f
    uint64_t u


cdef inline int _decode(double v, uint64_t *m, int *k, uint8_t *flag) noexcept nogil:
    """v as sign * m * 2**k with m odd (returns the sign: 1 negative, 0 positive), or -1 for a
    zero or a non-finite value (its flag in *flag)."""
    cdef dbits b
    b.f = v
    cdef uint64_t u = b.u
    cdef int neg = <int>(u >> 63)
    cdef int ex = <int>((u >> 52) & 0x7ff)
    cdef uint64_t man = u & MASK
    cdef int tz
    if ex == 0x7ff:
        if man:
            flag[0] = F_NAN
        else:
            flag[0] = F_NINF if neg else F_PINF
        return -1
    if ex == 0:
        if man == 0:
            flag[0] = F_NEGZ if neg else F_OTHER
            return -1
        k[0] = -1074
    else:
        man = man | (<uint64_t>1 << 52)
        k[0] = ex - 1075
    tz = shmt_ctz64(man)
    m[0] = man >> tz
    k[0] += tz
    flag[0] = F_OTHER
    return neg


cdef inline int _bitlen(uint64_t x) noexcept nogil:
    return 0 if x == 0 else 64 - shmt_clz64(x)


cdef inline void _add_shifted(int64_t *row, int W, int64_t v, int off) noexcept nogil:
    """row += v * 2**off (off >= 0 bits; v signed, |v| < 2**63), unnormalised: the pieces go
    into the limbs at off // 52 and above, each < 2**52 but the last row limb's, which takes
    the signed rest - also of a piece above it: the sign of a normalised row's top limb, whose
    value the caller's W holds."""
    cdef int li = off // BITS, sh = off % BITS
    cdef shmt_i128 t
    if li >= W - 1:                     # (a signed top piece: what it adds to the last limb)
        row[W - 1] += <int64_t>((<shmt_i128>v) << (off - BITS * (W - 1)))
        return
    t = (<shmt_i128>v) << sh
    row[li] += <int64_t>(t & MASK)
    t = t >> BITS                       # (arithmetic: the sign carries up)
    if li + 1 == W - 1:
        row[li + 1] += <int64_t>t
        return
    row[li + 1] += <int64_t>(t & MASK)
    t = t >> BITS
    row[li + 2] += <int64_t>t


cdef inline void _normalize_row(int64_t *row, int W) noexcept nogil:
    """Carry: every limb but the last into [0, 2**52), read as unsigned (a column sum of up to
    4096 normalised limbs), the last signed."""
    cdef int k
    cdef int64_t c
    for k in range(W - 1):
        c = row[k] >> BITS              # (floor: signed limbs of an unnormalised sum)
        row[k] -= c << BITS
        row[k + 1] += c


cdef inline void _normalize_sum_row(int64_t *row, int W) noexcept nogil:
    """As _normalize_row, for a column sum of normalised limbs: every limb but the last is a
    non-negative uint64 (it may have wrapped past 2**63)."""
    cdef int k
    cdef uint64_t u
    for k in range(W - 1):
        u = <uint64_t>row[k]
        row[k] = <int64_t>(u & MASK)
        row[k + 1] += <int64_t>(u >> BITS)


cdef inline shmt_i128 _load2(const int64_t *row, int W) noexcept nogil:
    """A normalised row of at most 2 limbs as one 128-bit integer (|value| < 2**103)."""
    if W == 1:
        return <shmt_i128>row[0]
    return ((<shmt_i128>row[1]) << BITS) + <shmt_i128>row[0]


cdef inline int _bitlen128(shmt_i128 v) noexcept nogil:
    """The bit length of |v| (|v| < 2**126)."""
    cdef shmt_i128 sgn = v >> 127                 # (branch-free |v|: random signs)
    cdef shmt_i128 a = (v ^ sgn) - sgn
    cdef uint64_t hi = <uint64_t>(a >> 64), lo = <uint64_t>a
    if hi:
        return 128 - shmt_clz64(hi)
    return _bitlen(lo)


cdef inline void _store128(int64_t *row, int W, shmt_i128 t) noexcept nogil:
    """row = t, normalised in W limbs (W * 52 bits hold t and its sign)."""
    cdef int k
    cdef int64_t ext = -1 if t < 0 else 0
    for k in range(W - 1):
        if BITS * k < 127:
            row[k] = <int64_t>((t >> (BITS * k)) & MASK)
        else:
            row[k] = ext & <int64_t>MASK
    if BITS * (W - 1) < 127:
        row[W - 1] = <int64_t>(t >> (BITS * (W - 1)))
    else:
        row[W - 1] = ext


def from_terms(const double[:, ::1] x):
    """The exact sums of the columns of x (m terms by n elements): (q int16[n], limbs
    int64[n, W], flags uint8[n]), normalised, W the fewest limbs that hold every column."""
    cdef Py_ssize_t m = x.shape[0], n = x.shape[1], i, e
    q_a = np.full(n, C_QNONE, np.int16)
    flags_a = np.zeros(n, np.uint8)
    top_a = np.zeros(n, np.int32)
    cdef int16_t[::1] q = q_a
    cdef uint8_t[::1] flags = flags_a
    cdef int32_t[::1] top = top_a
    cdef uint64_t mm
    cdef int k, neg, W = 1, need, extra = 0
    cdef uint8_t flag
    cdef int64_t *row
    with nogil:
        while (<Py_ssize_t>1 << extra) < m:
            extra += 1
        for i in range(m):
            for e in range(n):
                neg = _decode(x[i, e], &mm, &k, &flag)
                flags[e] |= flag
                if neg < 0:
                    continue
                if q[e] == C_QNONE:
                    q[e] = <int16_t>k
                    top[e] = k + _bitlen(mm)
                else:
                    if k < q[e]:
                        q[e] = <int16_t>k
                    if k + _bitlen(mm) > top[e]:
                        top[e] = k + _bitlen(mm)
        for e in range(n):
            if q[e] != C_QNONE:
                need = (top[e] - q[e] + extra + 2 + BITS - 1) // BITS
                if need > W:
                    W = need
    limbs_a = np.zeros((n, W), np.int64)
    cdef int64_t[:, ::1] limbs = limbs_a
    with nogil:
        for i in range(m):
            for e in range(n):
                neg = _decode(x[i, e], &mm, &k, &flag)
                if neg < 0:
                    continue
                row = &limbs[e, 0]
                _add_shifted(row, W, -<int64_t>mm if neg else <int64_t>mm, k - q[e])
            if i % 1024 == 1023:
                for e in range(n):
                    _normalize_row(&limbs[e, 0], W)
        for e in range(n):
            _normalize_row(&limbs[e, 0], W)
    return q_a, limbs_a, flags_a


def from_values(const double[::1] x, q_a=None, limbs_a=None, flags_a=None):
    """from_terms of one term per element (x: n values), in one pass: W = 2 (into the arrays
    given: int16[n], int64[n, 2], uint8[n])."""
    cdef Py_ssize_t n = x.shape[0], e
    if q_a is None:
        q_a = np.empty(n, np.int16)
        flags_a = np.empty(n, np.uint8)
        limbs_a = np.empty((n, 2), np.int64)
    cdef int16_t[::1] q = q_a
    cdef uint8_t[::1] flags = flags_a
    cdef int64_t[:, ::1] limbs = limbs_a
    cdef uint64_t mm
    cdef int k, neg
    cdef uint8_t flag
    cdef int64_t lo, sv
    with nogil:
        for e in range(n):
            neg = _decode(x[e], &mm, &k, &flag)
            flags[e] = flag
            if neg < 0:
                q[e] = C_QNONE
                limbs[e, 0] = 0
                limbs[e, 1] = 0
                continue
            q[e] = <int16_t>k
            sv = -(<int64_t>neg)                     # (0 or -1: the sign, branch-free)
            lo = ((<int64_t>mm) ^ sv) - sv           # (+-mm: |mm| < 2**53)
            limbs[e, 0] = lo & <int64_t>MASK
            limbs[e, 1] = lo >> BITS                 # (floor: the normalised top limb)
    return q_a, limbs_a, flags_a


cdef inline int _row_bits(const int64_t *row, int W) noexcept nogil:
    """The bit length of |value| of a normalised row (0 for zero)."""
    cdef int k = W - 1
    cdef int64_t t = row[k]
    cdef uint64_t a
    if t < 0:
        # |value| < 2**(52k + bitlen(-t)) + ...: bound it by the top limb's magnitude + 1
        a = <uint64_t>(-t)
        return BITS * k + _bitlen(a) + 1 if k or a else 0
    while k > 0 and row[k] == 0:
        k -= 1
    return BITS * k + _bitlen(<uint64_t>row[k])


def needed_limbs(const int16_t[::1] q, const int64_t[:, ::1] limbs, const int16_t[::1] qg,
                 int extra):
    """The fewest limbs that hold every element's value at quantum qg[e] (<= q[e]) with
    `extra` bits of headroom more (a sum of 2**extra such values) and the sign."""
    cdef Py_ssize_t n = q.shape[0], e
    cdef int W = limbs.shape[1], need, best = 1
    with nogil:
        for e in range(n):
            if q[e] == C_QNONE:
                continue
            if W <= 2:
                need = (_bitlen128(_load2(&limbs[e, 0], W)) + (q[e] - qg[e]) + extra + 2
                        + BITS - 1) // BITS
            else:
                need = (_row_bits(&limbs[e, 0], W) + (q[e] - qg[e]) + extra + 2 + BITS - 1) \
                    // BITS
            if need > best:
                best = need
    return best


def realign(const int16_t[::1] q, const int64_t[:, ::1] limbs, const int16_t[::1] qg,
            int64_t[:, ::1] out):
    """out = every element's value at quantum qg[e] (<= q[e]), normalised, in out's W limbs
    (which must hold it: needed_limbs)."""
    cdef Py_ssize_t n = q.shape[0], e
    cdef int W1 = limbs.shape[1], W2 = out.shape[1], k, d
    cdef int64_t *dst
    with nogil:
        for e in range(n):
            dst = &out[e, 0]
            if q[e] == C_QNONE:
                memset(dst, 0, W2 * sizeof(int64_t))
                continue
            d = q[e] - qg[e]
            if W1 <= 2 and d <= 22:               # (|value| < 2**103: shifted, still < 2**126)
                _store128(dst, W2, _load2(&limbs[e, 0], W1) << d)
                continue
            memset(dst, 0, W2 * sizeof(int64_t))
            for k in range(W1):
                if limbs[e, k]:
                    _add_shifted(dst, W2, limbs[e, k], BITS * k + d)
            _normalize_row(dst, W2)


def aligned(const int16_t[::1] q, const int64_t[:, ::1] limbs, const int16_t[::1] qg,
            int extra, int64_t[:, ::1] out):
    """needed_limbs and realign in one pass: every element whose value at quantum qg[e], with
    `extra` bits of headroom, fits out's W limbs is written there; returns the fewest limbs
    that hold every element (when that is more than out's, out is not all written: realign
    into as many)."""
    cdef Py_ssize_t n = q.shape[0], e
    cdef int W1 = limbs.shape[1], W2 = out.shape[1], k, d, need, best = 1
    cdef int64_t *dst
    cdef shmt_i128 t
    with nogil:
        if W1 == 2 and W2 == 2:                   # (the common case, without loops)
            for e in range(n):
                if q[e] == C_QNONE:
                    out[e, 0] = 0
                    out[e, 1] = 0
                    continue
                d = q[e] - qg[e]
                t = ((<shmt_i128>limbs[e, 1]) << BITS) + limbs[e, 0]
                k = _bitlen128(t)
                need = (k + d + extra + 2 + BITS - 1) // BITS
                if need <= 2:                     # (then k + d < 104: the shift fits 128 bits)
                    t = t << d
                    out[e, 0] = <int64_t>(t & MASK)
                    out[e, 1] = <int64_t>(t >> BITS)
                if need > best:
                    best = need
        else:
            _aligned_rows(q, limbs, qg, extra, out, &best)
    return best


cdef void _aligned_rows(const int16_t[::1] q, const int64_t[:, ::1] limbs,
                        const int16_t[::1] qg, int extra, int64_t[:, ::1] out,
                        int *bestp) noexcept nogil:
    """aligned's general case (any W)."""
    cdef Py_ssize_t n = q.shape[0], e
    cdef int W1 = limbs.shape[1], W2 = out.shape[1], k, d, need, best = bestp[0]
    cdef int64_t *dst
    cdef shmt_i128 t
    if True:
        for e in range(n):
            dst = &out[e, 0]
            if q[e] == C_QNONE:
                memset(dst, 0, W2 * sizeof(int64_t))
                continue
            d = q[e] - qg[e]
            if W1 <= 2 and d <= 22:               # (|value| < 2**103: shifted, < 2**126)
                t = _load2(&limbs[e, 0], W1) << d
                need = (_bitlen128(t) + extra + 2 + BITS - 1) // BITS
                if need <= W2:
                    _store128(dst, W2, t)
            else:
                need = (_row_bits(&limbs[e, 0], W1) + d + extra + 2 + BITS - 1) // BITS
                if need <= W2:
                    memset(dst, 0, W2 * sizeof(int64_t))
                    for k in range(W1):
                        if limbs[e, k]:
                            _add_shifted(dst, W2, limbs[e, k], BITS * k + d)
                    _normalize_row(dst, W2)
            if need > best:
                best = need
    bestp[0] = best


def normalize_sum(int64_t[:, ::1] limbs, int16_t[::1] q):
    """After a column sum of aligned normalised rows (the engine's int64 sum): carry, in place;
    an element whose sum is zero gets q = QNONE."""
    cdef Py_ssize_t n = limbs.shape[0], e
    cdef int W = limbs.shape[1], k
    cdef bint zero
    cdef uint64_t u
    with nogil:
        if W == 2:
            for e in range(n):
                u = <uint64_t>limbs[e, 0]
                limbs[e, 0] = <int64_t>(u & MASK)
                limbs[e, 1] += <int64_t>(u >> BITS)
                if limbs[e, 0] == 0 and limbs[e, 1] == 0:
                    q[e] = C_QNONE
        else:
            for e in range(n):
                _normalize_sum_row(&limbs[e, 0], W)
                zero = True
                for k in range(W):
                    if limbs[e, k]:
                        zero = False
                        break
                if zero:
                    q[e] = C_QNONE


def combine(const int16_t[:, ::1] qs, const int64_t[:, :, ::1] limbs, const uint8_t[:, ::1] fl):
    """The exact sum of P states per element (qs: P x n, limbs: P x n x W, flags P x n): (q,
    limbs, flags) normalised, with the fewest limbs that hold every element."""
    cdef Py_ssize_t P = qs.shape[0], n = qs.shape[1], e, r
    cdef int W = limbs.shape[2], Wout = 1, need, k, extra = 0, d
    q_a = np.full(n, C_QNONE, np.int16)
    flags_a = np.zeros(n, np.uint8)
    cdef int16_t[::1] q = q_a
    cdef uint8_t[::1] flags = flags_a
    cdef int16_t qm
    cdef bint zero
    with nogil:
        while (<Py_ssize_t>1 << extra) < P:
            extra += 1
        for e in range(n):
            qm = C_QNONE
            for r in range(P):
                flags[e] |= fl[r, e]
                if qs[r, e] != C_QNONE and (qm == C_QNONE or qs[r, e] < qm):
                    qm = qs[r, e]
            q[e] = qm
            if qm == C_QNONE:
                continue
            for r in range(P):
                if qs[r, e] != C_QNONE:
                    need = (_row_bits(&limbs[r, e, 0], W) + (qs[r, e] - qm) + extra + 2
                            + BITS - 1) // BITS
                    if need > Wout:
                        Wout = need
    out_a = np.zeros((n, Wout), np.int64)
    cdef int64_t[:, ::1] out = out_a
    cdef int64_t *dst
    cdef shmt_i128 acc128
    cdef bint small = W <= 2 and Wout <= 2
    with nogil:
        for e in range(n):
            if q[e] == C_QNONE:
                continue
            dst = &out[e, 0]
            if small:                     # (Wout <= 2: every aligned value < 2**103 / P)
                acc128 = 0
                for r in range(P):
                    if qs[r, e] != C_QNONE:
                        acc128 += _load2(&limbs[r, e, 0], W) << (qs[r, e] - q[e])
                if acc128 == 0:
                    q[e] = C_QNONE
                else:
                    _store128(dst, Wout, acc128)
                continue
            for r in range(P):
                if qs[r, e] == C_QNONE:
                    continue
                d = qs[r, e] - q[e]
                for k in range(W):
                    if limbs[r, e, k]:
                        _add_shifted(dst, Wout, limbs[r, e, k], BITS * k + d)
                _normalize_row(dst, Wout)
            zero = True
            for k in range(Wout):
                if dst[k]:
                    zero = False
                    break
            if zero:
                q[e] = C_QNONE
    return q_a, out_a, flags_a


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
    cdef double limit = ldexp(1.0, emax + 1), v, r
    cdef dbits sc
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
            if not zero and W <= 2 and p == 53 and -1022 <= q[e] <= 1023:
                # float64: the value's two limbs are exact doubles, and their sum, one IEEE
                # addition, is the value rounded to 53 bits (to nearest even); times 2**q it
                # is the result, exactly, when that is a normal double (else: below)
                v = <double>limbs[e, 0]
                if W == 2:
                    v = <double>limbs[e, 1] * 4503599627370496.0 + v      # (2**52)
                sc.u = (<uint64_t>(q[e] + 1023)) << 52
                r = v * sc.f
                if 2.2250738585072014e-308 <= fabs(r) < INFINITY:
                    out[e] = r
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


def small_rows(const int16_t[::1] q, const int64_t[:, ::1] limbs, const uint8_t[::1] flags,
               bint nonempty, int words):
    """An accumulator's state as rows of 1 + words int64 (q and flags, then its limbs in words
    limbs), a last row saying (fits, nonempty): the small allreduce's allgather."""
    cdef Py_ssize_t n = q.shape[0], e
    cdef int W = limbs.shape[1], k
    rows_a = np.zeros((n + 1, 1 + words), np.int64)
    cdef int64_t[:, ::1] rows = rows_a
    cdef bint fits = W <= words
    with nogil:
        if fits:
            for e in range(n):
                rows[e, 0] = (<int64_t>(<uint16_t>q[e])) | ((<int64_t>flags[e]) << 16)
                if q[e] == C_QNONE:
                    continue
                if W == words:
                    for k in range(W):
                        rows[e, 1 + k] = limbs[e, k]
                else:
                    _store_row(&rows[e, 1], words, &limbs[e, 0], W)
        rows[n, 0] = fits
        rows[n, 1] = nonempty
    return rows_a


cdef inline void _store_row(int64_t *dst, int W2, const int64_t *src, int W1) noexcept nogil:
    """A normalised row of W1 limbs in W2 > W1 limbs: the same value (its sign carried up)."""
    cdef int k
    cdef int64_t ext = -1 if src[W1 - 1] < 0 else 0
    for k in range(W1 - 1):
        dst[k] = src[k]
    dst[W1 - 1] = src[W1 - 1] & <int64_t>MASK if W2 > W1 else src[W1 - 1]
    for k in range(W1, W2 - 1):
        dst[k] = ext & <int64_t>MASK
    dst[W2 - 1] = ext if W2 > W1 else dst[W2 - 1]


def merge_rows(const int64_t[:, :, ::1] rows):
    """The exact sum of P ranks' small_rows (P x (n + 1) x (1 + words)): (q, limbs, flags,
    nonempty), or None when some rank's state did not fit."""
    cdef Py_ssize_t P = rows.shape[0], n = rows.shape[1] - 1, e, r
    cdef int words = rows.shape[2] - 1, k
    cdef bint nonempty = False
    for r in range(P):
        if not rows[r, n, 0]:
            return None
        nonempty = nonempty or rows[r, n, 1] != 0
    qs_a = np.empty((P, n), np.int16)
    fl_a = np.empty((P, n), np.uint8)
    limbs_a = np.empty((P, n, words), np.int64)
    cdef int16_t[:, ::1] qs = qs_a
    cdef uint8_t[:, ::1] fl = fl_a
    cdef int64_t[:, :, ::1] limbs = limbs_a
    with nogil:
        for r in range(P):
            for e in range(n):
                qs[r, e] = <int16_t>(<uint16_t>(rows[r, e, 0] & 0xffff))
                fl[r, e] = <uint8_t>((rows[r, e, 0] >> 16) & 0xff)
                for k in range(words):
                    limbs[r, e, k] = rows[r, e, 1 + k]
    q, out, flags = combine(qs_a, limbs_a, fl_a)
    return q, out, flags, nonempty


# ---- the rank-order fold of deterministic=True (repro.py) ----



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
