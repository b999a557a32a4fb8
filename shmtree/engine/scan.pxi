# The fold of scan and exscan (msg_scan: the rows of the gathered stack this rank needs, when
# the call ends; fold(): the transpose scheme's prefixes of every row, Executors._scan): rows
# folded in rank order, one pairwise step at a time, acc = acc op row_r, so that the bits are
# numpy's accumulate in rank order (ufunc.accumulate(stack, axis=0, dtype=stack.dtype)):
#   * sum, prod and the bitwise ops: the reduction kernels (_kernels), two operands a step;
#     float16 and bfloat16 are rounded after every step as numpy rounds them; complex products
#     follow the kernels' textbook formula (allreduce's rule, DESIGN section 11); where two
#     NaNs meet, the result is the left one, quieted (the kernels' rule; numpy's loops pick one
#     or the other from dtype to dtype, by how they were compiled: float32 and float64 as here,
#     float16, bfloat16 and complex the right one);
#   * min and max of floats: numpy's own rule (its loops, measured: tests/test_scan_paths.py),
#     which the kernels' (-0.0 below +0.0, allreduce's order-free rule) is not:
#       float32, float64, bfloat16: a if (a < b or a is NaN) else b      (max: a > b)
#       float16:                    a if (a <= b or a is NaN) else b     (max: a >= b)
#     so on a tie (-0.0 against +0.0) float16 keeps the left operand and the others the right
#     one, and a NaN operand is the result, its bits as they are;
#   * min and max of integers and bool: the kernels (exact either way).
# Included by _engine.pyx before the Engine class (nogil code only).

cdef struct ScanFold:
    # the fold a scan call runs when it ends (msg_scan; upto -1: none)
    const char *rows      # the stack: row r at r * stride
    char *out             # the output: one row
    uint64_t stride       # bytes per row
    int64_t n             # items per row
    int upto              # fold rows 0 .. upto - 1 (0: the op's identity)
    int op, dtype


cdef inline int fold_itemsize(int dtc) noexcept nogil:
    if dtc == DT_BOOL or dtc == DT_I1 or dtc == DT_U1:
        return 1
    if dtc == DT_I2 or dtc == DT_U2 or dtc == DT_F2 or dtc == DT_BF16:
        return 2
    if dtc == DT_I4 or dtc == DT_U4 or dtc == DT_F4:
        return 4
    if dtc == DT_C16:
        return 16
    return 8                                # (i8, u8, f8, c8)


cdef inline bint fold_by_numpy_rule(int opc, int dtc) noexcept nogil:
    """min / max of a float dtype: numpy's rule (above), not the kernels'."""
    return ((opc == OP_MIN or opc == OP_MAX)
            and (dtc == DT_F2 or dtc == DT_F4 or dtc == DT_F8 or dtc == DT_BF16))


cdef inline bint fold_supported(int opc, int dtc) noexcept nogil:
    return 0 <= dtc < N_DTYPES and 0 <= opc < N_OPS and get_kernel(opc, dtc) != NULL


# ---- numpy's min / max of floats ----

cdef inline int32_t _key16(uint16_t h) noexcept nogil:
    """A 16-bit float's order as an int (not NaN): -0.0 and +0.0 tie."""
    return -<int32_t>(h & 0x7fff) if h & 0x8000 else <int32_t>h


cdef inline bint _nan16(uint16_t h, uint16_t expo) noexcept nogil:
    return (h & expo) == expo and (h & ~expo & 0x7fff) != 0


cdef void _minmax16(uint16_t *d, const uint16_t *a, const uint16_t *b, int64_t n, bint is_max,
                    bint half) noexcept nogil:
    """float16 (half) or bfloat16, numpy's min / max (above)."""
    cdef uint16_t expo = 0x7c00 if half else 0x7f80
    cdef int64_t i
    cdef uint16_t x, y
    cdef int32_t kx, ky
    cdef bint take
    for i in range(n):
        x = a[i]
        y = b[i]
        if _nan16(x, expo):
            take = True
        elif _nan16(y, expo):
            take = False
        else:
            kx = _key16(x)
            ky = _key16(y)
            if half:
                take = kx >= ky if is_max else kx <= ky
            else:
                take = kx > ky if is_max else kx < ky
        d[i] = x if take else y


cdef void _minmax_f4(float *d, const float *a, const float *b, int64_t n,
                     bint is_max) noexcept nogil:
    cdef int64_t i
    cdef float x, y
    if is_max:
        for i in range(n):
            x = a[i]
            y = b[i]
            d[i] = x if (x > y or x != x) else y
    else:
        for i in range(n):
            x = a[i]
            y = b[i]
            d[i] = x if (x < y or x != x) else y


cdef void _minmax_f8(double *d, const double *a, const double *b, int64_t n,
                     bint is_max) noexcept nogil:
    cdef int64_t i
    cdef double x, y
    if is_max:
        for i in range(n):
            x = a[i]
            y = b[i]
            d[i] = x if (x > y or x != x) else y
    else:
        for i in range(n):
            x = a[i]
            y = b[i]
            d[i] = x if (x < y or x != x) else y


# ---- one step, a prefix, the identity ----

cdef void fold_step(int opc, int dtc, char *dst, const char *a, const char *b,
                    int64_t n) noexcept nogil:
    """dst = a op b, item by item (n items); dst may be a or b."""
    cdef const void *srcs[2]
    cdef bint is_max = opc == OP_MAX
    if fold_by_numpy_rule(opc, dtc):
        if dtc == DT_F4:
            _minmax_f4(<float *>dst, <const float *>a, <const float *>b, n, is_max)
        elif dtc == DT_F8:
            _minmax_f8(<double *>dst, <const double *>a, <const double *>b, n, is_max)
        else:
            _minmax16(<uint16_t *>dst, <const uint16_t *>a, <const uint16_t *>b, n, is_max,
                      dtc == DT_F2)
        return
    srcs[0] = a
    srcs[1] = b
    get_kernel(opc, dtc)(dst, srcs, 2, n)


cdef inline void _fold_fn(int opc, int dtc, void *d, const void **s, int nsrc,
                          Py_ssize_t n) noexcept nogil:
    """A kernel's call (reduce_fn) folded pairwise, left to right, with fold_step."""
    cdef int i
    if nsrc == 1:
        if d != s[0]:
            memcpy(d, s[0], n * fold_itemsize(dtc))
        return
    fold_step(opc, dtc, <char *>d, <const char *>s[0], <const char *>s[1], n)
    for i in range(2, nsrc):
        fold_step(opc, dtc, <char *>d, <const char *>d, <const char *>s[i], n)


cdef void _fold_min_f4(void *d, const void **s, int nsrc, Py_ssize_t n) noexcept nogil:
    _fold_fn(OP_MIN, DT_F4, d, s, nsrc, n)
cdef void _fold_max_f4(void *d, const void **s, int nsrc, Py_ssize_t n) noexcept nogil:
    _fold_fn(OP_MAX, DT_F4, d, s, nsrc, n)
cdef void _fold_min_f8(void *d, const void **s, int nsrc, Py_ssize_t n) noexcept nogil:
    _fold_fn(OP_MIN, DT_F8, d, s, nsrc, n)
cdef void _fold_max_f8(void *d, const void **s, int nsrc, Py_ssize_t n) noexcept nogil:
    _fold_fn(OP_MAX, DT_F8, d, s, nsrc, n)
cdef void _fold_min_f2(void *d, const void **s, int nsrc, Py_ssize_t n) noexcept nogil:
    _fold_fn(OP_MIN, DT_F2, d, s, nsrc, n)
cdef void _fold_max_f2(void *d, const void **s, int nsrc, Py_ssize_t n) noexcept nogil:
    _fold_fn(OP_MAX, DT_F2, d, s, nsrc, n)
cdef void _fold_min_bf16(void *d, const void **s, int nsrc, Py_ssize_t n) noexcept nogil:
    _fold_fn(OP_MIN, DT_BF16, d, s, nsrc, n)
cdef void _fold_max_bf16(void *d, const void **s, int nsrc, Py_ssize_t n) noexcept nogil:
    _fold_fn(OP_MAX, DT_BF16, d, s, nsrc, n)


cdef reduce_fn fold_kernel(int opc, int dtc) noexcept nogil:
    """The kernel of a scan's chain (alg_chain.pxi: pred op own, two operands a step): the
    reduction kernel, or numpy's rule for min and max of floats (fold_step's), so that the
    chain's bits are the fold's."""
    if not fold_by_numpy_rule(opc, dtc):
        return get_kernel(opc, dtc)
    if dtc == DT_F4:
        return _fold_max_f4 if opc == OP_MAX else _fold_min_f4
    if dtc == DT_F8:
        return _fold_max_f8 if opc == OP_MAX else _fold_min_f8
    if dtc == DT_F2:
        return _fold_max_f2 if opc == OP_MAX else _fold_min_f2
    return _fold_max_bf16 if opc == OP_MAX else _fold_min_bf16


cdef void fold_identity(int opc, int dtc, char *dst, int64_t n) noexcept nogil:
    """dst = n items of the op's identity (exscan's rank 0: collectives._identity's values):
    sum, bor, bxor 0; prod 1; band all ones (bool True); min the largest value (+inf, bool
    True), max the smallest (-inf, bool False)."""
    cdef unsigned char item[16]
    cdef int size = fold_itemsize(dtc), i
    cdef bint signed = dtc == DT_I1 or dtc == DT_I2 or dtc == DT_I4 or dtc == DT_I8
    cdef bint integer = signed or dtc == DT_U1 or dtc == DT_U2 or dtc == DT_U4 or dtc == DT_U8
    cdef float f
    cdef double g
    cdef uint16_t h = 0
    memset(item, 0, sizeof(item))
    if opc == OP_PROD or (dtc == DT_BOOL and (opc == OP_BAND or opc == OP_MIN)):
        if dtc == DT_F4 or dtc == DT_C8:
            f = 1.0
            memcpy(item, &f, 4)
        elif dtc == DT_F8 or dtc == DT_C16:
            g = 1.0
            memcpy(item, &g, 8)
        elif dtc == DT_F2 or dtc == DT_BF16:
            h = 0x3c00 if dtc == DT_F2 else 0x3f80
            memcpy(item, &h, 2)
        else:
            item[0] = 1                     # (little-endian ints, bool True)
    elif opc == OP_BAND or (opc == OP_MIN and integer and not signed):
        memset(item, 0xff, size)
    elif (opc == OP_MIN or opc == OP_MAX) and signed:       # (the largest / the smallest)
        memset(item, 0xff if opc == OP_MIN else 0, size)
        item[size - 1] = 0x7f if opc == OP_MIN else 0x80
    elif (opc == OP_MIN or opc == OP_MAX) and not integer:
        if dtc == DT_F4:
            f = INFINITY if opc == OP_MIN else -INFINITY
            memcpy(item, &f, 4)
        elif dtc == DT_F8:
            g = INFINITY if opc == OP_MIN else -INFINITY
            memcpy(item, &g, 8)
        elif dtc == DT_F2 or dtc == DT_BF16:
            h = 0x7c00 if dtc == DT_F2 else 0x7f80
            if opc == OP_MAX:
                h |= 0x8000
            memcpy(item, &h, 2)
        # (bool max: False, the zeros; unsigned max: 0)
    cdef uint64_t done = size, total = <uint64_t>n * size
    for i in range(size):
        if item[i]:
            break
    else:
        memset(dst, 0, total)               # (sum, bor, bxor; unsigned and bool max)
        return
    if n <= 0:
        return
    memcpy(dst, item, size)
    while done < total:                     # (doubling: a few large copies, not n small ones)
        memcpy(dst + done, dst, done if 2 * done <= total else total - done)
        done *= 2


cdef void fold_prefix(int opc, int dtc, const char *rows, uint64_t stride, int upto, char *dst,
                      int64_t n) noexcept nogil:
    """dst = rows[0] op rows[1] op ... op rows[upto - 1], in that order (the identity when upto
    is 0); dst lies clear of the rows."""
    cdef int r
    if upto <= 0:
        fold_identity(opc, dtc, dst, n)
        return
    if upto == 1:
        memcpy(dst, rows, n * fold_itemsize(dtc))
        return
    fold_step(opc, dtc, dst, rows, rows + stride, n)
    for r in range(2, upto):
        fold_step(opc, dtc, dst, dst, rows + r * stride, n)


cdef void fold_rows(int opc, int dtc, const char *rows, uint64_t in_stride, int m, char *out,
                    uint64_t out_stride, int64_t n, bint exclusive) noexcept nogil:
    """The prefixes of m rows, into m rows of out: inclusive (out[r] = rows[0] op ... op
    rows[r]) or exclusive (out[0] the identity, out[r] = rows[0] op ... op rows[r - 1]).  out
    may be rows itself (inclusive: in place), else lies clear of them."""
    cdef int r
    cdef uint64_t size = n * fold_itemsize(dtc)
    if m <= 0:
        return
    if exclusive:
        fold_identity(opc, dtc, out, n)
        if m > 1:
            memcpy(out + out_stride, rows, size)
        for r in range(2, m):
            fold_step(opc, dtc, out + r * out_stride, out + (r - 1) * out_stride,
                      rows + (r - 1) * in_stride, n)
        return
    if out != rows:
        memcpy(out, rows, size)
    for r in range(1, m):
        fold_step(opc, dtc, out + r * out_stride, out + (r - 1) * out_stride,
                  rows + r * in_stride, n)
