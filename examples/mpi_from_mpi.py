"""Across nodes: shmtree.from_mpi, for programs that mpiexec starts one process per core.

    mpiexec -n 128 python train.py      (e.g. 2 nodes x 64 cores)

Here: ``mpiexec -n 4 python examples/mpi_from_mpi.py``, with node_size=2 simulating two nodes
of two processes on one machine (leave node_size out on a real cluster: the processes that
share a node form its group).
"""
# needs: mpi4py
# mpiexec: -n 4
import sys

try:
    from mpi4py import MPI
except ImportError:
    print("mpi4py is not installed: skipped")
    sys.exit(0)

import numpy as np

import shmtree

comm = shmtree.from_mpi(MPI.COMM_WORLD, node_size=2)   # collective; node_size=k simulates nodes
grad = np.ones(1 << 20, np.float32)
comm.allreduce(grad, out=grad)                # every rank of every node: the sum
where = comm.allgather(np.array([comm.rank, comm.node, comm.node_rank]))
if comm.rank == 0:
    print(f"{comm.size} ranks on {comm.nodes} nodes; grad[0] = {grad[0]}")
    print("rank, node, rank in its node:", where.tolist())
comm.close()

# Output:
# 4 ranks on 2 nodes; grad[0] = 4.0
# rank, node, rank in its node: [[0, 0, 0], [1, 0, 1], [2, 1, 0], [3, 1, 1]]
