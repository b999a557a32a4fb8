"""The complete collective set (DESIGN section 11): alltoall (equal blocks and counts=), gather,
scatter, scan, exscan against numpy; their i-forms mixed with plain calls in issue order;
mismatches of every kind on every rank; out= checks; local errors only one rank can see;
non-contiguous, shared and private arrays; start methods; a SIGKILL mid-alltoall.

Every rank's input is rebuilt in the parent from (case, rank) (test_collectives.make), so the
expected values are computed here.  One shmtree.run carries many cases, with small chunks
(chunk_bytes=4096) so that the larger sizes take many chunks (4099 items is a non-multiple of
every chunk)."""
import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

import shmtree
from complete_workers import small_worker
from procutil import run_ok
from test_collectives import make, same_bytes, unwire, wire

try:
    import ml_dtypes
except ImportError:                       # pragma: no cover
    ml_dtypes = None

SIZES = (0, 1, 7, 4099)
MOVED = ["uint8", "float64", ">i4", "complex128", "S3", [("a", "<i2"), ("b", ">f8")],
         "datetime64[ns]"] + (["bfloat16"] if ml_dtypes else [])
CHUNK = dict(chunk_bytes=4096)


def dt(name):
    return np.dtype(getattr(ml_dtypes, name)) if name == "bfloat16" else np.dtype(name)


def inp(dtype, n, rank, seed=0, op=None):
    """A rank's 1-D input of n items (bfloat16: float32 values rounded)."""
    if not isinstance(dtype, list) and dtype == "bfloat16":
        return make("float32", op, n, rank, seed).astype(dt("bfloat16"))
    return make(dtype, op, n, rank, seed)


# ---------------------------------------------------------------------------------------------
# alltoall


def a2a_counts(P, src, seed):
    """Uneven counts with zeros: rank src's rows for each destination."""
    return [((src * 7 + q * 3 + seed) % 4) * (q != (src + seed) % P) for q in range(P)]


def alltoall_worker(comm, cases):
    P, r = comm.size, comm.rank
    out = []
    for i, (dtype, n, how) in enumerate(cases):
        if how == "counts":
            counts = a2a_counts(P, r, n)
            x = inp(dtype, sum(counts) * 3, r, i).reshape(-1, 3)
            if r % 2:                                     # non-contiguous input
                x = np.repeat(x, 2, axis=0)[::2]
            got = comm.alltoall(x, counts=counts)
        else:
            x = inp(dtype, P * n, r, i).reshape(P, n)
            if how == "out":
                o = np.empty_like(x)
                assert comm.alltoall(x, out=o) is o
                got = o
            elif how == "inplace":
                got = comm.alltoall(x, out=x)
                assert got is x
            elif how == "strided":
                got = comm.alltoall(np.repeat(x, 2, axis=1)[:, ::2])
            else:
                got = comm.alltoall(x)
        out.append(wire(got))
    return out


def alltoall_expected(P, dtype, n, how, rank, i):
    if how == "counts":
        parts = []
        for s in range(P):
            counts = a2a_counts(P, s, n)
            x = inp(dtype, sum(counts) * 3, s, i).reshape(-1, 3)
            lo = sum(counts[:rank])
            parts.append(x[lo:lo + counts[rank]])
        return np.concatenate(parts).astype(parts[0].dtype)     # (numpy's native order)
    rows = [inp(dtype, P * n, s, i).reshape(P, n)[rank] for s in range(P)]
    return np.stack(rows).astype(rows[0].dtype)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("P", [1, 2, 3, 5])
def test_alltoall_against_numpy(P):
    cases = [(d, n, "plain") for d in MOVED for n in SIZES]
    cases += [(d, n, how) for d in ("float32", ">i2") for n in (0, 1, 2, 5)
              for how in ("counts",)]
    cases += [("int64", n, how) for n in (1, 4099) for how in ("out", "inplace", "strided")]
    outs = run_ok(alltoall_worker, P, args=(cases,), **CHUNK)
    for i, (dtype, n, how) in enumerate(cases):
        for rank in range(P):
            got = unwire(outs[rank][i])
            want = alltoall_expected(P, dtype, n, how, rank, i)
            assert got.dtype == want.dtype and got.shape == want.shape, (dtype, n, how, rank)
            assert same_bytes(got, want), (dtype, n, how, rank)


# ---------------------------------------------------------------------------------------------
# gather, scatter


def gather_worker(comm, cases):
    P, r = comm.size, comm.rank
    out = []
    for i, (dtype, n, axis, root, how) in enumerate(cases):
        m = n + (r % 3) * (r != 1) if axis == 0 else n        # uneven, one rank may send 0
        if axis == 0 and r == 1:
            m = 0
        x = inp(dtype, m * 2, r, i).reshape(m, 2)
        if how == "strided":
            x = np.repeat(x, 2, axis=0)[::2]
        if how == "inplace" and r == root:                   # the input is out[root]
            o = np.empty((P,) + x.shape, x.dtype)
            o[root] = x
            got = comm.gather(o[root], root=root, out=o)
            assert got is o
        elif how == "out" and r == root:
            total = sum(n + (s % 3) * (s != 1) if s != 1 else 0 for s in range(P)) \
                if axis == 0 else None
            o = np.empty((total, 2) if axis == 0 else (P, n, 2), x.dtype)
            got = comm.gather(x, root=root, axis=axis, out=o)
            assert got is o
        else:
            got = comm.gather(x, root=root, axis=axis)
        if r != root:
            assert got is None
        out.append(wire(got))
    return out


def gather_expected(P, dtype, n, axis, i):
    xs = []
    for s in range(P):
        m = n + (s % 3) * (s != 1) if axis == 0 else n
        if axis == 0 and s == 1:
            m = 0
        xs.append(inp(dtype, m * 2, s, i).reshape(m, 2))
    return (np.concatenate(xs) if axis == 0 else np.stack(xs)).astype(xs[0].dtype)


def scatter_worker(comm, cases):
    P, r = comm.size, comm.rank
    out = []
    for i, (dtype, n, axis, root, how) in enumerate(cases):
        full = inp(dtype, (P * n if axis is None else n) * 2, root, i)
        full = full.reshape((P, n, 2) if axis is None else (n, 2))
        arg = full if r == root else None
        if r == root and how == "strided":
            arg = np.repeat(full, 2, axis=-1)[..., ::2]
        if how == "out":
            b = np.array_split(np.empty(full.shape), P, axis=0)[r].shape if axis == 0 \
                else full.shape[1:]
            o = np.full(b, 0, full.dtype) if r % 2 == 0 else \
                np.zeros((b[0], 4) if len(b) == 2 else b, full.dtype)[..., ::2] \
                if len(b) == 2 else np.zeros(b, full.dtype)
            got = comm.scatter(arg, root=root, axis=axis, out=o)
            assert got is o
        else:
            got = comm.scatter(arg, root=root, axis=axis)
        out.append(wire(np.ascontiguousarray(got)))
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("P", [1, 2, 3, 5])
def test_gather_and_scatter_every_root(P):
    cases = [(d, n, axis, root, "plain") for root in range(P) for d in ("float64", "S3")
             for n in SIZES for axis in (None, 0)]
    cases += [(d, n, axis, root, how) for root in range(P) for d in MOVED[1:3]
              for n in (1, 4099) for axis in (None, 0) for how in ("out", "strided")]
    cases += [("int32", n, None, root, "inplace") for root in range(P) for n in (3, 4099)]
    outs = run_ok(gather_worker, P, args=(cases,), **CHUNK)
    for i, (dtype, n, axis, root, how) in enumerate(cases):
        want = gather_expected(P, dtype, n, axis, i)
        got = unwire(outs[root][i])
        assert got.shape == want.shape and got.dtype == want.dtype, (dtype, n, axis, root)
        assert same_bytes(got, want), (dtype, n, axis, root, how)
    cases = cases[:-2 * P]
    outs = run_ok(scatter_worker, P, args=(cases,), **CHUNK)
    for i, (dtype, n, axis, root, how) in enumerate(cases):
        full = inp(dtype, (P * n if axis is None else n) * 2, root, i)
        full = full.reshape((P, n, 2) if axis is None else (n, 2))
        for rank in range(P):
            want = full[rank] if axis is None else np.array_split(full, P, axis=0)[rank]
            got = unwire(outs[rank][i])
            assert got.shape == want.shape and got.dtype == want.dtype, (dtype, n, axis, root)
            assert same_bytes(got, want), (dtype, n, axis, root, how, rank)


# ---------------------------------------------------------------------------------------------
# scan, exscan


SCANNED = ["bool", "int8", "uint16", "int32", "uint64", "float16", "float32", "float64",
           "complex64", "complex128"] + (["bfloat16"] if ml_dtypes else [])


def ops_for(dtype):
    kind = dt(dtype).kind
    if kind == "c":
        return ("sum", "prod")
    if kind in "fV" or dtype == "bfloat16":
        return ("sum", "prod", "min", "max")
    return ("sum", "prod", "min", "max", "band", "bor", "bxor")


UFUNC = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
         "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}
IDENTITY_NAMES = {"sum": 0, "bor": 0, "bxor": 0, "prod": 1}


def scan_input(dtype, op, n, rank, i):
    x = inp(dtype, n, rank, i, op)
    if dt(dtype).kind == "f" and n > 3 and op in ("min", "max"):
        x[:4] = [np.nan, -0.0, 0.0, np.inf][:4] if rank % 2 else [1.0, 0.0, -0.0, -np.inf]
    return x


def textbook_cprod(rows):
    """Complex products in rank order with the textbook formula (allreduce's kernel rule)."""
    out = [rows[0]]
    for x in rows[1:]:
        a = out[-1]
        re = a.real * x.real - a.imag * x.imag
        im = a.real * x.imag + a.imag * x.real
        out.append((re + 1j * im).astype(rows.dtype) if rows.size else a)
    return np.stack(out)


def scan_expected(P, dtype, op, n, i, exclusive):
    stack = np.stack([scan_input(dtype, op, n, s, i) for s in range(P)])
    d = dt(dtype)
    if op == "prod" and d.kind == "c":
        acc = textbook_cprod(stack)
    else:
        acc = UFUNC[op].accumulate(stack, axis=0, dtype=d)
    if not exclusive:
        return acc
    first = identity(op, d, stack.shape[1:])
    return np.concatenate([first[None], acc[:-1]])


def identity(op, d, shape):
    if op in IDENTITY_NAMES:
        return np.full(shape, IDENTITY_NAMES[op], d)
    if op == "band":
        return np.full(shape, True, d) if d.kind == "b" else np.full(shape, -1).astype(d)
    big = op == "min"
    if d.kind == "b":
        return np.full(shape, big, d)
    if d.kind in "iu":
        info = np.iinfo(d)
        return np.full(shape, info.max if big else info.min, d)
    return np.full(shape, np.inf if big else -np.inf, d)


def scan_worker(comm, cases):
    r = comm.rank
    out = []
    for i, (dtype, op, n, exclusive, how) in enumerate(cases):
        x = scan_input(dtype, op, n, r, i)
        fn = comm.exscan if exclusive else comm.scan
        if how == "out":
            o = np.empty_like(x)
            got = fn(x, op=op, out=o)
            assert got is o
        elif how == "inplace":
            got = fn(x, op=op, out=x)
            assert got is x
        elif how == "strided":
            got = fn(np.repeat(x, 2)[::2], op=op)
        elif how == "2d" and n % 7 == 0 and n:
            got = fn(x.reshape(7, -1), op=op).reshape(-1)
        else:
            got = fn(x, op=op)
        out.append(wire(got))
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("P", [1, 2, 3, 5])
def test_scan_and_exscan_bit_for_bit(P):
    cases = [(d, op, n, ex, "plain") for d in SCANNED for op in ops_for(d)
             for n in (0, 1, 4099) for ex in (False, True)]
    cases += [("float64", "sum", n, ex, how) for n in (7, 4099) for ex in (False, True)
              for how in ("out", "inplace", "strided", "2d")]
    cases += [("float16", op, 7, ex, "plain") for op in ("sum", "prod") for ex in (0, 1)]
    outs = run_ok(scan_worker, P, args=(cases,), **CHUNK)
    for i, (dtype, op, n, ex, how) in enumerate(cases):
        want = scan_expected(P, dtype, op, n, i, ex)
        for rank in range(P):
            got = unwire(outs[rank][i])
            assert got.dtype == want.dtype and got.shape == want[rank].shape, (dtype, op, n)
            assert got.tobytes() == want[rank].tobytes(), (dtype, op, n, ex, how, rank)


# ---------------------------------------------------------------------------------------------
# nonblocking forms, in issue order with plain calls; module level; torch


def mixed_worker(comm):
    P, r = comm.size, comm.rank
    x = np.arange(P * 5, dtype=np.float64).reshape(P, 5) + 10 * r
    reqs = [comm.ialltoall(x), comm.igather(x[0], root=P - 1),
            comm.iscatter(x if r == 0 else None), comm.iscan(x[0]),
            comm.iexscan(x[0], op="max")]
    plain = comm.alltoall(x)                 # queued behind the posted calls
    counts = [1] * P
    reqs.append(comm.ialltoall(x, counts=counts))
    reqs.append(comm.igather(np.arange(r + 1.0), axis=0))
    reqs.append(comm.iscatter(np.arange(10.0) if r == 0 else None, axis=0))
    got = shmtree.wait_all(reqs, timeout=60)
    mod = [shmtree.alltoall(x), shmtree.scan(x[0]), shmtree.exscan(x[0]),
           shmtree.gather(x[0]), shmtree.scatter(x if r == 0 else None)]
    return [wire(g) for g in got] + [wire(plain)] + [wire(m) for m in mod]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("P", [1, 3])
def test_nonblocking_forms_in_issue_order_and_module_level(P):
    outs = run_ok(mixed_worker, P)
    xs = [np.arange(P * 5, dtype=np.float64).reshape(P, 5) + 10 * s for s in range(P)]
    for r in range(P):
        g = [unwire(w) for w in outs[r]]
        a2a = np.stack([xs[s][r] for s in range(P)])
        assert np.array_equal(g[0], a2a) and np.array_equal(g[5], a2a)
        assert np.array_equal(g[8], a2a) and np.array_equal(g[9], a2a)
        firsts = np.stack([x[0] for x in xs])
        if r == P - 1:
            assert np.array_equal(g[1], firsts)
        else:
            assert g[1] is None
        assert np.array_equal(g[2], xs[0][r]) and np.array_equal(g[13], xs[0][r])
        assert np.array_equal(g[3], np.add.accumulate(firsts)[r])
        assert np.array_equal(g[10], np.add.accumulate(firsts)[r])
        want = np.full(5, -np.inf) if r == 0 else np.maximum.accumulate(firsts)[r - 1]
        assert np.array_equal(g[4], want)
        want = np.zeros(5) if r == 0 else np.add.accumulate(firsts)[r - 1]
        assert np.array_equal(g[11], want)
        if r == 0:
            assert np.array_equal(g[6], np.concatenate([np.arange(s + 1.0) for s in range(P)]))
            assert np.array_equal(g[12], firsts)
        else:
            assert g[6] is None and g[12] is None
        assert np.array_equal(g[7], np.array_split(np.arange(10.0), P)[r])


def torch_worker(comm):
    import torch
    P, r = comm.size, comm.rank
    t = torch.arange(P * 2, dtype=torch.float32).reshape(P, 2) + r
    a = comm.alltoall(t)
    s = comm.scan(t[0])
    o = torch.empty(2, dtype=torch.float32)
    sc = comm.scatter(t if r == 0 else None, out=o)
    b = torch.ones(3, dtype=torch.bfloat16) * (r + 1)
    e = comm.exscan(b)
    return (type(a).__name__, a.tolist(), s.tolist(), sc is o, o.tolist(), e.float().tolist())


@pytest.mark.timeout(120)
def test_torch_tensors():
    pytest.importorskip("torch")
    outs = run_ok(torch_worker, 2)
    assert outs[0][0] == "Tensor"
    assert outs[1][1] == [[2.0, 3.0], [3.0, 4.0]]
    assert outs[1][2] == [1.0, 3.0]
    assert outs[1][3] and outs[1][4] == [2.0, 3.0]
    assert outs[0][5] == [0.0] * 3 and outs[1][5] == [1.0] * 3


# ---------------------------------------------------------------------------------------------
# mismatches on every rank, then usable


MISMATCHES = {
    # name: (call by rank, words every rank's message holds)
    "kind": (lambda c: c.alltoall(np.zeros((c.size, 2))) if c.rank else
             c.gather(np.zeros((c.size, 2))), ["alltoall", "gather"]),
    "gather_root": (lambda c: c.gather(np.zeros(3), root=c.rank % 2), ["root=0", "root=1"]),
    "scatter_root": (lambda c: c.scatter(np.zeros((c.size, 2)) if c.rank < 2 else None,
                                         root=c.rank % 2), ["root=0", "root=1"]),
    "a2a_shape": (lambda c: c.alltoall(np.zeros((c.size, 2 + (c.rank == 1)))),
                  ["(3, 2)", "(3, 3)"]),
    "a2a_dtype": (lambda c: c.alltoall(np.zeros((c.size, 2), "f4" if c.rank else "i4")),
                  ["float32", "int32"]),
    "a2a_counts_rest": (lambda c: c.alltoall(np.zeros((c.size, 2 + (c.rank == 2))),
                                             counts=[1] * c.size), ["(3, 2)", "(3, 3)"]),
    "a2a_counts_vs_equal": (lambda c: c.alltoall(np.zeros((c.size, 2)),
                                                 counts=[1] * c.size if c.rank else None),
                            ["alltoall"]),
    "gather0_dtype": (lambda c: c.gather(np.zeros((c.rank, 2), "f8" if c.rank else ">f8"),
                                         axis=0), ["float64", "byte-swapped"]),
    "gather0_root": (lambda c: c.gather(np.zeros((1, 2)), root=c.rank % 2, axis=0),
                     ["root=0", "root=1"]),
    "gather_shape": (lambda c: c.gather(np.zeros(3 + c.rank)), ["(3,)", "(4,)"]),
    "scan_op": (lambda c: c.scan(np.ones(3), op="max" if c.rank == 1 else "sum"),
                ["'max'", "'sum'"]),
    "scan_dtype": (lambda c: c.scan(np.ones(3, "f4" if c.rank else "f8")),
                   ["float32", "float64"]),
    "scan_vs_exscan": (lambda c: (c.exscan if c.rank == 2 else c.scan)(np.ones(3)),
                       ["scan", "exscan"]),
    "scan_shape_large": (lambda c: c.scan(np.ones(5000 + c.rank)), ["5000", "5001"]),
    "scan_vs_allreduce": (lambda c: (c.allreduce if c.rank == 2 else c.scan)(np.ones(3)),
                          ["scan", "allreduce"]),
}


def mismatch_worker(comm, names):
    out = []
    for name in names:
        try:
            MISMATCHES[name][0](comm)
            out.append((name, None, ""))
        except Exception as exc:
            out.append((name, type(exc).__name__, str(exc)))
        got = comm.allreduce(np.array([1.0]), timeout=60)         # in step, usable
        out.append(("after", float(got[0]), ""))
    return out


@pytest.mark.timeout(120)
def test_mismatch_of_every_kind_on_every_rank_then_usable():
    names = list(MISMATCHES)
    outs = run_ok(mismatch_worker, 3, args=(names,), stall_timeout=None, **CHUNK)
    for rank, res in enumerate(outs):
        for k, name in enumerate(names):
            got, what, msg = res[2 * k]
            assert got == name
            assert what == "CollectiveMismatchError", (rank, name, what, msg)
            for word in MISMATCHES[name][1]:
                assert word in msg, (rank, name, word, msg)
            assert "#" not in msg.split("disagree")[-1] or "structured" in msg, (name, msg)
            assert res[2 * k + 1] == ("after", 3.0, "")


# ---------------------------------------------------------------------------------------------
# local errors: before any communication; an error only one rank sees, said in the round


def local_worker(comm):
    P, r = comm.size, comm.rank
    errs = []

    def expect(exc_type, fn):
        try:
            fn()
        except exc_type as exc:
            errs.append(str(exc))
        else:
            errs.append(None)

    x = np.zeros((P, 2))
    expect(ValueError, lambda: comm.alltoall(np.zeros((P + 1, 2))))
    expect(ValueError, lambda: comm.alltoall(x, counts=[1] * (P + 1)))
    expect(ValueError, lambda: comm.alltoall(x, counts=[P + 1] + [-1] * (P - 1)))
    expect(ValueError, lambda: comm.alltoall(x, counts=[2] * P))
    expect(ValueError, lambda: comm.alltoall(x, out=np.zeros((P, 3))))
    expect(ValueError, lambda: comm.alltoall(x, counts=[1] * P, out=np.zeros((P, 3))))
    expect(TypeError, lambda: comm.alltoall(np.zeros((P, 1), object)))
    expect(ValueError, lambda: comm.alltoall(np.float64(1.0)))
    expect(ValueError, lambda: comm.gather(x, root=P))
    expect(ValueError, lambda: comm.gather(x, axis=1))
    expect(ValueError, lambda: comm.scatter(x, root=-1))
    expect(ValueError, lambda: comm.scatter(x if r == 0 else None, out=(1, 2)))
    expect(ValueError, lambda: comm.gather(x, axis=0, out=np.zeros(3, "f4")))
    expect(ValueError, lambda: comm.scan(x, op="nope"))
    expect(TypeError, lambda: comm.scan(x.astype(complex), op="max"))
    expect(TypeError, lambda: comm.exscan(x, op="band"))
    expect(ValueError, lambda: comm.scan(x, out=np.zeros(3)))
    expect(ValueError, lambda: comm.iscan(x, out=np.zeros((P, 2), "f4")))
    ok = comm.allreduce(np.ones(1))[0]                         # nothing was sent: in step
    return errs, ok


@pytest.mark.timeout(60)
def test_local_errors_raise_before_communication():
    outs = run_ok(local_worker, 2)
    for errs, ok in outs:
        assert None not in errs, errs
        assert ok == 2.0


def one_rank_error_worker(comm):
    """Errors only one rank can see: raised there, CollectiveMismatchError elsewhere naming it,
    within the same call; then in step."""
    P, r = comm.size, comm.rank
    out = []
    cases = [
        lambda: comm.scatter(np.zeros((P, 1), object) if r == 1 else None, root=1),
        lambda: comm.gather(np.zeros(2, object) if r == 0 else np.zeros(2), root=0),
        lambda: comm.iscatter(np.zeros((P, 1), object) if r == 0 else None).wait(30),
        # out= whose length is known only after the counts: that rank raises
        # CollectiveMismatchError (its ValueError's words, said to the others)
        lambda: comm.alltoall(np.zeros((P, 2)), counts=[1] * P,
                              out=np.zeros((P + (r == 2), 2))),
        lambda: comm.gather(np.zeros((1, 2)), axis=0, out=np.zeros((P + 1, 2)) if r == 0
                            else None),
        # the root's errors the others cannot see
        lambda: comm.scatter(np.zeros((P + 1, 2)) if r == 0 else None),
        lambda: comm.scatter(None, root=2),
        lambda: comm.gather(np.zeros(2), root=1, out=np.zeros(3) if r == 1 else None),
        # a non-root's out= against the root's block
        lambda: comm.scatter(np.zeros((P, 4)) if r == 0 else None,
                             out=np.zeros(4 + (r == 1))),
    ]
    for k, case in enumerate(cases):
        try:
            case()
            out.append((k, None, ""))
        except Exception as exc:
            out.append((k, type(exc).__name__, str(exc)))
        out.append(("after", float(comm.allreduce(np.ones(1), timeout=60)[0]), ""))
    return out


@pytest.mark.timeout(120)
def test_an_error_one_rank_sees_raises_on_every_rank():
    P = 3
    outs = run_ok(one_rank_error_worker, P, stall_timeout=None)
    culprit = {0: 1, 1: 0, 2: 0, 3: 2, 4: 0, 5: 0, 6: 2, 7: 1, 8: 1}
    kinds = {0: "TypeError", 1: "TypeError", 2: "TypeError", 3: "ValueError", 4: "ValueError",
             5: "ValueError", 6: "ValueError", 7: "ValueError", 8: "ValueError"}
    for rank in range(P):
        for k in culprit:
            got, what, msg = outs[rank][2 * k]
            if rank == culprit[k]:
                # an out= that only the other ranks' arguments show wrong (the rows they send,
                # the root's block) is a mismatch on its own rank too (issue 34)
                assert what == ("CollectiveMismatchError" if k in (3, 4, 8) else kinds[k]), \
                    (k, rank, what, msg)
            elif k == 8:                  # (scatter's out= claims its block in the round:
                # every rank reads the same claims and says the same words)
                assert what == "CollectiveMismatchError", (k, rank, what, msg)
                assert f"rank {culprit[k]} passed out= of shape" in msg, (k, msg)
            else:
                assert what == "CollectiveMismatchError", (k, rank, what, msg)
                assert f"rank {culprit[k]}" in msg and kinds[k] in msg, (k, msg)
            assert outs[rank][2 * k + 1] == ("after", float(P), "")


# ---------------------------------------------------------------------------------------------
# shared arrays, start methods, the multi-node communicator, SIGKILL


def shared_worker(comm):
    P, r = comm.size, comm.rank
    n = 3000
    x = comm.empty((P, n))
    x[...] = np.arange(P * n).reshape(P, n) + 1000.0 * r
    o = comm.zeros((P, n))
    got = [comm.alltoall(x, out=o).copy(), comm.alltoall(x).copy()]
    y = comm.empty(n)
    y[...] = np.arange(n) * (r + 1.0)
    got.append(comm.scan(y, out=y).copy())          # in place, shared
    g = comm.gather(x[0], root=0)
    got.append(None if g is None else g.copy())
    s = comm.zeros((P, n))                          # (a collective: every rank asks)
    s[...] = x
    got.append(comm.scatter(s if r == 0 else None, out=comm.empty(n)).copy())
    return [wire(a) for a in got]


@pytest.mark.timeout(120)
def test_shared_arrays_as_input_and_out():
    P, n = 3, 3000
    outs = run_ok(shared_worker, P)
    xs = [np.arange(P * n).reshape(P, n) + 1000.0 * s for s in range(P)]
    for r in range(P):
        g = [unwire(w) for w in outs[r]]
        a2a = np.stack([xs[s][r] for s in range(P)])
        assert np.array_equal(g[0], a2a) and np.array_equal(g[1], a2a)
        assert np.array_equal(g[2], np.add.accumulate(
            [np.arange(n) * (s + 1.0) for s in range(P)])[r])
        assert (g[3] is None) == (r != 0)
        assert np.array_equal(g[4], xs[0][r])


def eight_worker(comm):
    P, r = comm.size, comm.rank
    x = np.arange(P * 3.0).reshape(P, 3) + 100 * r
    counts = [(r + q) % 3 for q in range(P)]
    return (comm.alltoall(x).tolist(), comm.alltoall(np.full((sum(counts), 1), r), counts=counts)
            .ravel().tolist(), comm.scan(x[0]).tolist(), comm.exscan(np.array([r + 1]),
                                                                    op="prod").tolist(),
            comm.scatter(x if r == 5 else None, root=5).tolist(),
            comm.gather(np.arange(r), root=7, axis=0))


@pytest.mark.timeout(120)
def test_eight_ranks():
    P = 8
    outs = run_ok(eight_worker, P)
    xs = [np.arange(P * 3.0).reshape(P, 3) + 100 * s for s in range(P)]
    for r, (a2a, a2av, sc, ex, sca, ga) in enumerate(outs):
        assert a2a == [xs[s][r].tolist() for s in range(P)]
        assert a2av == [s for s in range(P) for _ in range((s + r) % 3)]
        assert sc == np.add.accumulate([x[0] for x in xs])[r].tolist()
        assert ex == [int(np.prod(np.arange(1, r + 1)))]
        assert sca == xs[5][r].tolist()
        if r == 7:
            assert ga.tolist() == [v for s in range(P) for v in range(s)]
        else:
            assert ga is None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_start_methods(method):
    outs = run_ok(small_worker, 2, start_method=method)
    assert outs[1] == ([[2.0, 3.0], [3.0, 4.0]], [3], [2.0, 3.0])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("node_size", [0, 1])
def test_from_mpi_one_node_and_across_nodes(node_size):
    """One node (its own communicator makes every call, persistent calls bound there) and two
    simulated nodes (Spanning's executors): the same results, the persistent allreduce's
    output the same array every time."""
    import ast
    import subprocess
    import sys
    from test_multinode import _import_root, _mpiexec, _reports
    mpiexec = _mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec (pip install mpich)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [p for p in (os.environ.get("PYTHONPATH"), _import_root()) if p]))
    prog = os.path.join(os.path.dirname(__file__), "complete_mpi_prog.py")
    done = subprocess.run([mpiexec, "-n", "2", sys.executable, prog, str(node_size)],
                          capture_output=True, timeout=100, env=env)
    text = done.stdout.decode()
    assert done.returncode == 0, text + done.stderr.decode()
    reports = dict(line.split(" ", 2)[1:] for line in _reports(text, "REPORT "))
    for r in range(2):
        nodes, same, summed, a2a, scan, gather, after = ast.literal_eval(reports[str(r)])
        assert nodes == (2 if node_size else 1) and same and summed == [3.0] * 3
        assert after == [3.0] * 3
        assert a2a == [[2.0 * r, 2.0 * r + 1]] * 2
        assert scan == [float(sum(range(1, r + 2)))] * 3
        assert (gather is None) == (r != 0)


def _killed_member(group, rank, victim, n, queue):
    """The victim is SIGKILLed from a thread of its own while it waits inside the alltoall
    (rank 2 arrives late)."""
    import threading
    comm = group.join(rank)
    x = np.ones((group.size, n))
    if rank == victim:
        threading.Thread(target=lambda: (time.sleep(0.3), os.kill(os.getpid(),
                                                                   signal.SIGKILL))).start()
    elif rank == 2:
        time.sleep(0.6)
    try:
        comm.alltoall(x)
        queue.put((rank, "returned", time.monotonic()))
    except Exception as exc:
        queue.put((rank, type(exc).__name__, time.monotonic()))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 200000])
def test_sigkill_mid_alltoall(n):
    P, victim = 3, 1
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with shmtree.Group(P) as group:
        procs = [ctx.Process(target=_killed_member, args=(group, r, victim, n, queue))
                 for r in range(P)]
        for p in procs:
            p.start()
        got = [queue.get(timeout=30) for _ in range(P - 1)]
        for p in procs:
            p.join(10)
    assert sorted(r for r, _, _ in got) == [0, 2]
    assert all(what == "PeerLostError" for _, what, _ in got), got
