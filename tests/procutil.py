"""Helpers shared by the multi-process tests: /dev/shm listings, process cleanup, error names."""
import os
import signal
import time

import psutil
import pytest

import shmtree

SHM_DIR = "/dev/shm"


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
