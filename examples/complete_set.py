"""alltoall, gather, scatter, scan and exscan, on every rank of a group of 3."""
import numpy as np

import shmtree


def step(comm):
    size, me = comm.size, comm.rank
    x = np.arange(size) + 10 * me            # x.shape[0] == size: x[s] goes to rank s
    t = comm.alltoall(x)                     # t[s] is rank s's x[me]
    counts = [me, 0, 1][:size]               # this rank sends counts[q] rows to rank q
    rows = np.full(sum(counts), me)
    v = comm.alltoall(rows, counts=counts)   # in source order, the rows every rank sent here
    g = comm.gather(np.array([me, -me]), root=0)                   # rank 0: shape (size, 2)
    c = comm.gather(np.arange(me + 1), root=0, axis=0)   # rank 0: concatenated (lengths differ)
    table = np.arange(size * 2).reshape(size, 2) if me == 0 else None
    b = comm.scatter(table, root=0)                                # rank r: table[r]
    p = comm.scatter(np.arange(7) if me == 0 else None, axis=0)    # np.array_split(..., size)[r]
    s = comm.scan(np.array([me + 1]))                              # ranks 0..me, summed
    e = comm.exscan(np.array([float(me + 1)]), op="max")           # ranks 0..me-1; rank 0: -inf
    return [t.tolist(), v.tolist(), None if g is None else g.tolist(),
            None if c is None else c.tolist(), b.tolist(), p.tolist(), s.tolist(), e.tolist()]


if __name__ == "__main__":
    for rank, result in enumerate(shmtree.run(step, 3)):
        print(rank, result)

# Output:
# 0 [[0, 10, 20], [1, 2, 2], [[0, 0], [1, -1], [2, -2]], [0, 0, 1, 0, 1, 2], [0, 1], [0, 1, 2], [1], [-inf]]
# 1 [[1, 11, 21], [], None, None, [2, 3], [3, 4], [3], [1.0]]
# 2 [[2, 12, 22], [0, 1, 2], None, None, [4, 5], [5, 6], [6], [2.0]]
