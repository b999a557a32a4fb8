"""Run by tests/test_complete_set.py under mpiexec: from_mpi with node_size (argv[1]; 0: one
node).  Prints one line per rank: what the new collectives and a persistent call did."""
import sys

import numpy as np
from mpi4py import MPI

import shmtree

ns = int(sys.argv[1]) or None
comm = shmtree.from_mpi(MPI.COMM_WORLD, node_size=ns)
x = np.ones(3) * (comm.rank + 1)
p = comm.allreduce_init(x)
a, b = p(), p()
out = [comm.nodes, a is b, a.tolist()]
for call in (lambda: comm.alltoall(np.arange(comm.size * 2.0).reshape(comm.size, 2)),
             lambda: comm.scan_init(x)(), lambda: comm.gather(x)):
    try:
        got = call()
        out.append(None if got is None else got.tolist())
    except shmtree.ShmtreeError as exc:
        out.append(str(exc))
out.append(comm.allreduce(x).tolist())
print(f"REPORT {comm.rank} {out!r}", flush=True)
comm.close()
