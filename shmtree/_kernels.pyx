# cython: language_level=3, boundscheck=False, wraparound=False
# cython: cdivision=True, initializedcheck=False
"""Reduction kernels: dst = srcs[0] op srcs[1] op ... op srcs[nsrc-1], elementwise, in one pass.

The engine reduces each chunk of an allreduce with these kernels (through `get_kernel`, declared
in _kernels.pxd); the API layer and the tests use the Python helpers at the bottom.  The file has
four layers, each built only on the one above it:

1. Point functions (inline, nogil): one op on two elements, e.g. `_add`, `_max`, and `_combine`,
   which picks the op from a tag type at compile time.  They define the semantics, which are
   numpy's (`ufunc.reduce(np.stack(srcs), axis=0, dtype=dtype)`) except for the sign
   of zero in float min/max:
   - integers wrap modulo 2**bits, computed in uint64 so that no C signed overflow (undefined
     behaviour) or int promotion (uint16 * uint16 is an int multiply in C) is involved;
     band/bor/bxor are C's & | ^ (np.bitwise_and/or/xor);
   - floats: min/max propagate NaN (a NaN in either operand gives a NaN) and order -0.0 below
     +0.0, as IEEE 754-2019 minimum/maximum do: min(-0.0, +0.0) is -0.0 and max(-0.0, +0.0) is
     +0.0 in either operand order.  numpy instead returns one of the operands on such a tie, so
     its result would depend on the order in which operands meet, which differs between
     reduction trees; ours is the same whatever the tree.  Computed as the ordinary min/max
     followed by a fix of the sign bit (`_fix_min_sign`, `_fix_max_sign`), which keeps the
     loops vectorizable.  No bitwise ops;
   - complex: add and numpy's multiply, (a*c - b*d) + (a*d + b*c)i; no min/max (no order), no
     bitwise ops;
   - bool (0/1 bytes): sum, max and bor are logical or, prod, min and band logical and, bxor
     logical xor, which on 0/1 are exactly uint8 max, min and ^, so bool uses uint8 kernels;
   - float16 and bfloat16: every input widened to float32, reduced in float32 (min/max with the
     rule above), rounded to 16 bits once (round to nearest even).  Their kernels are C, in
     _csrc/half_kernels.h (conversions in _csrc/half.h): pairs of elements handled as 32-bit
     words so that vector lanes stay 32 bits wide, compiled for the baseline and for AVX2.
2. Fused loops: `_reduce[Num, Op]` copies when nsrc == 1; otherwise `_reduce_num` cuts the
   arrays into blocks of BLOCK_BYTES and, per block, computes dst = s0 op s1, then
   dst = dst op sj for j = 2..nsrc-1.  Each of those is a plain contiguous loop (`_pair`,
   `_accumulate`) that the compiler vectorizes, and the block of dst stays in L1 cache between
   them.  Written once; Cython instantiates them for every element type x op through the fused
   types `Num` and `Op` (ops are empty tag structs passed as NULL pointers, so the choice of op
   is made at compile time and costs nothing at run time).
3. The table: `_k_sum`, `_k_prod`, `_k_min`, `_k_max`, `_k_band`, `_k_bor`, `_k_bxor` have the
   shape of `reduce_fn`; their instantiations fill `_TABLE[op][dtype]` once at import, NULL
   where unsupported (min/max of complex, bitwise ops of float and complex); the float16 and
   bfloat16 columns come from _csrc/half_kernels.h, for the best instruction set the CPU has
   (`half_isa` tells and switches); `get_kernel` is a bounds-checked lookup.
4. Python helpers: DTYPE_CODES / dtype_code, OP_CODES and UFUNC_CODES (the one op table: names
   and numpy ufuncs -> OP_* codes) / op_code / op_name, supported, and reduce_into, which
   validates numpy arrays, takes their buffers and runs a kernel with the GIL released.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.mem cimport PyMem_Calloc, PyMem_Free
from libc.stdint cimport (int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t,
                          uint64_t)
from libc.string cimport memcpy

import numpy as np

cdef extern from "_csrc/half_kernels.h" nogil:
    ctypedef void (*shmt_half_fn)(void *dst, const void **srcs, int nsrc, Py_ssize_t n)
    shmt_half_fn shmt_half_kernel(int isa, int type, int op)
    enum:
        SHMT_ISA_BASE
        SHMT_ISA_AVX2


# ---------------------------------------------------------------------------------------------
# Element types and op tags
# ---------------------------------------------------------------------------------------------

# Complex numbers as numpy stores them: real then imaginary part.  Plain structs rather than C99
# complex, so that multiplication is exactly numpy's formula (C's `*` on _Complex adds inf/NaN
# recovery through a libgcc call, which is slower and not what numpy computes).
ctypedef struct c8_t:
    float re
    float im

ctypedef struct c16_t:
    double re
    double im

ctypedef fused Integer:
    uint8_t
    uint16_t
    uint32_t
    uint64_t
    int8_t
    int16_t
    int32_t
    int64_t

ctypedef fused Real:
    Integer
    float
    double

ctypedef fused Cplx:
    c8_t
    c16_t

ctypedef fused Flt:
    float
    double

# Every element type the generic loops reduce (float16 and bfloat16 have kernels of their own,
# in C: _csrc/half_kernels.h).
ctypedef fused Num:
    Real
    Cplx

# Op tags: never instantiated, only their types matter.
ctypedef struct OpSum:
    char unused

ctypedef struct OpProd:
    char unused

ctypedef struct OpMin:
    char unused

ctypedef struct OpMax:
    char unused

ctypedef struct OpBand:
    char unused

ctypedef struct OpBor:
    char unused

ctypedef struct OpBxor:
    char unused

ctypedef fused Op:
    OpSum
    OpProd
    OpMin
    OpMax
    OpBand
    OpBor
    OpBxor

# A float's bits, to set or clear its sign bit with integer ops (which vectorize like the float
# ops around them).  Reading the member not last written is defined in C (GNU C and C99 TC3).
ctypedef union f32_bits:
    float f
    uint32_t u

ctypedef union f64_bits:
    double f
    uint64_t u

cdef enum:
    # Bytes of dst per block: dst's block is re-read once per source, so it must stay in L1.
    BLOCK_BYTES = 2048


include "kernels/points.pxi"


# ---------------------------------------------------------------------------------------------
# Layer 3: the kernel table
# ---------------------------------------------------------------------------------------------

# One entry point per op, in the shape of reduce_fn but with typed pointers.  The table stores
# them cast to reduce_fn: they differ from it only in pointer parameter types, which every C ABI
# passes identically (GCC's -Wcast-function-type treats such casts as compatible).

cdef void _k_sum(Num *dst, const Num **srcs, int nsrc, Py_ssize_t n) noexcept nogil:
    _reduce(dst, srcs, nsrc, n, <OpSum *>NULL)


cdef void _k_prod(Num *dst, const Num **srcs, int nsrc, Py_ssize_t n) noexcept nogil:
    _reduce(dst, srcs, nsrc, n, <OpProd *>NULL)


cdef void _k_min(Num *dst, const Num **srcs, int nsrc, Py_ssize_t n) noexcept nogil:
    _reduce(dst, srcs, nsrc, n, <OpMin *>NULL)


cdef void _k_max(Num *dst, const Num **srcs, int nsrc, Py_ssize_t n) noexcept nogil:
    _reduce(dst, srcs, nsrc, n, <OpMax *>NULL)


cdef void _k_band(Num *dst, const Num **srcs, int nsrc, Py_ssize_t n) noexcept nogil:
    _reduce(dst, srcs, nsrc, n, <OpBand *>NULL)


cdef void _k_bor(Num *dst, const Num **srcs, int nsrc, Py_ssize_t n) noexcept nogil:
    _reduce(dst, srcs, nsrc, n, <OpBor *>NULL)


cdef void _k_bxor(Num *dst, const Num **srcs, int nsrc, Py_ssize_t n) noexcept nogil:
    _reduce(dst, srcs, nsrc, n, <OpBxor *>NULL)


cdef reduce_fn _TABLE[N_OPS][N_DTYPES]


cdef void _set_row(int dtype, Num *type_tag) noexcept:
    """Fill the table's column for one dtype with the kernels of element type Num."""
    _TABLE[OP_SUM][dtype] = <reduce_fn>_k_sum[Num]
    _TABLE[OP_PROD][dtype] = <reduce_fn>_k_prod[Num]
    if Num in Cplx:
        _TABLE[OP_MIN][dtype] = NULL
        _TABLE[OP_MAX][dtype] = NULL
    else:
        _TABLE[OP_MIN][dtype] = <reduce_fn>_k_min[Num]
        _TABLE[OP_MAX][dtype] = <reduce_fn>_k_max[Num]
    if Num in Integer:
        _TABLE[OP_BAND][dtype] = <reduce_fn>_k_band[Num]
        _TABLE[OP_BOR][dtype] = <reduce_fn>_k_bor[Num]
        _TABLE[OP_BXOR][dtype] = <reduce_fn>_k_bxor[Num]
    else:
        _TABLE[OP_BAND][dtype] = NULL
        _TABLE[OP_BOR][dtype] = NULL
        _TABLE[OP_BXOR][dtype] = NULL


cdef void _build_table() noexcept:
    _set_row(DT_I1, <int8_t *>NULL)
    _set_row(DT_I2, <int16_t *>NULL)
    _set_row(DT_I4, <int32_t *>NULL)
    _set_row(DT_I8, <int64_t *>NULL)
    _set_row(DT_U1, <uint8_t *>NULL)
    _set_row(DT_U2, <uint16_t *>NULL)
    _set_row(DT_U4, <uint32_t *>NULL)
    _set_row(DT_U8, <uint64_t *>NULL)
    _set_row(DT_F4, <float *>NULL)
    _set_row(DT_F8, <double *>NULL)
    _set_row(DT_C8, <c8_t *>NULL)
    _set_row(DT_C16, <c16_t *>NULL)
    # bool holds 0/1 bytes: or (sum, max, bor) is uint8 max, and (prod, min, band) is uint8
    # min, xor is uint8 ^ (0/1 in, 0/1 out).
    _TABLE[OP_SUM][DT_BOOL] = <reduce_fn>_k_max[uint8_t]
    _TABLE[OP_PROD][DT_BOOL] = <reduce_fn>_k_min[uint8_t]
    _TABLE[OP_MIN][DT_BOOL] = <reduce_fn>_k_min[uint8_t]
    _TABLE[OP_MAX][DT_BOOL] = <reduce_fn>_k_max[uint8_t]
    _TABLE[OP_BAND][DT_BOOL] = <reduce_fn>_k_band[uint8_t]
    _TABLE[OP_BOR][DT_BOOL] = <reduce_fn>_k_bor[uint8_t]
    _TABLE[OP_BXOR][DT_BOOL] = <reduce_fn>_k_bxor[uint8_t]


# Instruction sets the 16-bit kernels were compiled for, best last; HALF_ISA_NAMES[i] is isa i.
HALF_ISA_NAMES = ('baseline', 'avx2')
cdef int _half_isa = SHMT_ISA_BASE


cdef bint _set_half_rows(int isa) noexcept:
    """Point the float16 and bfloat16 columns at the kernels of instruction set isa; False (and
    nothing changed) if that set is not compiled in or the CPU lacks it."""
    global _half_isa
    cdef int op, t
    cdef int dtypes[2]
    dtypes[0] = DT_F2
    dtypes[1] = DT_BF16
    for t in range(2):
        for op in range(4):                     # OP_SUM, OP_PROD, OP_MIN, OP_MAX
            if shmt_half_kernel(isa, t, op) == NULL:
                return False
    for t in range(2):
        for op in range(4):
            _TABLE[op][dtypes[t]] = <reduce_fn>shmt_half_kernel(isa, t, op)
        _TABLE[OP_BAND][dtypes[t]] = NULL
        _TABLE[OP_BOR][dtypes[t]] = NULL
        _TABLE[OP_BXOR][dtypes[t]] = NULL
    _half_isa = isa
    return True


_build_table()
_set_half_rows(SHMT_ISA_BASE)
_set_half_rows(SHMT_ISA_AVX2)                   # where compiled in and the CPU has it


def half_isa(name=None):
    """The instruction set the float16/bfloat16 kernels run with: 'avx2' where the build has
    those kernels (x86-64, GCC or clang) and the CPU has AVX2, else 'baseline' (the build's own,
    SSE2 on x86-64).  Both give the same bits.  With a name (one of HALF_ISA_NAMES), switch to
    it first, for this process, for calls that start afterwards (tests and benchmarks compare
    the two); ValueError if it is not available here."""
    if name is not None:
        if name not in HALF_ISA_NAMES or not _set_half_rows(HALF_ISA_NAMES.index(name)):
            raise ValueError(f"16-bit kernels for {name!r} are not available here "
                             f"(known: {', '.join(HALF_ISA_NAMES)})")
    return HALF_ISA_NAMES[_half_isa]


def half_isas():
    """The instruction sets half_isa() can switch to here, baseline first."""
    return tuple(name for i, name in enumerate(HALF_ISA_NAMES)
                 if shmt_half_kernel(i, 0, 0) != NULL)


cdef reduce_fn get_kernel(int op, int dtype) noexcept nogil:
    if op < 0 or op >= N_OPS or dtype < 0 or dtype >= N_DTYPES:
        return NULL
    return _TABLE[op][dtype]


# ---------------------------------------------------------------------------------------------
# Layer 4: Python helpers
# ---------------------------------------------------------------------------------------------

# numpy dtype.str without its byte-order character -> DT_* code.
DTYPE_CODES = {
    'b1': DT_BOOL,
    'i1': DT_I1, 'i2': DT_I2, 'i4': DT_I4, 'i8': DT_I8,
    'u1': DT_U1, 'u2': DT_U2, 'u4': DT_U4, 'u8': DT_U8,
    'f2': DT_F2, 'f4': DT_F4, 'f8': DT_F8,
    'c8': DT_C8, 'c16': DT_C16,
    'bf16': DT_BF16,            # (not a dtype.str: bfloat16 is ml_dtypes', found by its name)
}

# The one op table, by name and by numpy ufunc -> OP_* code; everything else about ops derives
# from these two.
OP_CODES = {'sum': OP_SUM, 'prod': OP_PROD, 'min': OP_MIN, 'max': OP_MAX,
            'band': OP_BAND, 'bor': OP_BOR, 'bxor': OP_BXOR}
UFUNC_CODES = {np.add: OP_SUM, np.multiply: OP_PROD, np.minimum: OP_MIN, np.maximum: OP_MAX,
               np.bitwise_and: OP_BAND, np.bitwise_or: OP_BOR, np.bitwise_xor: OP_BXOR}

_OP_NAMES = {code: name for name, code in OP_CODES.items()}
assert sorted(_OP_NAMES) == sorted(UFUNC_CODES.values()) == list(range(N_OPS))
_OPS_TEXT = (", ".join(repr(name) for name in OP_CODES) + " or "
             + ", ".join(f"np.{ufunc.__name__}" for ufunc in UFUNC_CODES))
_BITWISE_OPS = (OP_BAND, OP_BOR, OP_BXOR)
_SUPPORTED_DTYPES = ("bool, int8, int16, int32, int64, uint8, uint16, uint32, uint64, "
                     "float16, bfloat16, float32, float64, complex64, complex128 (native byte "
                     "order)")


def dtype_code(dtype):
    """The DT_* code of `dtype` (anything np.dtype accepts); TypeError if it is not supported."""
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"shmtree cannot reduce dtype {dtype!r} ({exc}); "
                        f"supported: {_SUPPORTED_DTYPES}") from None
    if not dt.isnative:
        raise TypeError(f"shmtree cannot reduce dtype {dt.str!r}: non-native byte order; "
                        f"convert with .astype({dt.newbyteorder('=').str!r}) first; "
                        f"supported: {_SUPPORTED_DTYPES}")
    code = None
    if dt.fields is None and dt.subdtype is None:
        code = DT_BF16 if dt.name == "bfloat16" else DTYPE_CODES.get(dt.str[1:])
    if code is None:
        raise TypeError(f"shmtree cannot reduce dtype {dt!r}; supported: {_SUPPORTED_DTYPES}")
    return code


def op_code(op):
    """The OP_* code of `op`: a name in OP_CODES ('sum', 'prod', 'min', 'max', 'band', 'bor',
    'bxor') or a ufunc in UFUNC_CODES (np.add, np.multiply, np.minimum, np.maximum,
    np.bitwise_and, np.bitwise_or, np.bitwise_xor); ValueError for anything else."""
    if isinstance(op, str):
        if op in OP_CODES:
            return OP_CODES[op]
    else:
        for ufunc, code in UFUNC_CODES.items():    # by identity: op may be unhashable
            if op is ufunc:
                return code
    raise ValueError(f"unknown reduction op {op!r}: expected {_OPS_TEXT}")


def op_name(int code):
    """The name in OP_CODES of the OP_* code `code` (e.g. 'sum'); ValueError if there is none."""
    try:
        return _OP_NAMES[code]
    except KeyError:
        raise ValueError(f"unknown op code {code}: expected 0..{N_OPS - 1}") from None


def _unsupported_reason(int opc, dt):
    """Why (op code, dtype) has no kernel, for error messages."""
    if opc in _BITWISE_OPS:
        return "bitwise ops need an integer or bool dtype"
    if dt.kind == 'c':
        return "complex numbers have no order"
    return "no kernel for this pair"


def supported(int op_code, int dtype_code):
    """Whether a kernel exists for (op_code, dtype_code)."""
    return get_kernel(op_code, dtype_code) != NULL


def _check_operands(dst, srcs):
    """Raise unless dst is a writable array and srcs are arrays of dst's dtype and size, all
    C-contiguous and aligned (the kernels dereference typed pointers)."""
    if not isinstance(dst, np.ndarray):
        raise TypeError(f"dst must be a numpy array, not {type(dst).__name__}")
    if not dst.flags.c_contiguous or not dst.flags.writeable or not dst.flags.aligned:
        raise ValueError("dst must be a writable, aligned, C-contiguous array")
    if len(srcs) == 0:
        raise ValueError("srcs must hold at least one array")
    for j, src in enumerate(srcs):
        if not isinstance(src, np.ndarray):
            raise TypeError(f"srcs[{j}] must be a numpy array, not {type(src).__name__}")
        if src.dtype != dst.dtype:
            raise TypeError(f"srcs[{j}] has dtype {src.dtype}, dst has {dst.dtype}")
        if src.size != dst.size:
            raise ValueError(f"srcs[{j}] has {src.size} items, dst has {dst.size}")
        if not src.flags.c_contiguous or not src.flags.aligned:
            raise ValueError(f"srcs[{j}] must be an aligned, C-contiguous array")


cdef bint _overlaps(const Py_buffer *a, const Py_buffer *b) noexcept:
    cdef const char *pa = <const char *>a.buf
    cdef const char *pb = <const char *>b.buf
    return a.len > 0 and b.len > 0 and pa < pb + b.len and pb < pa + a.len


def reduce_into(dst, srcs, op):
    """dst[...] = srcs[0] op srcs[1] op ... (left to right), elementwise, with the GIL released.

    dst: writable, aligned, C-contiguous numpy array; srcs: non-empty sequence of aligned,
    C-contiguous arrays of dst's dtype and size (shapes may differ).  dst may be srcs[0] (in
    place) but may not otherwise overlap a source.
    op: as for op_code.  TypeError for an unsupported dtype or (op, dtype) pair: min/max of
    complex, band/bor/bxor of float or complex.
    """
    cdef int opc = op_code(op)
    srcs = tuple(srcs)
    _check_operands(dst, srcs)
    cdef int dtc = dtype_code(dst.dtype)
    cdef reduce_fn fn = get_kernel(opc, dtc)
    if fn == NULL:
        raise TypeError(f"op {op_name(opc)!r} is not supported for dtype {dst.dtype} "
                        f"({_unsupported_reason(opc, dst.dtype)})")
    cdef int nsrc = len(srcs)
    cdef Py_ssize_t n = dst.size
    # views[0] is dst, views[1 + j] is srcs[j]
    cdef Py_buffer *views = <Py_buffer *>PyMem_Calloc(nsrc + 1, sizeof(Py_buffer))
    cdef const void **ptrs = <const void **>PyMem_Calloc(nsrc, sizeof(void *))
    cdef int held = 0, j
    try:
        if views == NULL or ptrs == NULL:
            raise MemoryError()
        PyObject_GetBuffer(dst, &views[0], PyBUF_WRITABLE)
        held = 1
        for j in range(nsrc):
            PyObject_GetBuffer(srcs[j], &views[1 + j], PyBUF_SIMPLE)
            held += 1
            ptrs[j] = views[1 + j].buf
            if (views[1 + j].buf != views[0].buf or j > 0) and _overlaps(&views[0],
                                                                     &views[1 + j]):
                raise ValueError(f"dst overlaps srcs[{j}]; only dst is srcs[0] is allowed")
        with nogil:
            fn(views[0].buf, ptrs, nsrc, n)
    finally:
        for j in range(held):
            PyBuffer_Release(&views[j])
        PyMem_Free(views)
        PyMem_Free(ptrs)
    return dst
