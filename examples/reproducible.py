"""Reproducible sums: deterministic=True (rank order, any tree) and shmtree.Accumulator (exact,
any number of ranks)."""
import math

import numpy as np

import shmtree

VALUES = np.array([1e16, 1.0, -1e16, 1.0] * 2 + [0.5])    # the terms, split among the ranks


def step(comm):
    mine = VALUES[comm.rank::comm.size]                   # this rank's share of the terms
    x = np.array([mine.sum()])                            # its partial sum
    fold = comm.allreduce(x, deterministic=True)          # x_0 + x_1 + ... in rank order:
                                                          # the same bits on any machine
    acc = comm.allreduce(shmtree.Accumulator.of(mine))    # every term, exactly: the same
                                                          # bits at any number of ranks
    return float(fold[0]), float(acc.result())


if __name__ == "__main__":
    for P in (2, 4):
        print(P, "ranks:", shmtree.run(step, P)[0])
    print("math.fsum:", math.fsum(VALUES))

# Output:
# 2 ranks: (4.5, 4.5)
# 4 ranks: (2.0, 4.5)
# math.fsum: 4.5
