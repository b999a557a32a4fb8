# The exact sums of shmtree.Accumulator (shmtree/_accum.pyx): the representation's constants
# and the helpers that _accum.pyx and _rounding.pyx share.
from libc.stdint cimport int64_t, uint64_t

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


