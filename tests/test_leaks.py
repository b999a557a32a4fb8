"""What a Group and a Communicator leave behind in the processes that held them (docs/design.md,
"Lifetime and security"): the segment is a memfd, so a leak shows as an open descriptor or a mapping
of the process, never in /dev/shm; and joining pins the process, which closing must undo.

- the leak check of conftest (procutil.fd_and_map_problems) itself sees a memfd descriptor and a
  memfd mapping left behind, and nothing once they are gone;
- a Group unpickled in another process (spawn), or in this one (multiprocessing's pickler, the
  descriptor passed by the resource sharer), and dropped without close(): no memfd descriptor and
  no mapping remain after gc;
- in the test process: Group(2).join(0) and Group(1).join(0) then close(): the CPU affinity is
  what it was, no memfd descriptor and no mapping remain; a joined Group(1) dropped without
  close() once its Communicator is closed: no memfd descriptor and no mapping remain after gc.

These tests check and undo what they find (close the leaked descriptors, restore the affinity)
so that one failure is reported once, by the test, and does not poison the next test.
"""
import gc
import mmap
import multiprocessing as mp
import os
import subprocess
import sys
import textwrap
import threading
import time
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest

import shmtree
from procutil import (MEMFD, fd_and_map_problems, memfd_mappings, open_fds, open_gate,
                      stop_processes, wait_gate)


def memfd_fds():
    """{fd: target} of this process's memfd descriptors."""
    return {fd: t for fd, t in open_fds().items() if t.startswith(MEMFD)}


def leaked_since(fds_before, maps_before):
    """(memfd descriptors, memfd segment names mapped) new since the snapshots, after gc."""
    gc.collect()
    fds = {fd: t for fd, t in memfd_fds().items() if fds_before.get(fd) != t}
    maps = sorted(n for ino, n in memfd_mappings().items() if ino not in maps_before)
    return fds, maps


def close_fds(fds):
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


# ---------------------------------------------------------------------------------------------
# the leak check itself

def test_leak_check_sees_a_memfd_descriptor_and_mapping():
    gc.collect()
    fds_before, maps_before = open_fds(), memfd_mappings()
    fd = os.memfd_create("shmtree-leakcheck")
    os.ftruncate(fd, mmap.PAGESIZE)
    m = mmap.mmap(fd, mmap.PAGESIZE)
    try:
        failures, _ = fd_and_map_problems(fds_before, maps_before, settle_s=0.1)
        text = "\n".join(failures)
        assert "memfd descriptors left open" in text and "shmtree-leakcheck" in text, failures
        assert "memfd segments still mapped" in text, failures
    finally:
        m.close()
        os.close(fd)
    failures, _ = fd_and_map_problems(fds_before, maps_before, settle_s=0.1)
    assert not failures, failures


def test_leak_check_watches_a_shm_entry_nobody_holds(tmp_path, monkeypatch):
    """A new /dev/shm entry that nobody holds is most often another job's, between its holders'
    exit and its unlink, a moment a loaded machine stretches to seconds: split_foreign watches
    it (up to SHM_UNHELD_SETTLE_S) and does not blame the test for one that goes meanwhile; one
    that stays, held by nobody, is still the test's.  (In a directory of this test's own, so
    that other jobs' leak checks never see these entries.)"""
    import conftest
    import procutil
    monkeypatch.setattr(procutil, "SHM_DIR", str(tmp_path))
    monkeypatch.setattr(conftest, "SHM_DIR", str(tmp_path))
    goes, stays = tmp_path / "shmtree-goes", tmp_path / "shmtree-stays"
    goes.write_bytes(b"")
    stays.write_bytes(b"")
    timer = threading.Timer(conftest.SHM_SETTLE_S, goes.unlink)     # nobody holds either
    timer.start()
    try:
        monkeypatch.setattr(conftest, "SHM_UNHELD_SETTLE_S", 30.0)
        assert conftest.split_foreign([goes.name]) == ([], []), "an entry that went was blamed"
    finally:
        timer.cancel()
        timer.join()
    monkeypatch.setattr(conftest, "SHM_UNHELD_SETTLE_S", 0.5)
    assert conftest.split_foreign([stays.name]) == ([stays.name], [])


HOLDER = textwrap.dedent("""
    import os, sys, time
    fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)    # created and held ...
    deadline = time.monotonic() + 60
    while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:
        time.sleep(0.01)
    # ... and left behind: this process ends without unlinking it
""")


@pytest.mark.timeout(120)
def test_leak_check_leaves_an_entry_another_job_abandoned_to_that_job(tmp_path, monkeypatch):
    """Another job's process (outside this test's tree) creates an entry, holds it, and ends
    without unlinking it: at the check nobody holds it, but the watcher (shm_watch.py) saw
    whose it was, and split_foreign reports it as foreign, not as the test's.  (In a
    directory of this test's own, watched by a watcher of its own.)"""
    import conftest
    import procutil
    shm, verdicts = tmp_path / "shm", str(tmp_path / "verdicts.json")
    shm.mkdir()
    entry, release = shm / "other-job-segment", str(tmp_path / "release")
    watcher = conftest.start_shm_watch(verdicts, str(shm))
    try:
        monkeypatch.setattr(procutil, "SHM_DIR", str(shm))
        monkeypatch.setattr(conftest, "SHM_DIR", str(shm))
        monkeypatch.setattr(conftest, "_watcher", {"pid": watcher.pid, "verdicts": verdicts})
        monkeypatch.setattr(conftest, "SHM_UNHELD_SETTLE_S", 0.5)
        assert wait_gate(verdicts, 60), "the watcher never began"
        pid = os.fork()                   # the holder is orphaned: not of this test's tree
        if pid == 0:
            try:
                subprocess.Popen([sys.executable, "-c", HOLDER, str(entry), release],
                                 start_new_session=True)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        deadline = time.monotonic() + 60
        while conftest.watcher_verdicts().get(entry.name) != "foreign":
            assert time.monotonic() < deadline, \
                f"the watcher never saw {entry} held by another job: {conftest.watcher_verdicts()}"
            time.sleep(0.02)
        open_gate(release)
        while conftest.shm_holders(entry.name):
            assert time.monotonic() < deadline, "the other job's process never ended"
            time.sleep(0.02)
        assert conftest.split_foreign([entry.name]) == ([], [entry.name])
        # what the check made of it without the watcher's word: the test's own leak
        monkeypatch.setattr(conftest, "_watcher", {"pid": None, "verdicts": None})
        assert conftest.split_foreign([entry.name]) == ([entry.name], [])
    finally:
        open_gate(release)
        watcher.kill()
        watcher.wait()


# ---------------------------------------------------------------------------------------------
# (a) an unpickled copy of a Group, dropped without close()

def drop_copy_in_child(holder, close, conn):
    """Runs in a spawned child; holder = [group] (the Process keeps its args: the list is
    emptied so that the group's last reference is dropped here)."""
    try:
        group = holder.pop()
        before = sorted(t for t in memfd_fds().values())
        if close:
            group.close()
        del group
        gc.collect()
        conn.send((before, memfd_fds(), sorted(memfd_mappings().values())))
    except BaseException as e:  # noqa: B036
        conn.send(f"{type(e).__name__}: {e}")
    finally:
        conn.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("close", [True, False], ids=["closed", "dropped"])
def test_group_copy_in_spawned_child_leaves_no_memfd(close):
    """The spawned child holds the group's memfd (one descriptor, one mapping) while it has the
    group; none of them once the group is closed, or dropped without close()."""
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    with shmtree.Group(2) as group:
        p = ctx.Process(target=drop_copy_in_child, args=([group], close, send))
        try:
            p.start()
            send.close()
            assert recv.poll(45), "the spawned child did not report"
            report = recv.recv()
            p.join(10)
        finally:
            stop_processes([p])
            recv.close()
            if p.exitcode is not None:
                p.close()                     # its pipes, even if a failure keeps `p` alive
    assert not isinstance(report, str), f"the child failed: {report}"
    held, fds, maps = report
    assert len(held) == 1 and "shmtree" in held[0], f"the child's group held {held}"
    how = "closed" if close else "dropped without close()"
    assert not fds, f"the child's group copy, {how}, left its memfd open: {fds}"
    assert not maps, f"the child's group copy, {how}, left its segment mapped: {maps}"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("close", [True, False], ids=["closed", "dropped"])
def test_group_copy_unpickled_in_process_leaves_no_memfd(close):
    """multiprocessing's pickler outside a process start passes the descriptor through the
    resource sharer (a thread of this process): the copy gets a descriptor of its own."""
    with shmtree.Group(2) as group:
        gc.collect()
        fds_before, maps_before = memfd_fds(), memfd_mappings()
        copy = ForkingPickler.loads(ForkingPickler.dumps(group))
        fds, _ = leaked_since(fds_before, maps_before)
        assert len(fds) == 1, f"the copy should hold a memfd descriptor of its own: {fds}"
        if close:
            copy.close()
        del copy
        fds, maps = leaked_since(fds_before, maps_before)
        close_fds(fds)                                        # undo: do not poison what follows
    how = "closed" if close else "dropped without close()"
    assert not fds, f"the unpickled group copy, {how}, left its memfd open: {fds}"
    assert not maps, f"the unpickled group copy, {how}, left its segment mapped: {maps}"


# ---------------------------------------------------------------------------------------------
# (b) joining in the test process

@pytest.mark.timeout(30)
@pytest.mark.parametrize("size", [1, 2])
def test_join_and_close_in_test_process_restores_affinity(size):
    """Group(size).join(0) in this process (pinned when the group pins), then close(): the CPU
    affinity is the original one, no memfd descriptor and no mapping remain."""
    gc.collect()
    affinity = os.sched_getaffinity(0)
    fds_before, maps_before = memfd_fds(), memfd_mappings()
    try:
        g = shmtree.Group(size)
        cpu = g.cpu_of[0]
        pinned = g.pin and cpu is not None
        c = g.join(0)
        joined_affinity = os.sched_getaffinity(0)
        if size == 1:
            assert float(c.allreduce(np.ones(3))[0]) == 1.0
        c.close()
        g.close()
        after = os.sched_getaffinity(0)
        del c, g
        fds, maps = leaked_since(fds_before, maps_before)
        close_fds(fds)
    finally:
        os.sched_setaffinity(0, affinity)                     # undo: do not poison what follows
    # else the test would prove nothing: a group that fits the usable CPUs pins its members
    assert pinned or size > len(affinity), f"Group({size}) does not pin on {sorted(affinity)}"
    if pinned:
        assert joined_affinity == {cpu}, f"join(0) pinned to {sorted(joined_affinity)}, not {cpu}"
    assert after == affinity, (f"Group({size}): after join(0) (affinity {sorted(joined_affinity)}"
                               f"{', pinned' if pinned else ''}) and close(), this process's "
                               f"affinity is {sorted(after)}, was {sorted(affinity)}")
    assert not fds, f"Group({size}) joined and closed left memfd descriptors open: {fds}"
    assert not maps, f"Group({size}) joined and closed left its segment mapped: {maps}"


@pytest.mark.timeout(30)
def test_joined_group_dropped_without_close_leaves_no_memfd():
    """A Group(1) joined in this process, its Communicator closed, the Group dropped without
    close(): gc frees the descriptor and the mapping.  (A Communicator that is not closed stays
    reachable as shmtree.current(), and keeps its group: that is not a leak.)"""
    gc.collect()
    affinity = os.sched_getaffinity(0)
    fds_before, maps_before = memfd_fds(), memfd_mappings()
    try:
        g = shmtree.Group(1)
        c = g.join(0)
        assert float(c.allreduce(np.ones(2))[0]) == 1.0
        c.close()
        del c, g
        fds, maps = leaked_since(fds_before, maps_before)
        close_fds(fds)
    finally:
        os.sched_setaffinity(0, affinity)
    assert not fds, f"a joined Group dropped without close() left its memfd open: {fds}"
    assert not maps, f"a joined Group dropped without close() left its segment mapped: {maps}"


def _pidfds():
    got = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]":
                got.add(fd)
        except OSError:                 # (the listing's own descriptor, closed by now)
            pass
    return got


def test_a_closed_watch_opens_no_pidfd():
    """liveness.Watch after its group's close(): a liveness check that another thread makes
    then (a pool's result thread asking death_of while the pool closes) reads /proc and opens
    no pidfd, which would outlive the group (the leak check saw one after
    test_usable::test_pool_map_with_idle_members_fails_naming_them)."""
    from shmtree.machine.liveness import Watch
    if not hasattr(os, "pidfd_open"):
        pytest.skip("no pidfds here")
    before = _pidfds()
    w = Watch()
    got = w.watch(("me", os.getpid()), os.getpid())
    assert got is not None and got[1] is not None and len(_pidfds() - before) == 1
    w.close()
    assert _pidfds() == before
    got = w.watch(("me again", os.getpid()), os.getpid())
    assert got is not None and got[1] is None, got      # (alive: from /proc, no pidfd)
    assert _pidfds() == before
    w.drop()                    # (a forked child's copy: dropped, and may watch again)
    v = Watch()
    v.watch(("x", os.getpid()), os.getpid())
    v.drop()
    assert _pidfds() == before and not v.closed
    assert v.watch(("y", os.getpid()), os.getpid())[1] is not None
    v.close()
    assert _pidfds() == before


def test_two_threads_checking_one_member_open_one_pidfd(monkeypatch):
    """Two threads checking the same member of one group for the first time (a Pool's caller
    naming why the pool broke while its watch thread does the same: the leak check saw pidfds
    left after test_usable::test_pool_map_with_idle_members_fails_naming_them on a loaded
    machine) watch it through one pidfd, which the group's close() closes: the second one
    opened in the first one's place was never closed."""
    from shmtree.machine.liveness import Watch, how_gone, identity
    if not hasattr(os, "pidfd_open"):
        pytest.skip("no pidfds here")
    real_open = os.pidfd_open
    cond, inside, opened = threading.Condition(), [], []

    def slow_open(pid, *args):          # (each opener waits, 2 s at most, for the other one)
        with cond:
            inside.append(threading.current_thread().name)
            cond.notify_all()
            cond.wait_for(lambda: len(inside) >= 2, timeout=2.0)
        fd = real_open(pid, *args)
        opened.append(fd)
        return fd

    monkeypatch.setattr(os, "pidfd_open", slow_open)
    pid, ctime = identity()
    w = Watch()
    said = {}

    def check():
        said[threading.current_thread().name] = how_gone(w, ("me", pid), pid, ctime)

    threads = [threading.Thread(target=check, name=f"checker {i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert said == {"checker 0": "", "checker 1": ""}, said
    # (counted by the opener, not by this process's descriptor table: a pidfd of an earlier
    # test's Watch, closed by the garbage collector meanwhile, may give its number to this one)
    assert len(opened) == 1, (inside, opened)
    assert [fd for _, fd in w.values()] == opened
    w.close()
    for fd in opened:
        with pytest.raises(OSError):
            os.fstat(fd)


def test_a_watch_forked_while_another_thread_watches_is_usable_in_the_child():
    """Watch's lock, held by a thread of the parent (one inside watch()) at the fork, is not
    held in the child: the child's own liveness checks go on."""
    from shmtree.machine.liveness import Watch
    w = Watch()
    with w._lock:                       # (as a thread inside watch() at the fork)
        child = os.fork()
        if child == 0:
            try:
                got = w.watch(("me", os.getpid()), os.getpid())
                os._exit(0 if got is not None else 1)
            except BaseException:
                os._exit(2)
    deadline = time.monotonic() + 20
    while True:
        done, status = os.waitpid(child, os.WNOHANG)
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    if not done:
        os.kill(child, 9)
        os.waitpid(child, 0)
    w.close()
    assert done, "the forked child's watch() waited for a lock no thread of it holds"
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_check_while_another_thread_closes_the_watch_never_fails():
    """how_gone in one thread while another closes (and so closes the pidfds of) the group's
    Watch: every check answers ("" for a live process), none raises on a closed descriptor or
    polls one whose number was reused; and a pidfd numbered past 1023 is checked too (poll,
    not select)."""
    import resource
    from shmtree.machine.liveness import Watch, how_gone, identity
    if not hasattr(os, "pidfd_open"):
        pytest.skip("no pidfds here")
    pid, ctime = identity()
    before = _pidfds()
    errors, answers = [], set()
    stop = threading.Event()
    watches = []

    def checker():
        while not stop.is_set():
            w = watches[-1] if watches else None
            if w is None:
                continue
            try:
                answers.add(how_gone(w, ("me", pid), pid, ctime))
            except Exception as exc:       # (an EBADF from a pidfd closed under the check)
                errors.append(repr(exc))
                return

    t = threading.Thread(target=checker)
    t.start()
    try:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and not errors:
            w = Watch()
            w.watch(("me", pid), pid)
            watches.append(w)
            time.sleep(0.0005)
            w.close()
    finally:
        stop.set()
        t.join(30)
    assert not errors, errors[:3]
    assert answers <= {""}, answers
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1400:
        pytest.skip("the descriptor limit is below 1400")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1400), hard))
    try:
        w = Watch()
        fd = os.pidfd_open(pid)
        high = os.dup2(fd, 1300)
        os.close(fd)
        w[("me", pid)] = (w.watch(("probe", pid), pid)[0], high)
        assert how_gone(w, ("me", pid), pid, ctime) == ""
        w.close()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert _pidfds() == before


def test_a_running_member_is_watched_through_its_pidfd(monkeypatch):
    """watch() matches the pidfd it opened to the process by its start time alone: a member
    whose state changed between the two reads of /proc/PID/stat (running, then sleeping: any
    busy process) keeps its pidfd (it was closed, and the member read from /proc on every
    check after)."""
    from shmtree.machine import liveness
    if not hasattr(os, "pidfd_open"):
        pytest.skip("no pidfds here")
    real = liveness._stat_fields
    states = iter([b"R", b"S", b"R", b"S"])

    def flipping(pid):
        got = real(pid)
        return None if got is None else (next(states, got[0]), got[1])

    monkeypatch.setattr(liveness, "_stat_fields", flipping)
    w = liveness.Watch()
    try:
        start, fd = w.watch(("me", os.getpid()), os.getpid())
        assert fd is not None
    finally:
        w.close()
