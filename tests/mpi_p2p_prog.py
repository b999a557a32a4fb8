"""Run under mpiexec by tests/test_p2p.py: messages on a communicator across simulated nodes.

    mpiexec -n N python tests/mpi_p2p_prog.py NODE_SIZE

Between two ranks of one node messages travel as on one machine; between nodes every call
raises ShmtreeError naming the limitation (before anything is sent).  Rank 0 prints "OK p2p".
"""
import sys

import numpy as np
from mpi4py import MPI

import shmtree

W = MPI.COMM_WORLD
NS = int(sys.argv[1])
comm = shmtree.from_mpi(W, node_size=NS)
r, P = comm.rank, comm.size
partner = r ^ 1
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
other = (r + NS) % P
if other // NS != r // NS:
    for call in (lambda: comm.send(np.zeros(1), other), lambda: comm.recv(other),
                 lambda: comm.irecv(other), lambda: comm.sendrecv(np.zeros(1), other, r)):
        try:
            call()
            raise AssertionError("a message between nodes did not raise")
        except shmtree.ShmtreeError as e:
            assert "between nodes are not supported yet" in str(e), e
total = comm.allreduce(np.ones(1))             # the communicator is still in order
assert total[0] == P
comm.close()
if r == 0:
    print("OK p2p", flush=True)
