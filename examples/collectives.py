"""broadcast, reduce, allgather and reduce_scatter, on every rank of a group of 3."""
import numpy as np

import shmtree


def step(comm):
    x = np.array([1.0, 2.0]) * (comm.rank + 1)
    rows = np.arange(comm.rank + 1)                  # rank r has r + 1 rows
    y = comm.broadcast(x if comm.rank == 0 else None, root=0)   # every rank: the root's array
    s = comm.reduce(x, op="sum", root=2)                         # rank 2: the sum; others: None
    g = comm.allgather(x)                  # shape (size, *x.shape); g[r] is rank r's x
    c = comm.allgather(rows, axis=0)       # concatenated along axis 0; lengths may differ
    part = comm.reduce_scatter(np.arange(4.0))  # np.array_split(the full sum, size)[rank]
    return dict(rank=comm.rank, broadcast=y.tolist(), reduce=None if s is None else s.tolist(),
                allgather=g.tolist(), concatenated=c.tolist(), reduce_scatter=part.tolist())


if __name__ == "__main__":
    for result in shmtree.run(step, 3):
        print(result)

# Output:
# {'rank': 0, 'broadcast': [1.0, 2.0], 'reduce': None, 'allgather': [[1.0, 2.0], [2.0, 4.0], [3.0, 6.0]], 'concatenated': [0, 0, 1, 0, 1, 2], 'reduce_scatter': [0.0, 3.0]}
# {'rank': 1, 'broadcast': [1.0, 2.0], 'reduce': None, 'allgather': [[1.0, 2.0], [2.0, 4.0], [3.0, 6.0]], 'concatenated': [0, 0, 1, 0, 1, 2], 'reduce_scatter': [6.0]}
# {'rank': 2, 'broadcast': [1.0, 2.0], 'reduce': [6.0, 12.0], 'allgather': [[1.0, 2.0], [2.0, 4.0], [3.0, 6.0]], 'concatenated': [0, 0, 1, 0, 1, 2], 'reduce_scatter': [9.0]}
