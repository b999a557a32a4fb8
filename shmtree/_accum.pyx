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
from libc.stdint cimport int16_t, int32_t, int64_t, uint8_t, uint16_t, uint64_t, INT64_MIN
from libc.string cimport memset

cdef extern from "accum_fast.h" nogil:
    int shmt_acc_set_isa(int isa)
    int shmt_acc_isa
    int64_t shmt_acc_ulp_quanta(const double *x, int16_t *negq, Py_ssize_t n)
    int64_t shmt_acc_ulp_limbs(const double *x, const int16_t *negq_g, int extra, int64_t *out,
                               Py_ssize_t n)
    int64_t shmt_acc_round_sums(const int64_t *s, const int16_t *negq_g, double *out,
                                Py_ssize_t n)
    int64_t shmt_acc_align2(const int16_t *q, const int64_t *limbs, const int16_t *qg, int extra,
                            int64_t *out, Py_ssize_t n)
    void shmt_acc_carry2(int64_t *limbs, int16_t *q, Py_ssize_t n)


import numpy as np

QNONE = 32767
LIMB_BITS = 52
FLAG_NAN = 1
FLAG_PINF = 2
FLAG_NINF = 4
FLAG_NEGZ = 8
FLAG_OTHER = 16
SPECIAL = FLAG_NAN | FLAG_PINF | FLAG_NINF | FLAG_NEGZ   # flags that a result depends on

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
    that hold every element, 2 where two limbs of both hold them all (when that is more than
    out's, out is not all written: realign into as many)."""
    cdef Py_ssize_t n = q.shape[0], e
    cdef int W1 = limbs.shape[1], W2 = out.shape[1], k, d, need, best = 1
    cdef int64_t *dst
    cdef shmt_i128 t
    with nogil:
        if W1 == 2 and W2 == 2 and n:             # (the common case: accum_loops.h's align2,
            if shmt_acc_align2(&q[0], &limbs[0, 0], &qg[0], extra, &out[0, 0], n):  # then
                for e in range(n):                # the elements it left, the general way)
                    if out[e, 1] != INT64_MIN:
                        if q[e] != C_QNONE and 2 > best:
                            best = 2
                        continue
                    d = q[e] - qg[e]
                    t = ((<shmt_i128>limbs[e, 1]) << BITS) + limbs[e, 0]
                    k = _bitlen128(t)
                    need = (k + d + extra + 2 + BITS - 1) // BITS
                    if need <= 2:                 # (then k + d < 104: the shift fits 128 bits)
                        t = t << d
                        out[e, 0] = <int64_t>(t & MASK)
                        out[e, 1] = <int64_t>(t >> BITS)
                    if need > best:
                        best = need
            else:
                best = 2
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
            if n:
                shmt_acc_carry2(&limbs[0, 0], &q[0], n)     # (accum_loops.h's carry2)
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


# ---- the float64 fast path of reproducible=True (shmtree/accumulating.py): every x one term,
# at the quantum of its unit in the last place (accum_loops.h), without an Accumulator's state

def ulp_quanta(const double[::1] x, int16_t[::1] negq):
    """negq[e] = -(x[e]'s ulp exponent), -QNONE for a zero or non-finite x (accum_loops.h):
    the max round's row.  Returns how many x are NaN, infinite or -0.0 (0: the fast path may
    go on)."""
    cdef Py_ssize_t n = x.shape[0]
    if negq.shape[0] < n:
        raise ValueError("shmtree: ulp_quanta: negq is shorter than x")
    if n == 0:
        return 0
    cdef int64_t got
    with nogil:
        got = shmt_acc_ulp_quanta(&x[0], &negq[0], n)
    return got


def ulp_limbs(const double[::1] x, const int16_t[::1] negq_g, int extra, int64_t[:, ::1] out):
    """Every x[e] at the group's quantum -negq_g[e], in two normalised limbs of out (a sum of
    2**extra such rows fits): returns how many do not fit so (0: out is all written)."""
    cdef Py_ssize_t n = x.shape[0]
    if negq_g.shape[0] < n or out.shape[0] < n or out.shape[1] != 2:
        raise ValueError("shmtree: ulp_limbs: arrays of other shapes than x's")
    if n == 0:
        return 0
    cdef int64_t got
    with nogil:
        got = shmt_acc_ulp_limbs(&x[0], &negq_g[0], extra, &out[0, 0], n)
    return got


def round_sums(const int64_t[:, ::1] sums, const int16_t[::1] negq_g, double[::1] out):
    """The column sums of ulp_limbs times 2**-negq_g[e], rounded once to nearest even into
    out: returns how many elements are not a normal double's case (0: out is the result; else
    the caller rounds the general way)."""
    cdef Py_ssize_t n = out.shape[0]
    if negq_g.shape[0] < n or sums.shape[0] < n or sums.shape[1] != 2:
        raise ValueError("shmtree: round_sums: arrays of other shapes than out's")
    if n == 0:
        return 0
    cdef int64_t got
    with nogil:
        got = shmt_acc_round_sums(&sums[0, 0], &negq_g[0], &out[0], n)
    return got


def use_isa(int isa):
    """The instruction set of accum_loops.h's loops: 1 AVX2 (where the CPU has it), 0 the
    build's baseline (tests compare the two).  Returns whether it took."""
    return bool(shmt_acc_set_isa(isa))


def isa():
    """The instruction set in use: 1 AVX2, 0 the baseline."""
    return shmt_acc_isa


use_isa(1)
