"""The engine's exchange (engine/alg_exchange.pxi): blocks of any sizes between any pairs of
ranks through the outboxes, inline for small totals, single-copy on shared arrays.  Driven
through the one engine entry (Communicator._call, as the executors of alltoall, gather,
scatter and scan use it), against numpy, with the bytes each rank publishes counted."""
import numpy as np
import pytest

from procutil import run_ok
from shmtree.frontend import calls
from shmtree.codes import KIND_ALLTOALL


def exchange(comm, src, dst, C, itemsize):
    """Rank p sends C[p, q] items to rank q (src packed by destination, dst by source)."""
    B = (np.asarray(C, np.uint64) * itemsize).reshape(-1)
    return comm._call(calls.ALLTOALL, src, dst, None, 0, KIND_ALLTOALL, None, 0,
                      [int(itemsize)], B)


def tagged(p, q, k):
    """The items rank p sends rank q: recognisable, p and q and the index in them."""
    return (p * 1_000_000 + q * 1000 + np.arange(k) % 997).astype(np.float64)


def counts_worker(comm, seed, scale, rounds, shared):
    P, me = comm.size, comm.rank
    rng = np.random.default_rng(seed)
    wrong = []
    for it in range(rounds):
        C = rng.integers(0, scale + 1, size=(P, P))
        C[rng.random((P, P)) < 0.3] = 0                      # zeros, whole rows too
        src = np.concatenate([tagged(me, q, C[me, q]) for q in range(P)])
        if shared:
            buf = comm.empty(int(C.sum(axis=1).max()) + 1)
            buf[:src.size] = src
            src = buf[:src.size]
        dst = np.full(int(C[:, me].sum()), -1.0)
        exchange(comm, src, dst, C, 8)
        want = np.concatenate([tagged(p, me, C[p, me]) for p in range(P)])
        if not np.array_equal(dst, want):
            wrong.append(it)
    return wrong


@pytest.mark.parametrize("P", [2, 3, 5])
@pytest.mark.parametrize("scale", [3, 700, 9000])
def test_blocks_of_any_size_reach_their_rank(P, scale):
    """Random count matrices (zeros included), many calls in a row on a small chunk, so that
    items wrap around the outboxes' slots within a call and from call to call."""
    outs = run_ok(counts_worker, P, args=(P * 31 + scale, scale, 6, False), chunk_bytes=4096)
    assert outs == [[]] * P


@pytest.mark.parametrize("P", [2, 4])
def test_single_copy_on_shared_inputs(P):
    outs = run_ok(counts_worker, P, args=(P, 9000, 3, True), chunk_bytes=4096)
    assert outs == [[]] * P


def bytes_worker(comm, n):
    P, me = comm.size, comm.rank
    a = np.arange(P * n, dtype=np.float64).reshape(P, n) + me
    before = comm.stats()["bytes_sent"]
    got = comm._call(calls.ALLTOALL, a, None, None, 0, KIND_ALLTOALL, None,
                     calls.dtype_digest(a.dtype))
    sent = comm.stats()["bytes_sent"] - before
    want = np.stack([np.arange(P * n, dtype=np.float64).reshape(P, n)[me] + s
                     for s in range(P)])
    return sent, bool(np.array_equal(got, want))


@pytest.mark.parametrize("P", [2, 3, 4])
def test_exchange_sends_the_minimum(P, monkeypatch):
    """Each rank publishes (P-1)/P of its input - the blocks of the other ranks, once - and
    nothing else (the descriptor round carries no data)."""
    monkeypatch.setenv("SHMTREE_CMA", "0")  # (the outboxes' bytes: the single copy by cross-
                                             # memory attach has its own count, test_cma.py)
    n = 50000
    outs = run_ok(bytes_worker, P, args=(n,), chunk_bytes=16384)
    X = P * n * 8
    for sent, ok in outs:
        assert ok
        assert sent == (P - 1) * X // P


def inline_then_large_worker(comm):
    """Inline, exchanged and single-copy calls mixed: the tickets stay in step on every rank
    (an exchange that travels inline or single-copy takes none)."""
    P, me = comm.size, comm.rank
    bad = []
    shared = comm.empty((P, 30000))
    for it, n in enumerate([1, 30000, 2, 30000, 30000, 1, 30000]):
        a = shared[:, :n] if it % 3 == 2 else np.empty((P, n))
        a[...] = np.arange(P)[:, None] * 10 + me + it
        src = np.ascontiguousarray(a) if not a.flags.c_contiguous else a
        got = comm._call(calls.ALLTOALL, src, None, None, 0, KIND_ALLTOALL, None,
                         calls.dtype_digest(a.dtype))
        want = (me * 10 + np.arange(P) + it)[:, None] * np.ones(n)
        if not np.array_equal(got, want):
            bad.append(it)
    return bad


def test_inline_exchanged_and_single_copy_calls_mixed():
    assert run_ok(inline_then_large_worker, 3, chunk_bytes=4096) == [[]] * 3


def killed_inside_exchange(comm, shared):
    import os
    import signal
    import threading
    import time

    import shmtree

    P = comm.size
    n = (8 << 20) // P                               # 64 MiB of float64 each: many items
    x = comm.empty((P, n)) if shared else np.empty((P, n))
    x[...] = 1.0
    comm.barrier()
    if comm.rank == 1:                               # dies a few ms into the call
        threading.Timer(0.004, os.kill, (os.getpid(), signal.SIGKILL)).start()
    t0 = time.monotonic()
    try:
        for _ in range(50):
            comm._call(calls.ALLTOALL, x, None, None, 0, KIND_ALLTOALL, None,
                       calls.dtype_digest(x.dtype))
    except shmtree.PeerLostError:
        return "PeerLostError", time.monotonic() - t0
    return None, time.monotonic() - t0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shared", [False, True])
def test_dead_peer_inside_an_exchange(shared):
    """SIGKILL of a rank while the others wait on its outbox (or read its shared input): the
    run names the dead rank, and no one hangs."""
    import shmtree
    with pytest.raises(shmtree.WorkerError) as info:
        shmtree.run(killed_inside_exchange, 3, args=(shared,), chunk_bytes=65536)
    assert info.value.rank == 1 and "SIGKILL" in str(info.value), info.value


# ---------------------------------------------------------------------------------------------
# small calls keep their scratch from call to call


def scratch_worker(comm, n):
    import tracemalloc
    P, me = comm.size, comm.rank
    x = np.arange(P * n, dtype=np.float32).reshape(P, n) + 100 * me
    o = np.empty_like(x)
    g = np.empty((P, n), np.float32) if me == 0 else None
    row = x[0].copy()

    def calls_():
        comm.alltoall(x, out=o)                 # (the engine's byte matrix and its round)
        assert comm.gather(row, 0, out=g) is (g if me == 0 else None)   # (away from the
                                                # root: the engine's own bytes, DISCARD)
    y = np.ones(2, np.float32)

    def reference():                            # (a call known to allocate no array)
        comm.allreduce(y, out=y)
        comm.allreduce(y, out=y)

    def peak(fn):
        for _ in range(3):
            fn()
        peaks = []
        tracemalloc.start()
        try:
            for _ in range(5):                  # (the least of 5: a slow slice runs checks
                tracemalloc.reset_peak()        # that allocate)
                base = tracemalloc.get_traced_memory()[0]
                for _ in range(20):
                    fn()
                peaks.append(tracemalloc.get_traced_memory()[1] - base)
        finally:
            tracemalloc.stop()
        return min(peaks)
    got, ref = peak(calls_), peak(reference)
    want = np.stack([np.arange(P * n, dtype=np.float32).reshape(P, n)[me] + 100 * p
                     for p in range(P)])
    assert o.tobytes() == want.tobytes()
    if me == 0:
        assert g.tobytes() == np.stack([row + 100 * p for p in range(P)]).tobytes()
    return got, ref


@pytest.mark.timeout(120)
@pytest.mark.parametrize("P", [2, 3])
def test_small_alltoall_and_gather_allocate_nothing(P):
    """8 B blocks: alltoall with out= and a gather away from its root allocate no array per
    call (the engine keeps alltoall's byte matrix and inline round, and a gather's unwanted
    blocks go into its own bytes: each was a fresh array per call, 1.2 us of a 2.2 us call)."""
    for got, ref in run_ok(scratch_worker, P, args=(2,)):
        assert got < ref + 64, (got, ref)       # (an ndarray is at least 80 bytes)
