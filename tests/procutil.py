"""Helpers shared by the multi-process tests: /dev/shm listings, this process's descriptors and
memfd mappings, process cleanup, error names."""
import gc
import multiprocessing.forkserver
import multiprocessing.resource_sharer
import multiprocessing.resource_tracker
import os
import signal
import time

import psutil
import pytest

import shmtree

SHM_DIR = "/dev/shm"
MEMFD = "/memfd:"           # how the link of a memfd descriptor, and its mapping, read
FD_SETTLE_S = 10.0          # how long new memfd descriptors and mappings may take to go (only
                            # waited for when there are some: a loaded machine stretches it)
PLAIN_SETTLE_S = 0.3        # how long a few (FD_ALLOWANCE) other new descriptors may take to go;
                            # more than that are given FD_SETTLE_S
FD_ALLOWANCE = 3            # new plain descriptors reported as a warning, not a failure


def shm_listing():
    """The names in /dev/shm (empty if the directory does not exist)."""
    try:
        return set(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return set()


def new_shm_entries(before, settle_s=1.5):
    """Entries of /dev/shm not in ``before``, after waiting up to settle_s for them to go."""
    deadline = time.monotonic() + settle_s
    while True:
        new = shm_listing() - before
        if not new or time.monotonic() >= deadline:
            return sorted(new)
        time.sleep(0.05)


# ---- this process's own descriptors and memfd mappings (the autouse leak check) ----

def open_fds():
    """{fd: link target} of this process (the fd of the listing itself is gone by the readlink
    and left out)."""
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass
    return fds


def memfd_mappings():
    """{inode: name} of the memfd segments this process maps."""
    with open("/proc/self/maps", "rb") as f:
        data = f.read()
    segs = {}
    if MEMFD.encode() not in data:            # the common case: no line to parse
        return segs
    for line in data.decode(errors="replace").splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith(MEMFD):
            segs[parts[4]] = parts[5].strip()
    return segs


def _session_helper_fds():
    """Descriptors that multiprocessing keeps open for the whole session, once started."""
    fds = set()
    fs = getattr(multiprocessing.forkserver, "_forkserver", None)
    fd = getattr(fs, "_forkserver_alive_fd", None)
    if fd is not None:
        fds.add(fd)
    rt = getattr(multiprocessing.resource_tracker, "_resource_tracker", None)
    fd = getattr(rt, "_fd", None)
    if fd is not None:
        fds.add(fd)
    rs = getattr(multiprocessing.resource_sharer, "_resource_sharer", None)
    sock = getattr(getattr(getattr(rs, "_listener", None), "_listener", None), "_socket", None)
    if sock is not None:
        try:
            fds.add(sock.fileno())
        except OSError:
            pass
    return fds


def new_fds(before):
    """{fd: target} open now that were not open (with that target) before, session helpers'
    descriptors left out."""
    helpers = _session_helper_fds()
    return {fd: t for fd, t in open_fds().items()
            if before.get(fd) != t and fd not in helpers}


def fd_and_map_problems(fds_before, maps_before, settle_s=FD_SETTLE_S):
    """(failures, warnings) about this process's descriptors and memfd mappings new since
    fds_before (open_fds) and maps_before (memfd_mappings), after giving them settle_s to go.
    gc.collect() runs only when something new is found (a full collection costs ~60 ms once the
    whole suite is loaded: too much for every test)."""
    start = time.monotonic()
    tries = 0
    while True:
        if tries:
            gc.collect()
        fresh = new_fds(fds_before)
        memfds = {fd: t for fd, t in fresh.items() if t.startswith(MEMFD)}
        plain = {fd: t for fd, t in fresh.items() if not t.startswith(MEMFD)}
        maps = {ino: n for ino, n in memfd_mappings().items() if ino not in maps_before}
        now = time.monotonic()
        settled = not memfds and not maps and (
            not plain or len(plain) <= FD_ALLOWANCE and now >= start + min(settle_s,
                                                                          PLAIN_SETTLE_S))
        if settled or now >= start + settle_s:
            break
        if tries:
            time.sleep(0.05)
        tries += 1
    failures, warns = [], []
    if memfds:
        failures.append(f"memfd descriptors left open by the test process: {memfds}")
    if maps:
        failures.append(f"memfd segments still mapped by the test process: "
                        f"{sorted(maps.values())}")
    if len(plain) > FD_ALLOWANCE:
        failures.append(f"{len(plain)} new descriptors left open by the test process "
                        f"(more than {FD_ALLOWANCE}): {plain}")
    elif plain:
        warns.append(f"new descriptors left open by the test process: {plain}")
    return failures, warns


# ---- gates: one process holds back until another says it may go on (no sleep as a guess) ----

GATE_HOLD_S = 20.0          # how long wait_gate holds back before it goes on regardless
GATE_POLL_S = 0.002


def open_gate(path):
    """Let whoever waits in wait_gate(path) go on (a file appears, atomically)."""
    path = os.fspath(path)
    with open(path + ".tmp", "w"):
        pass
    os.replace(path + ".tmp", path)


def wait_gate(path, timeout=GATE_HOLD_S):
    """Hold back until open_gate(path) has run, in any process: True; or False after `timeout`
    seconds, and the caller goes on anyway (a gate that never opens is the test's failure to
    see, not a hang: what the caller then does shows what went wrong)."""
    path = os.fspath(path)
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() >= deadline:
            return False
        time.sleep(GATE_POLL_S)
    return True


def wait_in_call(group, rank, call, timeout=30.0):
    """Wait until `rank` of `group` is inside its call number `call` (1 = its first), as the
    group's segment says: True, or False after `timeout` s.  (A parent that strikes a member
    "while the others are blocked in their call" waits for this, not for a guessed sleep.)"""
    deadline = time.monotonic() + timeout
    while group._seg.call_of(rank) != call:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)
    return True


def wait_aborted(group, timeout=30.0):
    """Wait until `group` is aborted (a timeout, a death, a failure ran its course): True, or
    False after `timeout` s.  (A rank that must come "late", after the others' timeout has
    aborted the group, waits for this, not for a sleep guessed longer than their timeout.)"""
    deadline = time.monotonic() + timeout
    while not group.aborted():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)
    return True


def own_process_group():
    """Make this (victim) process the leader of a process group of its own.  The kernel sends
    SIGCONT (after SIGHUP, which a job started with nohup ignores) to every process of a group
    that becomes orphaned while one of them is stopped: when the shell that started the test
    run in the background exits mid-run, a victim stopped in the test process's group would be
    resumed behind the test's back (seen: every rank's call "returned" 0.9 s after the stop)."""
    os.setpgid(0, 0)


def wait_stopped(pid, timeout=30.0):
    """Wait until /proc says pid is stopped (state T)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                    return True
        except OSError:
            return False
        time.sleep(0.005)
    return False


def is_gone(proc):
    """Has this process (a psutil.Process or a pid) exited (a zombie counts as gone)?"""
    try:
        p = proc if isinstance(proc, psutil.Process) else psutil.Process(proc)
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def session_processes(sid):
    """The processes of session sid (a job started with start_new_session=True)."""
    procs = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid:
                procs.append(p)
        except (OSError, psutil.Error):
            pass
    return procs


def stop_processes(procs, timeout=5.0):
    """Resume, terminate, then kill and join every started multiprocessing.Process (also when
    a test fails; safe on processes never started)."""
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            try:
                os.kill(p.pid, signal.SIGCONT)
                p.terminate()
            except OSError:
                pass
    deadline = time.monotonic() + timeout
    for p in procs:
        if p.pid is None:
            continue
        p.join(max(0.0, deadline - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join(5)


def error_name(e):
    """The shmtree error class of e, or a description that shows it is not one."""
    for cls in (shmtree.PeerLostError, shmtree.CollectiveTimeoutError,
                shmtree.CollectiveMismatchError, shmtree.WorkerError, shmtree.ShmtreeError):
        if isinstance(e, cls):
            return cls.__name__
    return f"{type(e).__name__} (not a ShmtreeError): {e}"


def run_ok(fn, nprocs, **kw):
    """shmtree.run, turning a WorkerError into a test failure that shows the remote traceback."""
    try:
        return shmtree.run(fn, nprocs, **kw)
    except shmtree.WorkerError as e:
        pytest.fail(f"{e}\n--- remote traceback ---\n{getattr(e, 'remote_traceback', None)}")
