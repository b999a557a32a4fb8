"""Fault injection: SIGKILL and SIGSTOP of a member at chosen moments (docs/design.md, "Errors"
and "Waiting, aborting, liveness").

The contract under test:
- a member that dies (SIGKILL; left a zombie on purpose: nobody reaps it until the end) makes
  every waiting rank raise PeerLostError within a few seconds.  The library checks its tree
  neighbours every ~20 ms of stall and every member once a second, so the bound asserted here
  is DETECT_S = 5 s from the kill to the survivor's exception;
- a member that is only stopped (SIGSTOP) is not dead: survivors that passed timeout= raise
  CollectiveTimeoutError (or PeerLostError once another rank's timeout aborted the group),
  never a PeerLostError claiming a death;
- shmtree.run reports the failing rank (WorkerError.rank, message "rank N failed: ...");
- shmtree.Pool: a worker SIGKILLed mid-task must not hang map; the error names the lost rank;
- nothing is left in /dev/shm and no child survives (the autouse fixture of conftest.py).

The fault matrix (moment x signal x P x tree x size) is parametrized in full, but a default run
samples it: every tree shape at one P, every P at one tree shape, every moment x signal at one
P and tree.  Set SHMTREE_FAULTS_FULL=1 to run every combination (several minutes).
"""
import multiprocessing as mp
import os
import re
import signal
import time

import numpy as np
import pytest

import shmtree
from procutil import stop_processes, error_name, wait_in_call, own_process_group, wait_stopped

DETECT_S = 5.0                     # kill -> survivor's PeerLostError (design: ~20 ms / 1 s scans)
STOP_TIMEOUT_S = 1.5               # timeout= the survivors pass when the victim is stopped
LARGE_N = (4 << 20) // 8 + 3       # a ~4 MiB float64 array: many chunks on the bandwidth channel
SMALL_N = 10                       # inline in the latency round
FULL = os.environ.get("SHMTREE_FAULTS_FULL", "") not in ("", "0")
full_only = pytest.mark.skipif(not FULL, reason="full fault matrix: set SHMTREE_FAULTS_FULL=1")

TREES = ["chain", "binary", "flat", "ring", 3, "auto", "topology"]
MOMENTS = ["mid_call", "between_calls", "in_barrier"]
SIGNALS = ["SIGKILL", "SIGSTOP"]
PS = [2, 3, 4, 5, 6, 7, 8]
SIZES = ["small", "large"]


def group_options(tree):
    if tree == "topology":
        return dict(topology="2x4", tree="topology")
    return dict(tree=tree)


# ---------------------------------------------------------------------------------------------
# a Group with hand-made processes: the parent injects the fault

def fault_member(group, rank, victim, late, moment, n, timeout, ready, go, queue):
    """One member.  The victim sets `ready` at the moment the parent is waiting for, then is
    killed or stopped by the parent.  Survivors report (rank, outcome of the struck call, error,
    message, when): a call the victim had already done its part of may complete (a barrier the
    victim had entered), so a survivor whose call returned makes one more call, which cannot."""
    first = "raised"
    try:
        if rank == victim:
            own_process_group()
        comm = group.join(rank)
        x = np.full(n, rank + 1.0)
        out = np.empty_like(x)
        comm.allreduce(np.ones(4), timeout=60)          # every member is up
        if moment == "mid_call":
            for i in range(10 ** 9):
                if rank == victim and i == 2:
                    ready.set()                          # the parent strikes during the calls
                comm.allreduce(x, out=out, timeout=timeout)
        elif moment == "between_calls":
            if rank == victim:
                ready.set()
                time.sleep(300)                          # idle between calls until struck
                return
            comm.allreduce(x, out=out, timeout=timeout)  # blocks: the victim never calls
        elif moment == "in_barrier":
            if rank == victim:
                ready.set()
            if rank == late:
                go.wait(120)                             # the barrier cannot complete before
            comm.barrier(timeout=timeout)
        first = "returned"
        comm.allreduce(x, out=out, timeout=timeout)
        queue.put((rank, first, "returned", "", time.monotonic()))
    except BaseException as e:  # noqa: B036 -- reported to the parent
        queue.put((rank, first, error_name(e), str(e), time.monotonic()))


def inject(P, tree, moment, sig, n, victim, timeout=None):
    """Start P members, strike the victim, collect the survivors' reports.

    victim: a rank, or "root0": the root of the latency tree (the one barriers run on), whose
    part of a barrier needs every other rank's.  Returns (victim, reports {rank: (first, name,
    message, seconds after the strike)}, victim_report or None).
    """
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    ready, go = ctx.Event(), ctx.Event()
    procs = []
    reports, victim_report = {}, None
    with shmtree.Group(P, **group_options(tree)) as group:
        if victim == "root0":
            victim = group.trees[0].parent.index(-1)
        late = (victim + 1) % P
        try:
            for rank in range(P):
                p = ctx.Process(target=fault_member,
                                args=(group, rank, victim, late, moment, n, timeout, ready, go,
                                      queue))
                p.start()
                procs.append(p)
            assert ready.wait(60), "the victim never reached the moment of the fault"
            if moment in ("between_calls", "in_barrier"):
                # the others block in their call (call 2: call 1 made sure every member is
                # up), the victim too in a barrier; the late rank holds back for `go`
                until = time.monotonic() + 30
                for r in range(P):
                    if r != (victim if moment == "between_calls" else late):
                        wait_in_call(group, r, 2, max(0.0, until - time.monotonic()))
            else:
                time.sleep(0.005 + 0.01 * (P % 3))
            struck = time.monotonic()
            os.kill(procs[victim].pid, getattr(signal, sig))   # never reaped: a zombie
            if sig == "SIGSTOP":
                assert wait_stopped(procs[victim].pid), "the victim did not stop"
            go.set()
            deadline = time.monotonic() + 30
            while len(reports) < P - 1 and time.monotonic() < deadline:
                if queue.empty():
                    time.sleep(0.005)
                    continue
                rank, first, name, msg, t = queue.get()
                reports[rank] = (first, name, msg, t - struck)
            if sig == "SIGSTOP" and moment != "between_calls":
                resumed = time.monotonic()
                os.kill(procs[victim].pid, signal.SIGCONT)
                while time.monotonic() < resumed + 10:
                    if queue.empty():
                        time.sleep(0.005)
                        continue
                    rank, first, name, msg, t = queue.get()
                    assert rank == victim, f"second report from rank {rank}"
                    victim_report = (name, msg, t - resumed)
                    break
        finally:
            go.set()
            stop_processes(procs)
    return victim, reports, victim_report


def matrix():
    """Every combination; the ones outside the default sample run only with SHMTREE_FAULTS_FULL."""
    params = []
    for moment in MOMENTS:
        for sig in SIGNALS:
            for P in PS:
                for tree in TREES:
                    for size in SIZES:
                        if tree == "topology" and P != 8:
                            continue             # "2x4": eight cores
                        sampled = (
                            # every tree shape at one P (8 for the 2x4 topology)
                            (moment, sig, size) == ("mid_call", "SIGKILL", "large")
                            and (P == 4 or tree == "topology")
                            # every P at one tree shape
                            or (moment, sig, size, tree) == ("mid_call", "SIGKILL", "large",
                                                             "auto")
                            # every moment x signal x size at one P and tree
                            or (P, tree) == (3, "binary")
                            # a group of two, whose round is one exchange
                            or (moment, P, size, tree) == ("in_barrier", 2, "small", "auto")
                            # stops under the ring schedule and the flat tree
                            or (sig, P, size, moment) == ("SIGSTOP", 4, "large", "mid_call")
                            and tree in ("ring", "flat")
                        )
                        params.append(pytest.param(
                            moment, sig, P, tree, size,
                            id=f"{moment}-{sig}-P{P}-{tree}-{size}",
                            marks=() if sampled else full_only))
    return params


@pytest.mark.timeout(90)
@pytest.mark.parametrize("moment,sig,P,tree,size", matrix())
def test_fault_matrix(moment, sig, P, tree, size):
    n = LARGE_N if size == "large" else SMALL_N
    if moment == "in_barrier":
        victim = "root0"                  # its part of the barrier waits for the late rank
    else:
        victim = P // 2 if size == "large" else (0 if P % 2 else P - 1)  # middle, root, leaf
    timeout = STOP_TIMEOUT_S if sig == "SIGSTOP" else None
    victim, reports, victim_report = inject(P, tree, moment, sig, n, victim, timeout)
    # A group of two runs its round as one exchange: each rank's part is out as soon as it
    # enters, the root's too (as a leaf's is in test_victim_struck_inside_barrier_after_its_part),
    # so the survivor's barrier may complete - the victim did enter it - and its next call must
    # raise.
    check_reports(P, victim, moment, sig, reports, victim_report,
                  strict_first=not (moment == "in_barrier" and P == 2))


def check_reports(P, victim, moment, sig, reports, victim_report, strict_first):
    survivors = [r for r in range(P) if r != victim]
    assert sorted(reports) == survivors, \
        f"survivors that reported within 30 s: {sorted(reports)} of {survivors}: {reports}"
    print(f"{sig} {moment} P={P} victim={victim}: "
          + ", ".join(f"rank {r}: {first}/{name} after {s:.3f} s"
                      for r, (first, name, _, s) in sorted(reports.items())))
    failures = []
    for r, (first, name, msg, s) in sorted(reports.items()):
        if strict_first and first == "returned" and moment != "mid_call":
            failures.append(f"rank {r}: the struck {moment} call returned without the victim")
    if sig == "SIGKILL":
        for r, (first, name, msg, s) in sorted(reports.items()):
            if name != "PeerLostError":
                failures.append(f"rank {r}: {name}: {msg} (wanted PeerLostError)")
            elif s > DETECT_S:
                failures.append(f"rank {r}: PeerLostError {s:.2f} s after the kill "
                                f"(bound {DETECT_S} s)")
        # at least one survivor says who died (the others may only see the abort word)
        if not any(f"rank {victim} died" in msg for _, _, msg, _ in reports.values()):
            failures.append(f"no survivor names rank {victim} as dead: "
                            f"{[m for _, _, m, _ in reports.values()]}")
    else:
        names = [name for _, name, _, _ in reports.values()]
        for r, (first, name, msg, s) in sorted(reports.items()):
            if name not in ("CollectiveTimeoutError", "PeerLostError"):
                failures.append(f"rank {r}: {name}: {msg} (wanted a timeout)")
            if f"rank {victim} died" in msg:
                failures.append(f"rank {r}: a stopped peer was taken for dead: {msg}")
            if s > 2 * STOP_TIMEOUT_S + DETECT_S:
                failures.append(f"rank {r}: {name} {s:.2f} s after the stop")
        if "CollectiveTimeoutError" not in names:
            failures.append(f"no survivor raised CollectiveTimeoutError: {names}")
        if moment != "between_calls":
            # resumed, the victim finds the group aborted and raises at once
            if victim_report is None:
                failures.append("the resumed victim did not report within 10 s")
            elif victim_report[0] != "PeerLostError" or victim_report[2] > 2.0:
                failures.append(f"resumed victim: {victim_report} (wanted PeerLostError "
                                f"within 2 s)")
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", SIGNALS)
@pytest.mark.parametrize("tree", ["binary", "flat", "chain"])
def test_victim_struck_inside_barrier_after_its_part(tree, sig):
    """A leaf that entered the barrier (its part is published) and is then struck: the barrier
    may complete for the others (the victim did enter it), but their next call must raise."""
    P = 4
    with shmtree.Group(P, **group_options(tree)) as g:
        leaf = max(r for r in range(P) if not g.trees[0].children[r])
    timeout = STOP_TIMEOUT_S if sig == "SIGSTOP" else None
    victim, reports, victim_report = inject(P, tree, "in_barrier", sig, SMALL_N, leaf, timeout)
    check_reports(P, victim, "in_barrier", sig, reports, victim_report, strict_first=False)


@pytest.mark.timeout(60)
def test_kill_detected_despite_long_timeout():
    """A death is reported as PeerLostError soon, not as a timeout when timeout= runs out."""
    _, reports, _ = inject(4, "binary", "mid_call", "SIGKILL", LARGE_N, 3, timeout=60)
    for r, (first, name, msg, s) in reports.items():
        assert name == "PeerLostError" and s < DETECT_S, (r, name, msg, s)


# ---------------------------------------------------------------------------------------------
# shmtree.run: the failing rank is reported

def run_victim(comm, victim, how, n):
    x = np.full(n, comm.rank + 1.0)
    out = np.empty_like(x)
    if how == "first_call" and comm.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    for i in range(10 ** 9):
        if comm.rank == victim and i == 2:
            if how == "mid_call":
                os.kill(os.getpid(), signal.SIGKILL)
            elif how == "raises":
                raise ValueError(f"bad input on rank {comm.rank}")
            elif how == "exits":
                os._exit(7)
            elif how == "in_barrier":
                until = time.monotonic() + 30     # the others are in barrier #3 (call_of 3)
                for r in range(comm.size):
                    if r != victim:
                        wait_in_call(comm.group, r, 3, max(0.0, until - time.monotonic()))
                os.kill(os.getpid(), signal.SIGKILL)
        if how == "in_barrier":
            comm.barrier()
        else:
            comm.allreduce(x, out=out)


_REAL_JOIN = shmtree.Group.join


def _dying_join(self, rank):
    """Group.join as patched by test_run_worker_dies_before_join (inherited through fork)."""
    if rank == _DIE_BEFORE_JOIN:
        os.kill(os.getpid(), signal.SIGKILL)
    return _REAL_JOIN(self, rank)


_DIE_BEFORE_JOIN = -1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("P,victim,how,n,tree", [
    (3, 1, "first_call", SMALL_N, "auto"),
    (4, 0, "mid_call", LARGE_N, "ring"),
    (5, 4, "mid_call", SMALL_N, "flat"),
    (4, 2, "in_barrier", SMALL_N, "chain"),
    (3, 2, "raises", LARGE_N, "binary"),
    (4, 3, "exits", SMALL_N, 3),
    (8, 5, "mid_call", LARGE_N, "topology"),
])
def test_run_reports_failing_rank(P, victim, how, n, tree):
    t0 = time.monotonic()
    with pytest.raises(shmtree.WorkerError) as info:
        shmtree.run(run_victim, P, args=(victim, how, n), **group_options(tree))
    elapsed = time.monotonic() - t0
    err = info.value
    assert isinstance(err, shmtree.ShmtreeError)
    assert err.rank == victim, f"reported rank {err.rank}, the failing one is {victim}: {err}"
    assert str(err).startswith(f"rank {victim} failed: "), str(err)
    if how == "raises":
        assert "ValueError" in str(err) and f"bad input on rank {victim}" in str(err), str(err)
        assert "ValueError" in err.remote_traceback and "run_victim" in err.remote_traceback
    elif how == "exits":
        assert "7" in str(err), str(err)
    else:
        assert "SIGKILL" in str(err), str(err)
    assert elapsed < DETECT_S + 10, f"run took {elapsed:.1f} s to report the failure"


@pytest.mark.timeout(60)
def test_run_worker_dies_before_join(monkeypatch):
    """A worker that dies before it joins (nobody recorded its pid in the segment): run knows
    its process and must still report it, not wait for ever."""
    monkeypatch.setattr(shmtree.Group, "join", _dying_join)    # forked workers inherit it
    globals()["_DIE_BEFORE_JOIN"] = 2
    try:
        t0 = time.monotonic()
        with pytest.raises(shmtree.WorkerError) as info:
            shmtree.run(run_victim, 4, args=(-1, "none", SMALL_N))
        elapsed = time.monotonic() - t0
    finally:
        globals()["_DIE_BEFORE_JOIN"] = -1
    assert info.value.rank == 2, str(info.value)
    assert str(info.value).startswith("rank 2 failed: ") and "SIGKILL" in str(info.value)
    assert elapsed < DETECT_S + 10, f"run took {elapsed:.1f} s"


def run_stopper(comm, victim):
    comm.allreduce(np.ones(8), timeout=30)
    if comm.rank == victim:
        own_process_group()
        os.kill(os.getpid(), signal.SIGSTOP)
    comm.allreduce(np.ones(LARGE_N), timeout=STOP_TIMEOUT_S)


@pytest.mark.timeout(60)
def test_run_stopped_worker_times_out():
    """A stopped worker under run: the others' timeout= fires, run reports a timed-out rank
    (the root cause, not the stopped one, which never failed) and still ends every process."""
    t0 = time.monotonic()
    with pytest.raises(shmtree.WorkerError) as info:
        shmtree.run(run_stopper, 4, args=(1,))
    elapsed = time.monotonic() - t0
    err = info.value
    assert err.rank != 1, str(err)
    assert "CollectiveTimeoutError" in str(err), str(err)
    assert elapsed < STOP_TIMEOUT_S + 15, f"run took {elapsed:.1f} s"


# ---------------------------------------------------------------------------------------------
# shmtree.Pool: a worker lost mid-task must not hang map

def pool_killer_task(i, victim, n):
    x = np.full(n, shmtree.rank() + 1.0)
    for k in range(10 ** 9):
        if shmtree.rank() == victim and k == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        shmtree.allreduce(x)


def pool_ok_task(i):
    return float(shmtree.allreduce(np.ones(2))[0])


def names_rank(msg, rank):
    return re.search(rf"\brank {rank}\b", msg) is not None


@pytest.mark.timeout(90)
@pytest.mark.parametrize("P,victim,n", [(3, 2, SMALL_N), (4, 1, LARGE_N)])
def test_pool_worker_sigkilled_mid_task(P, victim, n):
    with shmtree.Pool(P) as pool:
        assert pool.map(pool_ok_task, range(P)) == [float(P)] * P
        res = pool.starmap_async(pool_killer_task, [(i, victim, n) for i in range(P)],
                                 chunksize=1)
        t0 = time.monotonic()
        try:
            res.get(timeout=30)
            pytest.fail("map returned although a worker was killed")
        except mp.TimeoutError:
            pytest.fail(f"Pool.map hung: no result 30 s after rank {victim} was SIGKILLed "
                        "mid-task (the lost task is never reported)")
        except shmtree.ShmtreeError as e:
            elapsed = time.monotonic() - t0
            assert names_rank(str(e), victim), f"the error does not name rank {victim}: {e!r}"
            assert elapsed < DETECT_S + 10, f"map took {elapsed:.1f} s to fail"
