"""Across nodes: one launching process per node, whose workers never touch MPI.

    mpiexec -n 2 --map-by node python launch.py        (one launcher per node)

Here: ``mpiexec -n 2 python examples/mpi_launchers.py``: two launchers on one machine, as
if on two nodes, each starting 2 workers.
"""
# needs: mpi4py
# mpiexec: -n 2
import sys

try:
    from mpi4py import MPI
except ImportError:
    print("mpi4py is not installed: skipped")
    sys.exit(0)

import numpy as np

import shmtree


def work(comm):                      # comm spans every node; rank is global
    return float(comm.allreduce(np.ones(4) * comm.rank)[0]), comm.rank, comm.size


if __name__ == "__main__":
    results = shmtree.run(work, 2, inter=MPI.COMM_WORLD)   # this node's 2 workers, by local rank
    everything = MPI.COMM_WORLD.gather(results, root=0)
    if MPI.COMM_WORLD.rank == 0:
        for node, got in enumerate(everything):
            print("launcher", node, got)

# Output:
# launcher 0 [(6.0, 0, 4), (6.0, 1, 4)]
# launcher 1 [(6.0, 2, 4), (6.0, 3, 4)]
