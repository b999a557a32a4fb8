"""shmtree.Pool: a multiprocessing Pool whose workers form one group."""
import numpy as np

import shmtree


def task(i):                                 # a task: the module-level calls
    y = shmtree.allreduce(np.ones(3) * shmtree.rank())
    return y.tolist()


def step(comm, scale):                       # SPMD on the pool's workers
    return float(comm.allreduce(np.array([scale * comm.rank]))[0])


if __name__ == "__main__":
    with shmtree.Pool(4) as pool:
        print(pool.map(task, range(4)))      # dealt one at a time: one task per worker
        print(pool.run(step, 2.0))           # step(comm, 2.0) once on every worker

# Output:
# [[6.0, 6.0, 6.0], [6.0, 6.0, 6.0], [6.0, 6.0, 6.0], [6.0, 6.0, 6.0]]
# [12.0, 12.0, 12.0, 12.0]
