"""Is a process still there?  Members of a group watch each other, and workers watch the process
that started them.

- `how_gone`: whether a member's process (pid and start time, as it recorded them when it
  joined) still lives, with the psutil handles cached by the caller;
- `identity`: (pid, start time) of this process, what a member records and a worker watches;
- `die_with_parent` / `start_parent_watch`: a worker dies with the process that started it.

psutil is imported on first use (importing shmtree stays cheap).
"""
import os
import signal
import threading
import time

PARENT_WATCH_S = 0.25       # how often a worker checks that the process that started it lives
CTIME_SLACK_S = 0.05        # start times within this are the same process (pid not reused)


def identity():
    """(pid, start time) of this process."""
    import psutil

    return os.getpid(), psutil.Process().create_time()


def how_gone(procs, key, pid, ctime) -> str:
    """'' while the process (pid, started at ctime) lives; else how it is gone: exited, a zombie
    nobody has reaped yet, or its pid now used by another process.  `procs` caches psutil handles
    by `key` (one per member process) between calls."""
    import psutil

    proc = procs.get(key)
    try:
        if proc is None:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - ctime) > CTIME_SLACK_S:
                return f"pid {pid} now belongs to another process"
            procs[key] = proc
        if not proc.is_running():
            return f"pid {pid} is gone"
        if proc.status() == psutil.STATUS_ZOMBIE:
            return f"pid {pid} is a zombie"
        return ""
    except psutil.NoSuchProcess:
        return f"pid {pid} is gone"
    except psutil.Error:
        return ""


def die_with_parent():
    """Linux: the worker gets SIGKILL if the process that started it dies."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:
            os._exit(1)
    except Exception:
        pass


def watch_parent(pid, ctime):
    """A worker dies with the process that started it (pid, started at ctime), even when that
    process is not its parent (forkserver workers are the forkserver's children, so PDEATHSIG
    does not see it).  Runs forever: see start_parent_watch."""
    import psutil

    while True:
        time.sleep(PARENT_WATCH_S)
        try:
            proc = psutil.Process(pid)
            alive = (abs(proc.create_time() - ctime) < CTIME_SLACK_S
                     and proc.status() != psutil.STATUS_ZOMBIE)
        except psutil.NoSuchProcess:
            alive = False
        except psutil.Error:
            alive = True
        if not alive:
            os.kill(os.getpid(), signal.SIGKILL)


def start_parent_watch(parent):
    """watch_parent(*parent) in a daemon thread of this worker."""
    threading.Thread(target=watch_parent, args=parent, name="shmtree-parent-watch",
                     daemon=True).start()
