"""Shared arrays that nothing can crash, exhaust or corrupt (docs/design.md, "Shared arrays";
DESIGN section 8): the peers' mappings a call uses live until the call has ended here, whatever
another thread does (Communicator.close, Group.close) and at interpreter exit; allocation checks
memory first (MemAvailable and the memory cgroup) and seals the memory; a mismatch names what
each rank asked for; the single copy stops writing once the group is aborted; the abort word
names the rank of its reason; wait_all in a forked child; SharedArrays.close under a finalizer.
"""
import fcntl
import os
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import shmtree
import shmtree.groups.transport as transport
from procutil import run_ok
from shmtree import _engine
from shmtree.codes import ABORT_FAILED
from shmtree.frontend.requests import Progress, Request

BIG = 16 << 20                  # float64 items: 128 MiB per array, a long single copy


def maps_of_arrays():
    with open("/proc/self/maps") as f:
        return sum("shmtree-array" in line for line in f)


def run_script(tmp_path, repo_root, text, args=(), timeout=120):
    """Run a Python script in a new session; (returncode, output)."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(text))
    env = dict(os.environ)
    env["PYTHONPATH"] = repo_root + os.pathsep + env.get("PYTHONPATH", "")
    job = subprocess.Popen([sys.executable, str(script), *map(str, args)], cwd=str(tmp_path),
                           env=env, start_new_session=True, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT)
    try:
        out, _ = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        out, _ = job.communicate()
        pytest.fail(f"the job did not end in {timeout} s:\n{out.decode()}")
    finally:
        try:
            os.killpg(job.pid, signal.SIGKILL)      # (whatever of the job is left)
        except ProcessLookupError:
            pass
    return job.returncode, out.decode()


# ---------------------------------------------------------------------------------------------
# item 1: close() from another thread during a single-copy call

def close_under_call_worker(comm, n):
    x = comm.zeros(n)
    x[:] = 1
    eng = comm._engine
    closed = threading.Event()

    def closer():                             # rank 0: close while a call runs in main
        while not eng.in_call:
            time.sleep(0)
        comm.close()
        closed.set()

    if comm.rank == 0:
        threading.Thread(target=closer, daemon=True).start()
    calls = 0
    try:
        for _ in range(10000):
            comm.allreduce(x, out=x)
            calls += 1
            x[:] = 1
    except shmtree.ShmtreeError as exc:
        return type(exc).__name__, str(exc), calls, closed.is_set()
    return None, "", calls, closed.is_set()


@pytest.mark.timeout(300)
def test_comm_close_from_a_thread_during_a_single_copy():
    for attempt in range(3):
        outs = run_ok(close_under_call_worker, 2, args=(BIG,))
        name, text, calls, closed = outs[0]
        assert closed and name == "ShmtreeError" and "closed" in text, outs[0]
        assert outs[1][0] in ("ShmtreeError", "PeerLostError"), outs[1]


GROUP_CLOSE_SCRIPT = """
    import os, sys, threading, time
    import numpy as np
    import shmtree

    n = int(sys.argv[1])
    g = shmtree.Group(2)
    pid = os.fork()
    if pid == 0:                              # rank 1
        code = 3
        try:
            comm = g.join(1)
            x = comm.zeros(n)
            x[:] = 1
            while True:
                comm.allreduce(x, out=x)
        except shmtree.PeerLostError:
            code = 0
        finally:
            os._exit(code)
    comm = g.join(0)                          # rank 0, in the group's creator
    x = comm.zeros(n)
    x[:] = 1
    eng = comm._engine

    def watchdog():                           # closes the group under the running call
        while not eng.in_call:
            time.sleep(0)
        g.close()

    t = threading.Thread(target=watchdog)
    t.start()
    try:
        while True:
            comm.allreduce(x, out=x)
    except shmtree.PeerLostError as exc:
        print("rank 0:", type(exc).__name__, exc, flush=True)
    t.join()
    _, status = os.waitpid(pid, 0)
    print("rank 1 status", status, flush=True)
"""


@pytest.mark.timeout(300)
def test_group_close_from_a_watchdog_thread_during_a_single_copy(tmp_path, repo_root):
    for attempt in range(3):
        rc, out = run_script(tmp_path, repo_root, GROUP_CLOSE_SCRIPT, [BIG])
        assert rc == 0, out
        assert "rank 0: PeerLostError" in out and "the group was closed" in out, out
        assert "rank 1 status 0" in out, out


STUCK_SCRIPT = """
    import time
    import numpy as np
    import shmtree

    g = shmtree.Group(2)
    comm = g.join(0)                          # rank 1 never comes: the call waits for ever
    req = comm.iallreduce(np.ones(1000))
    while not comm._engine.in_call:
        time.sleep(0)
    t0 = time.monotonic()
    g.close()                                 # (the creator's watchdog gives up)
    print(f"closed in {time.monotonic() - t0:.1f} s", flush=True)
    try:
        req.result(timeout=60)
    except shmtree.PeerLostError as exc:
        print("request: PeerLostError", exc, flush=True)
"""


@pytest.mark.timeout(120)
def test_group_close_ends_a_stuck_nonblocking_call_of_its_creator(tmp_path, repo_root):
    rc, out = run_script(tmp_path, repo_root, STUCK_SCRIPT, timeout=60)
    assert rc == 0 and "closed in" in out, out
    assert "request: PeerLostError" in out and "the group was closed" in out, out


# ---------------------------------------------------------------------------------------------
# item 2: interpreter exit with an outstanding nonblocking single copy

EXIT_SCRIPT = """
    import os, sys, time
    import numpy as np
    import shmtree

    n = int(sys.argv[1])
    g = shmtree.Group(2)
    pid = os.fork()
    rank = 1 if pid == 0 else 0
    comm = g.join(rank)
    x = comm.zeros(n)
    x[:] = 1
    comm.barrier()
    req = comm.iallreduce(x, out=x)
    seg = comm._seg
    # both ranks are inside the call (so past its agreement round: the single copy runs)
    deadline = time.monotonic() + 60
    while seg.call_of(1 - rank) == 0 or not comm._engine.in_call:
        if req.done() or time.monotonic() > deadline:
            break
        time.sleep(0)
    if rank == 0:
        _, status = os.waitpid(pid, 0)
        print("rank 1 status", status, flush=True)
    else:
        print("rank 1 exits", flush=True)
    sys.exit(0)                               # with the request outstanding
"""


@pytest.mark.timeout(300)
def test_interpreter_exit_with_an_outstanding_single_copy(tmp_path, repo_root):
    for attempt in range(4):
        rc, out = run_script(tmp_path, repo_root, EXIT_SCRIPT, [BIG])
        assert rc == 0, out
        assert "rank 1 status 0" in out, out


# ---------------------------------------------------------------------------------------------
# item 13: memory is checked before any is committed; the memory is sealed

def fake_root(tmp_path, available_kib, cgroup=None):
    """A tree standing for / with /proc/meminfo (MemAvailable) and, when cgroup is given (a
    dict of relative path -> file text), those files."""
    (tmp_path / "proc").mkdir(parents=True, exist_ok=True)
    (tmp_path / "proc" / "meminfo").write_text(
        f"MemTotal:       99999999 kB\nMemFree:        {available_kib} kB\n"
        f"MemAvailable:   {available_kib} kB\n")
    for rel, text in (cgroup or {}).items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path)


def test_available_memory_reads_meminfo_and_every_cgroup_level(tmp_path):
    root = fake_root(tmp_path / "plain", 1 << 20)
    assert transport.available_memory(root) == 1 << 30
    v2 = fake_root(tmp_path / "v2", 64 << 20, {          # 64 GiB free, the cgroups less
        "proc/self/cgroup": "0::/job/step\n",
        "sys/fs/cgroup/memory.max": "max\n",
        "sys/fs/cgroup/memory.current": "5000000000\n",
        "sys/fs/cgroup/job/memory.max": f"{300 << 20}\n",          # the parent's limit binds
        "sys/fs/cgroup/job/memory.current": f"{100 << 20}\n",
        "sys/fs/cgroup/job/memory.stat": f"anon 1\ninactive_file {20 << 20}\n",
        "sys/fs/cgroup/job/step/memory.max": f"{1 << 30}\n",
        "sys/fs/cgroup/job/step/memory.current": f"{50 << 20}\n"})
    assert transport.available_memory(v2) == (300 - 100 + 20) << 20
    v1 = fake_root(tmp_path / "v1", 64 << 20, {
        "proc/self/cgroup": "4:memory:/ci/job\n3:cpuset:/\n0::/\n",
        "sys/fs/cgroup/memory/ci/job/memory.limit_in_bytes": f"{200 << 20}\n",
        "sys/fs/cgroup/memory/ci/job/memory.usage_in_bytes": f"{150 << 20}\n",
        "sys/fs/cgroup/memory/ci/job/memory.stat": f"cache 9\ntotal_inactive_file {10 << 20}\n",
        "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
        "sys/fs/cgroup/memory/memory.usage_in_bytes": "1000\n"})
    assert transport.available_memory(v1) == (200 - 150 + 10) << 20
    # a container: its own cgroup is the mount's root, the path of /proc/self/cgroup is not
    # visible under it
    box = fake_root(tmp_path / "box", 64 << 20, {
        "proc/self/cgroup": "0::/system.slice/box\n",
        "sys/fs/cgroup/memory.max": f"{80 << 20}\n",
        "sys/fs/cgroup/memory.current": f"{30 << 20}\n"})
    assert transport.available_memory(box) == 50 << 20


def shortfall_worker(comm, per_rank, fits):
    res = {}
    before = maps_of_arrays()
    try:
        comm.zeros(per_rank, np.uint8)
        res["error"] = None
    except MemoryError as exc:
        res["error"] = str(exc)
    res["maps_kept"] = maps_of_arrays() - before
    res["after"] = float(comm.allreduce(np.ones(3))[0])          # the group is usable
    y = comm.zeros(fits, np.uint8)                                # and so is allocation
    y[:] = 1
    comm.allreduce(y, out=y)
    res["fits"] = int(y[0]), int(y[-1])
    return res


def check_shortfall(outs, per_rank, available):
    for rank, res in enumerate(outs):
        err = res["error"]
        assert err is not None, f"rank {rank}: no MemoryError"
        assert str(per_rank) in err and str(available) in err and "available" in err, err
        assert str(2 * per_rank) in err, err                     # all the ranks need
        assert res["maps_kept"] == 0 and res["after"] == 2.0, res
        assert res["fits"] == (2, 2), res


@pytest.mark.timeout(120)
def test_allocation_above_memavailable_raises_memory_error_on_every_rank(tmp_path,
                                                                         monkeypatch):
    available = 100 << 20
    monkeypatch.setattr(transport, "MEMORY_ROOT", fake_root(tmp_path, available >> 10))
    per_rank = available // 2 + (1 << 20)            # just above: the two ranks together
    outs = run_ok(shortfall_worker, 2, args=(per_rank, 1 << 20))
    check_shortfall(outs, per_rank, available)


@pytest.mark.timeout(120)
def test_allocation_above_the_memory_cgroup_raises_memory_error(tmp_path, monkeypatch):
    root = fake_root(tmp_path, 64 << 20, {                       # 64 GiB MemAvailable
        "proc/self/cgroup": "0::/job\n",
        "sys/fs/cgroup/job/memory.max": f"{120 << 20}\n",
        "sys/fs/cgroup/job/memory.current": f"{30 << 20}\n"})
    monkeypatch.setattr(transport, "MEMORY_ROOT", root)
    available = 90 << 20
    per_rank = available // 2 + 4096
    outs = run_ok(shortfall_worker, 2, args=(per_rank, 1 << 20))
    check_shortfall(outs, per_rank, available)


def real_shortfall_worker(comm):
    # a safety net should the check ever be missing: mappings past this fail (ENOMEM) instead
    # of reaching the OOM killer
    with open("/proc/self/statm") as f:
        vsize = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vsize + (2 << 30), hard))
    available = transport.available_memory()         # (rank 0's: every rank asks alike)
    per_rank = int(comm.broadcast(np.array([available // comm.size + (64 << 20)], np.int64),
                                  root=0)[0])        # just above what the machine has
    try:
        comm.zeros(per_rank, np.uint8)
        error = None
    except MemoryError as exc:
        error = str(exc)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    return error, per_rank, float(comm.allreduce(np.ones(2))[0])


@pytest.mark.timeout(120)
def test_allocation_just_above_this_machines_memory_raises_memory_error():
    for rank, (error, per_rank, after) in enumerate(run_ok(real_shortfall_worker, 2)):
        assert error is not None and str(per_rank) in error and "available" in error, error
        assert after == 2.0


def sealed_worker(comm):
    x = comm.zeros(1 << 20, np.uint8)
    x[:] = comm.rank + 1
    comm.barrier()
    out = []
    with open("/proc/self/maps") as f:
        ranges = [line.split()[0] for line in f if "shmtree-array" in line]
    for r in ranges:                  # this rank's array and its mapping of the peer's
        try:
            fd = os.open(f"/proc/self/map_files/{r}", os.O_RDWR)
        except OSError:
            out.append("no access")   # (map_files needs CAP_SYS_ADMIN on some kernels)
            continue
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            try:
                os.ftruncate(fd, (2 << 20))           # grow (harmless if it worked)
                grew = True
            except PermissionError:
                grew = False
            out.append((bool(seals & fcntl.F_SEAL_SHRINK), bool(seals & fcntl.F_SEAL_GROW),
                        grew))
        finally:
            os.close(fd)
    comm.barrier()
    return out


@pytest.mark.timeout(120)
def test_shared_arrays_are_sealed():
    outs = run_ok(sealed_worker, 2)
    for rank, out in enumerate(outs):
        assert len(out) == 2, (rank, out)
        if "no access" in out:
            pytest.skip("/proc/self/map_files is not accessible here")
        assert out == [(True, True, False)] * 2, (rank, out)


# ---------------------------------------------------------------------------------------------
# item 15: a mismatch of empty / zeros names what each rank asked for

def mismatch_worker(comm):
    out = []
    asks = [((5,), np.float64, "C"), ((4,), np.float64, "C"), ((4,), np.float64, "C")]
    for case in (asks, [((2, 3), "float32", "C"), ((2, 3), "float32", "F"),
                        ((2, 3), "int16", "C")]):
        shape, dtype, order = case[comm.rank]
        try:
            (comm.empty if comm.rank else comm.zeros)(shape, dtype, order=order)
            out.append(None)
        except shmtree.CollectiveMismatchError as exc:
            out.append(str(exc))
    out.append(float(comm.allreduce(np.ones(1))[0]))
    return out


@pytest.mark.timeout(120)
def test_allocation_mismatch_names_each_ranks_shape_dtype_and_order():
    for rank, (first, second, after) in enumerate(run_ok(mismatch_worker, 3)):
        assert first and "disagree" in first and ("zeros" in first or "empty" in first), first
        assert "rank 0 asked for shape (5,), dtype float64, C order" in first, first
        assert "ranks 1,2 asked for shape (4,), dtype float64, C order" in first, first
        assert "rank 0 asked for shape (2, 3), dtype float32, C order" in second, second
        assert "rank 1 asked for shape (2, 3), dtype float32, Fortran order" in second, second
        assert "rank 2 asked for shape (2, 3), dtype int16, C order" in second, second
        assert after == 3.0


# ---------------------------------------------------------------------------------------------
# item 21: SharedArrays.close while a finalizer empties its dict

def close_finalizer_worker(comm):
    held = [comm.zeros(1000 + i) for i in range(4)]
    real = comm._engine

    class Dropping:                   # an array's finalizer runs during close's loop (as the
        def __getattr__(self, name):  # collector or another thread may make it)
            return getattr(real, name)

        def unshare(self, ident):
            real.unshare(ident)
            held.clear()

    comm._engine = Dropping()
    try:
        comm.close()
    except RuntimeError as exc:
        return f"close raised {exc}"
    return comm._shared._live


@pytest.mark.timeout(120)
def test_shared_close_while_a_finalizer_forgets_arrays():
    for out in run_ok(close_finalizer_worker, 2):
        assert out == {}, out


# ---------------------------------------------------------------------------------------------
# item 21: the single copy stops writing into the outputs of an aborted call

def stopped_state(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def late_writes_worker(comm, n):
    assert comm._pos[0] == 0              # ring: rank 0 reduces the first half
    x = comm.zeros(n)
    x[:] = 1
    out = comm.zeros(n)
    out[:] = -1
    half = n // 2
    res = {}
    comm.barrier()
    pid0 = comm.group.member(0)[1]

    def watcher():                        # rank 1: stop rank 0 in the middle of its part
        try:
            deadline = time.monotonic() + 60
            while out[0] != 2.0 and time.monotonic() < deadline:
                pass
            os.kill(pid0, signal.SIGSTOP)
            while stopped_state(pid0) != "T":
                time.sleep(0.001)
            res["at_stop"] = int(np.count_nonzero(out[:half] == 2.0))
            comm.group.abort(ABORT_FAILED, 1, note="the test aborts the call")
            os.kill(pid0, signal.SIGCONT)
            deadline = time.monotonic() + 60  # rank 0 leaves the call (raises, or completes)
            while comm._seg.call_of(0) != 0 and time.monotonic() < deadline:
                time.sleep(0.001)
            res["after"] = int(np.count_nonzero(out[:half] == 2.0))
        except BaseException as exc:
            res["watcher"] = repr(exc)
            os.kill(pid0, signal.SIGCONT)

    t = None
    if comm.rank == 1:
        t = threading.Thread(target=watcher)
        t.start()
    try:
        comm.allreduce(x, out=out)
        res["call"] = "completed"
    except shmtree.PeerLostError:
        res["call"] = "aborted"
    if t is not None:
        t.join()
    res["half"] = half
    return res


@pytest.mark.timeout(300)
def test_single_copy_stops_writing_once_the_group_is_aborted():
    piece = 32768 // 8                    # the single copy's piece (alg_direct.pxi), in items
    for attempt in range(4):
        outs = run_ok(late_writes_worker, 2, args=(BIG,), tree="ring")
        res = outs[1]
        assert "watcher" not in res, res
        if res["at_stop"] >= res["half"] - 4 * piece:
            continue                      # rank 0 was (nearly) through its part when stopped
        assert outs[0]["call"] == "aborted" and res["call"] == "aborted", outs
        late = res["after"] - res["at_stop"]
        assert late <= 2 * piece, (f"rank 0 wrote {late} items into rank 1's output after the "
                                   f"abort (of {res['half']})")
        return
    pytest.skip("rank 0 finished its part before it could be stopped, every time")


# ---------------------------------------------------------------------------------------------
# item 21: the abort word and its rank are published together

def test_abort_reason_is_never_seen_without_its_rank():
    nseg, size = 500, 4096 + 1024 * 8     # (before the fix: 2-3 % of them saw rank 0)
    segs = []
    for _ in range(nseg):
        fd = os.memfd_create("shmtree-test-abort", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            segs.append(_engine.Segment(fd, size, 8))
        finally:
            os.close(fd)
    pid = os.fork()
    if pid == 0:                          # the reader: spins on each segment until aborted
        bad = 0
        try:
            for s in segs:
                s.mark_joined(0, 1, 0.0)  # (I am watching this one)
                while True:
                    reason, rank = s.abort_state()
                    if reason:
                        bad += rank != 5
                        break
        finally:
            os._exit(min(bad, 200))
    try:
        for s in segs:
            t0 = time.monotonic()
            while not s.member(0)[0]:
                if time.monotonic() - t0 > 30:
                    raise AssertionError("the reader stopped")
                os.sched_yield()          # (the reader may wait for this CPU)
            s.set_abort(ABORT_FAILED, 5)
    finally:
        _, status = os.waitpid(pid, 0)
        for s in segs:
            s.unmap()
    assert os.waitstatus_to_exitcode(status) == 0, \
        f"{os.waitstatus_to_exitcode(status)} of {nseg} readers saw a reason without its rank"


# ---------------------------------------------------------------------------------------------
# item 21: wait_all in a forked child, with a lock held at the fork

def wait_all_in_child(requests, hold, posted_in_child=None):
    """Fork while another thread holds `hold`; the child calls wait_all(requests), and of a
    request made (and completed) in the child too when posted_in_child is given."""
    held, release = threading.Event(), threading.Event()

    def holder():
        with hold:
            held.set()
            release.wait()

    t = threading.Thread(target=holder)
    t.start()
    held.wait()
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            more = []
            if posted_in_child is not None:
                more = [posted_in_child()]
            code = 0 if shmtree.wait_all(requests + more) == [5] * len(requests + more) else 2
        finally:
            os._exit(code)
    release.set()
    t.join()
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "blocked"
        time.sleep(0.01)


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")      # (fork with a thread running)
def test_wait_all_in_a_forked_child_with_a_lock_held_at_the_fork():
    import shmtree.frontend.requests as requests

    progress = Progress("test", threading.Lock())
    r = Request("iallreduce", 1, progress)
    r.set_result(5)                       # (makes its condition)
    assert wait_all_in_child([r], r._condition) == 0
    fresh = Request("iallreduce", 2, progress)
    fresh._state, fresh._result = "FINISHED", 5   # (done without its condition made yet)
    assert "_cond" not in fresh.__dict__

    def own_request():                    # the child's own request makes its condition
        mine = Request("iallreduce", 1, Progress("child", threading.Lock()))
        mine.set_result(5)
        return mine
    assert wait_all_in_child([fresh], requests._MAKING, own_request) == 0
