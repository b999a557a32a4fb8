"""Run under mpiexec by tests/test_p2p.py: messages on a communicator across simulated nodes.

    mpiexec -n N python tests/mpi_p2p_prog.py NODE_SIZE [fail]

(N a multiple of 2 * NODE_SIZE for the pairwise checks and `fail`; else the ring's only.)

Between two ranks of one node messages travel as on one machine, between nodes over MPI, with
the same semantics: dtypes and sizes (0 B .. 64 MiB), tags out of order, out= mismatch,
modify-after-send, isend/irecv, a sendrecv ring whose steps are partly within and partly
between nodes, interleaving with collectives, a from_mpi sub-communicator across nodes.  With
`fail`: a receive between nodes times out (CollectiveTimeoutError) and every other rank,
blocked in a receive, raises PeerLostError instead of hanging.  Rank 0 prints "OK p2p".
"""
import os
import sys

import numpy as np
from mpi4py import MPI

import shmtree

# its sibling tests/mpi_split_prog.py: CI's PYTHONSAFEPATH (the root conftest) leaves the
# script's own folder out of sys.path
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
from mpi_split_prog import time_out_between_nodes  # noqa: E402

W = MPI.COMM_WORLD
NS = int(sys.argv[1])
FAIL = sys.argv[2:] == ["fail"]
comm = shmtree.from_mpi(W, node_size=NS)
r, P = comm.rank, comm.size
partner = r ^ 1
# a rank of another node: the pairs r <-> r + NS (every rank has one when the nodes pair up;
# else, nodes of uneven sizes, the pairwise checks are left out and the ring's remain)
PAIRED = P % (2 * NS) == 0
other = r + NS if (r // NS) % 2 == 0 else r - NS
assert comm.nodes > 1 and (not PAIRED or other // NS != r // NS)


def same_node():
    if partner < P and partner // NS == r // NS:
        got = comm.sendrecv(np.full(3, r), partner, partner)
        assert got.tolist() == [partner] * 3, got
        big = comm.sendrecv(np.full(100_000, r), partner, partner, sendtag=1, recvtag=1)
        assert (big == partner).all()
        req = comm.irecv(partner, tag=2)
        comm.isend(np.arange(4) + r, partner, tag=2).result(30)
        assert (req.result(30) == np.arange(4) + partner).all()
        if r < partner:
            comm.send(np.array([7.5]), partner, tag=3)
        else:
            assert comm.recv(partner, tag=3).tolist() == [7.5]


def payload(dtype, shape, seed):
    """Distinct bytes of any dtype (structured, big-endian, bfloat16 included)."""
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = (np.arange(n, dtype=np.int64) * 7 + seed).astype(np.uint8)
    return raw.view(dtype).reshape(shape) if n else np.empty(shape, dtype)


def dtypes():
    out = [np.dtype(np.float64), np.dtype(">i4"), np.dtype(np.complex64), np.dtype(bool),
           np.dtype([("a", "<i2"), ("b", ">f8", (2,))]), np.dtype("V3")]
    try:
        import ml_dtypes
        out.append(np.dtype(ml_dtypes.bfloat16))
    except ImportError:
        pass
    return out


def between_nodes():
    # every dtype, shapes 0-d, empty, small, ~100 KiB, 3 MiB; exactly kept (bytes, shape, dtype)
    for i, dt in enumerate(dtypes()):
        for shape in ((), (0,), (5, 3), (100_000 // dt.itemsize + 1,),
                      ((3 << 20) // dt.itemsize, 1)):
            mine = payload(dt, shape, r + i)
            got = comm.sendrecv(mine, other, other, sendtag=i, recvtag=i)
            want = payload(dt, shape, other + i)
            assert got.dtype == dt and got.shape == want.shape, (dt, shape, got.dtype, got.shape)
            assert got.tobytes() == want.tobytes(), (dt, shape)
    # one 64 MiB message, and modify-after-send: the receiver gets what was sent
    if r < other:
        a = np.full(8 << 20, 3.0)
        comm.send(a, other, tag=5)
        a[:] = -1.0
        comm.send(np.arange(10), other, tag=5)
    else:
        got = comm.recv(other, tag=5)
        assert got.nbytes == 64 << 20 and (got == 3.0).all()
        assert comm.recv(other, tag=5).tolist() == list(range(10))
    # ordering: 300 messages on 3 tags, received tag by tag in reverse (non-overtaking per tag)
    if r < other:
        reqs = [comm.isend(np.array([k, k % 3]), other, tag=100 + k % 3) for k in range(300)]
        shmtree.wait_all(reqs, timeout=60)
    else:
        for t in (2, 1, 0):
            got = [int(comm.recv(other, tag=100 + t)[0]) for _ in range(100)]
            assert got == list(range(t, 300, 3)), (t, got[:5])
    # out=: a matching one (non-contiguous too), a mismatch (ValueError, the message consumed)
    if r < other:
        for k in range(4):
            comm.send(np.arange(6.0) + k, other, tag=7)
    else:
        out = np.empty(6)
        assert comm.recv(other, tag=7, out=out) is out and out.tolist() == list(range(6))
        strided = np.empty(12)[::2]
        assert comm.recv(other, tag=7, out=strided) is strided and strided[1] == 2.0
        try:
            comm.recv(other, tag=7, out=np.empty(5))
            raise AssertionError("out= of the wrong shape was taken")
        except ValueError as exc:
            assert "consumed" in str(exc), exc
        assert comm.recv(other, tag=7).tolist() == list(np.arange(6.0) + 3)   # the next one
    # a non-contiguous send; isend/irecv and their Requests
    req = comm.irecv(other, tag=8)
    assert isinstance(req, shmtree.Request)
    s = comm.isend(np.arange(20.0).reshape(4, 5)[:, ::2] + r, other, tag=8)
    got, _ = shmtree.wait_all([req, s], timeout=60)
    assert (got == np.arange(20.0).reshape(4, 5)[:, ::2] + other).all()
    # interleaving with collectives: a receive pending across the group's collectives
    req = comm.irecv(other, tag=9)
    for k in range(3):
        assert float(comm.allreduce(np.array([1.0]))[0]) == P
        comm.barrier()
    comm.send(np.array([r]), other, tag=9)
    assert int(req.wait(60)[0]) == other


def ring():
    # a ring of sendrecv (dest r+1, source r-1: some steps within a node, some between) at
    # every size, and one of isend/irecv
    for n in (1, 1000, 1 << 17, 1 << 21):
        got = comm.sendrecv(np.full(n, r), (r + 1) % P, (r - 1) % P, sendtag=11, recvtag=11)
        assert got.shape == (n,) and (got == (r - 1) % P).all(), n
    rq = comm.irecv((r - 1) % P, tag=12)
    comm.isend(np.array([r]), (r + 1) % P, tag=12).wait(60)
    assert int(rq.wait(60)[0]) == (r - 1) % P
    # two ahead (between nodes for most ranks), tags received in reverse order
    reqs = [comm.isend(np.array([r, k]), (r + 2) % P, tag=20 + k) for k in range(5)]
    for k in (4, 3, 2, 1, 0):
        assert comm.recv((r - 2) % P, tag=20 + k).tolist() == [(r - 2) % P, k]
    shmtree.wait_all(reqs, 60)


def on_sub_communicator():
    """A from_mpi sub-communicator across nodes (even and odd ranks): messages between its
    nodes on its own MPI communicator, not mixed with the parent's of the same tags."""
    sub = comm.split(r % 2, key=-r)
    try:
        assert sub.nodes > 1
        p = sub.size
        nxt, prv = (sub.rank + 1) % p, (sub.rank - 1) % p
        comm_req = comm.irecv((r - 1) % P, tag=0)
        got = sub.sendrecv(np.array([r, 10 * r]), nxt, prv)
        assert got.tolist() == [sub.parent_ranks[prv], 10 * sub.parent_ranks[prv]], got
        comm.send(np.array([-r]), (r + 1) % P, tag=0)
        assert int(comm_req.wait(60)[0]) == -((r - 1) % P)
        big = sub.sendrecv(np.full(1 << 19, r, np.int32), nxt, prv, sendtag=3, recvtag=3)
        assert (big == sub.parent_ranks[prv]).all()
        assert int(sub.allreduce(np.array([1]))[0]) == p
    finally:
        sub.close()



same_node()
if FAIL:
    time_out_between_nodes(comm)
else:
    if PAIRED:
        between_nodes()
    ring()
    on_sub_communicator()
    total = comm.allreduce(np.ones(1))             # the communicator is still in order
    assert total[0] == P
comm.close()
W.Barrier()
if r == 0:
    print("OK p2p", flush=True)
