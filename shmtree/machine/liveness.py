"""Is a process still there?  Members of a group watch each other, and workers watch the process
that started them.

- `how_gone`: whether a member's process (pid and start time, as it recorded them when it
  joined) still lives, with what it learned cached in the caller's `Watch` (pidfds);
- `identity`: (pid, start time) of this process, what a member records and a worker watches;
- `die_with_parent` / `start_parent_watch`: a worker dies with the process that started it.

psutil is imported on first use (importing shmtree stays cheap).
"""
import os
import select
import signal
import threading
import time
import weakref

PARENT_WATCH_S = 0.25       # how often a worker checks that the process that started it lives
CTIME_SLACK_S = 0.05        # start times within this are the same process (pid not reused)
MAX_PIDFDS = 16             # pidfds one group's Watch holds at most


def identity():
    """(pid, start time) of this process."""
    import psutil

    return os.getpid(), psutil.Process().create_time()


def how_gone(procs, key, pid, ctime) -> str:
    """'' while the process (pid, started at ctime) lives; else how it is gone: exited (a
    zombie too), or its pid now used by another process.  `procs` is a Watch: it caches, by
    `key` (one per member process), what psutil matched to ctime once: a pidfd of the process
    where the kernel gives one (a later check is one select of it: a waiting rank checks its
    neighbours every time slice, so the check must cost microseconds), else the start field of
    /proc/PID/stat (a later check is one read of that file)."""
    known = procs.get(key)
    if known is None:
        import psutil

        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - ctime) > CTIME_SLACK_S:
                return f"pid {pid} now belongs to another process"
        except psutil.NoSuchProcess:
            return f"pid {pid} is gone"
        except psutil.Error:
            return ""
        known = procs.watch(key, pid)
        if known is None:
            return f"pid {pid} is gone"
    start, fd = known
    if fd is not None:
        gone = procs.exited(key, known)
        if gone is not None:
            return f"pid {pid} is gone" if gone else ""
    fields = _stat_fields(pid)
    if fields is None:
        return f"pid {pid} is gone"
    state, now_start = fields
    if now_start != start:
        return f"pid {pid} now belongs to another process"
    if state in (b"Z", b"X", b"x"):
        return f"pid {pid} is a zombie"
    return ""


class Watch(dict):
    """how_gone's cache of one group's members: key -> (start field, pidfd or None).  Its
    pidfds are closed by close(), and in a child this process forks (they are the parent's).
    At most MAX_PIDFDS of them: the first members watched (a rank's tree neighbours, which it
    checks every slice, come first); the others are read from /proc.  Threads of one process
    may check the same group at once (a Pool's caller and its watch thread, both naming why
    the pool broke, while it closes): watch() and close() hold its lock, so a member is
    watched through one pidfd, and none is opened by or left in a closed Watch."""

    fds = 0
    closed = False                     # (close()d: its group is; watch() opens no pidfd then)

    def __init__(self):
        super().__init__()
        self._lock = threading.Lock()
        _WATCHES.add(self)

    def watch(self, key, pid):
        """Start watching pid (already matched to its recorded start time): (start, fd), or
        None when it is gone already.  The pidfd is checked against the start field after it is
        opened, so it names the matched process and not a successor with its pid.  A key that
        another thread has watched meanwhile keeps its entry (a second pidfd, put in its place,
        would never be closed)."""
        with self._lock:
            got = self.get(key)
            if got is not None:
                return got
            fields = _stat_fields(pid)
            fd = None
            if (fields is not None and hasattr(os, "pidfd_open") and self.fds < MAX_PIDFDS
                    and not self.closed):
                try:
                    fd = os.pidfd_open(pid)
                except OSError:         # (gone, or no pidfds here: the /proc reads serve)
                    fd = None
                if fd is not None:      # (the same process: its start time, not its state,
                    now = _stat_fields(pid)         # which a running process changes)
                    if now is None or now[1] != fields[1]:
                        os.close(fd)
                        fd, fields = None, now
            if fields is None:
                if fd is not None:
                    os.close(fd)
                return None
            self[key] = got = (fields[1], fd)
            if fd is not None:
                self.fds += 1
            return got

    def exited(self, key, known):
        """Has the process of `known` (key's entry, with a pidfd) exited: True or False, from
        one poll of its pidfd (poll, not select: a descriptor number past 1023 is fine), under
        the lock; None when the entry is gone meanwhile (close() or drop() in another thread
        closed its pidfd, whose number may name another file by now: the caller reads /proc)."""
        with self._lock:
            if self.get(key) is not known:
                return None
            p = select.poll()
            p.register(known[1], select.POLLIN)
            return bool(p.poll(0))

    def close(self):
        """The group is closed: its pidfds go, and none is opened again."""
        with self._lock:
            self.closed = True
            self._drop()

    def drop(self):
        """Close the pidfds (a forked child's copy of the parent's Watch, which may open its own
        afterwards)."""
        with self._lock:
            self._drop()

    def _drop(self):
        for _, fd in self.values():
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.clear()
        self.fds = 0

    def __del__(self):                 # (a group collected without close(): its pidfds too)
        try:
            self.close()
        except Exception:
            pass

    __hash__ = object.__hash__        # (a set member by identity)

    def __eq__(self, other):
        return self is other


_WATCHES = weakref.WeakSet()          # every Watch, to drop in a forked child


def _drop_after_fork():
    for w in list(_WATCHES):
        w._lock = threading.Lock()    # (a thread that held it at the fork is not in the child)
        w.drop()


os.register_at_fork(after_in_child=_drop_after_fork)


def _stat_fields(pid):
    """(state, start time in clock ticks) from /proc/PID/stat, as bytes; None when there is no
    such process.  (The command name, field 2, may hold spaces and parentheses: the fields after
    it are counted from its last ')'.)"""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    except (FileNotFoundError, ProcessLookupError):
        return None
    try:
        raw = os.read(fd, 4096)
    except ProcessLookupError:
        return None
    finally:
        os.close(fd)
    rest = raw[raw.rindex(b")") + 2:].split(b" ", 20)
    return rest[0], rest[19]          # (fields 3 and 22: state and starttime)


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
