# (included by shmtree/_kernels.pyx) Layers 1 and 2 of the kernels: the point functions (one
# element, numpy's rule for NaN, signed zeros and complex products) and the fused loops over
# blocks that the kernel table (layer 3) is made of.

# ---------------------------------------------------------------------------------------------
# Layer 1: point functions
# ---------------------------------------------------------------------------------------------

cdef inline Flt _nan_pick(Flt a, Flt b) noexcept nogil:
    """b, or a when a is a NaN: the right operand of a float sum or product (_fadd, _fsub,
    _fmul), so that where the left operand is a NaN the result is that NaN, quieted (a op a).
    IEEE 754 leaves open which NaN an operation on two NaNs returns, and compilers treat + and *
    as commutative, so the hardware's rule (x86: the first operand's) applies to whichever
    operand the compiler put first - and that differs between the vector and scalar loops of
    one kernel, and between the loops it takes by aliasing (dst is a source or not).  With a's
    NaN chosen here the bits of every result depend on the operands and their order only: every
    rank, every path (the single copy included) gets the same bits.  (When only b is a NaN, the
    hardware returns b's, quieted, in either operand order.)  Branch-free: a compare and a
    blend, which vectorize with the op (the mask as wide as the lanes: the form GCC
    vectorizes)."""
    cdef f32_bits b32, a32
    cdef f64_bits b64, a64
    cdef int32_t m32
    cdef int64_t m64
    if Flt is float:
        b32.f = b
        a32.f = a
        m32 = -1 if a != a else 0
        b32.u = (b32.u & ~<uint32_t>m32) | (a32.u & <uint32_t>m32)
        return b32.f
    else:
        b64.f = b
        a64.f = a
        m64 = -1 if a != a else 0
        b64.u = (b64.u & ~<uint64_t>m64) | (a64.u & <uint64_t>m64)
        return b64.f


cdef inline Flt _fadd(Flt a, Flt b) noexcept nogil:
    return a + _nan_pick(a, b)


cdef inline Flt _fsub(Flt a, Flt b) noexcept nogil:
    return a - _nan_pick(a, b)


cdef inline Flt _fmul(Flt a, Flt b) noexcept nogil:
    return a * _nan_pick(a, b)


cdef inline Cplx _cadd(Cplx a, Cplx b) noexcept nogil:
    cdef Cplx r
    r.re = _fadd(a.re, b.re)
    r.im = _fadd(a.im, b.im)
    return r


cdef inline Cplx _cmul(Cplx a, Cplx b) noexcept nogil:
    # numpy's complex multiply, same terms in the same order (each op NaN-first, as _fadd).
    cdef Cplx r
    r.re = _fsub(_fmul(a.re, b.re), _fmul(a.im, b.im))
    r.im = _fadd(_fmul(a.re, b.im), _fmul(a.im, b.re))
    return r


cdef inline Num _add(Num a, Num b) noexcept nogil:
    if Num in Cplx:
        return _cadd(a, b)
    elif Num in Integer:
        # Wraps modulo 2**64; the cast back keeps the low bits (GCC defines conversion to a
        # signed type as modulo), which is two's complement wrap-around at the type's width.
        return <Num>(<uint64_t>a + <uint64_t>b)
    else:
        return _fadd(a, b)


cdef inline Num _mul(Num a, Num b) noexcept nogil:
    if Num in Cplx:
        return _cmul(a, b)
    elif Num in Integer:
        return <Num>(<uint64_t>a * <uint64_t>b)    # same reasoning as in _add
    else:
        return _fmul(a, b)


cdef inline Real _fix_min_sign(Real r, Real a) noexcept nogil:
    """r, the ordinary min of a and b (a if a < b or a is NaN, else b), with a's sign bit ORed in:
    the IEEE minimum, -0.0 below +0.0.  If r is a, nothing changes.  If r is b, then a >= b or b
    is NaN: a NaN stays a NaN; a with its sign bit set means b <= a <= -0.0, so b's sign bit is
    set already unless b is +0.0 and a is -0.0, the tie, which gives -0.0.  So for a and b not
    NaN the result's sign bit is a's OR b's, in either operand order.  Branch-free: one AND with
    a constant and one OR, which vectorize like the compare and blend before them."""
    cdef f32_bits r32, a32
    cdef f64_bits r64, a64
    if Real is float:
        r32.f = r
        a32.f = a
        r32.u = r32.u | (a32.u & 0x80000000U)
        return r32.f
    elif Real is double:
        r64.f = r
        a64.f = a
        r64.u = r64.u | (a64.u & 0x8000000000000000ULL)
        return r64.f
    else:
        return r


cdef inline Real _fix_max_sign(Real r, Real a) noexcept nogil:
    """r, the ordinary max of a and b (a if a > b or a is NaN, else b), with its sign bit cleared
    unless a's is set: the IEEE maximum, +0.0 above -0.0.  As in _fix_min_sign, only r = b = -0.0
    with a = +0.0 changes (to +0.0); the result's sign bit is a's AND b's, in either order."""
    cdef f32_bits r32, a32
    cdef f64_bits r64, a64
    if Real is float:
        r32.f = r
        a32.f = a
        r32.u = r32.u & (a32.u | 0x7fffffffU)
        return r32.f
    elif Real is double:
        r64.f = r
        a64.f = a
        r64.u = r64.u & (a64.u | 0x7fffffffffffffffULL)
        return r64.f
    else:
        return r


cdef inline Real _min(Real a, Real b) noexcept nogil:
    # A NaN in either operand wins (a != a only for NaN; a NaN b fails a < b and is returned);
    # -0.0 is below +0.0 whatever the operand order (the sign fix), unlike np.minimum, which on
    # that tie returns one of the operands.
    if Real in Integer:
        return a if a < b else b
    else:
        return _fix_min_sign(a if (a < b) | (a != a) else b, a)


cdef inline Real _max(Real a, Real b) noexcept nogil:
    # As _min: NaN wins; +0.0 is above -0.0 in either order.
    if Real in Integer:
        return a if a > b else b
    else:
        return _fix_max_sign(a if (a > b) | (a != a) else b, a)


cdef inline Num _combine(Num a, Num b, Op *op) noexcept nogil:
    """a op b, the op chosen at compile time by the tag's type."""
    if Op is OpSum:
        return _add(a, b)
    elif Op is OpProd:
        return _mul(a, b)
    elif Op is OpBand or Op is OpBor or Op is OpBxor:
        if Num in Integer:
            if Op is OpBand:
                return a & b
            elif Op is OpBor:
                return a | b
            else:
                return a ^ b
        else:
            # Cython instantiates every (type, op) pair, so bitwise ops of float and complex
            # need a body; no kernel uses it: the table holds NULL there, and reduce_into and
            # the API layer raise TypeError.
            return a
    elif Num in Cplx:
        return a    # min/max of complex: likewise never used
    elif Op is OpMin:
        return _min(a, b)
    else:
        return _max(a, b)


# ---------------------------------------------------------------------------------------------
# Layer 2: fused loops
# ---------------------------------------------------------------------------------------------

cdef inline void _pair(Num *d, const Num *a, const Num *b, Py_ssize_t m, Op *op) noexcept nogil:
    """d[i] = a[i] op b[i] for i < m; d overlaps neither a nor b."""
    cdef Py_ssize_t i
    for i in range(m):
        d[i] = _combine(a[i], b[i], op)


cdef inline void _accumulate(Num *d, const Num *b, Py_ssize_t m, Op *op) noexcept nogil:
    """d[i] = d[i] op b[i] for i < m; d does not overlap b."""
    cdef Py_ssize_t i
    for i in range(m):
        d[i] = _combine(d[i], b[i], op)


cdef void _reduce_num(Num *dst, const Num **srcs, int nsrc, Py_ssize_t n, Op *op) noexcept nogil:
    """nsrc >= 2: per block, dst = s0 op s1, then dst = dst op sj; in place when dst is s0."""
    cdef Py_ssize_t blk = BLOCK_BYTES // sizeof(Num)
    cdef Py_ssize_t start = 0, m
    cdef int j
    while start < n:
        m = min(blk, n - start)
        if dst == srcs[0]:
            _accumulate(dst + start, srcs[1] + start, m, op)
        else:
            _pair(dst + start, srcs[0] + start, srcs[1] + start, m, op)
        for j in range(2, nsrc):
            _accumulate(dst + start, srcs[j] + start, m, op)
        start += m


cdef inline void _reduce(Num *dst, const Num **srcs, int nsrc, Py_ssize_t n,
                         Op *op) noexcept nogil:
    """dst[i] = srcs[0][i] op ... op srcs[nsrc-1][i], left to right; the one generic driver."""
    if nsrc == 1:
        if dst != srcs[0]:
            memcpy(dst, srcs[0], <size_t>n * sizeof(Num))
    else:
        _reduce_num(dst, srcs, nsrc, n, op)
