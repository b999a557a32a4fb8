"""Errors and fault behaviour: what each failure raises, and where."""
import os
import time

import numpy as np

import shmtree


def mismatch(comm):
    """Ranks that disagree: CollectiveMismatchError on every rank; the group stays usable."""
    try:
        comm.allreduce(np.ones(comm.rank + 1))           # shapes (1,) and (2,)
    except shmtree.CollectiveMismatchError as exc:
        said = type(exc).__name__
    return said, comm.allreduce(np.ones(2)).tolist()


def local_error(comm):
    """A local error is raised before any communication; the group stays usable."""
    try:
        comm.allreduce(np.ones(2), op="band")            # bitwise ops take integers and bools
    except TypeError as exc:
        said = str(exc)
    return said, comm.allreduce(np.ones(1)).tolist()


def timeout(comm):
    """A timeout aborts the group: the late rank then raises PeerLostError."""
    try:
        if comm.rank == 1:
            time.sleep(1.0)
        comm.barrier(timeout=0.2)
    except shmtree.CollectiveTimeoutError:
        return "CollectiveTimeoutError"
    except shmtree.PeerLostError:
        return "PeerLostError"


def dies(comm):
    """A worker that dies: run raises WorkerError naming it."""
    if comm.rank == 1:
        os._exit(3)
    comm.barrier()


def raises(comm):
    """A worker that raises: WorkerError names the root cause, not its consequences."""
    if comm.rank == 0:
        raise ValueError("bad input")
    comm.barrier()


if __name__ == "__main__":
    print(shmtree.run(mismatch, 2))
    print(shmtree.run(local_error, 2)[0])
    print(shmtree.run(timeout, 2))
    for fn in (dies, raises):
        try:
            shmtree.run(fn, 2)
        except shmtree.WorkerError as exc:
            print(f"WorkerError: rank {exc.rank}: {exc}")

# Output:
# [('CollectiveMismatchError', [2.0, 2.0]), ('CollectiveMismatchError', [2.0, 2.0])]
# ("shmtree: op 'band' is not defined for dtype float64 (bitwise ops take integer and bool dtypes)", [2.0])
# ['CollectiveTimeoutError', 'PeerLostError']
# WorkerError: rank 1: rank 1 failed: exited with code 3 without reporting a result
# WorkerError: rank 0: rank 0 failed: ValueError: bad input
