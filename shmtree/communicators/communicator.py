"""Communicator: one machine's communicator (docs/design.md, "Layers" and "One call").

It is a Front (front.py): every public collective comes in through its hooks - _quick (the
engine's C twin of the parse: a plain ndarray call goes straight to Engine.call), _run and _post
(a parsed CallSpec, run now or posted to the progress thread), _local_error, _shared_array - and
runs on its executors (collectives.py), whose every engine call is one Engine.call here (_call).
Between the engine's time slices it checks the abort word, the peers (dead, gone for good, idle
in a Pool), the timeout and signals, and turns a failure into an exception (and aborts the
group: a half-done collective cannot be resumed).  An interrupt at any point of a call either
lets it finish or aborts the group: never a call left half-begun.

The process's membership state (this process's communicator, the fork generation) is
shmtree.session's, read through that module.
"""
from __future__ import annotations

import os
import threading
import time

import numpy as np

from .. import _engine, _kernels
from ..frontend import repro as _repro
from ..groups import session
from ..machine import plan as _plan
from ..codes import (ABORT_CORRUPT, ABORT_DIED, ABORT_FAILED, ABORT_LEFT, ABORT_STALL,
                    ABORT_TIMEOUT, KIND_ALLREDUCE, KIND_BARRIER, KIND_BROADCAST, KIND_NAMES,
                    KIND_REDUCE, KIND_ALLGATHER, KIND_ALLGATHER_LENGTHS, KIND_ALLTOALL,
                    KIND_REDUCE_SCATTER, KIND_ROOT_STEP, KIND_GATHER, KIND_SCATTER, KIND_SCAN,
                    KIND_EXSCAN, KIND_SCAN_BACK, KIND_COUNTS, KIND_DETERMINISTIC, ROOTED, ST_IDLE,
                    ST_LEFT, kind_name,
                    ranks_text, states_text)
from ..errors import CollectiveMismatchError, CollectiveTimeoutError, PeerLostError, ShmtreeError
from ..frontend import calls
from ..frontend.calls import (ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST, REDUCE, REDUCE_SCATTER, destination as
                    _destination, dtype_digest as _dtype_digest, dtype_text as _dtype_text)
from ..frontend.collectives import KIND_A2AV, Executors, error_words, gather_gathers
from ..frontend.front import DECLINED, Front, Persistent
from ..groups.group import Group
from ..ops import OP_NAMES, OPS, dtype_name
from ..frontend.requests import Progress, Request, wait_all
from ..groups.shared import SharedArrays
from ..p2p.methods import Messages  # point-to-point (issue 24)
from ..groups.survive import Survive, lost_error  # revoke, agree, shrink (issue 38)
from ..groups.sentinel import unwatch, watch     # a member's death, at once (issue 38)

from .quick import _Quick, _BOUND, _KINDS  # noqa: F401  (the hooks' mixin)
__all__ = ["Communicator", "current", "allreduce", "broadcast", "reduce", "allgather",
           "reduce_scatter", "barrier", "iallreduce", "ibroadcast", "ireduce", "iallgather",
           "ireduce_scatter", "ibarrier", "Request", "wait_all", "empty", "zeros", "rank",
           "size", "Persistent",
           "alltoall", "gather", "scatter", "scan", "exscan", "ialltoall", "igather", "iscatter",
           "iscan", "iexscan", "allreduce_init", "broadcast_init", "reduce_init",
           "allgather_init", "reduce_scatter_init", "alltoall_init", "gather_init",
           "scatter_init", "scan_init", "exscan_init", "barrier_init"]

STALL_SLICE_S = 0.02        # engine time slice between liveness / signal / timeout checks
SLICE_NS = int(STALL_SLICE_S * 1e9)
FULL_SCAN_S = 1.0           # every member (not only tree neighbours) is checked this often
RAISED_GRACE_S = 0.5        # Pool: how long a member whose task raised may stay idle before
                            # the members waiting for it in a collective give up


# ---------------------------------------------------------------------------------------------
# the communicator


class Communicator(Survive, _Quick, Messages, Front, Executors):
    """One rank's handle on its group: `rank`, `size`, `allreduce`, `barrier`, `close`."""

    _restores_mask = True       # close() gives back the mask joining pinned (not a split's)

    def __init__(self, group: Group, rank: int):
        self.group = group
        self.rank = int(rank)
        self.size = int(group.size)
        self._pid = os.getpid()
        self._gen = session._fork_gen         # a forked child sees another generation
        self._exec = threading.Lock()         # held by whoever runs a call (requests.py)
        self._progress = None                 # the progress thread, from the first i-call
        self._posted = 0                      # calls posted to it so far
        self._shared = None                   # shared arrays (shared.py), from the first empty()
        self._closed = False
        specs = [group.layout.engine_spec(ch, rank) for ch in range(len(group.layout.channels))]
        self._seg = group._seg
        self._engine = _engine.Engine(group._seg, rank, specs, group.plan.selection(),
                                      spin_ns=group.plan.spin_ns, nt_bytes=group.plan.nt_bytes,
                                      slice_ns=SLICE_NS, exchange=group.layout.exchange_spec())
        # the ranks this one waits for (tree parent and children; ring predecessor, successor)
        self._neighbours = sorted({r for spec in specs for r in [spec.parent, *spec.children]
                                   if r >= 0})
        self._next_full_scan = 0.0
        self._stall = None                    # (seq, since): idle members seen since
        # the ring schedule's order (the engine's other collectives run around it)
        plan = group.plan
        self._plan = plan
        self._pos = {r: q for q, r in enumerate(plan.large_tree.ring)}    # ring positions
        tree = plan.large_tree                # the single copy folds in the schedule's order
        self._engine.direct_order(list(tree.ring), None if plan.large_schedule == "ring" else
                                  [list(c) for c in tree.children], tree.root)
        self._positions = {}                 # block offsets by ring position, per call shape
        self._digest_of = (None, 0)          # (dtype, its digest) of the last allgather,
                                             # alltoall, scan
        watch(self)                          # (groups/sentinel.py: the members' deaths)

    def __reduce__(self):
        raise TypeError("shmtree: a Communicator cannot be sent to another process (it is one "
                        "rank's membership); send the Group instead and call group.join(rank) "
                        "in the worker, or use shmtree.run / shmtree.Pool")

    def _call(self, coll, array, out, op, root, kind, deadline, tag=0, dims=None, offs=None):
        """One engine call of a normalised message (collectives.py), by the thread that holds
        the executor, driven to its end: its result."""
        eng = self._idle_engine()
        try:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            got = eng.call(coll, array, out, op, root, kind, left, tag, dims, offs)
            if got is None:
                if eng.in_call:               # another thread's fast path got in first
                    raise ShmtreeError(_CONCURRENT)
                raise RuntimeError(f"shmtree: internal error: the engine declined a normalised "
                                   f"{_engine_name(coll)} call")
            rc, result = got
            if rc != _engine.DONE:
                result = self._finish(eng, rc, deadline, result)
            return result
        except BaseException as exc:
            self._interrupted(eng, exc)      # (only a call this thread began)
            raise

    def _finish(self, eng, rc, deadline, result):
        """Drive a begun call to its end (rc: its first slice's): its result (None: the
        engine's, take_result).  A broadcast that stops for this rank's output (NEED_OUT) gets
        it here (made from the round's description: Executors._bcast_output)."""
        rc = self._drive(eng.seq, deadline, rc)
        while rc == _engine.NEED_OUT:
            eng.give_output(self._bcast_output(eng.take_result()))
            rc = self._drive(eng.seq, deadline)
        return result if result is not None else eng.take_result()

    def _run(self, spec):
        """A parsed call, blocking: run at once, or behind the outstanding nonblocking ones."""
        return self._now(self._prepared(spec))

    def _post(self, spec):
        """A parsed call, nonblocking: a Request."""
        return self._enqueue(self._prepared(spec), spec.request_name)

    def run(self, spec):
        """Run a parsed call (calls.py) in this thread, which must already be running a call
        of this rank (it holds the executor: a step of a call across nodes, nodes.py)."""
        return self._prepared(spec)()

    def _shared_array(self, shape, dtype, order, how):
        """empty / zeros (shared.py)."""
        if self._shared is None:
            self._shared = SharedArrays(self)
        return self._shared.allocate(shape, dtype, order, how)

    # ---- running a prepared call: at once, or posted to the progress thread ----

    def _now(self, run):
        """A blocking call: run the prepared call at once when nothing is outstanding, else post
        it behind the outstanding calls and wait for it (calls complete in issue order)."""
        progress = self._progress
        if progress is None or not (progress.outstanding or progress.is_current_thread()):
            if not self._exec.acquire(False):
                raise ShmtreeError(_CONCURRENT)
            try:
                return run()
            finally:
                self._exec.release()
        request = self._enqueue(run, "call")
        try:
            return request.result()
        except BaseException:
            if not request.done():           # interrupted while waiting for a blocking call
                self.group.abort(ABORT_FAILED, self.rank,
                                 note="interrupted while waiting for a blocking call queued "
                                      "behind nonblocking ones")
            raise

    def _enqueue(self, run, name):
        """Hand a prepared call to the progress thread (started on first use): a Request."""
        if self._closed or self._gen != session._fork_gen or self.group._closed:
            self._check_usable()
        progress = self._progress
        if progress is not None and progress.is_current_thread():
            raise ShmtreeError(_IN_CALLBACK)
        if progress is None:
            progress = self._progress = Progress(f"shmtree-progress-rank{self.rank}", self._exec)
        n = self._posted = self._posted + 1
        return progress.post(Request(name, n, progress), run)

    def _local_error(self, spec):
        """A local error of a rooted collective (broadcast, reduce) that the other ranks cannot
        see (spec.error): this rank's array's dtype holds Python objects, or is not reducible
        (a TypeError).  It is said in the call's round before it is raised here (DESIGN
        section 6): every other rank's call then raises CollectiveMismatchError naming this
        rank (the root) and its error, and every rank is through the same call (the group stays
        in step; ranks that all made the error each raise their own).  Other local errors
        (root, out=, timeout, op) stay local: every rank sees its own.  A nonblocking call's
        round is posted behind the outstanding ones (the posting call raises at once).
        Returns the error, for the caller to raise."""
        exc = spec.error
        text = error_words(exc)
        kind, deadline = spec.kind, spec.deadline
        run = lambda: self._error_round(kind, text, deadline)     # noqa: E731
        try:
            if spec.posted:
                self._enqueue(run, "call")
            else:
                self._now(run)
        except ShmtreeError:              # (the group cannot take the round: the error stands)
            pass
        return exc

    def _error_round(self, kind, text, deadline):
        try:
            self._call(_engine.ERROR, text, None, None, 0, kind, deadline)
        except CollectiveMismatchError:
            pass                          # (the others made the call: they raise it too)

    def stats(self) -> dict:
        """Counters of this rank's engine since it joined: calls (collectives completed), yields
        (sched_yield calls), sleeps (futex sleeps) and sleep_timeouts (sleeps nobody cut short)."""
        if self._closed:
            raise ShmtreeError("shmtree: this communicator is closed")
        return self._engine.stats()

    def ring_placement(self):
        """Group.ring_placement of the rings this rank produces (all their pages are mapped
        here): where the NUMA policy put them."""
        return self.group.ring_placement([self.rank])

    def close(self):
        """Leave the group (local, not a collective): later calls raise, peers that wait for
        this rank in a collective it never made fail at once, and the process gets back the CPU
        mask it had before it joined.  Nonblocking calls still outstanding are waited for
        first."""
        if self._closed:
            return
        if self._progress is not None and self._pid == os.getpid() \
                and self._gen == session._fork_gen:
            if self._progress.is_current_thread():
                raise ShmtreeError("shmtree: a communicator cannot be closed inside a "
                                   "completion callback (its calls run in that thread)")
            self._progress.stop()
        self._messages_drain()        # (messages.py: outstanding isends finish first)
        unwatch(self)
        self._closed = True
        if self._pid == os.getpid() and self._gen == session._fork_gen:
            try:
                if not self.group._closed:
                    self._seg.set_state(self.rank, ST_LEFT)
            except ShmtreeError:
                pass
            if self._restores_mask:   # (a sub-communicator never pinned: subcomm.py)
                _plan.unpin()
        self._messages_close()        # (messages.py: left already, so that nobody waits for
                                      # this rank in a collective while it waits for receivers)
        if self._shared is not None:
            self._shared.close()      # (a call in progress keeps the mappings it uses)
        eng = self._engine
        if eng is not None and not self._in_call_elsewhere():
            self._engine = None       # (else another thread's call runs on it: the engine stays
                                      # to that call's end, and goes with the communicator)
        if session._current is self:
            session._set_current(None)

    def _in_call_elsewhere(self) -> bool:
        """Is another thread of this process inside a call of this communicator (a watchdog
        closes the communicator or the group under it)?"""
        eng = self._engine
        return eng is not None and eng.in_call and not eng.owns_call()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<shmtree.Communicator rank={self.rank} size={self.size}>"

    # ---- one collective ----

    def _idle_engine(self):
        """The engine, for a call the caller (holding the executor lock) begins: the
        communicator must be usable and no other call in progress on the engine."""
        if self._closed or self._gen != session._fork_gen or self.group._closed:
            self._check_usable()
        eng = self._engine
        if eng.in_call:
            raise ShmtreeError(_CONCURRENT)
        return eng

    def _interrupted(self, eng, exc=None):
        """An exception (an interrupt, an error such as a failed allocation of a broadcast's
        output) left this thread's call half-done: forget it and abort the group, which is the
        only clean way out of a half-done collective; the note says which."""
        if eng is not None and eng.owns_call():
            eng.cancel()
            call = self._call_name(eng.seq)
            note = (f"{type(exc).__name__} inside {call}: {exc}" if isinstance(exc, Exception)
                    else f"interrupted inside {call}")
            self.group.abort(ABORT_FAILED, self.rank, note=note)

    def _drive(self, seq, deadline, rc=None):
        """Run the engine to the end of call `seq` (rc: the result of a slice already run), and
        between time slices check the group, the peers and the deadline.  Returns DONE, or
        NEED_OUT where a broadcast waits for this rank's output."""
        eng = self._engine
        while True:
            if rc is None:
                budget = STALL_SLICE_S
                if deadline is not None:
                    budget = max(0.0005, min(budget, deadline - time.monotonic()))
                rc = eng.progress(int(budget * 1e9))
            if rc == _engine.DONE or rc == _engine.NEED_OUT:
                return rc                     # (NEED_OUT: Engine.quick_bcast)
            if rc == _engine.STALLED:
                self._check_peers(seq, deadline)
                rc = None
                continue
            if rc == _engine.ABORTED:
                raise lost_error(self.group)(f"shmtree: rank {self.rank}: "
                                             f"{self.group.describe_abort()}")
            if rc == _engine.MISMATCH:
                raise CollectiveMismatchError(self._mismatch_message(seq))
            self.group.abort(ABORT_CORRUPT, self.rank)
            raise ShmtreeError(f"shmtree: rank {self.rank}: a ring holds data of another call "
                               "(corrupted shared memory); the group is aborted")

    # ---- checks ----

    def _check_peers(self, seq, deadline):
        """Between two slices of call `seq`: raise if it cannot complete (the group is aborted,
        a peer died or left for good, this rank's deadline passed, or Pool members idle)."""
        group = self.group
        if group.aborted():                   # say the first cause, not a consequence
            raise lost_error(group)(f"shmtree: rank {self.rank}: {group.describe_abort()}")
        absent = self._absent(seq)
        left = [r for r, st in absent if st == ST_LEFT]        # (said before it exits)
        if left:
            self._fail(ABORT_LEFT, ShmtreeError,
                       f"{ranks_text(left)} left the group (closed its communicator or "
                       f"returned from its function) after {self._seg.completed(left[0])} "
                       f"collective(s), while {self._waiting_text(seq)} waited in "
                       f"{self._call_name(seq)}")
        dead = self._find_dead(seq)
        if dead is not None:
            r, how = dead
            group.abort(ABORT_DIED, r)
            raise PeerLostError(f"shmtree: rank {self.rank}: rank {r} died ({how}); the group "
                                "is aborted")
        if deadline is not None and time.monotonic() >= deadline:
            self._fail(ABORT_TIMEOUT, CollectiveTimeoutError,
                       f"rank {self.rank} timed out in {self._call_name(seq)}; "
                       f"{ranks_text([r for r, _ in absent]) if absent else 'no rank'} had "
                       f"not arrived" + (f" ({states_text(absent)})" if absent else ""))
        self._check_stall(seq, absent)

    def _check_stall(self, seq, absent):
        """A Pool member waits in call seq while members that have not made it are idle (no
        task): once that has lasted stall_timeout, fail (they will never arrive).  When an idle
        member's last task raised, its round of collectives is broken: fail after a short grace
        (the time a worker takes to pick up a queued task) instead."""
        timeout = self.group.plan.stall_timeout
        idle = [r for r, st in absent if st == ST_IDLE]
        if timeout is None or not idle:
            self._stall = None
            return
        now = time.monotonic()
        if self._stall is None or self._stall[0] != seq:
            self._stall = (seq, now)
            return
        raised = [note for r in idle for note in [self._seg.note(r)] if note]
        if raised:
            timeout = min(timeout, RAISED_GRACE_S)
        if now - self._stall[1] < timeout:
            return
        self._fail(ABORT_STALL, ShmtreeError,
                   f"{self._call_name(seq)} cannot complete in the Pool: "
                   f"{self._waiting_text(seq)} waited in it for {now - self._stall[1]:.1f} s "
                   f"while {ranks_text(idle)} {'was' if len(idle) == 1 else 'were'} idle (no "
                   f"task, or finished their task without making it)"
                   + (f"; {'; '.join(raised)}" if raised else "")
                   + "; every task must make the same collectives on every worker: give the "
                   "pool a multiple of its size in tasks (map deals them one at a time), or use "
                   "pool.run(fn)")

    def _fail(self, reason, exc_type, text):
        self.group.abort(reason, self.rank, note=text)
        raise exc_type(f"shmtree: rank {self.rank}: {text}; the group is aborted")

    def _absent(self, seq):
        """(rank, state) of the members that have neither completed call seq nor entered it."""
        seg = self._seg
        return [(r, seg.state(r)) for r in range(self.size)
                if r != self.rank and seg.completed(r) <= seq and seg.call_of(r) != seq + 1]

    def _waiting_text(self, seq):
        seg = self._seg
        return ranks_text([r for r in range(self.size)
                            if r == self.rank or seg.call_of(r) == seq + 1])

    def _call_name(self, seq):
        """'allreduce #3': the kind of call seq (from this rank's descriptor) and its number,
        counted from 1 in the order the group's calls were made."""
        kind = self._seg.descriptor(self.rank, seq)[2]
        return f"{kind_name(kind)} #{seq + 1}"

    def _check_usable(self):
        if self._closed:
            raise ShmtreeError("shmtree: this communicator is closed")
        if self._gen != session._fork_gen or os.getpid() != self._pid:
            raise ShmtreeError(f"shmtree: this communicator belongs to process {self._pid} (rank "
                               f"{self.rank}); a forked child cannot use it")
        if self.group.closed:
            raise ShmtreeError("shmtree: the group is closed")
        if self.group.aborted():
            raise lost_error(self.group)(f"shmtree: rank {self.rank}: "
                                         f"{self.group.describe_abort()}")

    def _find_dead(self, seq):
        """(rank, how) of a member that died (gone, a zombie, or its pid reused) before finishing
        its part of call `seq`, else None.  (A member that completed the call and exited is no
        loss to it.)  Tree neighbours every slice, every member once a second."""
        ranks = self._neighbours
        now = time.monotonic()
        if now >= self._next_full_scan:
            ranks = self._neighbours + [r for r in range(self.size) if r not in self._neighbours]
            self._next_full_scan = now + FULL_SCAN_S
        seg = self._seg
        for r in ranks:
            if r != self.rank and seg.completed(r) <= seq:
                how = self.group.death_of(r)
                if how and seg.completed(r) <= seq:
                    return r, how
        return None

    def _mismatch_message(self, seq) -> str:
        seen = {}
        raised = []
        for r in range(self.size):
            dseq, nbytes, kind, opc, dtc, shape = self._seg.descriptor(r, seq)
            base = kind % KIND_ROOT_STEP
            if dseq == seq and opc == _engine.ERROR_CODE and dtc == _engine.ERROR_CODE:
                text = b"".join(int(v).to_bytes(8, "little", signed=True) for v in shape
                                if v is not Ellipsis).rstrip(b"\0")
                root = kind // KIND_ROOT_STEP if base in ROOTED else -1
                raised.append(f"rank {r}{' (the root)' if r == root else ''} raised "
                              f"{text.decode('utf-8', 'replace')} in {kind_name(kind)}")
                what = f"{kind_name(kind)}, which raised a local error"
            elif dseq != seq:
                what = "a different call"
            elif base == KIND_BARRIER:
                what = "barrier"
            elif base == KIND_DETERMINISTIC:
                what = _repro.described(kind, opc, dtc, shape, nbytes)
            elif dtc == _U1 and opc == OPS["bor"] and base not in _REDUCING_KINDS:
                what = _moved_text(kind, shape, nbytes)   # bytes moved: shape, item size, dtype
            else:
                root = f"root={kind // KIND_ROOT_STEP}, " if base != KIND_ALLREDUCE and \
                    kind >= KIND_ROOT_STEP else ""
                what = (f"{KIND_NAMES.get(base, 'collective')}({root}shape={shape}, "
                        f"dtype={dtype_name(dtc)}, op={OP_NAMES.get(opc, opc)!r})")
            seen.setdefault(what, []).append(r)
        parts = "; ".join(f"{ranks_text(rs)}: {what}" for what, rs in seen.items())
        if raised:
            return (f"shmtree: {'; '.join(raised)} (a local error of its arguments), so the call "
                    f"cannot complete on any rank; ranks disagree on the collective call: {parts}")
        return f"shmtree: ranks disagree on the collective call: {parts}"


_U1 = _kernels.DTYPE_CODES["u1"]


def _engine_name(coll):
    return calls.COLLECTIVE_NAMES[coll] if 0 <= coll < len(calls.COLLECTIVE_NAMES) else "error"
_REDUCING_KINDS = (KIND_ALLREDUCE,) + tuple(k for k, n in KIND_NAMES.items()
                                            if n in ("reduce", "reduce_scatter"))


def _moved_text(kind, shape, nbytes):
    """How a broadcast or allgather round is described: its kind and root, and the shape and
    dtype digest the rank passed (the descriptor's last two dims: item size, dtype digest)."""
    name = kind_name(kind)
    base = kind % KIND_ROOT_STEP
    whole = shape and shape[-1] is not Ellipsis
    if whole and len(shape) >= 3 and base in (KIND_SCAN, KIND_EXSCAN, KIND_SCAN_BACK):
        return (f"{name}(shape={tuple(shape[:-3])}, dtype {_dtype_text(shape[-1])}, "
                f"op={OP_NAMES.get(shape[-3], shape[-3])!r})")
    if whole and len(shape) >= 2 and base in (KIND_ALLGATHER, KIND_ALLTOALL, KIND_GATHER):
        return (f"{name}(shape={tuple(shape[:-2])}, dtype {_dtype_text(shape[-1])}, "
                f"{shape[-2]}-byte items)")
    if base == KIND_ALLGATHER_LENGTHS:
        return f"{name}(axis=0)"
    if base in (KIND_BROADCAST, KIND_SCATTER, KIND_COUNTS):   # (a round's size is the
        return name                                           # library's, not the call's)
    return f"{name}({nbytes} bytes)"


# ---------------------------------------------------------------------------------------------
# module-level calls, in a process that joined a group

# the texts of misuse the Communicator class raises
_IN_CALLBACK = ("shmtree: a collective cannot be made inside a completion callback: callbacks "
                "run in the progress thread, where the order of the rank's calls could no "
                "longer be the same on every rank; make the call after waiting instead")
_CONCURRENT = ("shmtree: another thread of this rank is inside a collective on the same "
               "communicator; collectives of one rank must not overlap")

# this process's communicator lives in shmtree.session (a leaf: the membership state)
from ..groups.session import current  # noqa: E402

# allreduce, broadcast, ..., ibarrier, empty, zeros: Front's methods, on current()
from ..frontend.front import module_functions as _module_functions  # noqa: E402
globals().update(_module_functions(current))


def rank() -> int:
    return current().rank


def size() -> int:
    return current().size
