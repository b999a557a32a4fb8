"""Mismatch messages name what each rank passed in words (issue 21, item 15): dtype names, not
digests, in allgather mismatches; the shapes and dtypes in allgather(axis=0) and broadcast
mismatches."""
import numpy as np
import pytest

from procutil import run_ok

CASES = {
    "dtype": lambda c: c.allgather(np.ones(2, "S8" if c.rank else "<f8")),
    "dtype_large": lambda c: c.allgather(np.ones(50001, ">i4" if c.rank == 1 else "<i4")),
    "axis0_rest": lambda c: c.allgather(np.ones((2, 3 if c.rank else 4)), axis=0),
    "axis0_dtype": lambda c: c.allgather(np.ones((2, 3), np.float32 if c.rank == 2 else float),
                                         axis=0),
    "bcast_shape": lambda c: c.broadcast(np.ones(4 if c.rank != 1 else 5)),
    "bcast_dtype": lambda c: c.broadcast(np.ones(70001, np.float32 if c.rank else float)),
    "bcast_out": lambda c: c.broadcast(np.ones(3) if c.rank == 0 else None,
                                       out=None if c.rank != 2 else np.empty(3, np.int16)),
    "bcast_root": lambda c: c.broadcast(np.ones(3), root=1 if c.rank == 1 else 0),
    "ibcast_shape": lambda c: c.ibroadcast(np.ones(4 if c.rank != 1 else 5)).result(60),
    "iaxis0_rest": lambda c: c.iallgather(np.ones((2, 3 if c.rank else 4)), axis=0).result(60),
}
WANT = {
    "dtype": ["rank 0: allgather(shape=(2,), dtype float64", "allgather(shape=(2,), dtype |S8"],
    "dtype_large": ["dtype int32", "rank 1: allgather(shape=(50001,), dtype >i4"],
    "axis0_rest": ["rank 0: shape (2, 4) and dtype float64",
                   "ranks 1,2: shape (2, 3) and dtype float64"],
    "axis0_dtype": ["ranks 0,1: shape (2, 3) and dtype float64",
                    "rank 2: shape (2, 3) and dtype float32"],
    "bcast_shape": ["the root passed shape (4,) and dtype float64",
                    "rank 1 passed shape (5,) and dtype float64"],
    "bcast_dtype": ["the root passed shape (70001,) and dtype float64",
                    "ranks 1,2 passed shape (70001,) and dtype float32"],
    "bcast_out": ["the root passed shape (3,) and dtype float64",
                  "rank 2 passed shape (3,) and dtype int16"],
    "bcast_root": ["ranks 0,2: broadcast(root=0); rank 1: broadcast(root=1)"],
    "ibcast_shape": ["the root passed shape (4,) and dtype float64",
                     "rank 1 passed shape (5,) and dtype float64"],
    "iaxis0_rest": ["rank 0: shape (2, 4) and dtype float64",
                    "ranks 1,2: shape (2, 3) and dtype float64"],
}


def worker(comm):
    out = {}
    for name, call in CASES.items():
        try:
            call(comm)
            out[name] = None
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        comm.barrier(timeout=60)
    return out


@pytest.mark.timeout(120)
def test_mismatch_messages_name_dtypes_and_shapes():
    for rank, out in enumerate(run_ok(worker, 3)):
        for name, msg in out.items():
            assert msg is not None and msg.startswith("CollectiveMismatchError"), (rank, name)
            assert "#" not in msg and "bytes)" not in msg, (rank, name, msg)
            for piece in WANT[name]:
                assert piece in msg, (rank, name, msg)
