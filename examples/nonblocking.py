"""Nonblocking calls: overlap a reduction with the computation that follows it."""
import numpy as np

import shmtree


def backward(bucket, rank):                      # a stand-in for a backward pass
    return np.full(1000, float(rank + bucket))


def ddp_style(comm, n_buckets):
    """Reduce each bucket's gradients while the next bucket's are being computed, as DDP does."""
    grads, reqs = [], []
    for bucket in reversed(range(n_buckets)):     # gradients come out last layer first
        grad = backward(bucket, comm.rank)        # computes while earlier buckets are reduced
        reqs.append(comm.iallreduce(grad, out=grad))
        grads.append(grad)
    for r in reqs:
        r.wait()                                  # now every grad holds the sum
    return [float(g[0]) for g in grads]


def cg_dot_products(comm):
    """A pipelined conjugate gradient hides its dot products behind the matrix-vector product."""
    rng = np.random.default_rng(comm.rank)
    A_local = rng.standard_normal((50, 50))
    r, p, Ap = rng.standard_normal(50), rng.standard_normal(50), rng.standard_normal(50)
    req = comm.iallreduce(np.array([r @ r, p @ Ap]))   # two partial dot products
    w = A_local @ r                                    # the matvec computes meanwhile
    rr, pAp = req.wait()
    return bool(np.isfinite(rr + pAp + w.sum()))


def module_level(comm):
    """The module-level forms, and wait_all: the results in the order given."""
    reqs = [shmtree.iallreduce(np.array([k])) for k in range(3)]
    return [int(x[0]) for x in shmtree.wait_all(reqs, timeout=60)]


def all_three(comm):
    return ddp_style(comm, 3), cg_dot_products(comm), module_level(comm)


if __name__ == "__main__":
    print(shmtree.run(all_three, 2))

# Output:
# [([5.0, 3.0, 1.0], True, [0, 2, 4]), ([5.0, 3.0, 1.0], True, [0, 2, 4])]
