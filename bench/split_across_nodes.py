"""The time of a split across nodes under inter= (a launcher per node, simulated nodes):

    mpiexec -n LAUNCHERS python bench/split_across_nodes.py [WORKERS] [SPLITS]

Each launcher starts WORKERS workers (default 2) with shmtree.run(..., inter=COMM_WORLD); the
workers split their communicator SPLITS times (default 30) into even and odd ranks (both new
communicators span every node), each time after a barrier, run one allreduce on it and close
it.  Launcher 0 prints each worker's median and slowest split, in ms."""
import sys
import time

import numpy as np
from mpi4py import MPI

import shmtree


def splits(comm, count):
    took = []
    for _ in range(count):
        comm.barrier()
        t = time.perf_counter()
        sub = comm.split(comm.rank % 2)
        took.append(time.perf_counter() - t)
        sub.allreduce(np.array([1.0]))
        sub.close()
    took.sort()
    return took[len(took) // 2] * 1e3, took[-1] * 1e3


def main():
    workers = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    world = MPI.COMM_WORLD
    got = shmtree.run(splits, workers, args=(count,), inter=world)
    got = world.gather(got)
    if world.rank == 0:
        print(f"{world.size} launchers x {workers} workers, {count} splits across nodes: "
              "median / slowest ms per worker:")
        for node, rows in enumerate(got):
            print(f"  node {node}: " + ", ".join(f"{m:.1f} / {s:.1f}" for m, s in rows))


if __name__ == "__main__":
    main()
