"""The measurement protocol shared by every column of every table.

One measurement of one operation at one size, inside every rank at once:

1. all ranks meet at a barrier; each makes one untimed call (first touch, lazy setup);
2. each times 5 more calls one by one (and, if those took under a millisecond in all, up to 100
   more, about a millisecond's worth); the median of those per-call times, maximised over the
   ranks (``sync.max``), is the estimate, so every rank derives the same warmup and iteration
   counts from it (collectives must be called the same number of times everywhere);
3. a few warmup calls (about 20 ms worth, at most 100), a barrier, then N timed calls, each timed
   on its own with ``time.perf_counter``; N is given (``--iters``) or adaptive: enough calls for
   about 0.2 s, at least 3, at most 20000;
4. the rank reports the median of its N per-call times; the caller reports the maximum over
   ranks of those medians.

``sync`` is any object with ``barrier()`` and ``max(seconds) -> seconds`` that all ranks call
together: a shmtree communicator, the fork harness of the baselines, an MPI or gloo wrapper.

``Buffers`` holds the arrays a rank passes to its calls: by default one input and one output that
stay warm in cache; with ``fresh`` a rotation of input/output pairs carved from arenas bigger
than the last-level cache, so that every call starts cache-cold.

This module imports only the standard library and numpy: ``mpi_worker.py`` loads it by path in
another interpreter (another virtualenv) where shmtree itself may not be importable.
"""
import math
import statistics
import time

import numpy as np

TARGET_S = 0.2
MIN_ITERS = 3
MAX_ITERS = 20000
WARMUP_S = 0.02
MAX_WARMUP = 100
PROBE_S = 1e-3
PROBE_CALLS = 5
PAGE = 4096

# the bench's op table (units.OPS are its names): a subset of shmtree's, spelled the same way
# (shmtree._kernels.OP_CODES / UFUNC_CODES, not imported here: see above)
UFUNCS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


def iteration_counts(per_call_s, iters=None, target_s=TARGET_S):
    """(warmup calls, timed calls) for an operation that takes per_call_s seconds."""
    per_call_s = max(per_call_s, 1e-7)
    warmup = min(MAX_WARMUP, max(1, math.ceil(WARMUP_S / per_call_s)))
    if iters is None:
        iters = min(MAX_ITERS, max(MIN_ITERS, math.ceil(target_s / per_call_s)))
    return warmup, iters


def measure(call, sync, iters=None, target_s=TARGET_S):
    """Time call(i) on this rank, all ranks together; returns this rank's summary dict."""
    sync.barrier()
    call(0)
    estimate = _estimate(call, PROBE_CALLS, sync)
    if estimate * PROBE_CALLS < PROBE_S:  # too few to go by: probe about a millisecond's worth
        estimate = _estimate(call, min(MAX_WARMUP, math.ceil(PROBE_S / estimate)), sync)
    warmup, iters = iteration_counts(estimate, iters, target_s)
    for i in range(warmup):
        call(2 + i)
    samples = [0.0] * iters
    sync.barrier()
    for i in range(iters):
        start = time.perf_counter()
        call(i)
        samples[i] = time.perf_counter() - start
    return {"median_s": statistics.median(samples), "min_s": min(samples),
            "mean_s": statistics.fmean(samples), "iters": iters}


def _estimate(call, count, sync):
    """Median seconds per call over `count` calls, the slowest rank's (the same on every rank)."""
    times = [0.0] * count
    for i in range(count):
        start = time.perf_counter()
        call(1 + i)
        times[i] = time.perf_counter() - start
    return sync.max(statistics.median(times))


def slowest(per_rank):
    """Combine the ranks' summaries: the maximum over ranks of each rank's median."""
    worst = max(per_rank, key=lambda s: s["median_s"])
    return {"median_s": worst["median_s"], "min_s": min(s["min_s"] for s in per_rank),
            "iters": worst["iters"]}


class Buffers:
    """Input/output arrays of `count` items for one rank, warm or rotating cache-cold."""

    def __init__(self, count, dtype, rank, fresh=False, rotation_bytes=0):
        dtype = np.dtype(dtype)
        stride = _round_up(count * dtype.itemsize, PAGE) // dtype.itemsize
        slots = max(2, math.ceil(rotation_bytes / (stride * dtype.itemsize))) if fresh else 1
        self.inputs = _carve(np.full(slots * stride, rank + 1, dtype=dtype), stride, count)
        self.outputs = _carve(np.zeros(slots * stride, dtype=dtype), stride, count)
        self.count = count

    def __len__(self):
        return len(self.inputs)

    def pair(self, i):
        """(input, output) for call i."""
        k = i % len(self.inputs)
        return self.inputs[k], self.outputs[k]


def _round_up(n, multiple):
    return max(multiple, -(-n // multiple) * multiple)


def _carve(arena, stride, count):
    return [arena[k * stride: k * stride + count] for k in range(len(arena) // stride)]


def expected(op, dtype, size):
    """The value every element of the result must have: rank r contributes r + 1."""
    contributions = np.arange(1, size + 1).astype(dtype)
    return UFUNCS[op].reduce(contributions, dtype=dtype)


def verify(result, op, size, what):
    """Raise RuntimeError unless every element of result is the expected value."""
    want = expected(op, result.dtype, size)
    if not np.all(result == want):
        bad = result[result != want].ravel()[:3]
        raise RuntimeError(f"{what}: wrong allreduce result: expected {want!r}, got {bad!r}")


class Plan:
    """What to measure at every size: dtype, op, iteration policy, buffer policy, timeout."""

    def __init__(self, dtype="float32", op="sum", iters=None, target_s=TARGET_S, fresh=False,
                 rotation_bytes=0, timeout=60.0):
        self.dtype, self.op = np.dtype(dtype).name, op
        self.iters, self.target_s = iters, target_s
        self.fresh, self.rotation_bytes = fresh, rotation_bytes
        self.timeout = timeout

    def as_dict(self):
        return dict(vars(self))
