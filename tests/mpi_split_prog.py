"""Run under mpiexec by tests/test_split.py: sub-communicators of communicators across
(simulated) nodes.

    mpiexec -n N python tests/mpi_split_prog.py from_mpi NODE_SIZE   (nodes of NODE_SIZE ranks)
    mpiexec -n N python tests/mpi_split_prog.py launch WORKERS       (a launcher per node, each
                                                                       running WORKERS workers;
                                                                       splits across nodes go
                                                                       through their proxies,
                                                                       messages between nodes
                                                                       through the launchers)
    mpiexec -n N python tests/mpi_split_prog.py launch-fail WORKERS  (a timeout between nodes:
                                                                       every worker raises)

Every rank checks its results itself and exits non-zero (a traceback) on any failure; rank 0
(launcher 0) prints "OK <mode>" at the end.
"""
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import shmtree

W = MPI.COMM_WORLD


def check(comm):
    """Splits of `comm` (a communicator across nodes): node-local ones work, and ones whose
    new communicators span nodes (check_across); comm stays usable throughout."""
    g = comm.rank
    node_ranks = [int(v) for v in comm.allgather(np.array(comm.node))]
    mine = [r for r in range(comm.size) if node_ranks[r] == comm.node]
    with comm.split_by("node") as sub:
        assert (sub.size, sub.rank) == (len(mine), mine.index(g)), (sub, mine)
        assert int(sub.allreduce(np.array([g]))[0]) == sum(mine)
        assert sub.allgather(np.array(g)).tolist() == mine
        with sub.split(sub.rank % 2) as inner:            # a split of a split
            want = [r for r in mine if mine.index(r) % 2 == sub.rank % 2]
            assert inner.allgather(np.array(g)).tolist() == want
    with comm.split(comm.node, key=-g) as rev:            # node-local, reversed
        assert rev.allgather(np.array(g)).tolist() == mine[::-1]
    with comm.split_by("socket") as sock:                 # within a node by nature
        assert set(sock.allgather(np.array(g)).tolist()) <= set(mine)
    out = comm.split(None if g == 0 else comm.node)
    assert (out is None) == (g == 0)
    if out is not None:
        assert out.allgather(np.array(g)).tolist() == [r for r in mine if r != 0]
        out.close()
    if comm.nodes > 1:
        check_across(comm)
        messages_between_nodes(comm)
        splits_leave_the_launcher_flat(comm)
    assert int(comm.allreduce(np.array([1]))[0]) == comm.size
    return g


def messages_between_nodes(comm):
    """Messages between nodes (from_mpi: over MPI; inter=: relayed by the launchers): rings at
    every size, tags received in reverse, a structured dtype, out= mismatch, an irecv pending
    across a collective; and on a sub-communicator across nodes (sub_messages)."""
    r, P = comm.rank, comm.size
    for n in (1, 1000, 1 << 17, 1 << 21):
        got = comm.sendrecv(np.full(n, r), (r + 1) % P, (r - 1) % P, sendtag=3, recvtag=3)
        assert got.shape == (n,) and (got == (r - 1) % P).all(), (r, n)
    reqs = [comm.isend(np.array([r, k]), (r + 2) % P, tag=20 + k) for k in range(5)]
    for k in (4, 3, 2, 1, 0):
        assert comm.recv((r - 2) % P, tag=20 + k).tolist() == [(r - 2) % P, k]
    shmtree.wait_all(reqs, 60)
    dt = np.dtype([("a", "<i2"), ("b", ">f8", (2,))])
    x = np.zeros((3, 2), dt)
    x["a"], x["b"] = r, -r
    got = comm.sendrecv(x, (r + 1) % P, (r - 1) % P, sendtag=4, recvtag=4)
    assert got.dtype == dt and got.shape == (3, 2) and (got["a"] == (r - 1) % P).all()
    mismatch_then_pending(comm, 5)
    relays = launcher_threads()
    with comm.split(r % 2, key=-r) as sub:          # across the nodes (inter=: its relay)
        sub_messages(sub)
        with sub.dup() as again:                    # a split of it, across nodes again
            sub_messages(again)
    assert int(comm.allreduce(np.array([1]))[0]) == P      # (every member closed it)
    t0 = time.monotonic()
    while launcher_threads() != relays:             # (its relay stops: its proxy closes)
        assert time.monotonic() - t0 < 10, (relays, launcher_threads())
        time.sleep(0.05)


def splits_leave_the_launcher_flat(comm, count=40):
    """inter=: splits across nodes, each used and closed, leave the launcher's threads and
    descriptors as they were (each made a child proxy: a mailbox, a link and a relay on the
    family's communicator, a mapping of the node's part; all go when the members close it)."""
    threads = launcher_threads()
    if threads is None:
        return
    fds = len(os.listdir(f"/proc/{os.getppid()}/fd"))
    for _ in range(count):
        with comm.split(comm.rank % 2) as sub:
            assert int(sub.allreduce(np.array([1]))[0]) == sub.size
    comm.barrier()
    t0 = time.monotonic()
    while launcher_threads() != threads or len(os.listdir(f"/proc/{os.getppid()}/fd")) > fds:
        assert time.monotonic() - t0 < 10, (threads, launcher_threads(), fds,
                                            len(os.listdir(f"/proc/{os.getppid()}/fd")))
        time.sleep(0.05)


def launcher_threads():
    """inter=: the names of the launcher's threads (a worker's parent), sorted; None under
    from_mpi."""
    if getattr(shmtree.current(), "_mpi", None) is not None:
        return None
    names = []
    for t in os.listdir(f"/proc/{os.getppid()}/task"):
        try:
            with open(f"/proc/{os.getppid()}/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return sorted(names)


def sub_messages(sub):
    """Messages on a sub-communicator across nodes (from_mpi: over MPI; inter=: relayed by its
    own launchers' relay): a sendrecv ring over its ranks at several dtypes and sizes (one over
    1 MiB), tags received out of order from a rank of another node, an out= mismatch."""
    r, P = sub.rank, sub.size
    nodes = [int(v) for v in sub.allgather(np.array(sub.node))]
    assert len(set(nodes)) > 1, nodes
    for dtype, n in ((np.int64, 1), (np.float32, 1000), (np.uint8, 3 << 20),
                     (np.float64, (1 << 18) + 3)):
        x = (np.arange(n) % 251 + r).astype(dtype)
        got = sub.sendrecv(x, (r + 1) % P, (r - 1) % P, sendtag=7, recvtag=7)
        want = (np.arange(n) % 251 + (r - 1) % P).astype(dtype)
        assert got.dtype == dtype and np.array_equal(got, want), (r, dtype, n)

    def there(q):                                   # a rank of another node than q's
        return next(p for p in range(P) if nodes[p] != nodes[q])

    reqs = [sub.isend(np.array([r, k]), there(r), tag=30 + k) for k in range(4)]
    for q in [q for q in range(P) if there(q) == r]:           # who sends to this rank
        for k in (3, 1, 0, 2):
            assert sub.recv(q, tag=30 + k, timeout=60).tolist() == [q, k], (r, q, k)
    shmtree.wait_all(reqs, 60)
    mismatch_then_pending(sub, 8)


def mismatch_then_pending(comm, tag):
    """On a ring over comm's ranks: an out= mismatch (the receiver raises, the message is
    consumed: the next one with that tag comes next), then an irecv (tag + 1) pending across a
    collective."""
    r, P = comm.rank, comm.size
    try:
        comm.sendrecv(np.ones(3), (r + 1) % P, (r - 1) % P, sendtag=tag, recvtag=tag,
                      out=np.empty(4))
        raise AssertionError("out= of the wrong shape was taken")
    except ValueError as exc:
        assert "consumed" in str(exc), exc
    got = comm.sendrecv(np.array([r]), (r + 1) % P, (r - 1) % P, sendtag=tag, recvtag=tag)
    assert int(got[0]) == (r - 1) % P, (r, got)
    req = comm.irecv((r - 1) % P, tag=tag + 1)
    assert int(comm.allreduce(np.array([1]))[0]) == P
    comm.send(np.array([r]), (r + 1) % P, tag=tag + 1)
    assert int(req.wait(60)[0]) == (r - 1) % P


def time_out_between_nodes(comm, words="timed out in recv from rank"):
    """Rank 0 times out in a receive from the last rank (on another node); every other rank,
    in a receive nothing satisfies, raises PeerLostError within seconds instead of hanging.
    (Also tests/mpi_p2p_prog.py's, under from_mpi.)"""
    r, P = comm.rank, comm.size
    t0 = time.monotonic()
    try:
        if r == 0:
            comm.recv(P - 1, tag=5, timeout=0.5)
        else:
            comm.recv((r + 2) % P, tag=6)
        raise AssertionError("a receive returned")
    except shmtree.CollectiveTimeoutError as exc:
        assert r == 0 and words in str(exc), exc
    except shmtree.PeerLostError as exc:
        assert r != 0 and "timed out" in str(exc), exc
    assert time.monotonic() - t0 < 20, time.monotonic() - t0


def failing(comm):
    """inter=: the timeout between nodes (the launchers relay the message and carry the
    failure), first on a sub-communicator across nodes (its own launchers' relay: the
    parent stays usable), then on the whole; the worker then fails on purpose (SystemExit 3),
    as its run must."""
    with comm.split(comm.rank % 2) as sub:
        time_out_between_nodes(sub, "through the launcher")
    assert int(comm.allreduce(np.array([1]))[0]) == comm.size
    time_out_between_nodes(comm, "through the launcher")
    print(f"worker {comm.rank} raised as expected", flush=True)
    raise SystemExit(3)                             # (the worker's failure ends the run)


def check_across(comm):
    """Splits whose new communicators span nodes (from_mpi, and inter=: through the launchers'
    proxies): every collective of them, nested
    splits of them (across nodes again, and node-local), and the parent meanwhile."""
    g = comm.rank
    for color_of, key_of in ((lambda r: r % 2, lambda r: r), (lambda r: 0, lambda r: -r),
                             (lambda r: None if r == 1 else r % 3, lambda r: r)):
        want = sorted((r for r in range(comm.size) if color_of(r) == color_of(g)
                       and color_of(r) is not None), key=lambda r: (key_of(r), r))
        sub = comm.split(color_of(g), key=key_of(g))
        if color_of(g) is None:
            assert sub is None
            assert int(comm.allreduce(np.array([1]))[0]) == comm.size    # (as the others)
            continue
        assert (sub.rank, sub.size) == (want.index(g), len(want)), (sub, want)
        assert sub.allgather(np.array(g)).tolist() == want
        x = np.arange(100_000, dtype=np.float64) * (g + 1)
        assert float(sub.allreduce(x)[-1]) == 99_999.0 * sum(r + 1 for r in want)
        b = sub.broadcast(np.array([g]) if sub.rank == sub.size - 1 else None,
                          root=sub.size - 1)
        assert int(b[0]) == want[-1]
        req = sub.iallreduce(np.array([g]))
        assert int(comm.allreduce(np.array([1]))[0]) == comm.size   # the parent meanwhile
        assert int(req.wait(30)[0]) == sum(want)
        with sub.dup() as again:                   # a split of a split, across nodes again
            assert again.allgather(np.array(g)).tolist() == want
        with sub.split_by("node") as here:         # and node-local
            assert set(here.allgather(np.array(g)).tolist()) <= set(want)
        sub.close()


def main():
    mode, n = sys.argv[1], int(sys.argv[2])
    if mode == "launch-fail":
        try:
            shmtree.run(failing, n, inter=W)
            raise AssertionError("run returned")
        except shmtree.WorkerError as exc:
            assert "SystemExit: 3" in str(exc), exc
            print(f"launcher {W.rank}: {exc}", flush=True)
    elif mode == "from_mpi":
        comm = shmtree.from_mpi(W, node_size=n)
        check(comm)
        comm.close()
    else:
        got = shmtree.run(check, n, inter=W)
        offset = sum(W.allgather(n)[:W.rank])
        assert got == [offset + r for r in range(n)], got
    W.Barrier()
    if W.rank == 0:
        print(f"OK {mode}", flush=True)


if __name__ == "__main__":
    main()
