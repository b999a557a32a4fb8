"""Failure and lifetime rules (docs/design.md, "Errors" and "Lifetime and security"): dead peers,
timeouts, aborts, no leaks.

- a worker SIGKILLed mid-allreduce: run raises WorkerError naming it; with a Group and hand-made
  processes the survivors raise PeerLostError within a few seconds (the dead process is left a
  zombie on purpose: a zombie is dead);
- timeout=: CollectiveTimeoutError (a TimeoutError) on the rank whose timeout ran out; a stopped
  peer is not a dead one; afterwards the group is aborted and every call raises PeerLostError
  at once;
- nothing outlives the group: Group.close() frees its fds and mappings, and killing a whole job
  (every process of it, with SIGKILL) leaves nothing in /dev/shm (the autouse fixture of
  conftest.py checks /dev/shm and child processes after every test as well).
"""
import gc
import mmap
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from collections import Counter

import numpy as np
import psutil
import pytest

import shmtree
from procutil import (shm_listing, new_shm_entries, is_gone, session_processes, stop_processes,
                      error_name, run_ok, open_gate, wait_gate, wait_aborted, own_process_group,
                      wait_stopped)

BIG_N = (4 << 20) // 8 + 5        # a ~4 MiB float64 array (many chunks)
LATER_TIMEOUT_S = 20.0            # the timeout of the later calls on an aborted group
AT_ONCE_S = 5.0                   # "at once" for a call on an aborted group: it waits for nobody,
                                  # so anything well short of LATER_TIMEOUT_S (what a call that
                                  # did wait would take) tells the two apart, however loaded
                                  # the machine
TIMEOUT_SLACK_S = 10.0            # how late a timeout may fire on a loaded machine: a rank
                                  # whose timeout never fired would wait forever


# ---------------------------------------------------------------------------------------------
# SIGKILL under shmtree.run

def kill_worker(comm, victim, n):
    x = np.full(n, comm.rank + 1.0)
    out = np.empty_like(x)
    for i in range(10 ** 9):
        if comm.rank == victim and i == 2:
            os.kill(os.getpid(), signal.SIGKILL)    # before its 3rd call
        comm.allreduce(x, out=out)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("P,victim,n,start_method",
                         [(4, 1, 1000, None), (4, 1, BIG_N, None), (3, 0, BIG_N, None),
                          (5, 4, 7, None), (8, 3, 65537, None), (2, 1, 1000, "forkserver")])
def test_run_sigkill_mid_allreduce(P, victim, n, start_method):
    kw = {} if start_method is None else dict(start_method=start_method)
    t0 = time.monotonic()
    with pytest.raises(shmtree.WorkerError) as info:
        shmtree.run(kill_worker, P, args=(victim, n), **kw)
    elapsed = time.monotonic() - t0
    err = info.value
    assert err.rank == victim, f"reported rank {err.rank}, the dead one is {victim}: {err}"
    assert str(err).startswith(f"rank {victim} failed:"), str(err)
    assert elapsed < 30, f"run took {elapsed:.1f} s to report the death"


# ---------------------------------------------------------------------------------------------
# a Group with hand-made processes: the survivors raise PeerLostError

def doomed_member(group, rank, victim, how, n, queue, death_time):
    """Loops on allreduce; the victim dies before its 3rd call (SIGKILL or a plain exit)."""
    try:
        comm = group.join(rank)
        x = np.full(n, rank + 1.0)
        for i in range(10 ** 9):
            if rank == victim and i == 2:
                death_time[0] = time.monotonic()
                if how == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                os._exit(3)
            comm.allreduce(x)
    except BaseException as e:  # noqa: B036 -- reported to the parent
        t = time.monotonic()
        later = []                                  # the group is aborted: every call fails
        for call in (lambda: comm.allreduce(x), comm.barrier):
            t0 = time.monotonic()
            try:
                call()
                later.append(("returned", time.monotonic() - t0))
            except BaseException as e2:  # noqa: B036
                later.append((error_name(e2), time.monotonic() - t0))
        queue.put((rank, error_name(e), t, later))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("P,victim,how,n", [(4, 1, "sigkill", 1000), (4, 1, "sigkill", BIG_N),
                                            (3, 0, "sigkill", 100), (3, 2, "exit", 100)])
def test_group_survivors_raise_peer_lost(P, victim, how, n):
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    # (an anonymous shared mapping, not ctx.RawValue: that comes from multiprocessing's heap,
    # whose arena keeps a descriptor of a deleted /dev/shm/pym-* file open for the life of the
    # test process, which the leak check reported)
    death_time = np.frombuffer(mmap.mmap(-1, 8), np.float64)
    procs = []
    with shmtree.Group(P) as group:
        try:
            for rank in range(P):
                p = ctx.Process(target=doomed_member,
                                args=(group, rank, victim, how, n, queue, death_time))
                p.start()
                procs.append(p)
            # do not join or poll the victim: it stays a zombie, which must count as dead
            reports = {}
            deadline = time.monotonic() + 60
            while len(reports) < P - 1 and time.monotonic() < deadline:
                if queue.empty():
                    time.sleep(0.01)
                    continue
                rank, name, t, later = queue.get()
                reports[rank] = (name, t, later)
        finally:
            stop_processes(procs)
    assert death_time[0] > 0, "the victim never reached its 3rd call"
    assert sorted(reports) == [r for r in range(P) if r != victim], \
        f"survivors that reported within 60 s: {sorted(reports)}"
    delays = {rank: round(t - death_time[0], 3) for rank, (_, t, _) in reports.items()}
    print(f"survivors noticed the death after (s): {delays}")
    for rank, (name, t, later) in reports.items():
        delay = t - death_time[0]
        assert name == "PeerLostError", f"rank {rank} raised {name}"
        assert delay < 10, f"rank {rank} noticed the death after {delay:.1f} s"
        for what, (lname, secs) in zip(("allreduce", "barrier"), later):
            assert lname == "PeerLostError" and secs < AT_ONCE_S, \
                f"rank {rank}: a later {what} gave {lname} after {secs:.2f} s"


# ---------------------------------------------------------------------------------------------
# timeouts

def timeout_worker(comm, sleeper, timeouts, collective):
    """Every rank joins (a barrier); then the sleeper calls only once the group is aborted (by
    the others' timeouts: it never arrives in time), the others call with timeouts[rank].  Then
    every rank calls three more times; all must raise PeerLostError at once."""
    def call(timeout):
        if collective == "barrier":
            comm.barrier(timeout=timeout)
        else:
            comm.allreduce(np.ones(1000), timeout=timeout)

    rep = {}
    comm.barrier()              # every rank has joined: the timeouts count from here
    if comm.rank == sleeper:
        rep["saw_abort"] = wait_aborted(comm.group, timeout=60.0)
        timeout = None
    else:
        timeout = timeouts.get(comm.rank)
    t0 = time.monotonic()
    try:
        call(timeout)
        rep["first"] = "returned"
    except Exception as e:
        rep["first"] = error_name(e)
        rep["first_is_timeout_error"] = isinstance(e, TimeoutError)
    rep["first_s"] = time.monotonic() - t0
    later = []
    for what in ("allreduce", "barrier", "allreduce"):
        t0 = time.monotonic()
        try:
            if what == "barrier":
                comm.barrier()
            else:
                comm.allreduce(np.ones(3), timeout=LATER_TIMEOUT_S)
            later.append((what, "returned", time.monotonic() - t0))
        except Exception as e:
            later.append((what, error_name(e), time.monotonic() - t0))
    rep["later"] = later
    return rep


def check_timeout_reports(results, sleeper, timeouts):
    failures = []
    timeout_errors = 0
    for rank, rep in enumerate(results):
        first, secs = rep["first"], rep["first_s"]
        if rank == sleeper:
            # the group was aborted before it called: its call raises at once
            if not rep["saw_abort"]:
                failures.append(f"sleeper rank {rank}: the group was not aborted within 60 s")
            if first != "PeerLostError" or secs > AT_ONCE_S:
                failures.append(f"sleeper rank {rank}: {first} after {secs:.2f} s "
                                f"(wanted PeerLostError at once)")
        elif timeouts.get(rank) is not None:
            t = timeouts[rank]
            if first == "CollectiveTimeoutError":
                timeout_errors += 1
                if not rep.get("first_is_timeout_error"):
                    failures.append(f"rank {rank}: CollectiveTimeoutError is not a TimeoutError")
                if not (t * 0.8 <= secs <= t + TIMEOUT_SLACK_S):
                    failures.append(f"rank {rank}: timeout={t} raised after {secs:.2f} s")
            elif first == "PeerLostError":      # another rank's timeout aborted the group first
                if secs > t + TIMEOUT_SLACK_S:
                    failures.append(f"rank {rank}: PeerLostError after {secs:.2f} s")
            else:
                failures.append(f"rank {rank}: {first} after {secs:.2f} s "
                                f"(wanted CollectiveTimeoutError)")
        else:
            if first != "PeerLostError" or secs > max(timeouts.values()) + TIMEOUT_SLACK_S:
                failures.append(f"rank {rank} (no timeout): {first} after {secs:.2f} s "
                                f"(wanted PeerLostError within a few seconds of the abort)")
        for what, name, s in rep["later"]:
            if name != "PeerLostError" or s > AT_ONCE_S:
                failures.append(f"rank {rank}: later {what}: {name} after {s:.2f} s "
                                f"(wanted PeerLostError at once)")
    if timeout_errors == 0:
        failures.append("no rank raised CollectiveTimeoutError")
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("collective", ["allreduce", "barrier"])
@pytest.mark.parametrize("timeouts", [{0: 0.5, 1: 0.5}, {0: 0.5}, {1: 1.0, 2: 0.5}],
                         ids=["two_ranks_0.5", "rank0_only", "ranks_1_2"])
def test_timeout_aborts_group(timeouts, collective):
    P = 3 if len(timeouts) < 2 or 2 not in timeouts else 4
    sleeper = P - 1 if P == 3 else 3
    results = run_ok(timeout_worker, P, args=(sleeper, timeouts, collective))
    check_timeout_reports(results, sleeper, timeouts)


def stopped_member(group, rank, queue, gate):
    """Rank 2 stops itself (SIGSTOP, in a process group of its own: own_process_group); once
    the parent has seen it stopped (the gate), rank 0 calls with a timeout, rank 1 without."""
    if rank == 2:
        own_process_group()
    comm = group.join(rank)
    x = np.ones(100)
    comm.allreduce(x)                               # everyone is up
    rep = dict(rank=rank)
    if rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        rep["gate"] = wait_gate(gate, timeout=60.0)
    t0 = time.monotonic()
    try:
        comm.allreduce(x, timeout=1.5 if rank == 0 else None)
        rep["first"] = "returned"
    except Exception as e:
        rep["first"] = error_name(e)
    rep["first_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    try:
        comm.barrier()
        rep["later"] = "returned"
    except Exception as e:
        rep["later"] = error_name(e)
    rep["later_s"] = time.monotonic() - t0
    queue.put(rep)


@pytest.mark.timeout(90)
def test_stopped_peer_is_not_dead(tmp_path):
    ctx = mp.get_context("fork")
    gate = tmp_path / "stopped"
    queue = ctx.SimpleQueue()
    procs = []
    reports = {}
    with shmtree.Group(3) as group:
        try:
            for rank in range(3):
                p = ctx.Process(target=stopped_member, args=(group, rank, queue, gate))
                p.start()
                procs.append(p)
            # rank 2 stops itself; only then do the others call (their timeout counts from a
            # stopped peer, not from one that has yet to stop)
            stopped = wait_stopped(procs[2].pid, timeout=60.0)
            open_gate(gate)
            deadline = time.monotonic() + 60
            while len(reports) < 2 and time.monotonic() < deadline:
                if queue.empty():
                    time.sleep(0.01)
                    continue
                rep = queue.get()
                reports[rep["rank"]] = rep
            os.kill(procs[2].pid, signal.SIGCONT)       # resume it
            while len(reports) < 3 and time.monotonic() < deadline:
                if queue.empty():
                    time.sleep(0.01)
                    continue
                rep = queue.get()
                reports[rep["rank"]] = rep
        finally:
            stop_processes(procs)
    assert stopped, "rank 2 did not stop within 60 s"
    assert sorted(reports) == [0, 1, 2], f"reports: {reports}"
    r0, r1, r2 = reports[0], reports[1], reports[2]
    assert r0["gate"] and r1["gate"], f"the gate did not open: {r0}, {r1}"
    assert r0["first"] == "CollectiveTimeoutError", f"rank 0 (timeout=1.5): {r0}"
    assert 1.2 <= r0["first_s"] <= 1.5 + TIMEOUT_SLACK_S, f"rank 0 (timeout=1.5): {r0}"
    assert r1["first"] == "PeerLostError" and r1["first_s"] < 1.5 + TIMEOUT_SLACK_S, \
        f"rank 1: {r1}"
    assert r2["first"] == "PeerLostError" and r2["first_s"] < AT_ONCE_S, f"rank 2 (resumed): {r2}"
    for rep in (r0, r1, r2):
        assert rep["later"] == "PeerLostError" and rep["later_s"] < AT_ONCE_S, rep


# ---------------------------------------------------------------------------------------------
# nothing outlives the group

def shm_like_mappings():
    """Lines of /proc/self/maps that look like shared-memory segments."""
    with open("/proc/self/maps") as f:
        return sorted(line.split(None, 5)[-1].strip() for line in f
                      if "/dev/shm" in line or "memfd:" in line or "shmtree" in line
                      or "SYSV" in line)


def fd_targets():
    gc.collect()                                    # fds of garbage from earlier tests go now
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return sorted(out)


def added(after, before):
    """Items of ``after`` not in ``before`` (as multisets): what was opened and not closed."""
    return sorted((Counter(after) - Counter(before)).elements())


@pytest.mark.timeout(60)
def test_group_close_frees_fds_and_mappings():
    with shmtree.Group(4, chunk_bytes=4096):
        pass                                        # warm-up (lazy imports, caches)
    fds, maps = fd_targets(), shm_like_mappings()
    for P in (1, 2, 4, 8, 8, 4):
        group = shmtree.Group(P)
        group.close()
    with shmtree.Group(3, tree="ring") as g:
        assert isinstance(g, shmtree.Group)
    assert not added(fd_targets(), fds), "Group.close() left file descriptors open"
    assert not added(shm_like_mappings(), maps), "Group.close() left shared mappings"


def tiny_worker(comm):
    return float(comm.allreduce(np.ones(4))[0])


@pytest.mark.timeout(90)
def test_run_frees_fds_and_mappings():
    assert run_ok(tiny_worker, 2) == [2.0, 2.0]    # warm-up
    fds, maps = fd_targets(), shm_like_mappings()
    for P in (1, 3, 4):
        assert run_ok(tiny_worker, P) == [float(P)] * P
    with pytest.raises(shmtree.WorkerError):
        shmtree.run(kill_worker, 3, args=(1, 1000))
    assert not added(fd_targets(), fds), "run() left file descriptors open"
    assert not added(shm_like_mappings(), maps), "run() left shared mappings"


JOB_SCRIPT = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import shmtree

    def work(comm, n, ready_path, nap):
        x = np.full(n, comm.rank + 1.0)
        out = np.empty_like(x)
        for i in range(10 ** 9):
            comm.allreduce(x, out=out)
            if i == 3 and comm.rank == 0:
                with open(ready_path, "w") as f:
                    f.write(str(os.getpid()))
            if nap:
                time.sleep(nap)

    def task(i, n, ready_path, nap):
        work(shmtree.current(), n, ready_path, nap)

    if __name__ == "__main__":
        P, n, ready, nap, method = sys.argv[1:6]
        if method == "pool":
            with shmtree.Pool(int(P)) as pool:
                pool.starmap(task, [(i, int(n), ready, float(nap)) for i in range(int(P))])
        else:
            shmtree.run(work, int(P), args=(int(n), ready, float(nap)),
                        start_method=None if method == "default" else method)
""")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victims,P,n,nap,method", [
    ("whole_job", 4, 1000, 0.01, "default"),
    ("whole_job", 4, BIG_N, 0.0, "default"),
    ("whole_job", 3, 5000, 0.005, "forkserver"),
    ("whole_job", 2, BIG_N, 0.0, "spawn"),
    ("whole_job", 3, BIG_N, 0.0, "pool"),
    # only the main process: run's workers must not outlive it (nothing outlives the group).
    # (Not for Pool: a pool worker busy with an endless task outlives its parent in plain
    # multiprocessing too.)
    ("parent_only", 4, 1000, 0.01, "default"),
    ("parent_only", 3, 5000, 0.005, "forkserver"),
    ("parent_only", 2, BIG_N, 0.0, "spawn"),
])
def test_killing_the_job_leaves_nothing(tmp_path, repo_root, P, n, nap, method, victims):
    """SIGKILL the job (every process of it, or only its main process, which leaves the
    workers orphaned): no process of the job and nothing in /dev/shm may remain."""
    script = tmp_path / "job.py"
    script.write_text(JOB_SCRIPT)
    ready = tmp_path / "ready"
    before = shm_listing()
    env = dict(os.environ)
    env["PYTHONPATH"] = repo_root + os.pathsep + env.get("PYTHONPATH", "")
    job = subprocess.Popen([sys.executable, str(script), str(P), str(n), str(ready), str(nap),
                            method], cwd=repo_root, env=env, start_new_session=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert job.poll() is None, f"job exited early: {job.communicate()[0].decode()}"
            assert time.monotonic() < deadline, "job never got going"
            time.sleep(0.02)
        time.sleep(0.2)                             # well inside the loop of allreduce
        members = session_processes(job.pid)
        assert len(members) >= P + 1, f"expected the job and {P} workers, saw {members}"
        if victims == "whole_job":
            os.killpg(job.pid, signal.SIGKILL)
        else:
            os.kill(job.pid, signal.SIGKILL)
        job.wait(30)
        deadline = time.monotonic() + 10
        while not all(is_gone(p) for p in members) and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = [p for p in members if not is_gone(p)]
        assert not alive, f"processes of the job survived ({victims} killed): {alive}"
    finally:
        try:
            os.killpg(job.pid, signal.SIGKILL)
        except OSError:
            pass
        job.wait(30)
        for p in session_processes(job.pid):
            try:
                p.kill()
            except psutil.Error:
                pass
        job.stdout.close()
    from conftest import split_foreign
    leaked, foreign = split_foreign(new_shm_entries(before, settle_s=2.0))
    if foreign:
        warnings.warn(f"ignored new /dev/shm entries held by processes of another job: {foreign}")
    assert not leaked, f"killing the whole job left {leaked} in /dev/shm"
