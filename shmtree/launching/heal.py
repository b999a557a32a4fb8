"""Heal: pools that go on after a worker dies, Pool(on_failure="shrink" | "respawn")
(docs/design.md, "Survive").

The pool's process (the Healer, run by the pool's watch thread) sees a worker die (its
sentinel) or the group aborted, and makes the next group: of the survivors (shrink, renumbered
in their old order) or of the same size (respawn: the survivors keep their ranks, a new
worker takes the dead one's), and publishes it in the pool's Control memory (generation,
the group's rendezvous token, the rank of each surviving worker by pid, the free ranks).  The
task the dead worker ran is failed with PeerLostError naming its rank (its job and item are in
the old group's survive region); the tasks of the others that waited for it in a collective
fail there with PeerLostError; the tasks not started yet run in the new group.  A worker
moves to the next group between tasks: at the start of its next task, or at once when it is
idle (a thread of its own sleeps on the Control's bell).  A worker that starts (respawn)
takes a free rank of the current generation, or waits for the next one.
"""
from __future__ import annotations

import multiprocessing.queues
import os
import select
import sys
import threading
import time
from multiprocessing.reduction import ForkingPickler

from .. import _engine
from ..codes import ABORT_CLOSED, ABORT_DIED, ABORT_INIT, ST_IDLE
from ..errors import PeerLostError, ShmtreeError
from ..groups import session, survive
from ..groups.group import Group

__all__ = ["Control", "Healer", "task_scope", "worker_start", "watch_pool"]

CONTROL_TOKEN_BYTES = 4 << 20       # room for the group's rendezvous token (the plan: a large
                                    # machine's is well under this; the memory is touched only
                                    # as far as it is written)
HEAL_WAIT_S = 30.0                  # how long a worker waits for the pool's next group
HELPER_SLEEP_S = 1.0                # a worker's Control watch: its longest sleep on the bell
LOCK_S = 5.0                        # a result queue's write lock held this long: a worker that
                                    # died held it (pool.POOL_LOCK_S)

# the Control's words (byte offsets)
_C_BELL, _C_GEN, _C_CLOSED, _C_CLAIM, _C_TOKEN, _C_TABLE, _C_FREE = 0, 8, 16, 24, 32, 40, 48
_C_HEAD = 4096


class Control:
    """The pool's control memory: one memfd shared by the pool's process (which writes it) and
    its workers (which read it).  The generation word is odd while a generation is written."""

    def __init__(self, nmax, fd=None):
        from ..groups.transport import create_memfd
        self.nmax = nmax
        self.table_at = _C_HEAD
        self.free_at = self.table_at + 16 * nmax
        self.token_at = self.free_at + 8 * nmax
        self.size = self.token_at + CONTROL_TOKEN_BYTES
        self.fd = create_memfd(self.size) if fd is None else fd
        self.seg = _engine.Segment(self.fd, self.size, 1)
        self._pid = os.getpid()

    def __reduce__(self):
        from multiprocessing import reduction
        return _rebuild_control, (self.nmax, reduction.DupFd(self.fd))

    def close(self):
        fd, self.fd = self.fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
        self.seg = None

    # ---- the pool's side ----

    def publish(self, group, table, free):
        """The next generation: `group` (its token), {pid: rank} of the workers that keep a
        place, the free ranks (for new workers, in order)."""
        token = group.rendezvous_token()
        if len(token) > CONTROL_TOKEN_BYTES:
            raise ShmtreeError(f"shmtree.Pool: the group's rendezvous token ({len(token)} bytes) "
                               "does not fit the pool's control memory")
        seg = self.seg
        gen = _engine.sv_load(seg, _C_GEN)
        _engine.sv_store(seg, _C_GEN, gen + 1)                 # (odd: being written)
        pairs = b"".join(int(p).to_bytes(8, "little") + int(r).to_bytes(8, "little")
                         for p, r in table.items())
        _engine.sv_write(seg, self.table_at, pairs)
        _engine.sv_write(seg, self.free_at, b"".join(int(r).to_bytes(8, "little")
                                                     for r in free))
        _engine.sv_write(seg, self.token_at, token)
        _engine.sv_store(seg, _C_TOKEN, len(token))
        _engine.sv_store(seg, _C_TABLE, len(table))
        _engine.sv_store(seg, _C_FREE, len(free))
        _engine.sv_store(seg, _C_CLAIM, (gen + 2) << 32)      # (no free rank claimed yet)
        _engine.sv_store(seg, _C_GEN, gen + 2)
        _engine.sv_ring(seg, _C_BELL)
        return (gen + 2) // 2

    def set_closed(self):
        if self.seg is not None:
            _engine.sv_store(self.seg, _C_CLOSED, 1)
            _engine.sv_ring(self.seg, _C_BELL)

    # ---- the workers' side ----

    def closed(self):
        return _engine.sv_load(self.seg, _C_CLOSED) != 0

    def generation(self):
        return _engine.sv_load(self.seg, _C_GEN) // 2

    def read(self):
        """(generation, token, {pid: rank}, free ranks) as published (read again while the
        pool's process writes a new one)."""
        seg = self.seg
        while True:
            gen = _engine.sv_load(seg, _C_GEN)
            if gen & 1:
                time.sleep(0.0005)
                continue
            token = _engine.sv_read(seg, self.token_at, _engine.sv_load(seg, _C_TOKEN))
            raw = _engine.sv_read(seg, self.table_at, 16 * _engine.sv_load(seg, _C_TABLE))
            table = {int.from_bytes(raw[i:i + 8], "little"):
                     int.from_bytes(raw[i + 8:i + 16], "little") for i in range(0, len(raw), 16)}
            raw = _engine.sv_read(seg, self.free_at, 8 * _engine.sv_load(seg, _C_FREE))
            free = [int.from_bytes(raw[i:i + 8], "little") for i in range(0, len(raw), 8)]
            if _engine.sv_load(seg, _C_GEN) == gen:
                return gen // 2, token, table, free

    def claim(self, gen, free):
        """Take the next free rank of generation `gen` (None: none left, or a later one)."""
        seg = self.seg
        while True:
            cur = _engine.sv_load(seg, _C_CLAIM)
            if cur >> 32 != 2 * gen or (cur & 0xFFFFFFFF) >= len(free):
                return None
            if _engine.sv_cas(seg, _C_CLAIM, cur, cur + 1):
                return free[cur & 0xFFFFFFFF]

    def bell(self):
        return _engine.sv_bell(self.seg, _C_BELL)

    def sleep(self, seen, timeout_s):
        _engine.sv_sleep(self.seg, _C_BELL, seen, max(10_000, int(timeout_s * 1e9)))


def _rebuild_control(nmax, dupfd):
    return Control(nmax, dupfd.detach())


class Healer:
    """The pool's process's side of a pool that heals (see above): the current group, and
    what makes the next one.  check() runs in the pool's watch thread."""

    def __init__(self, mode, group, options):
        self.mode = mode
        self.group = group
        self.options = options                  # (Group's, for the next groups)
        self.control = Control(group.size)
        self.control.publish(group, {}, list(range(group.size)))
        self.holders = {}                       # rank -> pid it was given in the current
                                                # generation (a worker that has not joined yet)
        self.broken = None                      # why the pool cannot go on (no worker left)
        self.healed = []                        # (rank, how, seconds to heal), for the bench
        self._closed = False

    def close(self):
        if self._closed:
            return
        self._closed = True
        self.control.set_closed()
        self.group.close()
        self.control.close()

    def check(self, pool):
        """Heal if a worker of the current group died, or the group is aborted."""
        group = self.group
        if self._closed or group.closed or self.broken is not None:
            return
        reason, _ = group._seg.abort_state()
        if reason == ABORT_CLOSED:
            return
        t0 = time.monotonic()
        alive = {p.pid for p in list(pool._pool)
                 if getattr(p, "pid", None) is not None and not _exited(p)}
        dead, live = {}, {}
        for r in range(group.size):
            joined, pid, _ = group.member(r)
            holder = pid if joined else self.holders.get(r)
            if holder is None:
                continue
            how = group.death_of(r) if joined else ""
            if how or holder not in alive:
                dead[r] = how or f"worker process {holder} exited"
            else:
                live[r] = holder
        if not dead and not reason:
            return
        self._heal(pool, group, dead, live, t0)

    def _heal(self, pool, old, dead, live, t0):
        if not old.aborted():
            old.abort(ABORT_DIED, min(dead))        # (its waiters raise PeerLostError now)
        if self.mode == "shrink":
            order = sorted(live)
            table = {live[r]: i for i, r in enumerate(order)}
            free, size = [], len(order)
        else:
            table = {pid: r for r, pid in live.items()}
            free, size = [r for r in range(old.size) if r not in live], old.size
        tasks = []
        reg = survive.Region(old)
        for r, how in sorted(dead.items()):
            task = reg.task_of(r)
            if task is not None:
                tasks.append((r, how, task))
            if reg.sending_of(r):             # (killed holding the result queue's write lock)
                try:
                    pool._outqueue._wlock.release()
                except (ValueError, AttributeError):
                    pass
        if size == 0:
            self.broken = (f"every worker is gone ({', '.join(f'rank {r}: {how}' for r, how in sorted(dead.items()))})")
            new = None
        else:
            new = Group(size, **self.options)
            self.control.publish(new, table, free)
            self.holders = {r: pid for pid, r in table.items()}
            self.group = new
            pool._shm_group = new
        left = (f"the pool goes on with {size} worker{'s' if size != 1 else ''}"
                if new is not None else "the pool is broken")
        for r, how, (job, item) in tasks:
            _fail_task(pool, job, item, PeerLostError(
                f"shmtree.Pool: rank {r} died ({how}) while it ran this task; {left} "
                f"(on_failure={self.mode!r})"))
        for r, how in sorted(dead.items()):
            self.healed.append((r, how, time.monotonic() - t0))
        old.close()


def _fail_task(pool, job, item, exc):
    """Complete item `item` of job `job` with `exc`, through the pool's result queue (its
    result handler sets it, in order with the others).  The queue's write lock, if a worker
    that died held it (killed while it sent a result), is released after LOCK_S."""
    q = pool._outqueue
    data = ForkingPickler.dumps((job, item, (False, exc)))
    lock = q._wlock
    got = lock is None or lock.acquire(timeout=LOCK_S)
    if not got:
        try:
            lock.release()              # (the dead worker's hold)
        except ValueError:
            pass
        got = lock.acquire(timeout=LOCK_S)
    try:
        q._writer.send_bytes(data)
    finally:
        if got and lock is not None:
            lock.release()


# ---- the workers' side ----

_MEMBER = None                      # this worker's _Member, in a pool that heals


class _Member:
    """A worker of a pool that heals: its place in the current generation's group."""

    def __init__(self, control, mode):
        self.control = control
        self.mode = mode
        self.lock = threading.RLock()   # held by a task, and by a move to the next group
        self.gen = None
        self.group = self.comm = None
        self.rank = None

    def move(self, wait=True):
        """Join the current generation's group if this worker is not in it yet (leaving the
        one it was in); wait for the next generation while there is no place for it (a new
        worker of a respawning pool before the pool has made the group it replaces a worker
        in) or while its group is aborted (the pool is making the next one).  False when the
        pool is closed."""
        control = self.control
        deadline = time.monotonic() + HEAL_WAIT_S
        while True:
            seen = control.bell()
            if control.closed():
                return False
            gen, token, table, free = control.read()
            if gen == self.gen and not (self.group is not None and self.group.aborted()):
                return True
            if gen != self.gen:
                rank = table.get(os.getpid())
                if rank is None and self.gen is not None and self.mode == "shrink":
                    os._exit(0)         # (left out of the group: its place is gone)
                if rank is None:
                    rank = control.claim(gen, free)
                if rank is not None:
                    self._join(gen, token, rank)
                    continue
            if not wait or time.monotonic() >= deadline:
                return True
            control.sleep(seen, min(HELPER_SLEEP_S, max(0.0, deadline - time.monotonic())))

    def _join(self, gen, token, rank):
        if self.comm is not None:
            try:
                self.comm.close()
            except Exception:
                pass
            self.group.close()
        self.comm = self.group = None
        self.gen = gen
        group = Group.from_token(token)
        try:
            comm = group.join(rank)
        except Exception:
            group.close()
            raise
        self.group, self.comm, self.rank = group, comm, rank
        session._set_pool_group(group)
        if self.gen_started is not None:        # (a worker moving: idle until its next task)
            group._seg.set_state(rank, ST_IDLE)

    gen_started = None
    _region = None

    def region(self):
        """The current group's survive region (survive.Region), made once per group."""
        if self._region is None or self._region.seg is not self.group._seg:
            self._region = survive.Region(self.group)
        return self._region


def worker_start(control, mode, initializer, initargs):
    """A worker's start in a pool that heals (pool._pool_worker_init): take a rank of the
    current generation, join, run the initializer (as a worker of a pool that does not heal
    does), then watch the Control in a thread of its own."""
    global _MEMBER
    member = _MEMBER = _Member(control, mode)
    if not member.move() or member.group is None:
        return                          # (the pool closed, or no place was left for it)
    if initializer is not None:
        try:
            initializer(*initargs)
        except BaseException as exc:
            member.group.abort(ABORT_INIT, member.rank,
                               note=f"the Pool's initializer raised on rank {member.rank}: "
                                    f"{type(exc).__name__}: {exc}")
            return
    member.gen_started = member.gen
    member.group._seg.set_state(member.rank, ST_IDLE)
    threading.Thread(target=_watch_control, args=(member,), name="shmtree-pool-heal",
                     daemon=True).start()


def _watch_control(member):
    """A worker's thread: move to the next group as soon as the pool publishes it, when the
    worker is idle (a task holds the member's lock: it moves before its next task instead)."""
    control = member.control
    while True:
        seen = control.bell()
        if control.closed():
            return
        if control.generation() != member.gen and member.lock.acquire(blocking=False):
            try:
                member.move(wait=False)
            except Exception:
                pass
            finally:
                member.lock.release()
        control.sleep(seen, HELPER_SLEEP_S)


class task_scope:
    """Around a task in a worker (pool._run_as_task, _spmd_task): in a pool that heals, the
    worker first moves to the current group (waiting for it if its own is aborted), and the
    task's job and item are in its survive words while it runs (the pool fails that task if the
    worker dies).  Nothing elsewhere."""

    def __enter__(self):
        member = self.member = _MEMBER
        if member is None:
            return self
        member.lock.acquire()
        try:
            member.move()
            ids = _task_ids()
            self.region = None
            if ids is not None and member.group is not None and not member.group.closed:
                self.region = survive.Region(member.group)
                self.rank = member.rank
                self.region.set_task(self.rank, ids[0] + 1, ids[1])
        except BaseException:
            member.lock.release()
            raise
        return self

    def __exit__(self, *exc):
        member = self.member
        if member is None:
            return
        try:
            region = self.region
            if region is not None and not member.group.closed and region.seg is member.group._seg:
                region.set_task(self.rank, 0, 0)
        finally:
            member.lock.release()


def _task_ids():
    """(job, item) of the task this worker runs: the locals of multiprocessing.pool.worker,
    the function that called the task (a private detail of multiprocessing, as those that
    pool.py lists), or None."""
    import multiprocessing.pool as mpp
    code = mpp.worker.__code__
    f = sys._getframe(1)
    while f is not None:
        if f.f_code is code:
            loc = f.f_locals
            job, item = loc.get("job"), loc.get("i")
            if isinstance(job, int) and isinstance(item, int):
                return job, item
            return None
        f = f.f_back
    return None


class TaskQueue(multiprocessing.queues.SimpleQueue):
    """The task queue of a pool that heals: a worker waits for a task without holding the
    queue's read lock (multiprocessing's holds it while it waits: a worker killed while idle
    would keep every other from its next task), and takes the lock only to read a task that is
    there."""

    def get(self):
        while True:
            self._reader.poll(None)
            with self._rlock:
                if not self._reader.poll(0):
                    continue                    # (another worker took it)
                res = self._reader.recv_bytes()
            return ForkingPickler.loads(res)


class ResultQueue(multiprocessing.queues.SimpleQueue):
    """The result queue of a pool that heals: while a worker holds the queue's write lock, its
    survive words say so, so that the pool releases the lock of a worker killed while it held
    it (its result sent, or not yet: the others would wait for the lock for ever)."""

    def put(self, obj):
        data = ForkingPickler.dumps(obj)
        member = _MEMBER
        group = member.group if member is not None else None
        region = rank = None
        if group is not None and not group.closed:
            region, rank = member.region(), member.rank
        with self._wlock:
            if region is not None:
                region.set_sending(rank, True)
            try:
                self._writer.send_bytes(data)
            finally:
                if region is not None:
                    region.set_sending(rank, False)


class Vacant:
    """A place in the pool's list of workers that no process fills: what a shrinking pool's
    worker handler gets where multiprocessing would start a replacement (pool.py's Process)."""

    pid = None
    exitcode = None
    name = "shmtree-vacant"
    daemon = True

    def start(self):
        pass

    def is_alive(self):
        return self.exitcode is None

    def terminate(self):
        self.exitcode = 0

    kill = terminate

    def join(self, timeout=None):
        pass


def watch_pool(pool_ref, healer, stop, fail_jobs, watch_s):
    """The watch thread of a pool that heals (pool.py): heal as soon as a worker dies (its
    sentinel) or the group is aborted; once no worker is left, fail every outstanding job
    (fail_jobs, as the watch thread of a pool that does not heal does)."""
    from multiprocessing.connection import wait

    while not stop.is_set():
        pool = pool_ref()
        if pool is None or healer.control.seg is None:
            return
        try:
            healer.check(pool)
        except Exception as exc:             # (the next group could not be made)
            healer.broken = f"the pool could not heal: {type(exc).__name__}: {exc}"
        if healer.broken is not None:
            fail_jobs(pool, PeerLostError(f"shmtree.Pool: the pool is broken: "
                                          f"{healer.broken}"))
        procs = [p for p in list(pool._pool) if getattr(p, "pid", None) is not None
                 and not _exited(p)]
        del pool
        wait([p.sentinel for p in procs], timeout=watch_s)
        del procs


def _exited(proc):
    """Has the worker process exited?  Its sentinel says so, without reaping it: the pool's
    worker handler and terminate() reap the workers (Process.exitcode here, in another thread,
    could reap one under a join() of theirs, which then leaves it in multiprocessing's list of
    children for good, with its descriptors)."""
    try:
        return bool(select.select([proc.sentinel], [], [], 0)[0])
    except (OSError, ValueError):             # (closed: it was joined)
        return True


class Starter:
    """A pool's Process (multiprocessing.pool.Pool.Process, which its worker handler calls to
    start a worker): a shrinking pool, once started, gets a Vacant place instead of a
    replacement for a worker that died."""

    def __init__(self, pool_ref):
        self.pool_ref = pool_ref

    def __call__(self, ctx, *args, **kwds):
        pool = self.pool_ref()
        if pool is not None and pool._shm_heals == "shrink" and \
                getattr(pool, "_shm_started", False):
            return Vacant()
        return ctx.Process(*args, **kwds)
