"""``shmtree-bench overlap``: what the nonblocking calls cost and how much of a collective they hide.

Measured in shmtree workers (``shmtree.run``), every figure the slowest rank's median:

- **posting**: the time of the ``comm.iallreduce(x)`` call itself for an 8-byte x (each request
  waited for before the next is posted, so the queue is empty as in a real loop);
- **blocking**: an 8-byte ``comm.allreduce`` before any nonblocking call, and after (the
  progress thread then exists, idle): the blocking path must not pay for it;
- **overlap**, for a message of ``--size`` bytes: T = the blocking allreduce's time; C = the
  time of a computation calibrated to about T on its own; then ``req = comm.iallreduce(x);
  compute; req.wait()`` takes O.  Perfect overlap gives O = max(T, C) (ratio O / T about 1), no
  overlap O = T + C (about 2).  Three computations: ``sleep`` (the core is free), ``numpy``
  (np.multiply over arrays larger than the caches, which releases the GIL: it needs a core of
  its own, so on a machine with no spare core per rank it competes with the progress thread),
  and ``python`` (a pure-Python loop that holds the GIL; the progress thread still runs between
  the interpreter's switch intervals).

A row reports T, C, O and O / max(T, C).  The comparison is within one run, side by side.
"""
import time

import numpy as np

COMPUTES = ("sleep", "numpy", "python")


def _median(xs):
    return float(np.median(xs))


def _compute(kind, scale, scratch):
    """One computation of size `scale` (seconds for sleep, repetitions otherwise)."""
    if kind == "sleep":
        time.sleep(scale)
    elif kind == "numpy":
        a, b, c = scratch
        for _ in range(int(scale)):
            np.multiply(a, b, out=c)
    else:
        s = 0
        for i in range(int(scale)):
            s += i * i
        return s


def _calibrate(comm, kind, target_s, scratch):
    """A scale for `kind` that takes about target_s here, agreed by all ranks (the largest)."""
    if kind == "sleep":
        return target_s
    scale = 1
    while True:
        t0 = time.perf_counter()
        _compute(kind, scale, scratch)
        dt = time.perf_counter() - t0
        if dt >= target_s / 4 or scale > 1 << 30:
            break
        scale *= 2
    scale = max(1, int(scale * target_s / max(dt, 1e-9)))
    return int(comm.allreduce(np.array([scale], np.int64), "max")[0])


def _worker(comm, size, repeats, computes, posts):
    out = {}
    small = np.ones(2, np.float32)
    # blocking 8 B before any nonblocking call
    out["blocking_before_us"] = _timed_blocking(comm, small, posts)
    # posting cost of an 8-byte iallreduce
    times = []
    for _ in range(posts):
        t0 = time.perf_counter()
        req = comm.iallreduce(small)
        times.append(time.perf_counter() - t0)
        req.wait()
    out["post_us"] = _median(times) * 1e6
    out["blocking_after_us"] = _timed_blocking(comm, small, posts)
    # overlap
    x = np.ones(size // 4, np.float32)
    res = np.empty_like(x)
    scratch = [np.ones(4 << 20, np.float32) for _ in range(3)]     # 16 MiB each
    comm.allreduce(x, out=res)
    t_block = []
    for _ in range(repeats):
        comm.barrier()
        t0 = time.perf_counter()
        comm.allreduce(x, out=res)
        t_block.append(time.perf_counter() - t0)
    T = _median(t_block)
    out["T_us"] = T * 1e6
    rows = {}
    for kind in computes:
        scale = _calibrate(comm, kind, T, scratch)
        t_c, t_o = [], []
        for _ in range(repeats):
            comm.barrier()
            t0 = time.perf_counter()
            _compute(kind, scale, scratch)
            t_c.append(time.perf_counter() - t0)
            comm.barrier()
            t0 = time.perf_counter()
            req = comm.iallreduce(x, out=res)
            _compute(kind, scale, scratch)
            req.wait()
            t_o.append(time.perf_counter() - t0)
        rows[kind] = {"C_us": _median(t_c) * 1e6, "O_us": _median(t_o) * 1e6}
    out["overlap"] = rows
    return out


def _timed_blocking(comm, x, n):
    for _ in range(50):
        comm.allreduce(x)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        comm.allreduce(x)
        times.append(time.perf_counter() - t0)
    return _median(times) * 1e6


def run_overlap(nprocs, size, repeats, computes, posts, options):
    """The per-rank results combined: the slowest rank's figure for each."""
    import shmtree
    per_rank = shmtree.run(_worker, nprocs, args=(size, repeats, computes, posts), **options)
    combined = {k: max(r[k] for r in per_rank)
                for k in ("blocking_before_us", "post_us", "blocking_after_us", "T_us")}
    combined["overlap"] = {}
    for kind in computes:
        C = max(r["overlap"][kind]["C_us"] for r in per_rank)
        O = max(r["overlap"][kind]["O_us"] for r in per_rank)
        T = combined["T_us"]
        combined["overlap"][kind] = {"C_us": C, "O_us": O, "ratio": O / max(T, C),
                                     "serial_ratio": (T + C) / max(T, C)}
    return combined


__all__ = ["COMPUTES", "run_overlap"]
