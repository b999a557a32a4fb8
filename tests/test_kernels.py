"""Reduction kernels (shmtree/_kernels.pyx) against numpy.

The contract: reduce_into(dst, srcs, op) leaves in dst what
`ufunc.reduce(np.stack(srcs), axis=0, dtype=dtype)` computes, for every supported dtype and op,
in place (dst is srcs[0]) and out of place.  Integers, bool, min/max and the bitwise ops must match
exactly; float sums and products up to rounding (float16 is accumulated in float32 and rounded
once, which the float16 tests below pin down bit for bit).  One deliberate difference: float
min/max order -0.0 below +0.0 (IEEE 754-2019 minimum/maximum) whatever the operand order, where
numpy returns one of the tied operands; test_signed_zero_rule pins that down.
"""
import itertools

import numpy as np
import pytest

from shmtree import _kernels as K

DTYPES = ['b1', 'i1', 'i2', 'i4', 'i8', 'u1', 'u2', 'u4', 'u8', 'f2', 'f4', 'f8', 'c8', 'c16']
UFUNCS = {'sum': np.add, 'prod': np.multiply, 'min': np.minimum, 'max': np.maximum,
          'band': np.bitwise_and, 'bor': np.bitwise_or, 'bxor': np.bitwise_xor}
BITWISE = ('band', 'bor', 'bxor')
SIZES = [0, 1, 7, 4099, 65537]
NSRCS = [1, 2, 3, 8]
RTOL = {'f': {2: 1e-2, 4: 1e-5, 8: 1e-12}, 'c': {8: 1e-5, 16: 1e-12}}


def numpy_reduce(op, srcs):
    dtype = srcs[0].dtype
    return UFUNCS[op].reduce(np.stack(srcs), axis=0, dtype=dtype)


def random_inputs(rng, dtype, op, size, nsrc):
    """nsrc arrays: full-range integers (so sums and products wrap), 0/1 bools, small integers
    as floats, or values k/64 near 1 for float products (no overflow to inf)."""
    dt = np.dtype(dtype)
    shape = (nsrc, size)
    if dt.kind == 'b':
        vals = rng.integers(0, 2, shape).astype(bool)
    elif dt.kind in 'iu':
        info = np.iinfo(dt)
        vals = rng.integers(info.min, info.max, shape, dtype=dt, endpoint=True)
    else:
        part = dt.type(0).real.dtype

        def draw():
            if op == 'prod':
                return (1 + rng.integers(-8, 9, shape) / 64).astype(part)
            return rng.integers(-50, 51, shape).astype(part)

        vals = draw() if dt.kind == 'f' else draw() + 1j * draw()
    return [np.ascontiguousarray(v, dtype=dt) for v in vals]


def assert_matches(got, expected, op):
    dt = got.dtype
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if dt.kind in 'fc' and op in ('sum', 'prod'):
        np.testing.assert_allclose(got, expected, rtol=RTOL[dt.kind][dt.itemsize], atol=0)
    else:
        np.testing.assert_array_equal(got, expected)   # NaN equals NaN here


def is_supported(dtype, op):
    """The kernels' table: min/max need an order (not complex), bitwise ops integers or bool."""
    if op in BITWISE:
        return dtype[0] in 'biu' and dtype != 'bf16'
    if op in ('min', 'max'):
        return dtype[0] != 'c'
    return True


def grid():
    for dtype in DTYPES:
        for op in UFUNCS:
            if is_supported(dtype, op):
                yield dtype, op


def unsupported():
    return [(dtype, op) for dtype in DTYPES for op in UFUNCS if not is_supported(dtype, op)]


@pytest.mark.parametrize('inplace', [False, True], ids=['out', 'inplace'])
@pytest.mark.parametrize('nsrc', NSRCS)
@pytest.mark.parametrize('size', SIZES)
@pytest.mark.parametrize('dtype,op', list(grid()))
def test_matches_numpy(dtype, op, size, nsrc, inplace):
    rng = np.random.default_rng([DTYPES.index(dtype), size, nsrc])
    srcs = random_inputs(rng, dtype, op, size, nsrc)
    expected = numpy_reduce(op, srcs)
    dst = srcs[0] if inplace else np.empty_like(srcs[0])
    assert K.reduce_into(dst, srcs, op) is dst
    assert_matches(dst, expected, op)


@pytest.mark.parametrize('dtype', ['f2', 'f4', 'f8'])
@pytest.mark.parametrize('op', ['min', 'max'])
@pytest.mark.parametrize('nsrc', [2, 3, 8])
def test_nan_propagates_in_min_max(dtype, op, nsrc):
    rng = np.random.default_rng(nsrc)
    size = 1000
    srcs = random_inputs(rng, dtype, op, size, nsrc)
    # NaN in a random source at every 3rd position; at every 7th, NaN in all sources.
    for i in range(0, size, 3):
        srcs[rng.integers(nsrc)][i] = np.nan
    for s in srcs:
        s[::7] = np.nan
    expected = numpy_reduce(op, srcs)
    dst = np.empty_like(srcs[0])
    K.reduce_into(dst, srcs, UFUNCS[op])
    assert np.isnan(dst[::3]).all()
    np.testing.assert_array_equal(dst, expected)


def signed_zero_reference(op, srcs):
    """The rule: NaN if any operand is NaN; else numpy's value, with the sign bit of the IEEE
    minimum (set if any operand's is: -0.0 is below +0.0) or maximum (set only if every
    operand's is)."""
    stack = np.stack(srcs)
    value = numpy_reduce(op, srcs)
    sign = np.signbit(stack).any(axis=0) if op == 'min' else np.signbit(stack).all(axis=0)
    nan = np.isnan(stack).any(axis=0)
    return value, sign, nan


def check_signed_zero_rule(dst, op, srcs):
    value, sign, nan = signed_zero_reference(op, srcs)
    np.testing.assert_array_equal(np.isnan(dst), nan)
    ok = ~nan
    np.testing.assert_array_equal(dst[ok], value[ok])      # == does not see the sign of zero
    np.testing.assert_array_equal(np.signbit(dst[ok]), sign[ok])


@pytest.mark.parametrize('dtype', ['f2', 'f4', 'f8'])
@pytest.mark.parametrize('op', ['min', 'max'])
@pytest.mark.parametrize('nsrc', [2, 3, 4, 5])
def test_signed_zero_rule(dtype, op, nsrc):
    # Every sequence of nsrc values from {-0.0, +0.0, NaN, -1, 1} is one column (3125 columns
    # for nsrc = 5: odd, and beyond any vector width and block), so every order and mix of
    # signed zeros, with and without NaN and non-zero values, meets both loops and the tail.
    values = np.array([-0.0, 0.0, np.nan, -1.0, 1.0], dtype)
    columns = np.array(list(itertools.product(range(len(values)), repeat=nsrc))).T
    srcs = [np.ascontiguousarray(values[c]) for c in columns]
    # Permuting the sources must not change a single bit (NaNs aside, which only need to stay
    # NaN): the result is independent of the order in which operands meet.
    perms = list(itertools.permutations(range(nsrc)))
    perms = perms if len(perms) <= 24 else perms[::7]
    first = None
    for perm in perms:
        ordered = [srcs[j] for j in perm]
        for inplace in (False, True):
            copies = [s.copy() for s in ordered]
            dst = copies[0] if inplace else np.empty_like(copies[0])
            K.reduce_into(dst, copies, op)
            check_signed_zero_rule(dst, op, ordered)
            bits = dst.view(f'u{dst.itemsize}')
            if first is None:
                first = bits.copy()
            nan = np.isnan(dst)
            np.testing.assert_array_equal(bits[~nan], first[~nan])


@pytest.mark.parametrize('dtype', ['f2', 'f4', 'f8'])
@pytest.mark.parametrize('op', ['min', 'max'])
def test_signed_zero_ties_either_order(dtype, op):
    # The rule at its simplest, against the literal values: min(-0, +0) = min(+0, -0) = -0 and
    # max(-0, +0) = max(+0, -0) = +0, out of place and in place, for a long array (both the
    # vector loop and its tail).
    n = 1001
    neg, pos = np.full(n, -0.0, dtype), np.full(n, 0.0, dtype)
    want_sign = op == 'min'
    for srcs in ([neg, pos], [pos, neg], [pos, neg, pos], [neg, pos, neg], [pos, pos, neg, pos]):
        for inplace in (False, True):
            copies = [s.copy() for s in srcs]
            dst = copies[0] if inplace else np.empty_like(copies[0])
            K.reduce_into(dst, copies, op)
            assert (dst == 0).all()
            assert (np.signbit(dst) == want_sign).all(), (op, [np.signbit(s[0]) for s in srcs])


@pytest.mark.parametrize('dtype', ['f4', 'f8'])
@pytest.mark.parametrize('op', ['min', 'max'])
def test_min_max_specials_pairwise(dtype, op):
    # Every pair of special values in both orders (zeros, subnormals, extremes, infinities,
    # NaNs with either sign): the value is numpy's, the sign the IEEE rule's.
    info = np.finfo(dtype)
    base = [0.0, info.smallest_subnormal, info.tiny, 1.0, info.max, np.inf, np.nan]
    values = np.array(base + [-v for v in base], dtype)
    a, b = (np.ascontiguousarray(x.ravel()) for x in np.meshgrid(values, values))
    for srcs in ([a, b], [b, a]):
        dst = np.empty_like(a)
        K.reduce_into(dst, srcs, op)
        check_signed_zero_rule(dst, op, srcs)


WRAP_CASES = [
    ('i1', 'sum', [127, 1], -128),
    ('i1', 'sum', [-128, -1], 127),
    ('u1', 'sum', [255, 1], 0),
    ('i1', 'prod', [-128, -1], -128),
    ('i2', 'prod', [256, 256], 0),
    ('i2', 'prod', [182, 182], 33124 - 65536),
    ('u2', 'prod', [65535, 65535], 1),                    # an int multiply in C would overflow
    ('i4', 'sum', [2**31 - 1, 1], -2**31),
    ('i4', 'prod', [65536, 65536], 0),
    ('u4', 'prod', [2**32 - 1, 2**32 - 1], 1),
    ('i8', 'sum', [2**63 - 1, 1], -2**63),
    ('i8', 'prod', [-2**63, -1], -2**63),
    ('u8', 'sum', [2**64 - 1, 2], 1),
    ('u8', 'prod', [2**64 - 1, 2**64 - 1], 1),
    ('i1', 'sum', [100, 100, 100], 44),
]


@pytest.mark.parametrize('dtype,op,values,result', WRAP_CASES)
def test_integer_wraparound(dtype, op, values, result):
    n = 37   # both the vector loop and its scalar tail
    srcs = [np.full(n, v, dtype=dtype) for v in values]
    expected = numpy_reduce(op, srcs)
    assert (expected == result).all()
    dst = np.empty_like(srcs[0])
    K.reduce_into(dst, srcs, op)
    np.testing.assert_array_equal(dst, expected)


@pytest.mark.parametrize('op,truth', [
    ('sum', [0, 1, 1, 1]), ('max', [0, 1, 1, 1]), ('bor', [0, 1, 1, 1]),     # logical or
    ('prod', [0, 0, 0, 1]), ('min', [0, 0, 0, 1]), ('band', [0, 0, 0, 1]),   # logical and
    ('bxor', [0, 1, 1, 0]),                                                  # logical xor
])
def test_bool_ops(op, truth):
    a = np.array([0, 0, 1, 1] * 9, bool)
    b = np.array([0, 1, 0, 1] * 9, bool)
    dst = np.empty_like(a)
    K.reduce_into(dst, [a, b], op)
    np.testing.assert_array_equal(dst, np.array(truth * 9, bool))
    np.testing.assert_array_equal(dst, numpy_reduce(op, [a, b]))
    # three inputs, and the stored bytes stay 0/1
    K.reduce_into(dst, [a, b, b], op)
    np.testing.assert_array_equal(dst, numpy_reduce(op, [a, b, b]))
    assert set(np.unique(dst.view(np.uint8))) <= {0, 1}


@pytest.mark.parametrize('dtype', ['c8', 'c16'])
def test_complex_prod_exact(dtype):
    vals = [1 + 2j, 3 + 4j, 0.5 - 1j, -2 + 0.25j]   # every product is exact in binary
    srcs = [np.full(21, v, dtype) for v in vals]
    dst = np.empty_like(srcs[0])
    K.reduce_into(dst, srcs, 'prod')
    expected = (1 + 2j) * (3 + 4j) * (0.5 - 1j) * (-2 + 0.25j)
    np.testing.assert_array_equal(dst, np.full(21, expected, dtype))
    np.testing.assert_array_equal(dst, numpy_reduce('prod', srcs))


@pytest.fixture(params=K.half_isas())
def isa(request):
    """Run a 16-bit test with the kernels of every instruction set this build and CPU have
    (baseline, and avx2 where available), then restore the default."""
    default = K.half_isa()
    K.half_isa(request.param)
    yield request.param
    K.half_isa(default)


def test_half_isa_switches():
    default = K.half_isa()
    assert K.half_isas()[0] == 'baseline' and default == K.half_isas()[-1]
    try:
        for name in K.half_isas():
            assert K.half_isa(name) == name == K.half_isa()
    finally:
        K.half_isa(default)
    with pytest.raises(ValueError, match="not available"):
        K.half_isa('sse9')
    assert K.half_isa() == default


def half_reference(op, srcs):
    """The float16 contract: widen to float32, reduce left to right in float32, round once."""
    acc = srcs[0].astype(np.float32)
    for s in srcs[1:]:
        acc = UFUNCS[op](acc, s.astype(np.float32))
    return acc.astype(np.float16)


def assert_same_half_bits(got, expected):
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got.view(np.uint16)[~nan], expected.view(np.uint16)[~nan])


@pytest.mark.parametrize('op', ['sum', 'prod'])
@pytest.mark.parametrize('nsrc', [2, 3, 8])
def test_float16_every_bit_pattern(op, nsrc, isa):
    # Every half value (zeros, subnormals, normals, infinities, NaNs) in every source, in random
    # pairings: exercises both conversions and round-to-nearest-even, subnormal results included.
    rng = np.random.default_rng(nsrc)
    everything = np.arange(2**16, dtype=np.uint16)
    srcs = [rng.permutation(everything).view(np.float16) for _ in range(nsrc)]
    dst = np.empty_like(srcs[0])
    with np.errstate(all='ignore'):
        expected = half_reference(op, srcs)
    K.reduce_into(dst, srcs, op)
    assert_same_half_bits(dst, expected)


def test_float16_rounds_once(isa):
    # 2048 + 1 + 1: rounding after each add (numpy's float16 loop) gives 2048; we give 2050.
    srcs = [np.full(9, v, np.float16) for v in (2048, 1, 1)]
    dst = np.empty_like(srcs[0])
    K.reduce_into(dst, srcs, 'sum')
    np.testing.assert_array_equal(dst, np.full(9, 2050, np.float16))
    # overflow to inf, and subnormal results rounded to nearest even
    big = [np.full(3, v, np.float16) for v in (60000, 10000)]
    K.reduce_into(dst[:3], big, 'sum')
    assert np.isposinf(dst[:3]).all()
    tiny = np.array([2**-24, 3 * 2**-24, 2**-14], np.float16)
    half = np.full(3, 0.5, np.float16)
    K.reduce_into(dst[:3], [tiny, half], 'prod')
    np.testing.assert_array_equal(dst[:3], np.array([0, 2 * 2**-24, 2**-15], np.float16))


def bfloat16():
    return pytest.importorskip('ml_dtypes').bfloat16


def ieee_fold(op, a, b):
    """float32 a op b as the kernels compute it: numpy's, except that min/max order -0.0 below
    +0.0 whatever the operand order."""
    r = UFUNCS[op](a, b)
    if op in ('min', 'max'):
        sa, sb = np.signbit(a), np.signbit(b)
        neg = (sa | sb) if op == 'min' else (sa & sb)
        r = np.where((a == 0) & (b == 0), np.where(neg, np.float32(-0.0), np.float32(0.0)), r)
    return r


def bf16_reference(op, srcs):
    """The bfloat16 contract: widen to float32, fold left to right in float32, round once to
    nearest even (ml_dtypes' float32 -> bfloat16 conversion)."""
    acc = srcs[0].astype(np.float32)
    with np.errstate(all='ignore'):
        for s in srcs[1:]:
            acc = ieee_fold(op, acc, s.astype(np.float32))
        return acc.astype(srcs[0].dtype)


def assert_same_bf16_bits(got, expected):
    """Bit for bit, except that a NaN may be any NaN; it must come out quiet (bits 0x7fc0 set:
    exponent all ones and the quiet bit)."""
    bits, want = got.view(np.uint16), expected.view(np.uint16)
    nan = (want & 0x7fff) > 0x7f80
    np.testing.assert_array_equal((bits & 0x7fff) > 0x7f80, nan)
    np.testing.assert_array_equal(bits[~nan], want[~nan])
    assert ((bits[nan] & 0x7fc0) == 0x7fc0).all(), "a NaN came out signaling"


@pytest.mark.parametrize('inplace', [False, True], ids=['out', 'inplace'])
@pytest.mark.parametrize('nsrc', [2, 3, 4, 8])
@pytest.mark.parametrize('op', ['sum', 'prod', 'min', 'max'])
def test_bfloat16_every_bit_pattern(op, nsrc, inplace, isa):
    # Every bfloat16 value (zeros, subnormals, normals, infinities, quiet and signaling NaNs with
    # every payload) in every source, in random pairings: both conversions, rounding to nearest
    # even, overflow to inf, subnormal results; 65536 elements are many blocks of the
    # more-than-two-sources path, and 2 sources take the one-pass path.
    bf = bfloat16()
    rng = np.random.default_rng([nsrc, 16])
    everything = np.arange(2**16, dtype=np.uint16)
    srcs = [rng.permutation(everything).view(bf) for _ in range(nsrc)]
    expected = bf16_reference(op, srcs)
    dst = srcs[0] if inplace else np.empty_like(srcs[0])
    K.reduce_into(dst, srcs, op)
    assert_same_bf16_bits(dst, expected)


def bf16_specials():
    """bfloat16 bit patterns at the edges of every class, both signs: exponents 0 (zero and
    subnormals), 1, 126, 127, 128, 253, 254 (largest finite) and 255 (inf, NaNs), mantissas
    0, 1, 0x3f, 0x40 (the quiet bit), 0x41, 0x7f."""
    return np.array([sign | exp << 7 | man for sign in (0, 0x8000)
                     for exp in (0, 1, 126, 127, 128, 253, 254, 255)
                     for man in (0, 1, 0x3f, 0x40, 0x41, 0x7f)], np.uint16)


@pytest.mark.parametrize('op', ['sum', 'prod', 'min', 'max'])
def test_bfloat16_special_values_every_pair(op, isa):
    bf = bfloat16()
    sp = bf16_specials()
    a, b = (x.ravel().copy().view(bf) for x in np.meshgrid(sp, sp, indexing='ij'))
    for srcs in ([a, b], [a, b, a], [a, b, b, a]):
        dst = np.empty_like(a)
        K.reduce_into(dst, srcs, op)
        assert_same_bf16_bits(dst, bf16_reference(op, srcs))


def test_bfloat16_ties_round_to_even_once(isa):
    bf = bfloat16()

    def run(op, *columns):
        srcs = [np.array(c, np.float32).astype(bf) for c in columns]
        dst = np.empty_like(srcs[0])
        K.reduce_into(dst, srcs, op)
        return dst.astype(np.float32)

    big = float(np.array(0x7f7f, np.uint16).view(bf))           # largest finite bfloat16
    # a + b exactly halfway between two bfloat16 values: to the even one.
    got = run('sum', [1, 1 + 2**-7, 2 - 2**-7, -1, big, big, 3],
                     [2**-8, 2**-8, 2**-8, -2**-8, 2.0**119, 2.0**118, 2**-7])
    np.testing.assert_array_equal(got, [1, 1 + 2**-6, 2, -1, np.inf, big, 3])
    # rounded once, not after every add: 1 + 2^-8 + 2^-8 is 1 + 2^-7, not 1
    np.testing.assert_array_equal(run('sum', [1, -1], [2**-8, -2**-8], [2**-8, -2**-8]),
                                  [1 + 2**-7, -1 - 2**-7])
    # products halfway between subnormals: 2^-134 to 0 (even), 1.5 * 2^-133 up to 2^-132
    np.testing.assert_array_equal(run('prod', [2.0**-133, 3 * 2.0**-133, -3 * 2.0**-133],
                                      [0.5, 0.5, 0.5]),
                                  [0, 2.0**-132, -2.0**-132])
    assert np.signbit(run('prod', [-(2.0**-133)], [0.5])[0])          # -0, not +0


@pytest.mark.parametrize('nsrc', [2, 3, 5])
@pytest.mark.parametrize('dtype', ['bf16', 'f2'])
def test_16bit_odd_lengths_and_unaligned_starts(dtype, nsrc, isa):
    # The 16-bit kernels load and store two elements at a time: odd lengths (a last element on
    # its own), starts at odd elements (words on 2-byte boundaries), lengths around the block of
    # the more-than-two-sources path; nothing outside dst is written.
    dt = bfloat16() if dtype == 'bf16' else np.dtype(np.float16)
    rng = np.random.default_rng([nsrc, 2])
    guard = np.uint16(0x3e00)
    for n in list(range(0, 18)) + [2047, 2048, 2049, 2050, 4097]:
        for dst_off, src_off in ((0, 0), (1, 0), (0, 1), (1, 1), (3, 2)):
            bufs = [rng.standard_normal(n + 8).astype(np.float32).astype(dt)
                    for _ in range(nsrc)]
            srcs = [b[(src_off + j) % 4:][:n] for j, b in enumerate(bufs)]
            expected = bf16_reference('sum', srcs) if dtype == 'bf16' else half_reference(
                'sum', srcs)
            out = np.full(n + 8, guard, np.uint16)
            dst = out[dst_off:dst_off + n].view(dt)
            K.reduce_into(dst, srcs, 'sum')
            assert dst.view(np.uint16).tolist() == expected.view(np.uint16).tolist(), (n, dst_off)
            assert (out[:dst_off] == guard).all() and (out[dst_off + n:] == guard).all()
            # in place: dst is srcs[0]
            before = bufs[0].copy()
            K.reduce_into(srcs[0], srcs, 'sum')
            assert srcs[0].view(np.uint16).tolist() == expected.view(np.uint16).tolist()
            lo = src_off % 4
            assert before[:lo].view(np.uint16).tolist() == bufs[0][:lo].view(np.uint16).tolist()
            assert (before[lo + n:].view(np.uint16).tolist()
                    == bufs[0][lo + n:].view(np.uint16).tolist())


@pytest.mark.parametrize('byname', [True, False], ids=['name', 'ufunc'])
@pytest.mark.parametrize('dtype,op', unsupported())
def test_unsupported_pairs(dtype, op, byname):
    # min/max of complex (no order) and bitwise ops of float or complex raise TypeError, saying
    # why, and leave dst alone.
    a = np.ones(5, dtype)
    dst = np.zeros_like(a)
    why = 'bitwise ops need an integer or bool dtype' if op in BITWISE else 'no order'
    with pytest.raises(TypeError, match=f"op '{op}' is not supported for dtype .*{why}"):
        K.reduce_into(dst, [a, a], op if byname else UFUNCS[op])
    assert (dst == 0).all()
    assert not K.supported(K.op_code(op), K.dtype_code(dtype))


def test_supported_table():
    assert len(unsupported()) == 2 * 2 + 3 * 5      # complex min/max; float, complex bitwise
    for dtype, code in K.DTYPE_CODES.items():
        for op, opc in K.OP_CODES.items():
            assert K.supported(opc, code) == is_supported(dtype, op), (dtype, op)
    assert not K.supported(-1, 0)
    assert not K.supported(len(K.OP_CODES), 0)
    assert not K.supported(0, -1)
    assert not K.supported(0, len(K.DTYPE_CODES))


def test_dtype_code_accepts_numpy_spellings():
    assert sorted(K.DTYPE_CODES.values()) == list(range(15))
    for key, code in K.DTYPE_CODES.items():
        if key == 'bf16':                   # (ml_dtypes' bfloat16: found by its name)
            ml_dtypes = pytest.importorskip("ml_dtypes")
            assert K.dtype_code(ml_dtypes.bfloat16) == K.dtype_code(np.dtype('bfloat16')) == code
            continue
        assert K.dtype_code(key) == code
        assert K.dtype_code(np.dtype(key)) == code
    assert K.dtype_code(np.float32) == K.DTYPE_CODES['f4']
    assert K.dtype_code('float16') == K.DTYPE_CODES['f2']
    assert K.dtype_code(bool) == K.DTYPE_CODES['b1']
    assert K.dtype_code(np.intc) == K.DTYPE_CODES['i4']
    assert K.dtype_code(np.dtype('i8').newbyteorder('=')) == K.DTYPE_CODES['i8']


NON_NATIVE = '>i4' if np.little_endian else '<i4'


@pytest.mark.parametrize('dtype', [
    object, 'U5', 'S3', 'V8', [('a', 'i4'), ('b', 'f8')], ('i4', (2,)), 'M8[ns]', 'm8[s]',
    np.longdouble, np.clongdouble, NON_NATIVE, 'no such dtype',
])
def test_dtype_code_rejects(dtype):
    if np.dtype(np.longdouble).itemsize == 8 and dtype in (np.longdouble, np.clongdouble):
        pytest.skip('long double is double on this platform')
    with pytest.raises(TypeError, match='supported: bool, int8'):
        K.dtype_code(dtype)


def test_op_code():
    assert K.OP_CODES == {'sum': 0, 'prod': 1, 'min': 2, 'max': 3,
                          'band': 4, 'bor': 5, 'bxor': 6}
    assert K.UFUNC_CODES == {np.add: 0, np.multiply: 1, np.minimum: 2, np.maximum: 3,
                             np.bitwise_and: 4, np.bitwise_or: 5, np.bitwise_xor: 6}
    assert list(UFUNCS) == list(K.OP_CODES)
    for name, ufunc in UFUNCS.items():
        assert K.op_code(name) == K.OP_CODES[name]
        assert K.op_code(ufunc) == K.OP_CODES[name]
        assert K.op_name(K.OP_CODES[name]) == name


@pytest.mark.parametrize('code', [-1, 7, 100])
def test_op_name_rejects(code):
    with pytest.raises(ValueError, match='unknown op code'):
        K.op_name(code)


@pytest.mark.parametrize('op', ['mean', 'SUM', '', 'and', np.subtract, np.logical_or,
                                np.logical_xor, np.invert, None, 0, [], {}, sum])
def test_op_code_rejects(op):
    # The message lists every op, by name and by ufunc.
    every = ("'sum', 'prod', 'min', 'max', 'band', 'bor', 'bxor' or np.add, np.multiply, "
             "np.minimum, np.maximum, np.bitwise_and, np.bitwise_or, np.bitwise_xor")
    with pytest.raises(ValueError, match='unknown reduction op') as exc:
        K.op_code(op)
    assert exc.value.args[0].endswith('expected ' + every)
    with pytest.raises(ValueError, match='unknown reduction op'):
        K.reduce_into(np.zeros(2), [np.zeros(2)], op)


def test_shapes_are_flattened():
    # Only the item count has to agree; 0-d arrays are one item.
    a = np.arange(12.0).reshape(3, 4)
    b = np.arange(12.0)
    dst = np.empty((2, 6))
    K.reduce_into(dst, [a, b], 'sum')
    np.testing.assert_array_equal(dst.ravel(), 2 * b)
    s = np.array(3, np.int16)
    K.reduce_into(s, [s, np.array(4, np.int16)], 'prod')
    assert s == 12


def test_read_only_sources_and_tuple():
    a = np.arange(10, dtype=np.uint32)
    a.flags.writeable = False
    dst = np.empty_like(a)
    K.reduce_into(dst, (a, a), np.add)
    np.testing.assert_array_equal(dst, 2 * a)


def test_reduce_into_rejects_bad_operands():
    a = np.arange(10.0)
    with pytest.raises(TypeError, match='numpy array'):
        K.reduce_into([0.0] * 10, [a], 'sum')
    with pytest.raises(TypeError, match='numpy array'):
        K.reduce_into(np.empty(10), [a, list(a)], 'sum')
    with pytest.raises(TypeError, match='dtype'):
        K.reduce_into(np.empty(10), [a, a.astype(np.float32)], 'sum')
    with pytest.raises(TypeError, match='supported'):
        K.reduce_into(np.empty(10, object), [a.astype(object)], 'sum')
    with pytest.raises(ValueError, match='items'):
        K.reduce_into(np.empty(10), [a, a[:9].copy()], 'sum')
    with pytest.raises(ValueError, match='C-contiguous'):
        K.reduce_into(np.empty(5), [a[::2], a[::2]], 'sum')
    with pytest.raises(ValueError, match='C-contiguous'):
        K.reduce_into(np.empty((4, 4)).T, [np.ones((4, 4))], 'sum')
    with pytest.raises(ValueError, match='at least one'):
        K.reduce_into(np.empty(10), [], 'sum')
    ro = np.empty(10)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match='writable'):
        K.reduce_into(ro, [a], 'sum')


def test_reduce_into_rejects_overlap():
    buf = np.arange(20.0)
    other = np.ones(10)
    with pytest.raises(ValueError, match='overlaps srcs\\[1\\]'):
        K.reduce_into(buf[:10], [other, buf[5:15]], 'sum')
    with pytest.raises(ValueError, match='overlaps srcs\\[1\\]'):
        K.reduce_into(buf[:10], [buf[:10], buf[:10]], 'sum')   # only srcs[0] may be dst
    with pytest.raises(ValueError, match='overlaps srcs\\[0\\]'):
        K.reduce_into(buf[:10], [buf[1:11], other], 'sum')
    np.testing.assert_array_equal(buf, np.arange(20.0))      # nothing written


def test_reduce_into_rejects_misaligned():
    raw = np.zeros(8 * 11, np.uint8)
    mis = raw[1:81].view(np.float64)
    assert not mis.flags.aligned
    with pytest.raises(ValueError, match='aligned'):
        K.reduce_into(np.empty(10), [mis, mis], 'sum')
