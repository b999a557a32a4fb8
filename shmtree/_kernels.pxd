# Interface of the reduction kernels (shmtree/_kernels.pyx), cimported by the engine.
#
# A kernel computes, in one fused pass, dst[i] = srcs[0][i] op srcs[1][i] op ... op srcs[nsrc-1][i]
# for i < n, in that fixed order (so the same inputs always give the same bits).  dst may be the same
# pointer as srcs[0] (accumulate in place), or as srcs[1] when nsrc == 2, but never partially
# overlaps any source.  Float sum and prod (and complex's parts): when the left operand is a NaN
# the result is that NaN, quieted, so NaN payloads too depend on the operands and their order
# only, not on the loop a kernel takes (vector or scalar, in place or not).  nsrc >= 1
# (nsrc == 1 is a copy).  n counts items, not bytes.  Kernels never touch the GIL.  Float min/max
# order -0.0 below +0.0 (IEEE 754-2019 minimum/maximum), so their result on a -0.0/+0.0 tie does
# not depend on the order in which operands meet.

ctypedef void (*reduce_fn)(void *dst, const void **srcs, int nsrc, Py_ssize_t n) noexcept nogil

# op codes
cdef enum:
    OP_SUM = 0
    OP_PROD = 1
    OP_MIN = 2
    OP_MAX = 3
    OP_BAND = 4     # bitwise and, or, xor: integer and bool dtypes only
    OP_BOR = 5
    OP_BXOR = 6
    N_OPS = 7

# dtype codes
cdef enum:
    DT_BOOL = 0
    DT_I1 = 1
    DT_I2 = 2
    DT_I4 = 3
    DT_I8 = 4
    DT_U1 = 5
    DT_U2 = 6
    DT_U4 = 7
    DT_U8 = 8
    DT_F2 = 9
    DT_F4 = 10
    DT_F8 = 11
    DT_C8 = 12
    DT_C16 = 13
    DT_BF16 = 14    # bfloat16 (ml_dtypes.bfloat16, torch.bfloat16)
    N_DTYPES = 15

# The kernel for (op, dtype), or NULL where the pair is not supported (min/max of complex,
# band/bor/bxor of float and complex).
cdef reduce_fn get_kernel(int op, int dtype) noexcept nogil
