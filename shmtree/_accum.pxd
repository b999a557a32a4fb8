# The exact sums of shmtree.Accumulator (shmtree/_accum.pyx): the representation's constants
# and the helpers that _accum.pyx and _rounding.pyx share.
from libc.stdint cimport int64_t, uint8_t, uint64_t

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


cdef inline int _bitlen(uint64_t x) noexcept nogil:
    return 0 if x == 0 else 64 - shmt_clz64(x)


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
