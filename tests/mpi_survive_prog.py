"""Run under mpiexec by tests/test_survive.py: a communicator across simulated nodes (from_mpi,
nodes of 2 ranks) refuses agree and shrink, naming ULFM, on every rank; a revoke on one node
reaches every rank of every node.  Rank 0 prints "OK survive"."""
import sys

import numpy as np
from mpi4py import MPI

import shmtree

W = MPI.COMM_WORLD
comm = shmtree.from_mpi(W, node_size=2)
assert comm.nodes == W.size // 2, comm.nodes
for what in ("agree", "shrink"):
    try:
        getattr(comm, what)()
        sys.exit(f"rank {W.rank}: {what} across nodes was not refused")
    except shmtree.ShmtreeError as exc:
        assert "ULFM" in str(exc) and "across nodes" in str(exc), str(exc)
assert comm.allreduce(np.ones(2)).tolist() == [float(W.size)] * 2     # (still usable)
if W.rank == W.size - 1:
    comm.revoke()
try:
    for _ in range(1000):
        comm.allreduce(np.ones(2))
    sys.exit(f"rank {W.rank}: the revocation did not reach it")
except shmtree.PeerLostError as exc:
    assert "revoked" in str(exc), str(exc)
comm.close()
W.Barrier()
if W.rank == 0:
    print("OK survive", flush=True)
