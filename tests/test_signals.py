"""Signals and interpreter exit (DESIGN.md section 5: "never hangs or leaks").

- SIGINT (to the parent alone, or to the whole process group as Ctrl-C in a terminal sends it)
  and SIGTERM to the parent of shmtree.run or of a shmtree.Pool, while the workers are busy in
  allreduce: the job exits, no process with a worker's pid remains (a zombie counts as gone),
  nothing new in /dev/shm;
- a member that returns without closing its communicator, a Group garbage-collected without
  close(), the interpreter exiting with a Group, a Communicator or a Pool still open: clean;
- Ctrl-C (SIGINT) delivered to a worker blocked in allreduce while another rank never calls: that
  worker raises KeyboardInterrupt promptly (< 2 s), the others PeerLostError.

Jobs run as separate scripts (start_new_session=True) so that their signals and their exit are
their own; every test kills what is left of the job's session in its `finally`.
"""
import gc
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import psutil
import pytest

import shmtree
from procutil import shm_listing, new_shm_entries, is_gone, session_processes

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
    assert not new_shm_entries(before), "the job left entries in /dev/shm"


# ---------------------------------------------------------------------------------------------
# Ctrl-C to a worker blocked in allreduce

def interrupted_member(group, rank, n, ready, go, queue):
    """Rank 1 never calls until `go`; ranks 0 and 2 block in allreduce; rank 0 gets SIGINT."""
    try:
        comm = group.join(rank)
        comm.barrier(timeout=60)                      # every member is up
        if rank == 1:
            go.wait(60)
        else:
            ready.set()
        t0 = time.monotonic()
        try:
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
    ready, go = ctx.Event(), ctx.Event()
    procs, reports = [], {}
    with shmtree.Group(3, tree="flat") as group:
        try:
            for rank in range(3):
                p = ctx.Process(target=interrupted_member, args=(group, rank, n, ready, go, queue))
                p.start()
                procs.append(p)
            assert ready.wait(60)
            time.sleep(0.3)                           # ranks 0 and 2 are blocked in allreduce
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
    assert not new_shm_entries(before), "entries left in /dev/shm"
