"""Shared arrays (comm.empty / comm.zeros, shmtree/shared.py) and the single-copy collectives
(the engine's alg_direct).

The single-copy path must give the very bits of the private path in the same group (the same
reduction order), for every schedule; it must run only when every rank passed shared arrays at
the same place (otherwise the private path, on every rank alike); allocation is a collective
with mismatch detection; memory goes with the arrays.
"""
import os
import signal
import time
import warnings

import numpy as np
import pytest

import shmtree
import shmtree.machine.plan
from procutil import run_ok
from test_collectives import make, ops_for, same_bytes

N = 100003                              # > 64 KiB for 8-byte items; not a multiple of P


def maps_of_arrays():
    with open("/proc/self/maps") as f:
        return sum("shmtree-array" in line for line in f)


def exactness_worker(comm, cases):
    out = []
    for dtype, op, n in cases:
        x = make(dtype, op, n, comm.rank)
        want = comm.allreduce(x, op=op)                      # the private path
        sx = comm.empty(x.shape, x.dtype)
        sx[...] = x
        before = comm.stats()["bytes_sent"]
        got = comm.allreduce(sx, op=op, out=sx)              # single copy, in place
        ring_bytes = comm.stats()["bytes_sent"] - before
        exact = want.tobytes() == sx.tobytes()
        so = comm.zeros(x.shape, x.dtype)
        sx[...] = x
        got2 = comm.allreduce(sx, op=op, out=so)             # single copy, another out
        out.append((got is sx, got2 is so, exact, want.tobytes() == so.tobytes(), ring_bytes,
                    x.nbytes))
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tree", ["ring", "auto", "binary"])
@pytest.mark.parametrize("P", [2, 3])
def test_single_copy_gives_the_private_paths_bits(P, tree):
    cases = [(dt, op, N) for dt in ("float32", "float64", "float16", "int32", "complex64")
             for op in ops_for(dt)[:3]]
    outs = run_ok(exactness_worker, P, args=(cases,), tree=tree)
    for rank, out in enumerate(outs):
        for (dt, op, n), (same, same2, exact, exact2, ring_bytes, nbytes) in zip(cases, out):
            assert same and same2, (rank, dt, op)
            assert exact and exact2, (rank, dt, op, tree)
            # only the agreement and the final barrier go through the rings
            assert ring_bytes < 4096 < nbytes, (rank, dt, op, ring_bytes)


def every_size_worker(comm, cases):
    """The engine's single copy with the defaults: from just above small_bytes on."""
    out = []
    for dtype, op, n in cases:
        x = make(dtype, op, n, comm.rank)
        want = comm.allreduce(x, op=op)
        sx = comm.empty(x.shape, x.dtype)
        sx[...] = x
        before = comm.stats()["bytes_sent"]
        got = comm.allreduce(sx, op=op, out=sx)
        sent = comm.stats()["bytes_sent"] - before
        exact = want.tobytes() == sx.tobytes()
        so = comm.zeros(x.shape, x.dtype)
        sx[...] = x
        req = comm.iallreduce(x, op=op)                       # (the progress thread's way in)
        got2 = comm.iallreduce(sx, op=op, out=so).wait()
        out.append((got is sx and got2 is so, exact,
                    req.wait().tobytes() == so.tobytes() == want.tobytes(), sent))
        # broadcast and allgather of shared outs (the engine's single copy too)
        root = comm.size - 1
        bw = comm.broadcast(x if comm.rank == root else None, root=root)
        so[...] = x if comm.rank == root else 0
        bg, bsent = _sent(comm, lambda: comm.broadcast(so if comm.rank == root else None,
                                                       root=root, out=so))
        aw = comm.allgather(x)
        ao = comm.zeros((comm.size,) + x.shape, x.dtype)
        ao[comm.rank] = x
        ag, asent = _sent(comm, lambda: comm.allgather(ao[comm.rank], out=ao))
        out.append((bg is so and ag is ao, bw.tobytes() == so.tobytes(),
                    aw.tobytes() == ao.tobytes(), max(bsent, asent)))
        # reduce into the root's input (in place), reduce_scatter of shared inputs
        rw = comm.reduce(x, op=op, root=root)
        sx[...] = x
        rg, rsent = _sent(comm, lambda: comm.reduce(sx, op=op, root=root,
                                                    out=sx if comm.rank == root else None))
        rexact = comm.rank != root or rw.tobytes() == sx.tobytes()
        sw = comm.reduce_scatter(x, op=op)
        sx[...] = x
        sg, ssent = _sent(comm, lambda: comm.reduce_scatter(sx, op=op))
        out.append((comm.rank != root or rg is sx, rexact, sw.tobytes() == sg.tobytes(),
                    max(rsent, ssent)))
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("P,tree", [(2, None), (3, "ring"), (3, "binary"), (4, None),
                                    (5, "ring")])
def test_single_copy_from_small_bytes(P, tree):
    """Without lowering any threshold: an allreduce of shared arrays runs single-copy (no data
    through the rings) at any size above small_bytes - odd sizes, every part length, parts that
    are empty - with the private path's bits, blocking and nonblocking; so do broadcast and
    allgather into shared outs, reduce into the root's input and reduce_scatter of shared
    inputs (in place)."""
    small = shmtree.machine.plan.plan_group(P, tree=tree).small_bytes
    cases = []
    for dt, ops in [("float32", ("sum", "max")), ("float16", ("sum", "prod")),
                    ("int64", ("sum", "bxor")), ("complex128", ("prod",)),
                    ("uint8", ("min",))]:
        item = np.dtype(dt).itemsize
        for n in (small // item + 1, 3 * small // item + P - 1, (32 << 10) // item + 7,
                  (256 << 10) // item + 1):
            if n * item > small:              # (small_bytes is 64 KiB when P > cores)
                cases += [(dt, op, n) for op in ops]
    outs = run_ok(every_size_worker, P, args=(cases,), tree=tree)
    for rank, out in enumerate(outs):
        for (dt, op, n), (same, exact, exact2, sent) in zip([c for c in cases for _ in "abc"],
                                                            out):
            assert same and exact and exact2, (rank, dt, op, n, same, exact, exact2)
            assert sent < 4096, (rank, dt, op, n, sent)


def mixed_worker(comm):
    """Shared on some ranks, private on others; views of shared arrays; strided views."""
    r, P = comm.rank, comm.size
    res = {}
    base = np.arange(N, dtype=np.float64) + r
    want = sum(np.arange(N, dtype=np.float64) + k for k in range(P))
    x = comm.empty(N)
    x[:] = base
    arg = x if r != 1 else base.copy()
    res["mixed"] = np.array_equal(comm.allreduce(arg, out=arg), want)   # (private on rank 1)
    x[:] = base
    big = comm.zeros(N + 64)
    big[10:10 + N] = base
    view = big[10:10 + N]                                   # a slice is still shared
    before = comm.stats()["bytes_sent"]
    got = comm.allreduce(view, out=view)
    res["slice"] = (got is view, np.array_equal(view, want),
                    comm.stats()["bytes_sent"] - before < 4096)
    y = comm.zeros(2 * N)
    y[::2] = base
    res["strided"] = np.array_equal(comm.allreduce(y[::2]), want)     # private path
    z = comm.zeros(N + 64)                     # different offsets on different ranks
    off = 8 * (r % 2)
    z[off:off + N] = base
    res["offsets"] = np.array_equal(comm.allreduce(z[off:off + N], out=z[off:off + N]), want)
    req = comm.iallreduce(x, out=x)
    x2 = req.wait()
    res["nonblocking"] = x2 is x and np.array_equal(x, want)
    res["module"] = np.array_equal(shmtree.zeros(3), np.zeros(3))
    return res


@pytest.mark.timeout(120)
@pytest.mark.parametrize("P", [2, 3])
def test_mixed_shared_private_slices_and_nonblocking(P):
    for rank, res in enumerate(run_ok(mixed_worker, P)):
        assert res["mixed"] and res["strided"] and res["offsets"], (rank, res)
        assert res["slice"] == (True, True, True), (rank, res)
        assert res["nonblocking"] and res["module"], (rank, res)


def alloc_worker(comm):
    res = {}
    a = comm.zeros((3, 4), np.int16, order="F")
    res["zeros"] = (a.shape, a.dtype.str, a.flags.f_contiguous, int(np.abs(a).sum()),
                    a.flags.writeable)
    res["empty"] = comm.empty(np.int64(5), "float32").shape
    res["zero_size"] = comm.zeros((0, 3)).shape
    errs = []
    for bad in (lambda: comm.empty((2, -1)), lambda: comm.empty(3, object),
                lambda: comm.empty("x"), lambda: comm.empty(3, order="K")):
        try:
            bad()
        except (ValueError, TypeError) as exc:
            errs.append(type(exc).__name__)
    res["local_errors"] = errs
    try:                                      # ranks disagree: every rank raises
        comm.empty(4 if comm.rank else 5)
        res["mismatch"] = None
    except shmtree.CollectiveMismatchError as exc:
        res["mismatch"] = str(exc)
    res["after"] = float(comm.allreduce(np.ones(1))[0])
    # empty on one rank, zeros on another: the same allocation
    b = comm.empty(7) if comm.rank else comm.zeros(7)
    res["empty_vs_zeros"] = b.shape
    return res


@pytest.mark.timeout(120)
def test_allocation_shapes_local_errors_and_mismatch():
    outs = run_ok(alloc_worker, 3)
    for rank, res in enumerate(outs):
        assert res["zeros"] == ((3, 4), "<i2", True, 0, True)
        assert res["empty"] == (5,) and res["zero_size"] == (0, 3)
        assert res["local_errors"] == ["ValueError", "TypeError", "TypeError", "ValueError"]
        assert res["mismatch"] and "disagree" in res["mismatch"], (rank, res)
        assert res["after"] == 3.0 and res["empty_vs_zeros"] == (7,)


def lifetime_worker(comm):
    def fds():                        # (pidfds left out: the liveness checks open and cache
        n = 0                         # a peer's the first time a wait outlasts a slice)
        for fd in os.listdir("/proc/self/fd"):
            try:
                n += os.readlink(f"/proc/self/fd/{fd}") != "anon_inode:[pidfd]"
            except OSError:           # (the listing's own descriptor, closed meanwhile)
                pass
        return n
    keep = comm.zeros(1000)
    first = (fds(), maps_of_arrays())
    for i in range(200):
        x = comm.empty(20000 + i)
        x[:] = comm.rank
        if i % 50 == 0:
            comm.allreduce(x, out=x)
        del x
    last = (fds(), maps_of_arrays())
    comm.close()
    closed = maps_of_arrays()
    keep[:] = 5                       # still valid memory after close (no longer shared)
    return first, last, closed, float(keep.sum())


@pytest.mark.timeout(120)
def test_memory_goes_with_the_arrays():
    for rank, (first, last, closed, kept) in enumerate(run_ok(lifetime_worker, 2)):
        assert last[0] <= first[0], (rank, first, last)            # no descriptor kept
        assert last[1] <= first[1], (rank, first, last)            # mappings: keep's only
        assert closed == 1 and kept == 5000.0, (rank, closed)      # own array, unshared


def killed_worker(comm):
    x = comm.empty(4 << 20)
    x[:] = 1
    comm.barrier()
    if comm.rank == 1:
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        for _ in range(200):
            comm.allreduce(x, out=x)
            time.sleep(0.001)
    except shmtree.PeerLostError:
        return "PeerLostError", time.monotonic() - t0
    return None, time.monotonic() - t0


@pytest.mark.timeout(120)
def test_a_rank_killed_while_holding_shared_arrays():
    with pytest.raises(shmtree.WorkerError) as info:
        shmtree.run(killed_worker, 3)
    assert info.value.rank == 1 and "SIGKILL" in str(info.value)


def moves_worker(comm):
    """broadcast and allgather straight between shared arrays, and the same calls when some
    rank's arrays are private (the private path, on every rank)."""
    r, P = comm.rank, comm.size
    n = 50001
    res = {}
    for root in range(P):
        x = comm.zeros(n)
        if r == root:
            x[:] = np.arange(n) * (root + 1)
        before = comm.stats()["bytes_sent"]
        got = comm.broadcast(x if r == root else None, root, out=x)
        res[f"bcast{root}"] = (got is x, np.array_equal(x, np.arange(n) * (root + 1)),
                               comm.stats()["bytes_sent"] - before < 4096)
        priv = np.zeros(n) if r == (root + 1) % P else None       # one rank: a private out
        y = comm.zeros(n)
        if r == root:
            y[:] = 7
        got = comm.broadcast(y if r == root else None, root, out=priv if priv is not None else y)
        res[f"bcast_mixed{root}"] = np.array_equal(got, np.full(n, 7.0))
    g = comm.zeros((P, n))
    mine = np.full(n, r + 0.5)                    # a private input is fine
    before = comm.stats()["bytes_sent"]
    got = comm.allgather(mine, out=g)
    res["gather"] = (got is g, np.array_equal(g, np.repeat(np.arange(P) + 0.5, n).reshape(P, n)),
                     comm.stats()["bytes_sent"] - before < 4096)
    h = comm.zeros((P, n))
    h = h if r else np.zeros((P, n))                    # rank 0 private: the private path
    res["gather_mixed"] = np.array_equal(comm.allgather(mine, out=h),
                                         np.repeat(np.arange(P) + 0.5, n).reshape(P, n))
    return res


@pytest.mark.timeout(120)
@pytest.mark.parametrize("P", [2, 3])
def test_broadcast_and_allgather_single_copy(P):
    for rank, res in enumerate(run_ok(moves_worker, P)):
        for key, value in res.items():
            assert value is True or value == (True, True, True), (rank, key, value)


def rooted_worker(comm, cases):
    """reduce and reduce_scatter on shared inputs: the private path's bits, through no ring."""
    out = []
    for dtype, op, n in cases:
        x = make(dtype, op, n, comm.rank)
        sx = comm.empty(x.shape, x.dtype)
        for root in range(comm.size):
            want = comm.reduce(x, op=op, root=root)
            sx[...] = x
            before = comm.stats()["bytes_sent"]
            got = comm.reduce(sx, op=op, root=root, out=sx if comm.rank == root else None)
            sent = comm.stats()["bytes_sent"] - before
            out.append(("reduce", root, got is sx if comm.rank == root else got is None,
                        comm.rank != root or want.tobytes() == sx.tobytes(), sent < 4096))
        want = comm.reduce_scatter(x, op=op)
        sx[...] = x
        before = comm.stats()["bytes_sent"]
        got = comm.reduce_scatter(sx, op=op)
        sent = comm.stats()["bytes_sent"] - before
        out.append(("reduce_scatter", None, True, want.tobytes() == got.tobytes(), sent < 4096))
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tree", ["ring", "auto"])
@pytest.mark.parametrize("P", [2, 3])
def test_reduce_and_reduce_scatter_single_copy(P, tree):
    cases = [(dt, op, N) for dt in ("float32", "float16", "int64") for op in ops_for(dt)[:2]]
    for rank, out in enumerate(run_ok(rooted_worker, P, args=(cases,), tree=tree)):
        for what, root, same, exact, quiet in out:
            assert same and exact and quiet, (rank, what, root, same, exact, quiet)


def bf16_worker(comm):
    import ml_dtypes
    bf = ml_dtypes.bfloat16
    x = ((np.arange(N) % 13) * 0.37 + comm.rank * 1.01).astype(np.float32).astype(bf)
    want = comm.allreduce(x)
    sx = comm.empty(N, bf)
    sx[:] = x
    comm.allreduce(sx, out=sx)
    rs = comm.reduce_scatter(x)
    srs = comm.reduce_scatter(_shared_copy(comm, x))
    return want.tobytes() == sx.tobytes(), rs.tobytes() == srs.tobytes()


def _shared_copy(comm, x):
    s = comm.empty(x.shape, x.dtype)
    s[...] = x
    return s


@pytest.mark.timeout(120)
def test_bfloat16_single_copy_gives_the_private_bits():
    pytest.importorskip("ml_dtypes")
    for res in run_ok(bf16_worker, 3, tree="ring"):
        assert res == (True, True)


# ---------------------------------------------------------------------------------------------
# The matrix: every collective x dtype x op x P = 1..8, on shared inputs, shared outs, mixes of
# shared and private (across ranks, or input vs out), views and slices of shared arrays, and
# arrays of another group (which are private to this one).  Each rank runs the same call twice,
# on private arrays (the reference: test_collectives checks that path against numpy) and on the
# layout under test, and compares the bytes; the parent checks which path ran (bytes sent
# through the rings) where the layout decides it.

MOVES = ["uint8", "float64", "complex128", ">i4", "S5", [("a", "<i2"), ("b", ">f8")],
         np.longdouble, "datetime64[ns]"]
REDUCING = ["bool", "int8", "uint16", "int32", "uint64", "float16", "float32", "float64",
            "complex64", "complex128"]
BIG = 100003                    # every dtype: >= 64 KiB, more than small_bytes; prime
SMALL = (1, 4099)               # inline, and just above small_bytes (P=2)

# layout: (input kind, out kind), every rank alike; out kind "same": out is the input (in
# place), None: no out.  Kinds: priv, shared, slice (a stretch of a larger shared array, the
# same offset on every rank), offset (a stretch at an offset that differs between ranks), view
# (a reshaped view of a 2-D shared array), strided (every other element of a shared array),
# unaligned (a shared byte array one byte in), foreign (a shared array of the other group),
# mixed (shared on even ranks, private on odd ones).
LAYOUTS = {
    "inplace": ("shared", "same"),
    "shared_in": ("shared", None),
    "shared_both": ("shared", "shared"),
    "private_in_shared_out": ("priv", "shared"),
    "shared_in_private_out": ("shared", "priv"),
    "mixed_ranks": ("mixed", "same"),
    "slice": ("slice", "same"),
    "slice_out": ("shared", "slice"),
    "view": ("view", "same"),
    "offsets": ("offset", "same"),
    "strided": ("strided", "same"),
    "unaligned": ("unaligned", "same"),
    "foreign": ("foreign", "same"),
    "foreign_out": ("shared", "foreign"),
}
# the layouts in which every rank's arrays allow the single-copy path of each collective (for
# allreduce: every rank's input in one allocation and every rank's out in one, at any offsets;
# for broadcast and allgather: every rank's out, in one allocation; for reduce_scatter: every
# rank's input, in one allocation; for reduce: the input, and the root's out in the inputs'
# allocation; the others: the private path on every rank)
SINGLE = {
    "allreduce": {"inplace", "shared_both", "slice", "slice_out", "view", "offsets"},
    "broadcast": {"inplace", "shared_both", "private_in_shared_out", "slice", "slice_out",
                  "view", "offsets"},         # (the root copies its input into its out first)
    "reduce": {"inplace", "slice", "view", "offsets"},
    "allgather": {"inplace", "shared_both", "private_in_shared_out", "slice", "slice_out",
                  "view", "offsets"},
    "reduce_scatter": {"inplace", "shared_in", "shared_both", "shared_in_private_out",
                       "slice", "slice_out", "view", "foreign_out", "offsets"},
}


def _carve(comm, other, kind, shape, dtype):
    """An array of `shape` and `dtype` of the given kind (see LAYOUTS)."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    if kind == "priv":
        return np.zeros(shape, dtype)
    if kind == "shared":
        return comm.zeros(shape, dtype)
    if kind == "foreign":
        return other.zeros(shape, dtype)
    if kind == "mixed":                                      # (allocation is collective)
        a = comm.zeros(shape, dtype)
        return np.zeros(shape, dtype) if comm.rank % 2 else a
    if kind in ("slice", "offset"):
        pad = 3 if kind == "slice" else 1 + comm.rank % 3
        return comm.zeros(n + 4, dtype)[pad:pad + n].reshape(shape)
    if kind == "view":
        cols = 1 if n % 7 else 7
        base = comm.zeros((n // cols, cols), dtype)
        return base.reshape(shape)                           # a view of the 2-D array
    if kind == "strided":
        return comm.zeros(tuple(shape) + (2,), dtype)[..., 0]
    if kind == "unaligned":
        raw = comm.zeros(n * dtype.itemsize + 1, np.uint8)
        return raw[1:].view(dtype).reshape(shape)
    raise ValueError(kind)


def _filled(comm, other, kind, x):
    a = _carve(comm, other, kind, x.shape, x.dtype)
    a[...] = x
    return a


def _outs(comm, other, kind, arg, shape, dtype):
    if kind is None:
        return None
    if kind == "same":
        return arg
    return _carve(comm, other, kind, shape, dtype)


def _sent(comm, call):
    """call's result, and the bytes it moved: sent into the rings, or read out of the peers'
    private buffers by cross-memory attach (engine/alg_cma.pxi)."""
    moved = lambda: comm.stats()["bytes_sent"] + comm._engine.cma_counts()["bytes"]  # noqa: E731
    before = moved()
    got = call()
    return got, moved() - before


def matrix_worker(comm, cases, other_group):
    """cases: (collective, dtype, op, n, layout, root); returns per case (the result was `out`
    where one was given, the very bytes of the private path, bytes sent into the rings)."""
    r, P = comm.rank, comm.size
    with warnings.catch_warnings():               # (joining a second group warns)
        warnings.simplefilter("ignore", RuntimeWarning)
        other = other_group.join((r + 1) % P)     # the same processes, other rank numbers
    other.zeros(1)                                # (so that the other group checks its arrays)
    comm.zeros(1)
    res = []
    try:
        for coll, dtype, op, n, layout, root in cases:
            kin, kout = LAYOUTS[layout]
            if coll == "allreduce":
                x = make(dtype, op, n, r)
                want = comm.allreduce(x, op=op)
                a = _filled(comm, other, kin, x)
                o = _outs(comm, other, kout, a, x.shape, x.dtype)
                got, sent = _sent(comm, lambda: comm.allreduce(a, op=op, out=o))
                if o is not a:
                    a[...] = 0                     # a rank may modify its input at once
            elif coll == "reduce":
                x = make(dtype, op, n, r)
                want = comm.reduce(x, op=op, root=root)
                a = _filled(comm, other, kin, x)
                o = _outs(comm, other, kout, a, x.shape, x.dtype)    # (every rank allocates)
                got, sent = _sent(comm, lambda: comm.reduce(a, op=op, root=root,
                                                            out=o if r == root else None))
                if o is not a:
                    a[...] = 0
            elif coll == "reduce_scatter":
                x = make(dtype, op, n, r)
                want = comm.reduce_scatter(x, op=op)
                a = _filled(comm, other, kin, x)
                o = None if kout in (None, "same") else np.zeros_like(want)
                got, sent = _sent(comm, lambda: comm.reduce_scatter(a, op=op, out=o))
                a[...] = 0
            elif coll == "broadcast":
                x = make(dtype, None, n, root)
                want = comm.broadcast(x if r == root else None, root=root)
                a = _carve(comm, other, kin, x.shape, x.dtype)
                if r == root:
                    a[...] = x
                o = _outs(comm, other, kout, a, x.shape, x.dtype)
                got, sent = _sent(comm, lambda: comm.broadcast(a if r == root else None,
                                                               root=root, out=o))
                if r == root and o is not a:
                    a[...] = x[::-1]
            else:                                 # allgather: out has shape (P, n)
                x = make(dtype, None, n, r)
                want = comm.allgather(x)
                o = None if kout is None else _carve(
                    comm, other, kin if kout == "same" else kout, (P, n), x.dtype)
                if kout == "same":
                    a = o[r]                      # in place: out[rank] is the input
                    a[...] = x
                else:
                    a = _filled(comm, other, kin, x)
                got, sent = _sent(comm, lambda: comm.allgather(a, out=o))
                if kout != "same":
                    a[...] = x[::-1]
            if got is None:
                exact, same = want is None, True
            else:
                exact = (got.shape == want.shape and got.dtype == want.dtype
                         and same_bytes(np.ascontiguousarray(got), want))
                same = o is None or got is o or r != root and coll == "reduce"
            res.append((same, exact, sent))
    finally:
        other.close()
    return res


def matrix_cases(P, dtypes_ops, layouts, sizes=(BIG,), moves=MOVES):
    roots = sorted({0, P - 1})
    cases = []
    for i, (dt, op) in enumerate(dtypes_ops):
        for n in sizes:
            for lay in layouts:
                cases.append(("allreduce", dt, op, n, lay, None))
                cases.append(("reduce", dt, op, n, lay, roots[i % len(roots)]))
                cases.append(("reduce_scatter", dt, op, n, lay, None))
    for i, dt in enumerate(moves):
        for n in sizes:
            for lay in layouts:
                cases.append(("broadcast", dt, None, n, lay, roots[(i + 1) % len(roots)]))
                cases.append(("allgather", dt, None, n, lay, None))
    return cases


def check_matrix(P, cases, outs, small_bytes):
    for i, (coll, dt, op, n, layout, root) in enumerate(cases):
        got = [o[i] for o in outs]
        for rank, (same, exact, sent) in enumerate(got):
            assert same and exact, (rank, coll, dt, op, n, layout, root, same, exact)
        nbytes = n * np.dtype(dt).itemsize * (P if coll == "allgather" else 1)
        if P == 1 or nbytes <= small_bytes:
            continue
        sent = [s for _, _, s in got]
        single = layout in SINGLE[coll] or (     # (1-aligned dtypes are aligned anywhere)
            layout == "unaligned" and np.dtype(dt).alignment == 1 and "view" in SINGLE[coll])
        if single:                            # only the agreement and the barrier: no data
            assert max(sent) < 4096, (coll, dt, op, n, layout, root, sent)
        else:                                 # the private path: the data went through rings
            assert max(sent) >= nbytes // 2, (coll, dt, op, n, layout, root, sent)


def run_matrix(P, cases, tree=None):
    with shmtree.Group(P) as other:
        outs = run_ok(matrix_worker, P, args=(cases, other), tree=tree)
    check_matrix(P, cases, outs, shmtree.machine.plan.plan_group(P, tree=tree).small_bytes)


def every_dtype_op():
    return [(dt, op) for dt in REDUCING for op in ops_for(dt)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("P,tree", [(2, None), (3, "ring"), (3, None)])
def test_matrix_every_dtype_and_op_in_place(P, tree):
    """Every reducing dtype and op, and the moves' dtypes, in place on shared arrays, and on
    arrays of another group (the private path); at P=2 small sizes too (inline, and just above
    small_bytes: the single copy)."""
    run_matrix(P, matrix_cases(P, every_dtype_op(), ["inplace", "foreign"],
                               sizes=SMALL + (BIG,) if P == 2 else (BIG,)), tree)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("P,tree", [(2, None), (3, None)])
def test_matrix_every_layout(P, tree):
    """Every layout, with the dtypes and ops spread over them."""
    pairs = every_dtype_op()
    layouts = list(LAYOUTS)
    cases = []
    for j, lay in enumerate(layouts):
        picked = [pairs[(j * 7 + k * 17) % len(pairs)] for k in range(3)]
        cases += matrix_cases(P, picked, [lay], moves=[MOVES[j % len(MOVES)]])
    run_matrix(P, cases, tree)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("P,tree", [(1, None), (4, None), (5, "ring"), (6, "binary"),
                                    (7, None), (8, None), (8, "ring")])
def test_matrix_representative_at_larger_groups(P, tree):
    pairs = [("float32", "sum"), ("float16", "prod"), ("int32", "bxor"), ("complex128", "sum"),
             ("bool", "min"), ("uint64", "max")]
    layouts = ["inplace", "shared_both", "mixed_ranks", "slice", "offsets", "foreign",
               "foreign_out"]
    cases = []
    for j, lay in enumerate(layouts):
        cases += matrix_cases(P, [pairs[j % len(pairs)], pairs[(j + 3) % len(pairs)]], [lay],
                              moves=[MOVES[j % len(MOVES)]])
    run_matrix(P, cases, tree)
