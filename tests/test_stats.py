"""Communicator.stats() (the engine's counters): per-rank counters of completed calls and of waiting.

The counters are unsigned, so "delta >= 0" says nothing; these tests make them move:
- every completed call counts exactly once, on every path (inline fast path, pipelined general
  path, a non-contiguous input, barrier);
- a rank alone (P = 1) never waits: yields, sleeps and sleep timeouts stay 0;
- a rank whose peer arrives 50 ms late must wait: it spins, then yields, then sleeps on its bell,
  and nobody rings the bell while the peer sleeps, so some of those sleeps run out their time.
"""
import time

import numpy as np
import pytest

import shmtree
from procutil import run_ok

LATE_S = 0.05               # how late the late rank enters each call
LATE_CALLS = 3              # calls entered late, at least, and at most MAX_LATE_CALLS: until every
MAX_LATE_CALLS = 40         # other rank has waited (a loaded machine may deschedule a rank past
                            # the late one's sleep, which it then does not wait for)
WAIT_KEYS = ("yields", "sleeps", "sleep_timeouts")


def delta(before, after):
    assert set(before) == set(after) == {"calls", "bytes_sent", *WAIT_KEYS}, (before, after)
    return {k: after[k] - before[k] for k in after}


def calls_worker(comm, rounds):
    """`rounds` times: a small (inline) allreduce, a large (pipelined) one, a non-contiguous one
    (the general path) and a barrier; results checked."""
    P = comm.size
    small = np.full(1, comm.rank + 1.0)
    large = np.full(100_000, comm.rank + 1.0)                # 800 kB: several chunks
    strided = np.full(64, comm.rank + 1.0)[::2]
    comm.barrier()                                           # every rank is up
    before = comm.stats()
    for _ in range(rounds):
        for x in (small, large, strided):
            y = comm.allreduce(x)
            assert np.all(y == P * (P + 1) / 2), y[:4]
        comm.barrier()
    return delta(before, comm.stats())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("P", [1, 2, 3])
def test_stats_count_every_call_exactly(P):
    rounds = 5
    for rank, d in enumerate(run_ok(calls_worker, P, args=(rounds,))):
        assert d["calls"] == 4 * rounds, f"rank {rank}: {d}"     # 3 allreduces + 1 barrier
        assert d["sleep_timeouts"] <= d["sleeps"], f"rank {rank}: {d}"
        if P == 1:
            assert all(d[k] == 0 for k in WAIT_KEYS), f"P=1 has nobody to wait for: {d}"


def late_worker(comm, late_rank, calls, max_calls, late_s):
    """Every call: `late_rank` sleeps late_s before entering it, the others enter at once and
    wait for it.  `calls` such calls, then more (up to max_calls in all) while some other rank
    has not yet seen each of WAIT_KEYS move (the ranks agree on that with one more allreduce
    per call).  Returns (calls entered late, calls in all, the counters' delta)."""
    comm.barrier()
    before = comm.stats()
    x = np.full(8, comm.rank + 1.0)
    late = total = 0
    while True:
        if comm.rank == late_rank:
            time.sleep(late_s)
        y = comm.allreduce(x)
        late += 1
        total += 1
        assert np.all(y == comm.size * (comm.size + 1) / 2), y
        if late >= max_calls:
            break
        if late >= calls:
            d = delta(before, comm.stats())
            waited = comm.rank == late_rank or all(d[k] > 0 for k in WAIT_KEYS)
            total += 1
            if comm.allreduce(np.array([not waited]), op="max")[0] == 0:
                break
    return late, total, delta(before, comm.stats())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("P", [2, 3])
def test_stats_count_waiting(P):
    late = P - 1
    reports = run_ok(late_worker, P, args=(late, LATE_CALLS, MAX_LATE_CALLS, LATE_S))
    for rank, (late_calls, calls, d) in enumerate(reports):
        assert d["calls"] == calls, f"rank {rank}: {d} ({calls} calls made)"
        assert d["sleep_timeouts"] <= d["sleeps"], f"rank {rank}: {d}"
        if rank == late:
            continue                      # it may or may not wait for the others' last steps
        # 3 (or more) x 50 ms of waiting for the late rank: past the spin, yields, then sleeps
        # on the bell; nobody rings it while the late rank sleeps, so sleeps also time out
        assert d["yields"] > 0, f"rank {rank} waited {late_calls} x {LATE_S} s: {d}"
        assert d["sleeps"] > 0, f"rank {rank} waited {late_calls} x {LATE_S} s: {d}"
        assert d["sleep_timeouts"] > 0, f"rank {rank} waited {late_calls} x {LATE_S} s: {d}"


def closed_stats(comm):
    """stats() of a live communicator, then of the same one closed."""
    keys = sorted(comm.stats())
    comm.close()
    try:
        comm.stats()
    except shmtree.ShmtreeError as exc:
        return keys, str(exc)
    return keys, None


@pytest.mark.timeout(30)
def test_stats_public_and_closed():
    ((keys, err),) = run_ok(closed_stats, 1)
    assert keys == sorted(["calls", "bytes_sent", *WAIT_KEYS])
    assert err is not None and "closed" in err


IDLE_WAIT_S = 1.5           # how long the waiting rank waits in one allreduce
SLEEP_S = 0.02              # the engine's longest sleep on its bell (Engine sleep_ns)


def idle_worker(comm, wait_s):
    """Rank 1 enters an allreduce wait_s late; rank 0 waits for it in one call.  Returns the
    counters' delta and the CPU time the rank used during that call."""
    comm.barrier()
    before = comm.stats()
    if comm.rank == 1:
        time.sleep(wait_s)
    cpu = time.process_time()
    y = comm.allreduce(np.ones(1))
    cpu = time.process_time() - cpu
    assert y[0] == comm.size
    return delta(before, comm.stats()), cpu


@pytest.mark.timeout(60)
def test_a_long_wait_parks():
    """A rank blocked in one call for 1.5 s spins and yields once, at the start of the wait, then
    sleeps on its bell in long sleeps until the peer arrives: the wait goes on across the
    engine's time slices (each slice's peer checks do not restart the spin-and-yield phase,
    and the liveness check of a peer is a poll of its pidfd, not a /proc read through psutil)."""
    (d, cpu), _ = run_ok(idle_worker, 2, args=(IDLE_WAIT_S,))
    slices = IDLE_WAIT_S / SLEEP_S
    assert d["calls"] == 1, d
    # one yield phase (200 us of sched_yield: a few hundred calls), not one per 20 ms slice
    # (that was 75 phases: over 20,000 yields); none when a yield of an earlier wait found the
    # CPU busy (test_a_busy_cpu_makes_waits_sleep_without_yielding)
    assert d["yields"] < 3000, f"rank 0 waited {IDLE_WAIT_S} s: {d}"
    # sleeps of 20 ms, one per slice (5 ms sleeps were 4 per slice)
    assert 0 < d["sleeps"] <= slices * 1.3 + 5, f"rank 0 waited {IDLE_WAIT_S} s: {d}"
    # the CPU the waiting rank used: 0.5-0.7% here, 3.3% before it parked across slices
    assert cpu < 0.02 * IDLE_WAIT_S, f"rank 0 used {cpu * 1e3:.1f} ms of CPU in a {IDLE_WAIT_S} s wait"


def contended_worker(comm, calls, late_s):
    """Rank 0 shares its CPU with a busy process (both pinned to the same CPU); rank 1 enters
    each allreduce late_s late.  Returns rank 0's counters' delta over the calls."""
    import os
    import signal

    cpus = sorted(os.sched_getaffinity(0))
    comm.barrier()
    pid = None
    if comm.rank == 0:
        os.sched_setaffinity(0, {cpus[0]})
        pid = os.fork()
        if pid == 0:                                  # the competitor: busy on rank 0's CPU
            try:
                os.sched_setaffinity(0, {cpus[0]})
                while True:
                    pass
            finally:
                os._exit(0)
    elif len(cpus) > 1:
        os.sched_setaffinity(0, {cpus[-1]})
    try:
        x = np.ones(4)
        comm.allreduce(x)
        before = comm.stats()
        for _ in range(calls):
            if comm.rank == 1:
                time.sleep(late_s)
            comm.allreduce(x)
        return delta(before, comm.stats())
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.sched_setaffinity(0, cpus)


@pytest.mark.timeout(60)
def test_a_busy_cpu_makes_waits_sleep_without_yielding():
    """A yield that finds the CPU taken by another process gives that process the CPU for the
    rest of its time slice, and nobody wakes a rank that yields; so once a yield took long, the
    waits of the next 200 ms sleep on the bell after their spin (the peer's ring wakes them,
    and a woken thread preempts a busy one).  30 waits of 2 ms on a CPU shared with a busy
    process: a yield or two, not one or more per wait."""
    calls = 30
    d, _ = run_ok(contended_worker, 2, args=(calls, 0.002), pin=False)
    assert d["calls"] == calls, d
    assert d["sleeps"] >= calls // 2, d            # (the waits happened)
    assert d["yields"] < calls // 3, d
