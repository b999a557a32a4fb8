"""The sentinel (issue 38): a thread per member process that sleeps in poll() on the pidfds of
the members its communicators wait for, and aborts a group (ABORT_DIED) the moment one of them
dies while a member is inside a call it has not completed (docs/design.md, "Survive").

The abort rings every rank's bell, so every rank asleep in that call wakes at once: without
the sentinel a rank sees a death at the end of its engine time slice (20 ms, shmtree.
communicator).  Watched: every other member of a group of up to SENTINEL_ALL ranks, the tree
and ring neighbours in larger ones.  A member that dies between calls is remembered and
looked at again every DEAD_LOOK_S, until some member enters a call it has not completed (a
member that closed its communicator first is no loss).  Only the sentinel's thread opens and
closes its pidfds: a descriptor number closed under a poll() could name another process's pidfd
next.  The thread starts with the first communicator of the process that has peers
(Communicator's constructor: watch) and ends with the last one's close (unwatch).
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
        self.fds = {}           # rank -> pidfd (the sentinel's thread opens and closes them)
        self.dead = set()       # ranks that died between calls
        self.unseen = set(self.ranks)   # ranks not watched yet (not joined, or no pidfd yet)
        self.look_s = JOIN_LOOK_S[0]    # when to look for them again
        self.dropped = False
        self.gone = threading.Event()   # set once its descriptors are closed


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
        try:
            self._loop()
        finally:
            for fd in (self.wake_r, self.wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _loop(self):
        poller = select.poll()
        poller.register(self.wake_r, select.POLLIN)
        polled = {}             # fd -> (entry, rank), as registered with the poller
        while True:
            with self.lock:
                entries = list(self.entries.values())
                stop = self.stop
            if stop:
                break
            # the descriptors of dropped entries go; new members get theirs
            for e in entries:
                if e.dropped:
                    continue
                group = e.group()
                try:
                    if group is None or group._closed or group.aborted():
                        e.dropped = True
                        continue
                    for r in list(e.unseen):
                        fd = _pidfd_of(group, r)
                        if fd is not None:
                            e.unseen.discard(r)
                            if fd >= 0:
                                e.fds[r] = fd
                                polled[fd] = (e, r)
                                poller.register(fd, select.POLLIN)
                            elif fd == -1:
                                e.dead.add(r)        # (gone already)
                except Exception:                    # (its group closed meanwhile)
                    e.dropped = True
                del group
            for e in entries:
                if e.dropped:
                    self._drop(e, poller, polled)
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
                got = polled.pop(fd, None)
                if got is None:
                    continue
                e, r = got
                poller.unregister(fd)           # (closed with its entry: the descriptors a
                e.dead.add(r)                   # communicator holds do not follow its peers)
            for e in live:
                if e.dead and not e.dropped:
                    _judge(e)
        for e in list(self.entries.values()):
            self._drop(e, poller, polled)

    def _drop(self, e, poller, polled):
        for r, fd in list(e.fds.items()):
            if polled.pop(fd, None) is not None:
                poller.unregister(fd)
            os.close(fd)
        e.fds.clear()
        e.unseen.clear()
        e.dead.clear()
        with self.lock:
            self.entries.pop(id(e), None)
        e.gone.set()


def _pidfd_of(group, r):
    """A pidfd of rank r's process (checked to be the process that joined), -1 when that
    process is gone already, -2 when no pidfd can be had, None when r has not joined yet."""
    joined, pid, ctime = group.member(r)
    if not joined:
        return None
    if not hasattr(os, "pidfd_open"):
        return None
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return -1
    except OSError:
        return -2                           # (no pidfds here: the ranks' own checks serve)
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
    fds = [s.wake_r, s.wake_w] + [fd for e in s.entries.values() for fd in e.fds.values()]
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


os.register_at_fork(after_in_child=_sentinel_after_fork)
