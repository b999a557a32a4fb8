"""shmtree.Group: bring your own processes (fork, spawn or forkserver).

The group is made in the parent; each worker calls ``group.join(rank)`` once, with its own
rank.  A Group can be pickled, so it travels to spawned and forkserver workers too.
"""
import multiprocessing

import numpy as np

import shmtree


def worker(group, rank, results):
    with group.join(rank) as comm:                   # this rank's Communicator
        total = comm.allreduce(np.array([rank + 1.0]))
        results.put((rank, float(total[0])))


if __name__ == "__main__":
    ctx = multiprocessing.get_context("spawn")       # "fork" and "forkserver" work the same
    results = ctx.Queue()
    with shmtree.Group(3) as group:
        procs = [ctx.Process(target=worker, args=(group, r, results)) for r in range(3)]
        for p in procs:
            p.start()
        got = sorted(results.get(timeout=60) for _ in procs)
        for p in procs:
            p.join()
    print(got)

# Output:
# [(0, 6.0), (1, 6.0), (2, 6.0)]
