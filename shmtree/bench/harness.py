"""A small fork-based process launcher for the parts of the bench that do not use shmtree.

The baselines (the numpy + shared_memory loop, the Pipe loop, gloo), the concurrent-copy limit
and the NUMA matrix all need P processes that meet at barriers and agree on a maximum, exactly as
shmtree's own workers do in ``sweep.py``.  ``launch(fn, nprocs, args)`` forks them, calls
``fn(peer, *args)`` in each (``peer`` has ``rank``, ``size``, ``barrier()``, ``max(x)``) and
returns the list of return values, indexed by rank.

Cleanup is the point of this module: if any rank raises, dies or outlives ``timeout``, the others
are terminated (then killed), every process is joined, and ``BenchError`` carries the failing
rank's traceback.  Shared memory that a caller creates is the caller's to unlink in its own
``finally``; the barrier and the slots here are anonymous and vanish with the processes.  Should
the parent itself be killed outright, each child is killed by the kernel too (PR_SET_PDEATHSIG).
"""
import ctypes
import mmap
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from multiprocessing.connection import wait

DEFAULT_TIMEOUT = 600.0
BARRIER_TIMEOUT = 120.0
PR_SET_PDEATHSIG = 1


class BenchError(RuntimeError):
    """A benchmark could not run (a rank failed, a tool is missing or misbehaved)."""


class _Barrier:
    """A reusable barrier of n forked processes: two turnstiles (semaphores) and a count in an
    anonymous shared page.  (multiprocessing's Barrier keeps its count in the multiprocessing
    heap, whose arena is a deleted /dev/shm file that the creating process holds open for as
    long as it lives.)"""

    def __init__(self, ctx, n, count):
        self._n, self._count = n, count       # count: a one-item int64 view of shared memory
        self._lock = ctx.Lock()
        self._turnstiles = (ctx.Semaphore(0), ctx.Semaphore(0))

    def wait(self, timeout):
        """Return once all n processes have called wait (BrokenBarrierError after timeout s)."""
        for phase, (step, full) in enumerate(((1, self._n), (-1, 0))):
            with self._lock:
                self._count[0] += step
                if self._count[0] == full:
                    for _ in range(self._n):
                        self._turnstiles[phase].release()
            if not self._turnstiles[phase].acquire(timeout=timeout):
                raise threading.BrokenBarrierError(f"a rank missed the barrier for {timeout} s")


class Peer:
    """What a harness worker gets: its rank, the group size, a barrier and a max-reduction."""

    def __init__(self, rank, size, barrier, slots):
        self.rank, self.size = rank, size
        self._barrier, self._slots = barrier, slots

    def barrier(self):
        self._barrier.wait(BARRIER_TIMEOUT)

    def max(self, value):
        self._slots[self.rank] = value
        self.barrier()
        top = max(self._slots[:])
        self.barrier()
        return top


def usable_cpus():
    """The CPUs this process may run on, sorted."""
    return sorted(os.sched_getaffinity(0))


def pin_to(cpus):
    """Restrict the calling process to `cpus` (an iterable of CPU numbers)."""
    os.sched_setaffinity(0, set(cpus))


def launch(fn, nprocs, args=(), pin=None, timeout=DEFAULT_TIMEOUT):
    """Run fn(peer, *args) in nprocs forked processes; return their results by rank.

    pin: True pins rank r to the r-th usable CPU (modulo their number); None does so only when
    there are at least as many usable CPUs as ranks; False leaves scheduling to the kernel.
    """
    cpus = usable_cpus()
    if pin is None:
        pin = nprocs <= len(cpus)
    ctx = mp.get_context("fork")
    page = memoryview(mmap.mmap(-1, 8 * (nprocs + 1)))       # (anonymous: the ranks inherit it)
    barrier = _Barrier(ctx, nprocs, page[8 * nprocs:].cast("q"))
    slots = page[:8 * nprocs].cast("d")
    procs, readers = [], []
    try:
        for rank in range(nprocs):
            reader, writer = ctx.Pipe(duplex=False)
            cpu = [cpus[rank % len(cpus)]] if pin else None
            proc = ctx.Process(target=_child, daemon=True, name=f"shmtree-bench-{rank}",
                               args=(fn, Peer(rank, nprocs, barrier, slots), args, cpu, writer))
            proc.start()
            writer.close()
            procs.append(proc)
            readers.append(reader)
        results = _collect(procs, readers, timeout)
        _stop(procs, readers, grace=5.0)  # all reported: let them exit on their own
        return results
    finally:
        _stop(procs, readers, grace=0.0)


def die_with_parent(sig=signal.SIGKILL):
    """Ask Linux to send `sig` to this process when its parent dies (prctl PR_SET_PDEATHSIG)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the parent's finally still stops the children


def _child(fn, peer, args, cpu, writer):
    die_with_parent()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the parent stops us with SIGTERM
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    try:
        if cpu is not None:
            pin_to(cpu)
        writer.send(("ok", fn(peer, *args)))
    except BaseException as exc:  # report everything, including KeyboardInterrupt
        writer.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        writer.close()


def _collect(procs, readers, timeout):
    results, pending = [None] * len(procs), dict(zip(readers, range(len(procs))))
    deadline = time.monotonic() + timeout
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise BenchError(f"ranks {sorted(pending.values())} did not finish in {timeout:.0f} s")
        sentinels = {procs[r].sentinel: r for r in pending.values()}
        for ready in wait(list(pending) + list(sentinels), timeout=min(left, 1.0)):
            rank = pending.get(ready, sentinels.get(ready))
            if rank is not None and readers[rank] in pending:
                results[rank] = _receive(readers[rank], procs[rank], rank)
                del pending[readers[rank]]
    return results


def _receive(reader, proc, rank):
    if not reader.poll(1.0):
        proc.join(1.0)
        raise BenchError(f"rank {rank} died (exit code {proc.exitcode}) without a result")
    try:
        status, value = reader.recv()
    except EOFError:
        proc.join(1.0)
        raise BenchError(f"rank {rank} died (exit code {proc.exitcode}) without a result") from None
    if status != "ok":
        raise BenchError(f"rank {rank} failed: {value}")
    return value


def _stop(procs, readers, grace):
    for proc in procs:
        proc.join(grace)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for reader in readers:
        reader.close()
