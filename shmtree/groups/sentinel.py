"""The sentinel (issue 38): a thread per member process that sleeps in poll() on the pidfds of
the members its communicators wait for, and aborts a group (ABORT_DIED) the moment one of them
dies while a member is inside a call it has not completed (docs/design.md, "Survive").

The abort rings every rank's bell, so every rank asleep in that call wakes at once: without
the sentinel a rank sees a death at the end of its engine time slice (20 ms, communicators/
communicator.py).  Watched: every other member of a group of up to SENTINEL_ALL ranks, the
tree and ring neighbours in larger ones.  A member that dies between calls is remembered and
looked at again every DEAD_LOOK_S, until some member enters a call it has not completed (a
member that closed its communicator first is no loss).  Only the sentinel's thread opens and
closes its pidfds: a descriptor number closed under a poll() could name another process's pidfd
next.  A process watched for several communicators (a sub-communicator's members are its
parent's) has one pidfd.  The thread starts with the first communicator of the process that has
peers (Communicator's constructor: watch) and ends with the last one's close (unwatch).
"""
from __future__ import annotations

import os
import select
import threading
import weakref

from ..codes import ABORT_DIED, ST_LEFT
from ..machine.liveness import CTIME_SLACK_S

__all__ = ["watch", "unwatch"]

SENTINEL_ALL = 16           # groups of up to this many ranks: every other member is watched
DEAD_LOOK_S = 0.002         # a member that died between calls: looked at again this often
JOIN_LOOK_S = (0.001, 0.1)  # members that have not joined yet: looked for after 1 ms, then
                            # twice as long each time, up to 100 ms

UNWATCH_S = 1.0             # how long a closing communicator waits for the sentinel's thread

_SENTINEL = None


class _Entry:
    def __init__(self, comm):
        self.group = weakref.ref(comm.group)
        self.me = comm.rank
        self.size = comm.size
        ranks = range(comm.size) if comm.size <= SENTINEL_ALL else comm._neighbours
        self.ranks = [r for r in ranks if r != comm.rank]
        self.keys = {}          # rank -> its process's key in the sentinel's pidfds
        self.dead = set()       # ranks that died between calls
        self.unseen = set(self.ranks)   # ranks not watched yet (not joined, or no pidfd yet)
        self.look_s = JOIN_LOOK_S[0]    # when to look for them again
        self.dropped = False
        self.gone = threading.Event()   # set once its descriptors are closed


class _Pidfd:
    """One watched process: its pidfd (shared by every entry that watches it: the members of a
    sub-communicator are the parent's processes), who watches it, whether it has exited."""

    def __init__(self, fd):
        self.fd = fd
        self.watchers = set()   # (entry, rank)
        self.dead = False


class _Sentinel:
    def __init__(self):
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.entries = {}       # id(entry) -> _Entry
        self.wake_r, self.wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self.stop = False
        self.thread = threading.Thread(target=self._run, name="shmtree-sentinel", daemon=True)
        self.thread.start()

    def poke(self):
        try:
            os.write(self.wake_w, b"x")
        except OSError:
            pass

    def _run(self):
        self.poller = select.poll()
        self.pidfds = {}        # (pid, create time) -> _Pidfd
        self.by_fd = {}         # fd -> (pid, create time), of the pidfds polled
        try:
            self._loop()
        finally:
            for e in list(self.entries.values()):
                self._drop(e)
            for rec in list(self.pidfds.values()):
                os.close(rec.fd)
            for fd in (self.wake_r, self.wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _loop(self):
        poller = self.poller
        poller.register(self.wake_r, select.POLLIN)
        while True:
            with self.lock:
                entries = list(self.entries.values())
                stop = self.stop
            if stop:
                return
            for e in entries:                    # new members get watched
                if not e.dropped:
                    self._look(e)
            for e in entries:                    # the descriptors of dropped entries go
                if e.dropped:
                    self._drop(e)
            live = [e for e in entries if not e.dropped]
            timeout = None
            if any(e.dead for e in live):
                timeout = DEAD_LOOK_S
            elif any(e.unseen for e in live):
                timeout = min(e.look_s for e in live if e.unseen)
                for e in live:
                    if e.unseen:
                        e.look_s = min(JOIN_LOOK_S[1], 2 * e.look_s)
            try:
                ready = poller.poll(None if timeout is None else timeout * 1e3)
            except InterruptedError:
                ready = []
            for fd, _ in ready:
                if fd == self.wake_r:
                    try:
                        os.read(self.wake_r, 4096)
                    except OSError:
                        pass
                    continue
                key = self.by_fd.pop(fd, None)
                if key is None:
                    continue
                poller.unregister(fd)            # (it has exited; the descriptor stays open
                rec = self.pidfds[key]           # with its watchers: the descriptors a
                rec.dead = True                  # communicator holds do not follow its peers)
                for e, r in rec.watchers:
                    e.dead.add(r)
            for e in live:
                if e.dead and not e.dropped:
                    _judge(e)

    def _look(self, e):
        """Watch e's members that have joined since it last looked."""
        group = e.group()
        try:
            if group is None or group._closed or group.aborted():
                e.dropped = True
                return
            for r in list(e.unseen):
                joined, pid, ctime = group.member(r)
                if not joined:
                    continue
                e.unseen.discard(r)
                key = (pid, ctime)
                rec = self.pidfds.get(key)
                if rec is None:
                    fd = _pidfd_of(pid, ctime)
                    if fd == -1:
                        e.dead.add(r)            # (gone already)
                    if fd < 0:
                        continue
                    rec = self.pidfds[key] = _Pidfd(fd)
                    self.by_fd[fd] = key
                    self.poller.register(fd, select.POLLIN)
                rec.watchers.add((e, r))
                e.keys[r] = key
                if rec.dead:
                    e.dead.add(r)
        except Exception:                        # (its group closed meanwhile)
            e.dropped = True

    def _drop(self, e):
        for r, key in e.keys.items():
            rec = self.pidfds.get(key)
            if rec is None:
                continue
            rec.watchers.discard((e, r))
            if not rec.watchers:                 # (nobody watches that process any more)
                del self.pidfds[key]
                if self.by_fd.pop(rec.fd, None) is not None:
                    self.poller.unregister(rec.fd)
                os.close(rec.fd)
        e.keys.clear()
        e.unseen.clear()
        e.dead.clear()
        with self.lock:
            self.entries.pop(id(e), None)
        e.gone.set()


def _pidfd_of(pid, ctime):
    """A pidfd of process pid (checked to be the one that started at ctime), -1 when that
    process is gone already, -2 when no pidfd can be had (the ranks' own checks serve)."""
    if not hasattr(os, "pidfd_open"):
        return -2
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return -1
    except OSError:
        return -2
    import psutil
    try:
        same = abs(psutil.Process(pid).create_time() - ctime) <= CTIME_SLACK_S
    except psutil.NoSuchProcess:
        same = False
    except psutil.Error:
        same = True
    if not same:                          # (its pid belongs to another process now)
        os.close(fd)
        return -1
    return fd


def _judge(e):
    """Members of e died (e.dead): abort the group if a member is inside a call that one of
    them has not completed (it would wait for it for ever); forget those that left first."""
    group = e.group()
    if group is None or group._closed:
        e.dropped = True
        return
    seg = group._seg
    try:
        if seg.abort_state()[0]:
            e.dropped = True
            return
        for r in sorted(e.dead):
            if seg.state(r) == ST_LEFT:          # (it closed its communicator first: no loss)
                e.dead.discard(r)
                continue
            done = seg.completed(r)
            if any(seg.call_of(s) > done for s in range(e.size) if s != r and s not in e.dead):
                group.abort(ABORT_DIED, r)
                e.dropped = True
                return
    except Exception:                            # (the group was closed meanwhile)
        e.dropped = True


def watch(comm):
    """Have this process's sentinel watch the members `comm` waits for (Communicator's
    constructor)."""
    global _SENTINEL
    if comm.size < 2:
        return
    entry = _Entry(comm)
    if not entry.ranks:
        return
    while True:
        s = _SENTINEL
        if s is None or s.pid != os.getpid() or not s.thread.is_alive():
            s = _SENTINEL = _Sentinel()
        with s.lock:
            if not s.stop:
                s.entries[id(entry)] = entry
                break
        if _SENTINEL is s:                      # (it is ending: a new one)
            _SENTINEL = None
    comm._sv_entry = entry
    s.poke()


def unwatch(comm):
    """comm is closing: its entry goes (its descriptors, in the sentinel's thread), and the
    thread ends with the last entry."""
    global _SENTINEL
    comm.__dict__.pop("_sv_region", None)       # (its mapping goes with the communicator's)
    s = _SENTINEL
    entry = comm.__dict__.pop("_sv_entry", None)
    if s is None or s.pid != os.getpid() or entry is None:
        return
    with s.lock:
        entry.dropped = True
        last = all(e.dropped for e in s.entries.values())
        if last:
            s.stop = True
    s.poke()
    if s.thread is threading.current_thread():
        return
    entry.gone.wait(UNWATCH_S)          # (its descriptors are closed when close() returns)
    if last:
        if _SENTINEL is s:
            _SENTINEL = None
        s.thread.join(UNWATCH_S)


def _sentinel_after_fork():
    """A forked child has no sentinel thread: its descriptors (the parent's) are closed."""
    global _SENTINEL
    s, _SENTINEL = _SENTINEL, None
    if s is None:
        return
    fds = [s.wake_r, s.wake_w] + [rec.fd for rec in getattr(s, "pidfds", {}).values()]
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


os.register_at_fork(after_in_child=_sentinel_after_fork)
