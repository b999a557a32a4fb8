"""Every rank gets the same bits, NaN payloads included (DESIGN sections 5 and 8): a reduction of
NaNs with distinct payloads on each rank gives bit-identical results on every rank, in place and
not, for private arrays and for shared ones (the single copy), whatever loop a kernel takes.

The kernels' rule (shmtree/_kernels.pxd): when the first operand of an op is a NaN, the result is
that NaN, quieted; otherwise what the hardware gives for the other operand (its NaN quieted, or
the default NaN of an invalid operation), so the bits depend on the operands and their order
only - not on which operand the compiler put first, nor on whether the output is an input.
"""
import hashlib

import numpy as np
import pytest

from procutil import run_ok

ml_dtypes = pytest.importorskip("ml_dtypes")

DTYPES = ("float16", "bfloat16", "float32", "float64", "complex64", "complex128")
SIZES = (7, 1001, 40003)         # inline, inline over several pieces, the bandwidth channel
SMALL_BYTES = 65536


def dtype_of(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
QUIET = {2: {"float16": 0x7e00, "bfloat16": 0x7fc0}, 4: 0x7fc00000, 8: 0x7ff8000000000000}
SIGNALING = {2: {"float16": 0x7c00, "bfloat16": 0x7f80}, 4: 0x7f800000, 8: 0x7ff0000000000000}


def nan_bits(name, width, quiet, payload, negative):
    q = (QUIET if quiet else SIGNALING)[width]
    if width == 2:
        q = q[name]
    sign = 1 << (8 * width - 1)
    return (q | payload) | (sign if negative else 0)


def make(name, op, n, rank, P):
    """Rank `rank`'s input: exact small values (sums and products of them are exact in every
    dtype), and NaNs by position: i % 5 == 1 a quiet NaN on one rank only, == 2 quiet NaNs with
    a payload and sign of each rank's own on every rank, == 3 signaling NaNs likewise, == 4 a
    NaN on every rank but the first."""
    dt = dtype_of(name)
    real = dt.kind == "c"
    width = dt.itemsize // 2 if real else dt.itemsize
    ut = UINT[width]
    i = np.arange(n)
    vals = np.where(op == "prod", np.where((i + rank) % 3 == 0, 2.0, 1.0),
                    ((i * 7 + rank * 3) % 9) - 4.0)
    parts = 2 if real else 1
    out = np.empty((n, parts), dtype=dtype_of("float32") if name in ("float16", "bfloat16")
                   else (np.float32 if width == 4 else np.float64))
    out[:] = vals[:, None]
    out = out.astype(dt if not real else (np.float32 if width == 4 else np.float64))
    bits = out.view(ut).copy()
    k = i % 5
    for part in range(parts):
        payload = rank + 1 + 4 * part
        neg = bool((rank + part) % 2)
        one = (k == 1) & ((i // 5) % P == rank)
        bits[one, part] = nan_bits(name, width, True, payload, neg)
        bits[k == 2, part] = nan_bits(name, width, True, payload, neg)
        bits[k == 3, part] = nan_bits(name, width, False, payload, neg)
        if rank > 0:
            bits[k == 4, part] = nan_bits(name, width, True, payload + 8, not neg)
    return bits.view(dt).reshape(n)


def ops(name):
    return ("sum", "prod") if name.startswith("complex") else ("sum", "prod", "min", "max")


def worker(comm):
    """Per case, a digest of the result's bytes; rank 0 also checks the values against numpy
    (NaN where numpy has one; elsewhere exactly numpy's value)."""
    P, r = comm.size, comm.rank
    digests, wrong = {}, []
    for name in DTYPES:
        dt = dtype_of(name)
        for op in ops(name):
            for n in SIZES:
                x = make(name, op, n, r, P)
                for shared in (False, True):
                    for inplace in (False, True):
                        a = comm.zeros(n, dt) if shared else np.empty(n, dt)
                        a[...] = x
                        if inplace:
                            got = comm.allreduce(a, op, out=a)
                        elif shared:
                            got = comm.allreduce(a, op, out=comm.zeros(n, dt))
                        else:
                            got = comm.allreduce(a, op)
                        key = (name, op, n, shared, inplace)
                        digests[key] = hashlib.sha256(got.tobytes()).hexdigest()
                        if r == 0 and not (shared or inplace):
                            problem = check(name, op, got, [make(name, op, n, q, P)
                                                            for q in range(P)])
                            if problem:
                                wrong.append((key, problem))
    return digests, wrong


def check(name, op, got, inputs):
    dt = dtype_of(name)
    wide = np.stack([x.astype(np.float32) if dt.itemsize == 2 else x for x in inputs])
    ufunc = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[op]
    with np.errstate(invalid="ignore"):
        want = ufunc.reduce(wide, axis=0)
    got_w = got.astype(np.float32) if dt.itemsize == 2 else got
    nan_in = np.isnan(wide).any(axis=0)
    if dt.kind != "c" and not np.array_equal(np.isnan(got_w), np.isnan(want)):
        return "NaNs where numpy has none, or none where it has"
    ok = ~nan_in
    if not np.array_equal(got_w[ok], want.astype(got_w.dtype)[ok]):
        return "values differ from numpy's"
    return None


@pytest.mark.timeout(600)
@pytest.mark.parametrize("P", [2, 3])
def test_nan_payloads_same_bits_everywhere(P):
    results = run_ok(worker, P, small_bytes=SMALL_BYTES)
    wrong = results[0][1]
    assert not wrong, wrong[:10]
    first = results[0][0]
    differ = []
    for key, digest in first.items():
        for r in range(1, P):
            if results[r][0][key] != digest:
                differ.append((key, f"rank {r} differs from rank 0"))
        base = first[key[:3] + (False, False)]
        if digest != base:
            differ.append((key, "differs from the private, not-in-place call"))
    assert not differ, f"{len(differ)} of {len(first) * P}: {differ[:12]}"
