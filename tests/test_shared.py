"""Shared arrays (comm.empty / comm.zeros) and the single-copy allreduce (shmtree/shared.py).

The single-copy path must give the very bits of the private path in the same group (the same
reduction order), for every schedule; it must run only when every rank passed shared arrays at
the same place (otherwise the private path, on every rank alike); allocation is a collective
with mismatch detection; memory goes with the arrays.
"""
import os
import signal
import time

import numpy as np
import pytest

import shmtree
from procutil import run_ok
from test_collectives import make, ops_for

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
    def fds():
        return len(os.listdir("/proc/self/fd"))
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
