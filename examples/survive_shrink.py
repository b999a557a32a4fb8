"""A rank dies; the others agree on it, shrink, and go on (issue 38)."""
import os

import numpy as np

import shmtree


def step(comm):
    x = np.ones(3)
    for it in range(6):
        if comm.rank == 2 and it == 3:
            os._exit(1)                               # rank 2 dies without a word
        try:
            x = comm.allreduce(x) / comm.size
        except shmtree.PeerLostError:                 # RevokedError too
            old = comm
            comm = comm.shrink()                      # the survivors, renumbered 0, 1, 2
            x = comm.allreduce(x) / comm.size         # (redo the step that failed)
            lost = old.failed_ranks()
            old.close()
    return comm.rank, comm.size, lost, x.tolist()


if __name__ == "__main__":
    for got in shmtree.run(step, 4, on_failure="shrink"):
        print(got)

# Output:
# (0, 3, [2], [1.0, 1.0, 1.0])
# (1, 3, [2], [1.0, 1.0, 1.0])
# rank 2 failed: exited with code 1 without reporting a result
# (2, 3, [2], [1.0, 1.0, 1.0])
