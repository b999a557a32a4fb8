"""shmtree.run: call a function in N new processes (SPMD), each with its communicator."""
import numpy as np

import shmtree


def step(comm, scale):                       # runs in every worker
    x = np.arange(10.0) * (comm.rank + 1) * scale
    y = comm.allreduce(x)                    # a new array, op="sum"
    comm.allreduce(x, op="max", out=x)       # in place
    return float(y.sum())


if __name__ == "__main__":
    print(shmtree.run(step, 4, args=(2.0,)))  # the return values, by rank

# Output:
# [900.0, 900.0, 900.0, 900.0]
