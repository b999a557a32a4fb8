"""The two allreduces a user writes by hand today, as baselines for ``compare``.

numpy + shared_memory ("numpy-shm"): one ``multiprocessing.shared_memory`` segment holds one
slot per rank.  Each call: every rank copies its input into its slot, barrier, every rank reduces
all P slots into its own output (``ufunc.reduce(slots, axis=0)``), barrier (so that nobody
overwrites a slot that another rank is still reading).  Each rank reads P*X bytes per call.

Pipes ("pipe"): rank 0 is connected to every other rank by a ``multiprocessing.Pipe``.  Each
call: ranks 1..P-1 send their input (``send_bytes``, no pickling), rank 0 receives them one by
one into a scratch array and accumulates into its output, then sends the result back to each
rank, which receives it straight into its output (``recv_bytes_into``).  This is the careful
version of "pickle arrays through pipes"; pickling would only be slower.

Both run in the fork harness (``harness.py``).  The segment is created by the parent and its name
unlinked at once, before any fork: the ranks inherit the mapping, and nothing can be left in
/dev/shm, even if the bench is killed outright.
"""
import multiprocessing as mp
import os
from multiprocessing import shared_memory

import numpy as np

from . import harness
from .measure import UFUNCS, Buffers, measure, slowest, verify
from .units import count_for, format_size

PAGE = 4096


def _slot_items(sizes, dtype):
    """Items per shared slot: the largest message, rounded up to whole pages."""
    itemsize = np.dtype(dtype).itemsize
    largest = max(count_for(s, dtype) for s in sizes) * itemsize
    return -(-largest // PAGE) * PAGE // itemsize


def _check_room(nbytes, where="/dev/shm"):
    """BenchError unless `where` has room for nbytes (a full tmpfs is a SIGBUS, not an error)."""
    st = os.statvfs(where)
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise harness.BenchError(f"needs {format_size(nbytes)} in {where}, "
                                 f"{format_size(free)} free")


def _numpy_shm_size(peer, arena, size, plan):
    ufunc, dtype = UFUNCS[plan.op], np.dtype(plan.dtype)
    bufs = Buffers(count_for(size, dtype), dtype, peer.rank, plan.fresh, plan.rotation_bytes)
    slots, mine = arena[:, :bufs.count], arena[peer.rank, :bufs.count]

    def call(i):
        x, out = bufs.pair(i)
        np.copyto(mine, x)
        peer.barrier()
        ufunc.reduce(slots, axis=0, dtype=dtype, out=out)
        peer.barrier()

    call(0)
    verify(bufs.pair(0)[1], plan.op, peer.size, "numpy-shm")
    return measure(call, peer, plan.iters, plan.target_s)


def _numpy_shm_worker(peer, segment, sizes, plan):
    dtype = np.dtype(plan.dtype)
    arena = np.ndarray((peer.size, _slot_items(sizes, dtype)), dtype=dtype, buffer=segment.buf)
    return [_numpy_shm_size(peer, arena, size, plan) for size in sizes]


def run_numpy_shm(sizes, nprocs, plan, pin=None):
    """{size: summary} of the numpy + shared_memory loop."""
    nbytes = nprocs * _slot_items(sizes, plan.dtype) * np.dtype(plan.dtype).itemsize
    _check_room(nbytes)
    segment = shared_memory.SharedMemory(create=True, size=nbytes)
    segment.unlink()  # the name goes now; the mapping lives on in this process and its forks
    try:
        per_rank = harness.launch(_numpy_shm_worker, nprocs, (segment, sizes, plan), pin=pin)
    finally:
        segment.close()
    return {size: slowest([r[k] for r in per_rank]) for k, size in enumerate(sizes)}


def _pipe_call(peer, conns, bufs, scratch, ufunc):
    def call(i):
        x, out = bufs.pair(i)
        if peer.rank == 0:
            np.copyto(out, x)
            for conn in conns[1:]:
                conn.recv_bytes_into(scratch)
                ufunc(out, scratch, out=out)
            for conn in conns[1:]:
                conn.send_bytes(out)
        else:
            conns[peer.rank].send_bytes(x)
            conns[peer.rank].recv_bytes_into(out)
    return call


def _pipe_worker(peer, ends, sizes, plan):
    ufunc, dtype = UFUNCS[plan.op], np.dtype(plan.dtype)
    # rank 0 holds the first end of every pipe, rank k the second end of pipe k
    conns = [pair[0] if peer.rank == 0 else pair[1] for pair in ends]
    results = []
    for size in sizes:
        bufs = Buffers(count_for(size, dtype), dtype, peer.rank, plan.fresh, plan.rotation_bytes)
        call = _pipe_call(peer, conns, bufs, np.empty(bufs.count, dtype), ufunc)
        call(0)
        verify(bufs.pair(0)[1], plan.op, peer.size, "pipe")
        results.append(measure(call, peer, plan.iters, plan.target_s))
    return results


def run_pipe(sizes, nprocs, plan, pin=None):
    """{size: summary} of the reduce-to-rank-0-and-broadcast loop over Pipes."""
    ctx = mp.get_context("fork")
    ends = [(None, None)] + [ctx.Pipe(duplex=True) for _ in range(nprocs - 1)]
    try:
        per_rank = harness.launch(_pipe_worker, nprocs, (ends, sizes, plan), pin=pin)
    finally:
        for pair in ends[1:]:
            pair[0].close()
            pair[1].close()
    return {size: slowest([r[k] for r in per_rank]) for k, size in enumerate(sizes)}
