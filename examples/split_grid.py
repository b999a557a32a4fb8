"""Sub-communicators: a 2-D process grid, with a communicator per row and one per column."""
import numpy as np

import shmtree


def step(comm, rows, cols):
    r, c = divmod(comm.rank, cols)             # this rank's place in the rows x cols grid
    with comm.split(r) as row, comm.split(c) as col:
        # row.rank == c, row.size == cols; col.rank == r, col.size == rows
        a = np.full(4, float(comm.rank))
        row_sums = row.allreduce(a)             # the sum over this rank's row
        col_max = col.allreduce(a, op="max")    # the largest rank of its column
        panel = col.broadcast(a if r == 0 else None, root=0)   # row 0's block, down each column
        return float(row_sums[0]), float(col_max[0]), float(panel[0])


if __name__ == "__main__":
    print(shmtree.run(step, 6, args=(2, 3)))   # a 2 x 3 grid of six ranks

# Output:
# [(3.0, 3.0, 0.0), (3.0, 4.0, 1.0), (3.0, 5.0, 2.0), (12.0, 3.0, 0.0), (12.0, 4.0, 1.0), (12.0, 5.0, 2.0)]
