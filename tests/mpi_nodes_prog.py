"""Run under mpiexec by tests/test_multinode.py: shmtree across simulated nodes.

    mpiexec -n N python tests/mpi_nodes_prog.py MODE NODE_SIZE

from_mpi modes (N processes, nodes of NODE_SIZE consecutive ranks; MODE-rr: ranks dealt round-robin
over as many nodes): collectives, set, set-rr, setfail, parsed, mismatch,
failure, kill, sigint, formfail, earlyclose, linktimeout, late, spin.  Launcher modes (N launchers, one per
node, node n forking
NODE_SIZE + n workers through shmtree.run(..., inter=COMM_WORLD)): launch-collectives, launch-set,
launch-mismatch, launch-kill, launch-pool, launch-loop, launch-startfail.  orphans, closebusy: two Links, no group.
Each mode checks its results itself and exits non-zero (with a traceback) on any failure; rank 0
prints "OK <mode>" at the end.
"""
import hashlib
import os
import re
import sys
import time

import numpy as np
from mpi4py import MPI

import shmtree

W = MPI.COMM_WORLD
# PROG_SEGMENT=bytes: segments that small (many of them per message, and allgathers too big
# for a launcher's mailbox)
SEGMENT = {"segment_bytes": int(os.environ["PROG_SEGMENT"])} if "PROG_SEGMENT" in os.environ \
    else {}


def same_everywhere(a, what, comm=None):
    """The same bytes on every rank (global), or fail: compared through MPI, or (workers of a
    launcher, which never call MPI) through comm itself."""
    raw = np.ascontiguousarray(a).tobytes() if a is not None else b""
    if comm is None:
        blobs = W.allgather(raw)
        assert all(b == blobs[0] for b in blobs), f"{what}: ranks got different bits"
        return
    digest = np.frombuffer(hashlib.sha256(raw).digest(), np.uint8)
    every = comm.allgather(digest)
    assert (every == every[0]).all(), f"{what}: ranks got different bits"


def inputs(rank, n, dtype, seed):
    rng = np.random.default_rng(seed * 1000 + rank)
    if dtype == "float16":          # (small integers: every partial sum exact in half)
        return rng.integers(-8, 8, n).astype(dtype)
    if np.dtype(dtype).kind == "f":
        return (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(dtype)
    return rng.integers(0, 50, n).astype(dtype)


def mode_collectives(c, launched=False):
    P, me = c.size, c.rank
    check = c if launched else None
    if not launched:
        assert me == W.rank and P == W.size
    sizes = [tuple(int(v) for v in row) for row in
             c.allgather(np.array([c.node, c.node_rank, c.node_size, c.nodes]))]
    assert len({s[3] for s in sizes}) == 1
    for node in range(c.nodes):
        ranks = [g for g, s in enumerate(sizes) if s[0] == node]
        assert sorted(sizes[g][1] for g in ranks) == list(range(len(ranks)))
    cases = [("float64", "sum"), ("float32", "sum"), ("float32", "max"), ("int64", "prod"),
             ("int32", "bxor"), ("float16", "sum"), ("uint8", "min")]
    # (launchers with small segments: no 1.6 MB case, which costs 20 s through the mailboxes
    # and adds nothing there: lanes need nodes of one size, and 70001 items are pipelined in
    # over a hundred segments already)
    for seed, n in enumerate([0, 1, 5, 1000, 70001] + ([] if launched and SEGMENT else
                                                       [400003])):
        for dtype, op in cases:
            if n > 70001 and dtype not in ("float32", "int32"):
                continue
            xs = [inputs(r, n, dtype, seed) for r in range(P)]
            fold = {"sum": np.add, "max": np.maximum, "prod": np.multiply,
                    "bxor": np.bitwise_xor, "min": np.minimum}[op]
            ref = xs[0].copy()
            for x in xs[1:]:
                ref = fold(ref, x)
            got = c.allreduce(xs[me], op)
            same_everywhere(got, f"allreduce {dtype} {op} {n}", check)
            if dtype in ("float32", "float64") and op == "sum":
                assert np.allclose(got, ref, rtol=1e-4, atol=1e-3 * P), (dtype, n)
            else:
                assert np.array_equal(got, ref), (dtype, op, n)
            # in place, and the non-blocking form: the same bits
            x = xs[me].copy()
            assert c.allreduce(x, op, out=x) is x and np.array_equal(x.view(np.uint8),
                                                                     got.view(np.uint8))
            req = c.iallreduce(xs[me], op)
            assert np.array_equal(req.wait().view(np.uint8), got.view(np.uint8))
            root = (seed + 1) % P
            r = c.reduce(xs[me], op, root=root)
            if me == root:
                assert np.array_equal(r.view(np.uint8), got.view(np.uint8))
            else:
                assert r is None
            if n >= 1:
                rs = c.reduce_scatter(xs[me], op)
                assert np.array_equal(rs.view(np.uint8),
                                      np.array_split(got, P)[me].view(np.uint8))
        # non-contiguous input and output
        if n:
            big = inputs(me, 2 * n, "float64", seed)
            out = np.zeros(2 * n)
            c.allreduce(big[::2], out=out[1::2])
            ref = sum(inputs(r, 2 * n, "float64", seed)[::2] for r in range(P))
            assert np.allclose(out[1::2], ref) and not out[::2].any()
            # an input at an odd address (not aligned for its items): the same bits
            raw = np.zeros(8 * n + 1, np.uint8)
            odd = raw[1:].view(np.float64)
            odd[...] = big[::2]
            assert not odd.flags.aligned
            assert np.array_equal(c.allreduce(odd).view(np.uint8),
                                  c.allreduce(big[::2].copy()).view(np.uint8)), n
        # broadcast from every root, some ranks passing None
        for root in range(P):
            data = np.arange(n * 3, dtype=np.int16).reshape(n, 3) + root
            b = c.broadcast(data if me == root else (None if me % 2 else np.empty_like(data)),
                            root=root)
            assert b.dtype == np.int16 and np.array_equal(b, data), (root, n)
        # allgather: stacked, and along axis 0 with lengths that differ between ranks
        g = c.allgather(np.full((n, 2), me, np.float32))
        assert g.shape == (P, n, 2) and all((g[r] == r).all() for r in range(P))
        g0 = c.allgather(np.full(me + n, me, np.int32), axis=0)
        assert np.array_equal(g0, np.concatenate([np.full(r + n, r, np.int32)
                                                  for r in range(P)]))
        c.barrier()
    # from 4 MiB (nodes.LANES_BYTES; nodes of one size: cut among the lanes): out given, out
    # the input itself, none, reduce, reduce_scatter: the same bits
    n = (4 << 20) // 4 + 12345
    for seed, (dtype, op) in enumerate((("float32", "sum"), ("int32", "bxor"))):
        xs = [inputs(r, n, dtype, 50 + seed) for r in range(P)]
        fold = {"sum": np.add, "bxor": np.bitwise_xor}[op]
        ref = xs[0].copy()
        for x in xs[1:]:
            ref = fold(ref, x)
        got = c.allreduce(xs[me], op)
        same_everywhere(got, f"allreduce {dtype} {op} {n}", check)
        if dtype == "float32":
            assert np.allclose(got, ref, rtol=1e-4, atol=1e-3 * P), (dtype, n)
        else:
            assert np.array_equal(got, ref), (dtype, op, n)
        bits = got.view(np.uint8)
        x = xs[me].copy()
        assert c.allreduce(x, op, out=x) is x and np.array_equal(x.view(np.uint8), bits)
        o = np.empty_like(got)
        assert c.allreduce(xs[me], op, out=o) is o and np.array_equal(o.view(np.uint8), bits)
        r = c.reduce(xs[me], op, root=P - 1)
        assert (r is None) == (me != P - 1)
        if r is not None:
            assert np.array_equal(r.view(np.uint8), bits)
        rs = c.reduce_scatter(xs[me], op)
        assert np.array_equal(rs.view(np.uint8), np.array_split(got, P)[me].view(np.uint8))
    # out overlapping the input without being it: the root's data reaches every rank (and
    # the same array, in place, works directly)
    for n, shift in ((125, 10), (70001, 3), (70001, -5)):
        for root in range(P):
            buf = np.arange(n + 20, dtype=np.float64) + 1000 * me
            lo = 5
            a, out = buf[lo:lo + n], buf[lo + shift:lo + shift + n]
            want = np.arange(n, dtype=np.float64) + lo + 1000 * root
            got = c.broadcast(a, root=root, out=out)
            assert got is out and np.array_equal(out, want), (n, shift, root)
        x = np.arange(n, dtype=np.float64) + 1000 * me
        c.broadcast(x, root=P - 1, out=x)
        assert np.array_equal(x, np.arange(n, dtype=np.float64) + 1000 * (P - 1))
    buf = np.zeros(5 * P + 2, np.int64)
    buf[:5] = np.arange(5) + 10 * me
    out = buf[2:2 + 5 * P].reshape(P, 5)
    c.allgather(buf[:5], out=out)
    assert all(np.array_equal(out[r], np.arange(5) + 10 * r) for r in range(P)), out
    # module-level calls go to this communicator
    assert shmtree.current() is c and shmtree.rank() == me and shmtree.size() == P
    assert float(shmtree.allreduce(np.ones(1))[0]) == P


def mode_parsed(c, launched=False):
    """What calls.py's parse accepts, the communicator across nodes runs (the same as one
    node's): out= a writable buffer of the input's size (array.array), in the blocking and
    nonblocking forms and at a reduce's root; broadcast with only out= on ranks other than the
    root (its shape and dtype are the rank's claim: a wrong one is a mismatch on every rank,
    and the communicator stays usable); reduce_scatter into out=."""
    import array
    P, me = c.size, c.rank
    x = np.arange(6, dtype=np.float64) + me
    want = sum(np.arange(6, dtype=np.float64) + r for r in range(P))
    buf = array.array("d", [0.0] * 6)
    assert c.allreduce(x, out=buf) is buf and np.array_equal(np.frombuffer(buf), want)
    buf = array.array("d", [0.0] * 6)
    assert c.iallreduce(x, out=buf).wait() is buf and np.array_equal(np.frombuffer(buf), want)
    for root in range(P):
        buf = array.array("d", [0.0] * 6)
        got = c.reduce(x, root=root, out=buf)
        if me == root:
            assert got is buf and np.array_equal(np.frombuffer(buf), want), root
        else:
            assert got is None and not any(buf), root        # (out= ignored there)
    for root in range(P):
        data = np.arange(10, dtype=np.int32).reshape(5, 2) * (root + 1)
        out = np.full((5, 2), -1, np.int32)
        got = c.broadcast(data if me == root else None, root=root,
                          out=None if me == root else out)
        assert np.array_equal(got, data) and (me == root or got is out), root
    bad = P - 1
    try:
        c.broadcast(np.arange(4.0) if me == 0 else None, root=0,
                    out=None if me == 0 else np.empty(3 if me == bad else 4))
    except shmtree.CollectiveMismatchError as exc:
        assert f"rank {bad}" in str(exc) and "(3,)" in str(exc), exc
        same_everywhere(np.frombuffer(str(exc).encode(), np.uint8), "the mismatch message",
                        c if launched else None)
    else:
        raise AssertionError(f"rank {me}: a broadcast out= of another shape did not raise")
    full = np.arange(4 * P + 3, dtype=np.int64) * (me + 1)
    piece = np.array_split(np.arange(4 * P + 3), P)[me]
    out = np.zeros(len(piece), np.int64)
    assert c.reduce_scatter(full, out=out) is out
    ref = np.arange(4 * P + 3, dtype=np.int64) * sum(r + 1 for r in range(P))
    assert np.array_equal(out, ref[piece]), (out, ref[piece])
    assert float(c.allreduce(np.ones(1))[0]) == P        # (still usable)


def mode_mismatch(c, launched=False):
    P, me = c.size, c.rank
    bad = P - 1
    for call in ("shape", "op", "kind"):
        try:
            if call == "shape":
                c.allreduce(np.ones(4 if me == bad else 3))
            elif call == "op":
                c.allreduce(np.ones(3), "max" if me == bad else "sum")
            else:
                c.broadcast(np.ones(3), root=0) if me == bad else c.allreduce(np.ones(3))
        except shmtree.CollectiveMismatchError as exc:
            text = str(exc)
            assert f"rank {bad} (node {c.nodes - 1})" in text, text
            same_everywhere(np.frombuffer(text.encode(), np.uint8), "the message",
                            c if launched else None)
        else:
            raise AssertionError(f"rank {me}: no mismatch raised for {call}")
        # the group stays usable
        assert float(c.allreduce(np.ones(1))[0]) == P
    # shared arrays are the node's: a mismatch in the last node names its global ranks
    if c.node_size > 1:
        last = c.nodes - 1
        try:
            c.empty(4 if me == bad else 3)
        except shmtree.CollectiveMismatchError as exc:
            assert c.node == last and f"rank {bad} " in str(exc) and \
                f"(in node {last})" in str(exc), str(exc)
        else:
            assert c.node != last, f"rank {me}: no mismatch raised for empty"
    assert float(c.allreduce(np.ones(1))[0]) == P


def _acc(op, xs, dtype):
    """numpy's inclusive scan of the ranks' inputs, in rank order (DESIGN section 11)."""
    fold = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum,
            "bxor": np.bitwise_xor}[op]
    return fold.accumulate(np.stack(xs), axis=0, dtype=dtype)


def _mpi_op(op):
    return {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN,
            "bxor": MPI.BXOR}[op]


def mode_set(c, launched=False):
    """alltoall (equal blocks, counts=), gather and scatter (axis None and 0, every root), scan
    and exscan across nodes: against numpy on every rank (every rank makes every rank's
    inputs) and, under from_mpi, against MPI's own Alltoall(v), Gather(v), Scatter(v), Scan and
    Exscan on the same inputs; the same bits on every rank; an i-form and a persistent form;
    then mismatches across nodes, each raising on every rank with the same text."""
    P, me = c.size, c.rank
    check = c if launched else None
    mpi = not launched
    rng = np.random.default_rng(7)
    # ---- alltoall, equal blocks: small, and blocks of 200 KB (a launcher's mailbox takes
    # the step between the nodes in rounds) ----
    for dtype, rest in (("float64", (3,)), ("int16", ()), ("float64", (25000,))):
        xs = [inputs(r, P * int(np.prod(rest)), dtype, 11).reshape((P,) + rest)
              for r in range(P)]
        got = c.alltoall(xs[me])
        want = np.stack([xs[s][me] for s in range(P)])
        assert got.dtype == want.dtype and np.array_equal(got, want), (dtype, rest)
        if mpi:
            ref = np.empty_like(xs[me])
            W.Alltoall([xs[me].view(np.uint8), MPI.BYTE], [ref.view(np.uint8), MPI.BYTE])
            assert np.array_equal(ref, got)
    # in place (out= the input), and a structured dtype
    x = np.arange(P * 2, dtype=np.int64).reshape(P, 2) + 100 * me
    assert c.alltoall(x, out=x) is x
    assert all(np.array_equal(x[s], np.arange(2 * me, 2 * me + 2) + 100 * s) for s in range(P))
    st = np.zeros(P, dtype=[("a", "i4"), ("b", "f8")])
    st["a"], st["b"] = np.arange(P) + 10 * me, me
    got = c.alltoall(st)
    assert list(got["a"]) == [10 * s + me for s in range(P)] and list(got["b"]) == list(range(P))
    # ---- alltoall with counts=: random counts, zeros included ----
    for seed in range(3):
        counts = np.random.default_rng(seed).integers(0, 4, (P, P))
        counts[seed % P, :] = 0                  # (a rank that sends nothing)
        data = [np.arange(counts[s].sum() * 2, dtype=np.int32).reshape(-1, 2) + 1000 * s
                for s in range(P)]
        got = c.alltoall(data[me], counts=counts[me].tolist())
        starts = [np.concatenate([[0], np.cumsum(counts[s])]) for s in range(P)]
        want = np.concatenate([data[s][starts[s][me]:starts[s][me + 1]] for s in range(P)])
        assert got.shape == want.shape and np.array_equal(got, want), (seed, got, want)
        out = np.empty_like(want)
        assert c.alltoall(data[me], counts=counts[me].tolist(), out=out) is out
        assert np.array_equal(out, want)
        if mpi:
            ref = np.empty_like(want)
            rb = 8
            W.Alltoallv([data[me].view(np.uint8), (list(counts[me] * rb),
                                                  list(starts[me][:-1] * rb)), MPI.BYTE],
                        [ref.view(np.uint8), (list(counts[:, me] * rb),
                                              list(np.concatenate([[0], np.cumsum(
                                                  counts[:, me])])[:-1] * rb)), MPI.BYTE])
            assert np.array_equal(ref, got)
    # ---- gather: axis None and 0 (lengths differ), every root ----
    for root in range(P):
        xs = [inputs(r, 6, "float32", root).reshape(3, 2) for r in range(P)]
        got = c.gather(xs[me], root=root)
        assert (got is None) == (me != root)
        if got is not None:
            assert np.array_equal(got, np.stack(xs)), root
        ys = [np.full((r + root % 2, 3), r + 0.5) for r in range(P)]
        got0 = c.gather(ys[me], root=root, axis=0)
        if me == root:
            assert np.array_equal(got0, np.concatenate(ys)), root
        out = np.empty((sum(len(y) for y in ys), 3))
        assert c.gather(ys[me], root=root, axis=0, out=out) is (out if me == root else None)
        assert me != root or np.array_equal(out, np.concatenate(ys))
        if mpi:
            ref = np.empty((P, 3, 2), np.float32) if me == root else None
            W.Gather([xs[me], MPI.FLOAT], [ref, MPI.FLOAT] if ref is not None else None,
                     root=root)
            if me == root:
                assert np.array_equal(ref, got)
            lens = [y.size for y in ys]
            ref0 = np.empty(sum(lens)) if me == root else None
            W.Gatherv([ys[me], MPI.DOUBLE], [ref0, lens] if me == root else None, root=root)
            if me == root:
                assert np.array_equal(ref0.reshape(-1, 3), got0)
    # ---- scatter: axis None and 0, every root, some ranks passing out= ----
    for root in range(P):
        full = np.arange(P * 4, dtype=np.int64).reshape(P, 2, 2) * (root + 1)
        out = np.empty((2, 2), np.int64) if me % 2 else None
        got = c.scatter(full if me == root else None, root=root, out=out)
        assert np.array_equal(got, full[me]) and (out is None or got is out), root
        long = np.arange(3 * P + 2, dtype=np.float64) + root
        got0 = c.scatter(long if me == root else None, root=root, axis=0)
        assert np.array_equal(got0, np.array_split(long, P)[me]), root
        if mpi:
            ref = np.empty((2, 2), np.int64)
            W.Scatter([full, MPI.INT64_T] if me == root else None, [ref, MPI.INT64_T], root=root)
            assert np.array_equal(ref, got)
            lens = [len(p) for p in np.array_split(long, P)]
            ref0 = np.empty(lens[me])
            W.Scatterv([long, lens] if me == root else None, [ref0, MPI.DOUBLE], root=root)
            assert np.array_equal(ref0, got0)
    # ---- scan, exscan: bit for bit numpy's accumulate in rank order; small (gathered) and
    # large (the transpose) ----
    for n in (7, 20000):
        for dtype, op in (("float32", "sum"), ("float64", "prod"), ("int32", "max"),
                          ("float16", "sum"), ("int64", "bxor")):
            xs = [inputs(r, n, dtype, 3 + n % 5) for r in range(P)]
            if op == "prod":
                xs = [1 + x / 1e4 for x in xs]
            ref = _acc(op, xs, dtype)
            got = c.scan(xs[me], op)
            assert got.tobytes() == ref[me].tobytes(), (n, dtype, op)
            ex = c.exscan(xs[me], op)
            if me:
                assert ex.tobytes() == ref[me - 1].tobytes(), (n, dtype, op)
            same_everywhere(c.allgather(got), f"scan {dtype} {op}", check)
            if mpi and dtype != "float16":
                m = np.empty_like(xs[me])
                W.Scan(xs[me], m, op=_mpi_op(op))
                e = np.empty_like(xs[me])
                W.Exscan(xs[me], e, op=_mpi_op(op))
                if np.dtype(dtype).kind == "f":    # (MPI's order is its own: close only)
                    tol = 1e-5 * P * float(np.abs(np.stack(xs)).max())
                    assert np.allclose(m, got, rtol=1e-5, atol=tol), (n, dtype, op)
                    assert me == 0 or np.allclose(e, ex, rtol=1e-5, atol=tol)
                else:
                    assert np.array_equal(m, got) and (me == 0 or np.array_equal(e, ex))
        # exscan's rank 0: the op's identity
        z = c.exscan(np.full(n, 5, np.int32), "min")
        assert me or (z == np.iinfo(np.int32).max).all()
        z = c.exscan(np.full(n, 5.0), "max")
        assert me or (z == -np.inf).all()
    # in place
    x = np.arange(10, dtype=np.float64) + me
    assert c.scan(x, out=x) is x
    assert np.array_equal(x, sum(np.arange(10, dtype=np.float64) + r for r in range(me + 1)))
    # ---- an i-form and persistent forms ----
    reqs = [c.ialltoall(np.full((P, 2), me, np.int8)), c.iscan(np.ones(5), "sum"),
            c.igather(np.array([me]), root=P - 1), c.iscatter(
                np.arange(P) * 3 if me == 0 else None, root=0)]
    a2a, sc, ga, sca = [r.wait() for r in reqs]
    assert np.array_equal(a2a, np.repeat(np.arange(P, dtype=np.int8)[:, None], 2, axis=1))
    assert np.array_equal(sc, np.full(5, me + 1.0)) and int(sca) == 3 * me
    assert (ga is None) == (me != P - 1) and (ga is None or list(ga[:, 0]) == list(range(P)))
    buf = np.zeros(4)
    p = c.scan_init(buf, "sum")
    q = c.gather_init(buf, root=0)
    for k in range(3):
        buf[:] = me + k
        r1 = p()
        assert np.array_equal(r1, np.full(4, float(sum(r + k for r in range(me + 1))))), k
        r2 = q.start().wait()
        assert (r2 is None) == (me != 0)
        if r2 is not None:
            assert np.array_equal(r2[:, 0], np.arange(P) + k)
    p.free()
    q.free()
    # persistent forms whose output's shape is the peers' to say: bound from the first call
    pa = c.alltoall_init(np.arange(P, dtype=np.int32) + 10 * me, counts=[1] * P)
    ps = c.scatter_init(np.arange(P * 2).reshape(P, 2) if me == 0 else None, root=0)
    for k in range(3):
        assert np.array_equal(pa(), np.arange(P, dtype=np.int32) * 10 + me), k
        assert np.array_equal(ps.start().wait(), [2 * me, 2 * me + 1]), k
    _set_mismatches(c, check)


def _set_mismatches(c, check):
    """A mismatch of each new collective in the last node: CollectiveMismatchError on every rank
    of every node, the same text everywhere, naming the last rank; the group stays usable."""
    P, me = c.size, c.rank
    bad = P - 1
    last = int(c.allgather(np.array([c.node]))[bad, 0])      # (bad's node)
    calls = {
        "counts": lambda: c.alltoall(np.zeros((P, 2)), counts=[1] * P) if me == bad
        else c.alltoall(np.zeros((P, 2))),
        "rest": lambda: c.alltoall(np.zeros((P, 3 if me == bad else 2))),
        "root": lambda: c.gather(np.zeros(2), root=1 if me == bad else 0),
        "axis": lambda: c.gather(np.zeros(2), root=0, axis=0 if me == bad else None),
        "op": lambda: c.scan(np.zeros(3), "max" if me == bad else "sum"),
        "kind": lambda: c.exscan(np.zeros(3)) if me == bad else c.scan(np.zeros(3)),
        "out": lambda: c.scatter(np.zeros((P, 2)) if me == 0 else None, root=0,
                                 out=np.empty(3) if me == bad else None),
        "outrows": lambda: c.alltoall(np.zeros((P, 1)), counts=[1] * P,
                                      out=np.empty((P + 1 if me == bad else P, 1))),
        "objects": lambda: c.gather(np.array([None, 1], object) if me == bad
                                    else np.zeros(2), root=0),
        "rootshape": lambda: c.scatter(np.zeros((P + 1, 2)) if me == bad else None, root=bad),
    }
    own = {"objects": TypeError, "rootshape": ValueError}     # (the bad rank's own error)
    for what, call in calls.items():
        try:
            call()
        except shmtree.CollectiveMismatchError as exc:
            text = str(exc)
            assert f"rank {bad}" in text and f"node {last}" in text, (what, text)
            if what in own:
                assert me != bad and "cannot take" in text, text
                text = ""
            same_everywhere(np.frombuffer(text.encode(), np.uint8), f"the {what} message",
                            check)
        except (TypeError, ValueError) as exc:
            assert me == bad and isinstance(exc, own.get(what, ())), (what, exc)
            same_everywhere(np.frombuffer(b"", np.uint8), f"the {what} message", check)
        else:
            raise AssertionError(f"rank {me}: no mismatch raised for {what}")
        assert float(c.allreduce(np.ones(1))[0]) == P, what

FAILURE_TIMEOUT_S = 0.5       # mode_failure: rank P-1's timeout
HANG_S = 30.0                 # time for a failure to reach every rank: a hang bound (nothing
                              # else there has a timeout: a missed failure waits for ever)


def mode_failure(c):
    """Rank P-1 times out in its node (its node peers enter only once that timeout has aborted
    the node's group): every rank of every node raises (PeerLostError or the timeout), none
    hangs."""
    P, me = c.size, c.rank
    c.allreduce(np.ones(8))
    t0 = time.monotonic()
    try:
        if me == P - 1:
            c.allreduce(np.ones(1 << 16), timeout=FAILURE_TIMEOUT_S)
        else:
            if c.node == c.nodes - 1:
                # late: only once rank P-1's timeout has aborted the node's group (entering
                # before would let its allreduce complete), not after a guess of how long
                # that takes on a loaded machine
                while not c.group.aborted():
                    assert time.monotonic() - t0 < FAILURE_TIMEOUT_S + HANG_S, \
                        f"rank {me}: rank {P - 1}'s timeout did not abort the node's group"
                    time.sleep(0.01)
            c.allreduce(np.ones(1 << 16))
    except (shmtree.PeerLostError, shmtree.CollectiveTimeoutError) as exc:
        took = time.monotonic() - t0
        # a bound on a hang (no call here has a timeout but rank P-1's), not on speed
        assert took < FAILURE_TIMEOUT_S + HANG_S, took
        print(f"rank {me} raised {type(exc).__name__} after {took:.1f} s: {exc}", flush=True)
    else:
        raise AssertionError(f"rank {me}: no error")
    try:
        c.allreduce(np.ones(1))
    except shmtree.PeerLostError:
        pass
    else:
        raise AssertionError(f"rank {me}: the communicator still works after a failure")
    # a communicator formed again works (nothing of the failed one's links reaches it)
    c.close()
    W.Barrier()
    c2 = shmtree.from_mpi(W, node_size=c.node_size)
    for _ in range(5):
        assert float(c2.allreduce(np.ones(1 << 16))[0]) == P
    c2.close()


def mode_setfail(c):
    """Rank 0 fails inside an alltoall's exchange across nodes (1 s in, before its first step,
    while the other nodes' leaders or lanes wait for it in Link.exchange): every
    rank of every node raises (rank 0 its error, the others PeerLostError naming the call),
    none waits, whether it waited in its node or between the nodes (Link.exchange); later
    calls fail at once."""
    import types
    P, me = c.size, c.rank
    c.alltoall(np.zeros((P, 4)))
    if me == 0:
        def broken(self, *args):      # (late: the other leaders wait in Link.exchange)
            time.sleep(1.0)
            raise RuntimeError("injected: rank 0 fails inside the exchange")
        c._exchange_nodes = types.MethodType(broken, c)
    t0 = time.monotonic()
    try:
        c.alltoall(np.zeros((P, 1 << 14)))
    except (RuntimeError, shmtree.PeerLostError) as exc:
        took = time.monotonic() - t0
        assert took < HANG_S, took
        assert me == 0 or "alltoall #2 across nodes" in str(exc), exc
        print(f"rank {me} raised {type(exc).__name__} after {took:.1f} s: {exc}", flush=True)
    else:
        raise AssertionError(f"rank {me}: no error")
    try:
        c.scan(np.ones(3))
    except shmtree.PeerLostError:
        pass
    else:
        raise AssertionError(f"rank {me}: the communicator still works after a failure")

def mode_sigint(c):
    """Nodes of 2: rank 1 (node 0) is interrupted by SIGINT inside an allreduce (PROG_BYTES
    bytes) that rank 2 (node 1's leader: rank 0's partner between the nodes) has not entered:
    every other rank, rank 1's own node peer included, raises before rank 2 arrives (which
    waits until told, or 60 s); then rank 2's call fails at once too."""
    import signal
    import threading
    P, me = c.size, c.rank
    late, victim = 2, 1
    n = int(os.environ.get("PROG_BYTES", "64")) // 8
    c.allreduce(np.ones(8))
    W.Barrier()
    if me == late:
        told, t0 = set(), time.monotonic()
        while len(told) < P - 1 and time.monotonic() - t0 < 30:
            st = MPI.Status()
            if W.Iprobe(source=MPI.ANY_SOURCE, tag=77, status=st):
                W.recv(source=st.Get_source(), tag=77)
                told.add(st.Get_source())
            else:
                time.sleep(0.005)
        assert len(told) == P - 1, (f"ranks {sorted(set(range(P)) - {late} - told)} did not "
                                    f"raise before the late rank arrived")
    elif me == victim:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    t0 = time.monotonic()
    try:
        c.allreduce(np.ones(n))
    except (KeyboardInterrupt, shmtree.PeerLostError) as exc:
        took = time.monotonic() - t0
        print(f"rank {me} raised {type(exc).__name__} after {took:.2f} s: {exc}", flush=True)
        if me != late:
            W.send(took, dest=late, tag=77)
    else:
        raise AssertionError(f"rank {me}: no error")


def mode_earlyclose(c):
    """Nodes of 2 (one size: lanes): a small allreduce ends on lane 0 and rank 0 closes its
    communicator (its node's group with it) while rank 1's lane (with rank 3, held back until
    rank 0 has closed) still folds: rank 1's step needs nothing of the node any more and ends
    with the right sum instead of taking the closed group for a failure."""
    from shmtree.internode.inter import Link
    P, me = c.size, c.rank
    assert c.nodes == 2 and c.node_size == 2 and c._lane is not None
    if me == 3:
        real = Link.allreduce

        def held(link, buf, op):
            W.recv(source=0, tag=88)          # (rank 0 has closed)
            return real(link, buf, op)
        Link.allreduce = held
    try:
        got = c.allreduce(np.full(5, float(me + 1)))
    finally:
        if me == 3:
            Link.allreduce = real
    assert np.array_equal(got, np.full(5, float(sum(range(1, P + 1))))), (me, got)
    if me == 0:
        c.close()
        W.send(None, dest=3, tag=88)


def mode_linktimeout(c):
    """Nodes of 1: rank 0's allreduce has a timeout and rank 1 enters only once rank 0 has
    raised: rank 0's step between the nodes (inline: the link is idle) raises
    CollectiveTimeoutError within its timeout's reach, its next call and rank 1's raise
    PeerLostError (none hangs)."""
    P, me = c.size, c.rank
    assert c.nodes == P
    c.allreduce(np.ones(8))
    if me == 0:
        t0 = time.monotonic()
        try:
            c.allreduce(np.ones(8), timeout=FAILURE_TIMEOUT_S)
        except shmtree.CollectiveTimeoutError as exc:
            took = time.monotonic() - t0
            assert "timed out in allreduce #2 across nodes; rank 1 (node 1) had not " \
                "arrived" in str(exc), exc
            assert took < FAILURE_TIMEOUT_S + HANG_S, took
            print(f"rank 0 raised CollectiveTimeoutError after {took:.1f} s: {exc}", flush=True)
        else:
            raise AssertionError("rank 0: no timeout")
        for r in range(1, P):
            W.send(None, dest=r, tag=89)
    else:
        W.recv(source=0, tag=89)
    try:
        c.allreduce(np.ones(8))
    except shmtree.PeerLostError as exc:
        print(f"rank {me} raised PeerLostError: {exc}", flush=True)
    else:
        raise AssertionError(f"rank {me}: the communicator still works after a timeout")


LATE_S = 2.0                # mode_late: how late the last rank enters
LATE_TIMEOUT_S = 0.6        # the others' timeout


def mode_late(c):
    """The last rank enters an allreduce LATE_S late; the others pass timeout=LATE_TIMEOUT_S.
    Every on-time rank raises CollectiveTimeoutError naming the user's call and the late
    rank's global number (or its node's ranks) as the one that had not arrived, never an
    on-time rank alone; the late rank raises PeerLostError."""
    P, me = c.size, c.rank
    late = P - 1
    c.allreduce(np.ones(8))
    W.Barrier()
    if me == late:
        time.sleep(LATE_S)
    try:
        c.allreduce(np.ones(8), timeout=LATE_TIMEOUT_S)
    except shmtree.CollectiveTimeoutError as exc:
        text = str(exc)
        assert me != late, f"rank {me}: {text}"
        assert "allreduce" in text and "had not arrived" in text, text
        missing = re.search(r";\s*([^;]*?) had not arrived", text).group(1)
        named = {int(r) for r in re.findall(r"\d+", re.sub(r"node \d+", "", missing))}
        assert late in named, f"rank {me}: the late rank {late} is not named: {text}"
        node_of_late = [r for r in range(P) if r // c.node_size == late // c.node_size]
        assert named <= set(node_of_late), f"rank {me}: names on-time ranks: {text}"
        print(f"rank {me} raised CollectiveTimeoutError: {text}", flush=True)
    except shmtree.PeerLostError as exc:
        assert me == late, f"rank {me}: {exc}"
        print(f"rank {me} raised PeerLostError: {exc}", flush=True)
    else:
        raise AssertionError(f"rank {me}: no error")


def killed(who):
    """SIGKILL this process, saying when first (time.monotonic: the clock of every process of
    the machine), so that the test measures how long the job takes to end from the kill, not
    from its start (a loaded machine stretches the start)."""
    print(f"{who} killed at {time.monotonic():.3f}", flush=True)
    os.kill(os.getpid(), 9)


def mode_spin(c):
    """What the nodes' groups spin before they yield: 0 when the machine has more of the job's
    processes than cores (whatever a node's group has), else the plan's default."""
    from mpi4py import MPI
    host = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    over = host.Get_size() > len(os.sched_getaffinity(0))
    host.Free()
    spin = c.local.group.plan.spin_ns
    assert (spin == 0) == over, (spin, over)
    print(f"rank {c.rank}: spin_ns {spin} oversubscribed {over}", flush=True)
    assert np.array_equal(c.allreduce(np.ones(10)), np.full(10, float(c.size)))


def mode_kill(c):
    P, me = c.size, c.rank
    c.allreduce(np.ones(8))
    if me == P - 1:
        killed(f"rank {me}")
    c.allreduce(np.ones(1 << 18))
    time.sleep(60)


def launched(comm, mode):
    """A worker of a launcher: the mode's checks on the communicator across nodes."""
    if mode == "kill":
        comm.allreduce(np.ones(8))
        if comm.rank == comm.size - 1:
            killed(f"worker {comm.rank}")
        comm.allreduce(np.ones(1 << 18))
        raise AssertionError(f"rank {comm.rank}: the allreduce survived a dead peer")
    if mode == "exit":                 # collectives until the launcher of node 1 is killed
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:
            comm.allreduce(np.ones(1 << 12))
        raise AssertionError(f"rank {comm.rank}: still running after 60 s")
    globals()[f"mode_{mode}"](comm, launched=True)
    return comm.rank, comm.node, comm.node_rank


def pool_task(x):
    return float(shmtree.allreduce(np.array([x], float))[0]), shmtree.rank(), shmtree.size()


def pool_spmd(comm):
    return comm.rank, comm.node, int(comm.allreduce(np.ones(3, np.int64))[0])


def main_pool(base):
    """A Pool per node across nodes: pool.run (SPMD) and map, whose tasks of one round meet in
    an allreduce across nodes (every node deals 3 rounds)."""
    workers = base + W.rank
    counts = W.allgather(workers)
    offset, P = sum(counts[:W.rank]), sum(counts)
    with shmtree.Pool(workers, inter=W, **SEGMENT) as pool:
        assert pool.run(pool_spmd) == [(offset + r, W.rank, P) for r in range(workers)]
        got = pool.map(pool_task, range(3 * workers))
    xs = W.allgather(list(range(3 * workers)))
    for k in range(3):          # round k: tasks k*w .. k*w+w-1 of every node
        want = float(sum(x for n, w in enumerate(counts) for x in xs[n][k * w:(k + 1) * w]))
        assert all(v == want and s == P for v, _, s in got[k * workers:(k + 1) * workers]), got
    assert sorted(r for _, r, _ in got[:workers]) == [offset + r for r in range(workers)]
    W.Barrier()
    if W.rank == 0:
        print("OK launch-pool", flush=True)


def loop_spmd(comm):
    return int(comm.allreduce(np.ones(3, np.int64))[0])


def main_loop(base):
    """Groups across nodes made and closed again and again (run, then Pool): every one works
    (a launcher closing its group must not fail the others' groups, now or later)."""
    workers = base + W.rank
    P = sum(W.allgather(workers))
    for i in range(int(os.environ.get("PROG_ROUNDS", "12"))):
        try:
            got = shmtree.run(loop_spmd, workers, inter=W, **SEGMENT)
            assert got == [P] * workers, got
            with shmtree.Pool(workers, inter=W, **SEGMENT) as pool:
                assert pool.run(loop_spmd) == [P] * workers
        except Exception as exc:        # (the other launchers would wait in the next round)
            print(f"launcher {W.rank}: round {i} failed: {type(exc).__name__}: {exc}",
                  flush=True)
            W.Abort(1)
    W.Barrier()
    if W.rank == 0:
        print("OK launch-loop", flush=True)


def main_startfail(base):
    """Launcher 1 cannot start: a segment_bytes too small (refused as the proxy starts), a tree
    the planner refuses (before its group exists), a misspelt option of run and of Pool (before
    anything).  It raises its own error, every other launcher a ShmtreeError naming node 1 (none
    waits for it in MPI); then all start again."""
    workers = base + W.rank
    for bad, error, words, pool in (({"segment_bytes": 1000}, ValueError, "at least 4096", False),
                                    ({"tree": "no-such-tree"}, ValueError, "tree", False),
                                    ({"chunk_byte": 4096}, TypeError, "chunk_bytes", False),
                                    ({"chunk_byte": 4096}, TypeError, "chunk_bytes", True)):
        mine = bad if W.rank == 1 else {}
        try:
            if pool:
                with shmtree.Pool(workers, inter=W, **mine) as p:
                    p.run(loop_spmd)
            else:
                shmtree.run(loop_spmd, workers, inter=W, **mine)
        except error as exc:
            assert W.rank == 1 and words in str(exc), exc
        except shmtree.ShmtreeError as exc:
            assert W.rank != 1 and \
                f"node 1 could not start its group: {error.__name__}" in str(exc), exc
        else:
            raise AssertionError(f"launcher {W.rank}: no error for {bad}")
    P = sum(W.allgather(workers))
    assert shmtree.run(loop_spmd, workers, inter=W) == [P] * workers
    W.Barrier()
    if W.rank == 0:
        print("OK launch-startfail", flush=True)


def main_launcher(mode, base):
    if mode == "pool":
        return main_pool(base)
    if mode == "startfail":
        return main_startfail(base)
    if mode == "loop":
        return main_loop(base)
    workers = base + W.rank
    t0 = time.monotonic()
    if mode == "exit" and W.rank == 1:
        import threading
        threading.Timer(1.0, killed, (f"launcher {W.rank}",)).start()
    try:
        got = shmtree.run(launched, workers, args=(mode,), inter=W, **SEGMENT,
                          **({"start_method": os.environ["PROG_START"]}
                             if "PROG_START" in os.environ else {}))
    except shmtree.WorkerError as exc:
        took = time.monotonic() - t0
        assert mode == "kill", exc
        print(f"launcher {W.rank}: WorkerError rank {exc.rank} after {took:.1f} s: {exc}",
              flush=True)
        return
    assert mode != "kill"
    offset = sum(W.allgather(workers)[:W.rank])
    assert got == [(offset + r, W.rank, r) for r in range(workers)], got
    W.Barrier()
    if W.rank == 0:
        print(f"OK launch-{mode}", flush=True)


def main_formfail(node_size):
    """One process of the last node cannot form its node's group (PROG_FAIL=create: its
    creator, join: its last member): every rank of every node raises the same ShmtreeError
    naming that node and rank (none waits in a global step), and from_mpi works again."""
    import shmtree.groups.group as sg
    import shmtree.internode.nodes as sn
    P, me = W.size, W.rank
    last = list(range(P))[(P - 1) // node_size * node_size:]
    victim = last[0] if os.environ["PROG_FAIL"] == "create" else last[-1]
    if me == victim:
        real_group, real_from_token = sn.Group, sg.Group.from_token

        class Refused(real_group):
            def __init__(self, *a, **k):
                raise OSError("simulated: no memory for the segment")

            @classmethod
            def from_token(cls, token):
                raise OSError("simulated: cannot open the segment")
        sn.Group = Refused
    t0 = time.monotonic()
    try:
        shmtree.from_mpi(W, node_size=node_size)
    except shmtree.ShmtreeError as exc:
        text = str(exc)
        node = (P - 1) // node_size
        assert f"node {node} could not form a group" in text and f"rank {victim}:" in text \
            and "simulated" in text, text
        same_everywhere(np.frombuffer(text.encode(), np.uint8), "the message")
        print(f"rank {me} raised after {time.monotonic() - t0:.1f} s: {text}", flush=True)
    else:
        raise AssertionError(f"rank {me}: from_mpi did not raise")
    if me == victim:
        sn.Group = real_group
    c = shmtree.from_mpi(W, node_size=node_size)
    assert float(c.allreduce(np.ones(1))[0]) == P
    c.close()
    W.Barrier()
    if me == 0:
        print("OK formfail", flush=True)


class _StubGroup:
    """What a Link needs of its node's group, aborted on demand."""
    closed = False

    def __init__(self):
        self.failed = False

    def aborted(self):
        return self.failed

    def abort(self, *args, **kwargs):
        self.failed = True

    def describe_abort(self):
        return "rank 0 failed (the test aborted it); the group is aborted"


def main_orphans():
    """Two leaders' Links.  Leader 0's allreduce step posts its receive into a temporary and
    is aborted (its node fails) before leader 1 sends; then leader 1 sends what leader 0's
    receive expects, straight on the link's communicator.  MPI completes that receive: into
    memory the failed step must have kept (not freed under MPI: a SIGSEGV or a corrupted
    array of leader 0)."""
    import gc
    import threading
    from shmtree.internode.inter import Link, TAG_RS
    me = W.rank
    stub = _StubGroup()
    link = Link(W.Dup(), stub)
    n = 8 << 20                                      # float64: 64 MiB, halves of 32 MiB
    if me == 0:
        threading.Timer(0.2, setattr, (stub, "failed", True)).start()
        try:
            link.run(Link.allreduce, np.ones(n), "sum")
        except shmtree.PeerLostError:
            pass
        else:
            raise AssertionError("leader 0: the step did not fail")
        gc.collect()
        fresh = [np.full(n // 2, 7.0) for _ in range(4)]   # (where a freed temporary was)
        W.send("go", dest=1)
        assert W.recv(source=1) == "sent"            # (MPI progresses here: the receive)
        assert all((f == 7.0).all() for f in fresh), "a late receive wrote into leader 0's " \
            "memory"
    else:
        assert W.recv(source=0) == "go"
        half = np.full(n // 2, 3.0)
        req = link.comm.Isend([half.view(np.uint8), MPI.BYTE], dest=0, tag=TAG_RS)
        while not req.Test():
            time.sleep(0.001)
        W.send("sent", dest=0)
    link.close()
    W.Barrier()
    if me == 0:
        print("OK orphans", flush=True)


def main_closebusy():
    """Leader 0 closes its Link while another thread of it (as a launcher's proxy thread does)
    runs a step inline that leader 1 never joins: close makes that step fail (PeerLostError in
    that thread, the other leader told) and returns, instead of acting on the link's MPI
    requests under the running step and leaving it to spin for ever."""
    import threading
    from shmtree.internode.inter import Link
    me = W.rank
    stub = _StubGroup()
    link = Link(W.Dup(), stub)
    if me == 0:
        seen = []

        def step():
            try:
                link.run(Link.bcast, np.zeros(1 << 20, np.uint8), 1)
            except shmtree.PeerLostError as exc:
                seen.append(exc)
        t = threading.Thread(target=step)
        t.start()
        while not link._running:                 # (the step has started)
            time.sleep(0.001)
        t0 = time.monotonic()
        link.close()
        t.join(30)
        assert not t.is_alive(), "leader 0: the step still runs after close"
        assert seen and "closed during an inter-node step" in str(seen[0]), seen
        print(f"leader 0: closed in {time.monotonic() - t0:.2f} s", flush=True)
        W.send("closed", dest=1)
    else:
        assert W.recv(source=0) == "closed"
        t0 = time.monotonic()
        while link.failure is None and time.monotonic() - t0 < 30:
            time.sleep(0.01)
        assert link.failure and "closed during an inter-node step" in link.failure, \
            link.failure
        link.close()
    W.Barrier()
    if me == 0:
        print("OK closebusy", flush=True)


class _RoundRobin(MPI.Intracomm):
    """COMM_WORLD whose first Split (from_mpi's grouping into simulated nodes of node_size
    consecutive ranks) deals the ranks round-robin over `nodes` nodes instead: node n holds
    ranks n, n + nodes, ... (a placement mpiexec makes with --map-by node)."""

    def __new__(cls, comm, nodes):
        self = super().__new__(cls, comm)
        self._nodes, self._first = nodes, True
        return self

    def Split(self, color=0, key=0):
        if self._first:
            self._first = False
            color = self.Get_rank() % self._nodes
        return super().Split(color, key)


def main():
    mode, node_size = sys.argv[1], int(sys.argv[2])
    if mode == "closebusy":
        return main_closebusy()
    if mode == "orphans":
        return main_orphans()
    if mode.startswith("launch-"):
        return main_launcher(mode[len("launch-"):], node_size)
    if mode == "formfail":
        return main_formfail(node_size)
    if mode.endswith("-rr"):        # nodes of ranks dealt round-robin (not consecutive)
        mode = mode[:-3]
        c = shmtree.from_mpi(_RoundRobin(W, -(-W.size // node_size)), node_size=node_size,
                             **SEGMENT)
        assert c.node == W.rank % c.nodes and c._in_order == (c.nodes == 1)
    else:
        c = shmtree.from_mpi(W, node_size=node_size, **SEGMENT)
    globals()[f"mode_{mode}"](c)
    if mode not in ("failure", "sigint", "linktimeout", "setfail", "late"):
        c.close()
    W.Barrier()
    if W.rank == 0:
        print(f"OK {mode}", flush=True)


if __name__ == "__main__":
    if sys.argv[1].startswith(("set", "launch-set")):
        try:          # (a failed check must end the job, not leave the other ranks waiting
            main()    # in MPI's own collectives, which the set modes compare against)
        except BaseException:
            import traceback
            traceback.print_exc()
            sys.stderr.flush()
            W.Abort(1)
    else:
        main()
