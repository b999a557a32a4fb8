"""Signals and interpreter exit (docs/design.md, "Waiting, aborting, liveness": never hangs or leaks).

- SIGINT (to the parent alone, or to the whole process group as Ctrl-C in a terminal sends it)
  and SIGTERM to the parent of shmtree.run or of a shmtree.Pool, while the workers are busy in
  allreduce: the job exits, no process with a worker's pid remains (a zombie counts as gone),
  nothing new in /dev/shm;
- a member that returns without closing its communicator, a Group garbage-collected without
  close(), the interpreter exiting with a Group, a Communicator or a Pool still open: clean;
- Ctrl-C (SIGINT) delivered to a worker blocked in allreduce while another rank never calls: that
  worker raises KeyboardInterrupt promptly (< 2 s), the others PeerLostError;
- KeyboardInterrupt at random moments of a loop of small (fast-path) allreduce calls, hundreds of
  times: after each one the group is either usable (the next calls give the right result on
  every rank) or cleanly aborted (every rank raises PeerLostError, promptly); never wedged (a
  call that waits for a peer forever, "another thread of this rank is inside a collective") nor
  corrupted ("a ring holds data of another call").

Jobs run as separate scripts (start_new_session=True) so that their signals and their exit are
their own; every test kills what is left of the job's session in its `finally`.
"""
import gc
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import psutil
import pytest

import shmtree
from procutil import (shm_listing, new_shm_entries, is_gone, session_processes, stop_processes,
                      wait_in_call)

DETECT_S = 5.0
EXIT_S = 15.0             # a signalled job must be gone within this
INTERRUPT_S = 2.0         # SIGINT -> KeyboardInterrupt in a worker blocked in allreduce

JOB = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import shmtree

    def note_pid(piddir, rank):
        path = os.path.join(piddir, str(rank))
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(path + ".tmp", path)

    def busy(comm, piddir, n):
        x = np.full(n, comm.rank + 1.0)
        out = np.empty_like(x)
        comm.allreduce(x, out=out)
        note_pid(piddir, comm.rank)
        while True:
            comm.allreduce(x, out=out)

    def pool_busy(piddir, n):
        x = np.full(n, shmtree.rank() + 1.0)
        out = np.empty_like(x)
        shmtree.allreduce(x, out=out)
        note_pid(piddir, shmtree.rank())
        while True:
            shmtree.allreduce(x, out=out)

    if __name__ == "__main__":
        mode, P, piddir, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
        note_pid(piddir, "parent")
        if mode == "run":
            shmtree.run(busy, P, args=(piddir, n))
        else:
            with shmtree.Pool(P) as pool:
                pool.starmap(pool_busy, [(piddir, n)] * P, chunksize=1)
""")


def jobs_shm_entries(before):
    """The /dev/shm entries new since `before` that are not another job's (one running on the
    same machine at the same time: conftest.split_foreign, a warning there)."""
    from conftest import split_foreign
    return split_foreign(new_shm_entries(before))[0]


def kill_session(job, pids):
    """Kill what is left of the job: its session and any recorded pid (our own descendants)."""
    try:
        os.killpg(job.pid, signal.SIGKILL)
    except OSError:
        pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        job.wait(10)
    except subprocess.TimeoutExpired:
        pass
    for p in session_processes(job.pid):
        try:
            p.kill()
        except psutil.Error:
            pass


def start_job(tmp_path, repo_root, script_text, args):
    script = tmp_path / "job.py"
    script.write_text(script_text)
    env = dict(os.environ)
    env["PYTHONPATH"] = repo_root + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen([sys.executable, str(script), *map(str, args)], cwd=str(tmp_path),
                            env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def wait_pids(job, piddir, names, timeout=60):
    """{name: pid} once every name's pid file exists."""
    deadline = time.monotonic() + timeout
    while True:
        have = {n: piddir / str(n) for n in names}
        if all(p.exists() for p in have.values()):
            return {n: int(p.read_text()) for n, p in have.items()}
        if job.poll() is not None:
            pytest.fail(f"the job exited early:\n{job.stdout.read().decode()}")
        if time.monotonic() > deadline:
            pytest.fail(f"the job never got going: {sorted(os.listdir(piddir))}")
        time.sleep(0.02)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode,sig,target,n", [
    ("run", "SIGINT", "parent", 1000),
    ("run", "SIGINT", "group", (4 << 20) // 8),
    ("run", "SIGTERM", "parent", (4 << 20) // 8),
    ("run", "SIGTERM", "group", 1000),
    ("pool", "SIGINT", "parent", 1000),
    ("pool", "SIGINT", "group", (4 << 20) // 8),
    ("pool", "SIGTERM", "parent", 1000),
    ("pool", "SIGTERM", "group", 1000),
])
def test_signal_to_parent_ends_job(tmp_path, repo_root, mode, sig, target, n):
    """The parent of run / Pool is signalled while its workers are busy in allreduce."""
    P = 3
    piddir = tmp_path / "pids"
    piddir.mkdir()
    before = shm_listing()
    job = start_job(tmp_path, repo_root, JOB, [mode, P, piddir, n])
    pids = {}
    try:
        pids = wait_pids(job, piddir, ["parent", *range(P)])
        assert pids["parent"] == job.pid
        workers = [pids[r] for r in range(P)]
        time.sleep(0.2)                                   # busy in allreduce
        t0 = time.monotonic()
        if target == "parent":
            os.kill(job.pid, getattr(signal, sig))
        else:
            os.killpg(job.pid, getattr(signal, sig))      # Ctrl-C / kill of the job
        try:
            job.wait(EXIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{mode} parent still running {EXIT_S} s after {sig} to the {target}")
        deadline = time.monotonic() + EXIT_S
        while not all(is_gone(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = [p for p in workers if not is_gone(p)]
        assert not alive, (f"{mode}: workers {alive} still running {time.monotonic() - t0:.1f} s "
                           f"after {sig} to the {target} (the parent exited with "
                           f"{job.returncode})")
    finally:
        kill_session(job, pids.values())
        job.stdout.close()
    assert not jobs_shm_entries(before), "the job left entries in /dev/shm"


# ---------------------------------------------------------------------------------------------
# Ctrl-C to a worker blocked in allreduce

def interrupted_member(group, rank, n, ready, go, queue):
    """Rank 1 never calls until `go`; ranks 0 and 2 block in allreduce (each sets ready[rank]
    just before); rank 0 gets SIGINT."""
    try:
        comm = group.join(rank)
        comm.barrier(timeout=60)                      # every member is up
        if rank == 1:
            go.wait(60)
        t0 = time.monotonic()
        try:
            if rank != 1:
                ready[rank].set()
            comm.allreduce(np.ones(n))
            queue.put((rank, "returned", "", time.monotonic(), time.monotonic() - t0))
        except BaseException as e:  # noqa: B036 -- KeyboardInterrupt is the point
            queue.put((rank, type(e).__name__, str(e), time.monotonic(), time.monotonic() - t0))
    except BaseException as e:  # noqa: B036
        queue.put((rank, "setup " + type(e).__name__, str(e), time.monotonic(), 0.0))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [10, (8 << 20) // 8])
def test_ctrl_c_to_worker_blocked_in_allreduce(n):
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    ready, go = [ctx.Event() for _ in range(3)], ctx.Event()
    procs, reports = [], {}
    with shmtree.Group(3, tree="flat") as group:
        try:
            for rank in range(3):
                p = ctx.Process(target=interrupted_member, args=(group, rank, n, ready, go, queue))
                p.start()
                procs.append(p)
            for rank in (0, 2):                       # ranks 0 and 2 are blocked in allreduce
                assert ready[rank].wait(60), f"rank {rank} never got to its call"
                wait_in_call(group, rank, 2)          # (call 1 was the barrier)
            sent = time.monotonic()
            os.kill(procs[0].pid, signal.SIGINT)
            deadline = time.monotonic() + 30
            while len(reports) < 2 and time.monotonic() < deadline:
                if queue.empty():
                    time.sleep(0.005)
                    continue
                rank, name, msg, t, _ = queue.get()
                reports[rank] = (name, msg, t - sent)
            go.set()                                  # rank 1 calls at last: the group is gone
            while len(reports) < 3 and time.monotonic() < deadline:
                if queue.empty():
                    time.sleep(0.005)
                    continue
                rank, name, msg, t, took = queue.get()
                reports[rank] = (name, msg, took)
        finally:
            go.set()
            for p in procs:
                p.join(5)
                if p.exitcode is None:
                    p.kill()
                    p.join(5)
    assert sorted(reports) == [0, 1, 2], reports
    name, msg, s = reports[0]
    assert name == "KeyboardInterrupt", f"rank 0 after SIGINT: {reports[0]}"
    assert s < INTERRUPT_S, f"rank 0 raised KeyboardInterrupt {s:.2f} s after SIGINT"
    name, msg, s = reports[2]
    assert name == "PeerLostError" and s < DETECT_S, f"rank 2: {reports[2]}"
    assert "rank 0" in msg, f"rank 2's error does not say rank 0 failed: {msg}"
    name, msg, took = reports[1]
    assert name == "PeerLostError" and took < 1.0, f"rank 1 (late caller): {reports[1]}"


# ---------------------------------------------------------------------------------------------
# KeyboardInterrupt at random early moments of fast-path calls

FAST_SIZES = (1, 8, 64, 512)      # float64 items: 8 B .. 4 KiB, the inline fast path
FAST_TARGET = 500                 # interrupts to deliver in all (if FAST_BUDGET_S allows)
FAST_MIN = 100                    # fewer than this, and the test proved too little
FAST_PER_ROUND = 25               # interrupts per group, at most (an abort ends a group sooner)
FAST_MAX_DELAY_S = 0.003          # each interrupt comes 10 us .. 3 ms after the previous one
FAST_BUDGET_S = 12.0              # no new group after this (the test must stay short) ...
FAST_MIN_BUDGET_S = 35.0          # ... unless fewer than FAST_MIN were delivered (a loaded machine
                                  # starts fewer groups in FAST_BUDGET_S): then until this
FAST_CALL_TIMEOUT_S = 3.0         # every call: a wedge shows as CollectiveTimeoutError
FAST_PROMPT_S = 2.0               # PeerLostError within this of the start of the call
STOP_VOTE = 10.0                  # the victim adds this to its input to end the loop


def fastpath_member(group, rank, victim, n, interrupts, seed, conn):
    """Both ranks loop on allreduce(x) with x = rank + 1 (the sum is 3 everywhere).  The victim
    arms a one-shot timer of a random 10 us .. 3 ms whose SIGALRM runs SIGINT's handler
    (KeyboardInterrupt), catches the interrupt, re-arms, and after `interrupts` of them adds
    STOP_VOTE to its input: the call that sums to 13 ends the loop on every rank at once.  Every
    call has a timeout, so a wedged group ends as an error, not a hang.  Reports a dict."""
    rep = {"rank": rank, "calls": 0, "caught": 0, "end": None, "msg": "", "took": 0.0}
    try:
        comm = group.join(rank)
        x = np.full(n, rank + 1.0)
        last = x + STOP_VOTE
        rng = random.Random(seed)
        me = rank == victim
        if me:
            signal.signal(signal.SIGALRM, signal.default_int_handler)
        armed = False
        # the interrupt may come at any bytecode, also at the jump back of a loop: the inner
        # loop runs inside the try; the outer one goes round only after an interrupt was handled
        # (no alarm pending then)
        while rep["end"] is None:
            try:
                while rep["end"] is None:
                    t0 = time.monotonic()
                    try:
                        stop = me and rep["caught"] >= interrupts
                        if me and not stop and not armed:
                            armed = True
                            signal.setitimer(signal.ITIMER_REAL,
                                             rng.uniform(1e-5, FAST_MAX_DELAY_S))
                        y = comm.allreduce(last if stop else x, timeout=FAST_CALL_TIMEOUT_S)
                        rep["calls"] += 1
                        if np.all(y == 3.0 + STOP_VOTE):
                            rep["end"] = "stopped"
                        elif not np.all(y == 3.0):
                            rep["end"], rep["msg"] = "wrong result", f"{y[:4]} (expected 3.0)"
                    except KeyboardInterrupt:
                        raise
                    except BaseException as e:  # noqa: B036
                        rep["end"], rep["msg"] = type(e).__name__, str(e)
                        rep["took"] = time.monotonic() - t0
            except KeyboardInterrupt as e:
                armed = False
                rep["caught"] += 1
                cause = e.__context__       # an interrupt in the handler of another error
                if rep["end"] is None and cause is not None and \
                        not isinstance(cause, KeyboardInterrupt):
                    rep["end"], rep["msg"] = type(cause).__name__, str(cause)
                    rep["took"] = time.monotonic() - t0
    except BaseException as e:  # noqa: B036
        if rep["end"] is None:
            rep["end"], rep["msg"] = "setup " + type(e).__name__, str(e)
    finally:
        for _ in range(5):            # a last pending alarm may interrupt this too
            try:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, signal.SIG_IGN)
                break
            except KeyboardInterrupt:
                pass
        conn.send(rep)
        conn.close()


def fastpath_round(ctx, rnd, n, victim, interrupts):
    """One group of 2: the reports of both ranks ({rank: dict}, missing ones absent)."""
    reports, procs, conns = {}, [], []
    deadline = time.monotonic() + interrupts * FAST_MAX_DELAY_S + 2 * FAST_CALL_TIMEOUT_S + 5
    with shmtree.Group(2) as group:
        try:
            for rank in range(2):
                recv, send = ctx.Pipe(duplex=False)
                p = ctx.Process(target=fastpath_member,
                                args=(group, rank, victim, n, interrupts, rnd * 7919 + rank,
                                      send))
                p.start()
                send.close()
                procs.append(p)
                conns.append(recv)
            for rank, c in enumerate(conns):
                if c.poll(max(0.0, deadline - time.monotonic())):
                    try:
                        reports[rank] = c.recv()
                    except EOFError:
                        pass
        finally:
            stop_processes(procs)
            for c in conns:
                c.close()
    return reports


def fastpath_verdict(reports, victim):
    """'' when the round kept the contract, else what went wrong."""
    if sorted(reports) != [0, 1]:
        return f"no report from rank(s) {sorted({0, 1} - set(reports))} (wedged or died)"
    ends = {r: reports[r]["end"] for r in (0, 1)}
    if ends[1 - victim] == "setup PeerLostError" and ends[victim] == "PeerLostError":
        ends[1 - victim] = "PeerLostError"          # (the victim's first call was interrupted
                                                    # before its peer joined: join refuses the
                                                    # aborted group, with the same error)
    if set(ends.values()) == {"stopped"}:
        return ""                                   # usable after every interrupt
    if set(ends.values()) == {"PeerLostError"}:     # cleanly aborted
        slow = [r for r in (0, 1) if reports[r]["took"] > FAST_PROMPT_S]
        return f"PeerLostError not prompt on rank(s) {slow}" if slow else ""
    return "; ".join(f"rank {r}{' (interrupted)' if r == victim else ''}: {rep['end']}: "
                     f"{rep['msg']} (after {rep['calls']} calls, {rep['caught']} interrupts, "
                     f"{rep['took']:.2f} s in the call)" for r, rep in sorted(reports.items()))


@pytest.mark.timeout(60)
def test_interrupts_at_random_moments_of_fast_path_calls():
    ctx = mp.get_context("fork")
    t0 = time.monotonic()
    delivered, rounds, aborted, failures = 0, 0, 0, []
    while delivered < FAST_TARGET and not failures and (
            time.monotonic() - t0 < FAST_BUDGET_S
            or delivered < FAST_MIN and time.monotonic() - t0 < FAST_MIN_BUDGET_S):
        n = FAST_SIZES[rounds % len(FAST_SIZES)]
        victim = (rounds // len(FAST_SIZES)) % 2
        reports = fastpath_round(ctx, rounds, n, victim, min(FAST_PER_ROUND,
                                                             FAST_TARGET - delivered))
        rounds += 1
        delivered += reports.get(victim, {}).get("caught", 0)
        aborted += all(r["end"] == "PeerLostError" for r in reports.values())
        verdict = fastpath_verdict(reports, victim)
        if verdict:
            failures.append(f"round {rounds} ({8 * n} B, rank {victim} interrupted): {verdict}")
    took = time.monotonic() - t0
    assert not failures, (f"{failures[0]}\n({delivered} interrupts in {rounds} groups, "
                          f"{aborted} cleanly aborted, {took:.1f} s)")
    # else the test proved too little (each abort costs a new group: a slow machine may not
    # reach FAST_TARGET within the budget)
    assert delivered >= FAST_MIN, f"only {delivered} interrupts in {rounds} groups ({took:.1f} s)"


# ---------------------------------------------------------------------------------------------
# members and groups that are not closed

def unclosed_member(group, rank, calls, n, quitter, queue):
    """Every rank makes `calls` allreduces; the quitter leaves right after its last one without
    closing anything (os._exit: no cleanup at all), the others check their results."""
    try:
        comm = group.join(rank)
        x = np.full(n, rank + 1.0)
        ok = True
        for _ in range(calls):
            y = comm.allreduce(x, timeout=30)
            ok = ok and bool(np.all(y == group.size * (group.size + 1) / 2))
        if rank == quitter:
            os._exit(0)
        queue.put((rank, ok, ""))
    except BaseException as e:  # noqa: B036
        queue.put((rank, False, f"{type(e).__name__}: {e}"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tree,quitter,n", [("chain", 0, 10), ("chain", 3, (4 << 20) // 8),
                                            ("binary", 0, (4 << 20) // 8), ("ring", 2, 100000),
                                            ("flat", 0, 10)])
def test_member_returns_without_closing(tree, quitter, n):
    """A member that finished its part and left is no loss: the others' calls complete."""
    P = 4
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    procs, reports = [], {}
    with shmtree.Group(P, tree=tree, chunk_bytes=64 * 1024) as group:
        try:
            for rank in range(P):
                p = ctx.Process(target=unclosed_member,
                                args=(group, rank, 6, n, quitter, queue))
                p.start()
                procs.append(p)
            deadline = time.monotonic() + 40
            while len(reports) < P - 1 and time.monotonic() < deadline:
                if queue.empty():
                    time.sleep(0.005)
                    continue
                rank, ok, err = queue.get()
                reports[rank] = (ok, err)
            for p in procs:
                p.join(10)
        finally:
            for p in procs:
                if p.exitcode is None:
                    p.kill()
                    p.join(5)
    assert sorted(reports) == [r for r in range(P) if r != quitter], reports
    assert all(ok for ok, _ in reports.values()), reports
    assert [p.exitcode for p in procs] == [0] * P


def fd_target(fd):
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def shmtree_mappings():
    with open("/proc/self/maps") as f:
        return [line for line in f if "memfd:shmtree" in line]


@pytest.mark.timeout(30)
def test_group_garbage_collected_without_close():
    gc.collect()
    maps_before = len(shmtree_mappings())
    group = shmtree.Group(4)
    fd = group._fd                                    # private: the memfd, to watch it go
    assert "memfd:shmtree" in fd_target(fd)
    assert len(shmtree_mappings()) == maps_before + 1
    del group
    gc.collect()
    target = fd_target(fd)
    assert target is None or "memfd:shmtree" not in target, "the memfd outlived its Group"
    assert len(shmtree_mappings()) == maps_before, "the mapping outlived its Group"


EXIT_SCRIPT = textwrap.dedent("""
    import multiprocessing as mp, os, sys
    import numpy as np
    import shmtree

    KEEP = []

    def keep_comm(comm):
        KEEP.append(comm)                     # never closed
        return float(comm.allreduce(np.ones(3))[0])

    def member(group):
        comm = group.join(0)                  # never closed; the process just ends
        KEEP.append(comm)
        comm.allreduce(np.ones(3))

    def task(i):
        return float(shmtree.allreduce(np.ones(2))[0])

    if __name__ == "__main__":
        what = sys.argv[1]
        if what == "group":
            g = shmtree.Group(4)              # the interpreter exits with it open
        elif what == "run":
            assert shmtree.run(keep_comm, 3) == [3.0] * 3
            g = shmtree.Group(2)
        elif what == "member":
            g = shmtree.Group(1)
            p = mp.get_context("fork").Process(target=member, args=(g,))
            p.start()
            p.join()
            assert p.exitcode == 0, p.exitcode
        elif what == "pool":
            pool = shmtree.Pool(2)            # neither closed nor terminated
            assert pool.map(task, range(2)) == [2.0, 2.0]
        print("done", flush=True)
""")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", ["group", "run", "member", "pool"])
def test_interpreter_exit_with_open_objects(tmp_path, repo_root, what):
    before = shm_listing()
    job = start_job(tmp_path, repo_root, EXIT_SCRIPT, [what])
    try:
        out, _ = job.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        kill_session(job, [])
        pytest.fail(f"the interpreter did not exit with a {what} open")
    finally:
        kill_session(job, [])
        job.stdout.close()
    text = out.decode()
    assert job.returncode == 0, text
    assert text.strip() == "done", f"output at exit (warnings, tracebacks?):\n{text}"
    assert not session_processes(job.pid), "processes of the job outlived it"
    assert not jobs_shm_entries(before), "entries left in /dev/shm"
