"""Run under mpiexec by tests/test_repro.py: reproducible sums across simulated nodes.

    mpiexec -n N python tests/mpi_repro_prog.py repro NODE_SIZE

from_mpi with nodes of NODE_SIZE consecutive ranks: deterministic=True (allreduce, reduce,
reduce_scatter, scan; small, through one allgather, and large, through the transpose) against
the rank-order fold of every rank's input; Accumulator allreduces (blocking and i-forms) and
reproducible=True against the exact sum of every rank's terms, which is also the one-node
result; a rank that passes deterministic=True while the others do not raises
CollectiveMismatchError on every rank of every node.  Checks its results itself and exits
non-zero on a failure; rank 0 prints "OK repro".
"""
import sys
import zlib

import numpy as np
from mpi4py import MPI

import shmtree
from shmtree import Accumulator

W = MPI.COMM_WORLD


def terms(rank, n, dtype, seed):
    rng = np.random.default_rng(zlib.crc32(repr((rank, n, dtype, seed)).encode()))
    return (rng.normal(size=n) * 10.0 ** rng.integers(-6, 7, n)).astype(dtype)


def mode_repro(c):
    P, me = c.size, c.rank
    for n in (5, 3001, 50001):
        for dtype in ("float64", "float32", "int32"):
            x = terms(me, n, dtype, 1)
            every = [terms(r, n, dtype, 1) for r in range(P)]
            fold = every[0].copy()
            for y in every[1:]:
                fold = np.add(fold, y, dtype=fold.dtype)
            got = c.allreduce(x, deterministic=True)
            assert got.tobytes() == fold.tobytes(), ("allreduce", n, dtype)
            got = c.ireduce(x, root=P - 1, deterministic=True).wait()
            assert (got is None) == (me != P - 1), ("reduce", n, dtype)
            assert got is None or got.tobytes() == fold.tobytes(), ("reduce", n, dtype)
            block = c.reduce_scatter(x, deterministic=True)
            assert block.tobytes() == np.array_split(fold, P)[me].tobytes(), ("scatter", n)
            scan = c.scan(x, deterministic=True)
            want = every[0].copy()
            for y in every[1:me + 1]:
                want = np.add(want, y, dtype=want.dtype)
            assert scan.tobytes() == want.tobytes(), ("scan", n, dtype)
            if dtype == "int32":
                continue
            exact = Accumulator.of(np.stack(every)).result()
            acc = c.allreduce(Accumulator.of(x[None]))
            assert acc.result().tobytes() == exact.tobytes(), ("Accumulator", n, dtype)
            acc = c.iallreduce(Accumulator.of(x[None])).wait()
            assert acc.result().tobytes() == exact.tobytes(), ("iallreduce", n, dtype)
            got = c.allreduce(x, reproducible=True)
            assert got.tobytes() == exact.tobytes(), ("reproducible", n, dtype)
    # a rank's terms of other magnitudes: the exact sum, whatever the split
    values = terms(0, 997, "float64", 2)
    mine = values[me::P]
    acc = c.allreduce(Accumulator.of(mine))
    assert acc.result().tobytes() == Accumulator.of(values).result().tobytes(), "split"
    # ranks that disagree raise on every rank of every node; the communicator works on
    try:
        c.allreduce(np.ones(4), deterministic=me == 0)
    except shmtree.CollectiveMismatchError as exc:
        assert "deterministic" in str(exc), str(exc)
    else:
        raise AssertionError("no CollectiveMismatchError")
    try:
        c.allreduce(Accumulator.of(np.ones((2, 3)).astype(np.float32 if me else np.float64)))
    except shmtree.CollectiveMismatchError:
        pass
    else:
        raise AssertionError("no CollectiveMismatchError")
    assert c.allreduce(np.ones(2), deterministic=True).tolist() == [P, P]


def main():
    mode, node_size = sys.argv[1], int(sys.argv[2])
    c = shmtree.from_mpi(W, node_size=node_size)
    assert c.nodes > 1
    globals()[f"mode_{mode}"](c)
    c.close()
    W.Barrier()
    if W.rank == 0:
        print(f"OK {mode}", flush=True)


if __name__ == "__main__":
    main()
