"""Survive: a communicator that loses a rank goes on (docs/design.md, "Survive").

The methods here are a mixin of every communicator (Communicator, and the one across nodes):

- ``revoke()``: the group's abort word, with reason ABORT_REVOKED (codes.py).  Every rank
  waiting in a collective watches that word, and the abort wakes every rank asleep on its bell,
  so a revocation reaches them at once; every later call raises `RevokedError`.  A dead rank
  aborts the group the same way (ABORT_DIED), as it always has.
- ``agree(flag)``: a fault-tolerant AND over the live ranks, in the group's survive region
  (transport.Layout.survive), which no collective uses and which works after the abort:

      control line   commit[2] (by epoch parity: epoch << 16 | winner + 1), the bell
      per rank r     a line of words: vote (epoch << 1 | flag), a Pool task (job + 1, item),
                     a shrink's offer (epoch, pid, descriptor, nonce), whether the Pool worker
                     holds its result queue's write lock
                     two proposals (by epoch parity): tag (epoch), value, failed bitmask

  Every rank's k-th agree on a communicator is epoch k.  A rank writes its vote and rings the
  bell.  The decider - the lowest rank not known to be gone (an earlier agreement's failed
  set, a death seen through its pidfd (liveness.Watch), a member that left) - waits until every
  other rank has voted or is gone, writes its proposal (the AND of the voters' flags, and the
  failed set: the earlier one, plus the ranks gone, plus those that had not voted when an
  agree's timeout ran out), then commits it with one compare-and-swap of the epoch's commit
  word.  That word is written once per epoch: the first commit wins, whoever made it, and every
  rank returns the committed proposal.  A decider that dies before committing is seen dead
  through its pidfd: the next lowest rank decides instead (a stalled decider that comes back
  finds the epoch committed and adopts that decision).  Waits are futex sleeps on the bell
  (every vote and commit rings it) of at most WAIT_S, between which the ranks still awaited
  are looked at (a pidfd select each): no polling loop of 100 ms.
- ``failed_ranks()``: the failed set of this rank's last agreement.
- ``shrink()``: made by shmtree.launching.heal (registered into this module: it sits above
  the communicator, whose class this mixin is part of).

A rank that dies is seen at once by the sentinel (sentinel.py: a thread per member process
asleep on its peers' pidfds), which aborts the group.
"""
from __future__ import annotations

import os
import time

from .. import _engine
from ..codes import ABORT_DIED, ABORT_REVOKED, ST_LEFT
from ..errors import PeerLostError, RevokedError, ShmtreeError
from .transport import LINE, survive_geometry

__all__ = ["Survive", "Region", "lost_error", "agree_round", "gone"]

WAIT_S = 0.002              # agree: the longest sleep on the bell between two looks at the
                            # ranks still awaited (a vote or a commit wakes the sleepers at once)
WAIT_NS = int(WAIT_S * 1e9)

# the words of a rank's line (byte offsets)
VOTE, TASK_JOB, TASK_ITEM, OFFER_TAG, OFFER_PID, OFFER_FD, OFFER_NONCE, SENDING = \
    0, 8, 16, 24, 32, 40, 48, 64
BELL = 16                   # the control line's bell (after the two commit words)


def lost_error(group):
    """The class of the error for a call on an aborted `group`: RevokedError when a rank
    revoked it, else PeerLostError."""
    try:
        reason = group._seg.abort_state()[0]
    except Exception:
        return PeerLostError
    return RevokedError if reason == ABORT_REVOKED else PeerLostError


class Region:
    """The survive region of a group's segment (see the module docstring), as this process
    maps it."""

    def __init__(self, group):
        self.seg = group._seg
        self.base = group.layout.survive
        self.n = group.size
        self.stride, self.prop = survive_geometry(self.n)

    def word(self, r, at):
        return self.base + LINE + r * self.stride + at

    def proposal(self, r, epoch):
        return self.base + LINE + r * self.stride + LINE + (epoch & 1) * self.prop

    # ---- the bell ----

    def bell(self):
        return _engine.sv_bell(self.seg, self.base + BELL)

    def ring(self):
        _engine.sv_ring(self.seg, self.base + BELL)

    def sleep(self, seen, timeout_s=WAIT_S):
        _engine.sv_sleep(self.seg, self.base + BELL, seen,
                         max(10_000, int(min(timeout_s, WAIT_S) * 1e9)))

    # ---- votes, proposals, commits ----

    def vote(self, r, epoch, flag):
        _engine.sv_store(self.seg, self.word(r, VOTE), (epoch << 1) | bool(flag))
        self.ring()

    def vote_of(self, r):
        """(epoch, flag) of rank r's last vote."""
        v = _engine.sv_load(self.seg, self.word(r, VOTE))
        return v >> 1, bool(v & 1)

    def propose(self, r, epoch, value, failed):
        at = self.proposal(r, epoch)
        seg = self.seg
        _engine.sv_store(seg, at, 0)                     # (being written)
        mask = sum(1 << f for f in failed).to_bytes((self.n + 7) // 8, "little")
        _engine.sv_write(seg, at + 16, mask)
        _engine.sv_store(seg, at + 8, int(bool(value)))
        _engine.sv_store(seg, at, epoch)

    def read_proposal(self, r, epoch):
        """(value, failed set) of rank r's proposal for `epoch`, or None if it holds another
        epoch's (read twice around: a proposal rewritten meanwhile is not taken)."""
        at = self.proposal(r, epoch)
        seg = self.seg
        if _engine.sv_load(seg, at) != epoch:
            return None
        value = bool(_engine.sv_load(seg, at + 8))
        mask = int.from_bytes(_engine.sv_read(seg, at + 16, (self.n + 7) // 8), "little")
        if _engine.sv_load(seg, at) != epoch:
            return None
        return value, {f for f in range(self.n) if mask >> f & 1}

    def commit(self, r, epoch):
        """Commit rank r's proposal for `epoch` (once per epoch: False if one was committed)."""
        at = self.base + 8 * (epoch & 1)
        seg = self.seg
        while True:
            cur = _engine.sv_load(seg, at)
            if cur >> 16 >= epoch:
                return False
            if _engine.sv_cas(seg, at, cur, (epoch << 16) | (r + 1)):
                self.ring()
                return True

    def decision(self, epoch):
        """None while `epoch` is undecided; else (winner, (value, failed set)), or (winner,
        None) when it is gone from the region (a later epoch decided since: this rank was
        left behind)."""
        cur = _engine.sv_load(self.seg, self.base + 8 * (epoch & 1))
        if cur >> 16 < epoch:
            return None
        winner = (cur & 0xFFFF) - 1
        if cur >> 16 > epoch:
            return winner, None
        return winner, self.read_proposal(winner, epoch)

    # ---- a shrink's offer, a Pool task ----

    def offer(self, r, epoch, pid, fd, nonce):
        seg = self.seg
        _engine.sv_store(seg, self.word(r, OFFER_TAG), 0)
        _engine.sv_store(seg, self.word(r, OFFER_PID), pid)
        _engine.sv_store(seg, self.word(r, OFFER_FD), fd)
        _engine.sv_write(seg, self.word(r, OFFER_NONCE), bytes(nonce))
        _engine.sv_store(seg, self.word(r, OFFER_TAG), epoch)
        self.ring()

    def offer_of(self, r, epoch):
        """(pid, fd, nonce) rank r offered for `epoch`, or None."""
        seg = self.seg
        if _engine.sv_load(seg, self.word(r, OFFER_TAG)) != epoch:
            return None
        return (_engine.sv_load(seg, self.word(r, OFFER_PID)),
                _engine.sv_load(seg, self.word(r, OFFER_FD)),
                _engine.sv_read(seg, self.word(r, OFFER_NONCE), 16))

    def set_task(self, r, job, item):
        """A Pool worker's task (job id + 1, item; 0: none), for the pool to fail it if the
        worker dies while it runs (heal.py)."""
        _engine.sv_store(self.seg, self.word(r, TASK_ITEM), item)
        _engine.sv_store(self.seg, self.word(r, TASK_JOB), job)

    def set_sending(self, r, holds):
        """A Pool worker holds its pool's result queue's write lock (heal.ResultQueue)."""
        _engine.sv_store(self.seg, self.word(r, SENDING), int(holds))

    def sending_of(self, r):
        return _engine.sv_load(self.seg, self.word(r, SENDING)) != 0

    def task_of(self, r):
        job = _engine.sv_load(self.seg, self.word(r, TASK_JOB))
        return (job - 1, _engine.sv_load(self.seg, self.word(r, TASK_ITEM))) if job else None


def gone(group, r):
    """'' while rank r may still take part; else how it is gone (it died, or left)."""
    seg = group._seg
    if seg.state(r) == ST_LEFT:
        return "left the group"
    how = group.death_of(r)
    if not how and seg.abort_state() == (ABORT_DIED, r):
        how = "its launcher saw it die"           # (shmtree.run: also one that never joined)
    return f"died ({how})" if how else ""


def agree_round(comm, flag, timeout=None):
    """One agreement over `comm` (a one-machine communicator): (value, failed set).  See the
    module docstring.  Raises PeerLostError when this rank was itself declared failed by the
    others (it came too late: a timeout elsewhere ran out)."""
    group = comm.group
    if group._closed:
        raise ShmtreeError("shmtree: the group is closed")
    reg = comm.__dict__.get("_sv_region")
    if reg is None or reg.seg is not group._seg:
        reg = comm._sv_region = Region(group)
    me, n = comm.rank, comm.size
    epoch = comm.__dict__.get("_sv_epoch", 0) + 1
    known = set(comm.__dict__.get("_sv_failed", ()))
    comm._sv_epoch = epoch
    reg.vote(me, epoch, flag)
    deadline = None if timeout is None else time.monotonic() + timeout
    dead = {}
    while True:
        seen = reg.bell()
        got = reg.decision(epoch)
        if got is not None:
            winner, decided = got
            if decided is None or me in decided[1]:
                comm._sv_excluded = True
                raise PeerLostError(f"shmtree: rank {me}: the other ranks agreed without this "
                                    f"one (agree #{epoch}: it was declared failed, too late "
                                    "for their timeout)")
            value, failed = decided
            comm._sv_failed = frozenset(failed)
            return value, set(failed)
        late = deadline is not None and time.monotonic() >= deadline
        live = [r for r in range(n) if r not in known and r not in dead]
        if live[0] == me or late:
            pending = []
            for r in live:
                if r == me:
                    continue
                voted = reg.vote_of(r)[0] == epoch
                how = gone(group, r)
                if how:
                    dead[r] = how
                elif not voted:
                    pending.append(r)
            if not pending or late:
                failed = known | set(dead) | set(pending)
                value = all(reg.vote_of(r)[1] for r in range(n) if r not in failed)
                reg.propose(me, epoch, value, failed)
                reg.commit(me, epoch)
                continue
        else:
            for r in live[:live.index(me)]:          # the ranks that would decide first
                how = gone(group, r)
                if how:
                    dead[r] = how
            if live[0] in dead:
                continue
        reg.sleep(seen, WAIT_S if deadline is None else max(0.0, deadline - time.monotonic()))


# shrink's maker, registered by shmtree.launching.heal (which sits above the communicator)
_SHRINK = None


def _made_by(shrink):
    global _SHRINK
    _SHRINK = shrink


class Survive:
    """revoke, agree, failed_ranks, shrink: the mixin every communicator has (see the module
    docstring)."""

    def _sv_local(self, what):
        """The one-machine communicator these calls work on; across nodes (from_mpi,
        inter=) agree and shrink are refused: they would need MPI's fault-tolerance
        interface (ULFM: MPIX_Comm_agree, MPIX_Comm_shrink) between the nodes."""
        if getattr(self, "local", None) is not None:
            raise ShmtreeError(
                f"shmtree: {what} across nodes is not supported: it needs MPI's fault-tolerance "
                f"interface (ULFM: MPIX_Comm_revoke, MPIX_Comm_agree, MPIX_Comm_shrink) "
                f"between the nodes' leaders, {_ulfm_text()}; a dead rank on any node revokes "
                "the whole communicator (every rank raises PeerLostError): start again, or use "
                "agree / shrink on each node's own communicator (comm.local)")
        if self._closed:
            raise ShmtreeError("shmtree: this communicator is closed")
        if self._pid != os.getpid():
            raise ShmtreeError(f"shmtree: this communicator belongs to process {self._pid} "
                               f"(rank {self.rank}); a forked child cannot use it")
        return self

    def revoke(self):
        """Revoke this communicator: every pending and later call on it, on every rank, fails.

        Local and non-blocking; any rank may call it, at any time (also from another thread
        while this rank waits in a call).  A rank blocked in a collective is woken at once and
        raises `RevokedError` (a `PeerLostError`), and so does every later call on this
        communicator; ``agree``, ``failed_ranks``, ``shrink`` and ``close`` still work.  A
        rank that dies revokes the communicator the same way, by itself (the others raise
        `PeerLostError` naming it).  Sub-communicators made by ``split`` are not revoked.

        Across nodes the node's part is revoked, and with it the whole communicator.

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     comm.barrier()                     # (every rank has joined)
        ...     if comm.rank == 1:
        ...         comm.revoke()                  # e.g. its input was bad
        ...     try:
        ...         comm.allreduce(np.ones(3))
        ...     except shmtree.RevokedError:
        ...         pass
        ...     return comm.agree(comm.rank != 1)  # still works: an AND over the ranks
        >>> shmtree.run(step, 3)
        [False, False, False]
        """
        local = getattr(self, "local", self)
        if local._closed:
            raise ShmtreeError("shmtree: this communicator is closed")
        if not local.group._closed:
            local.group.abort(ABORT_REVOKED, local.rank)

    def is_revoked(self) -> bool:
        """Whether the communicator is revoked or aborted (a rank revoked it, died, failed or
        timed out): its calls raise `PeerLostError`."""
        local = getattr(self, "local", self)
        return local.group.aborted()

    def agree(self, flag=True, *, timeout=None) -> bool:
        """A fault-tolerant AND of `flag` over the ranks that are alive.

        Works on a healthy communicator and on a revoked one (it uses memory of its own in the
        group's segment, not the collectives' rings), and completes on every rank that is
        alive with the same value, also when ranks die before or during the call: a rank that
        died (or left the group) is left out, and the ranks the survivors agree are gone are
        ``failed_ranks()`` afterwards.  Every rank alive must call it (like a collective, in
        the same order as its other agree calls).

        Parameters
        ----------
        flag : bool, default True
            This rank's vote.
        timeout : float, optional
            Seconds after which a rank that has not called agree yet, and has not died, is
            counted failed (a stopped or hung process).  Default: wait for every rank alive.

        Returns
        -------
        bool
            The AND of the votes of the ranks not failed.

        Raises
        ------
        PeerLostError
            This rank came after the others had agreed without it (their timeout ran out).
        ShmtreeError
            The communicator is closed, or spans nodes (agree across nodes needs MPI's ULFM
            interface, which shmtree does not use).

        Examples
        --------
        >>> import os, shmtree
        >>> def step(comm):
        ...     if comm.rank == 2:
        ...         os._exit(1)                    # dies
        ...     ok = comm.agree(True)
        ...     return ok, comm.failed_ranks()
        >>> shmtree.run(step, 3, on_failure="shrink")[:2]
        [(True, [2]), (True, [2])]
        """
        local = self._sv_local("agree")
        value, _ = agree_round(local, flag, timeout)
        return value

    def failed_ranks(self) -> list:
        """The ranks the survivors agreed are gone, in the last ``agree`` (or ``shrink``) this
        rank made on this communicator; [] before any.

        Returns
        -------
        list of int
            Ranks of this communicator, in order.
        """
        local = getattr(self, "local", self)
        return sorted(local.__dict__.get("_sv_failed", ()))

    def shrink(self, *, timeout=None):
        """A new communicator of the ranks that are alive: the way on after a rank is lost.

        A collective over the survivors (every rank alive calls it), on a healthy or a revoked
        communicator.  The survivors agree on who they are (as ``agree`` does; a rank that
        dies during the call is left out, and the call goes on), keep their order and are
        renumbered from 0.  The new communicator has its own shared memory and a plan over the
        survivors' cores; every collective, shared arrays, ``split`` and messages work on it.
        It becomes this process's communicator (``shmtree.current()``) where this one was.
        This communicator stays revoked (close it); sub-communicators made from it go on if
        they did not hold a dead rank.

        Parameters
        ----------
        timeout : float, optional
            As agree's: seconds after which a rank that has not called shrink, and has not
            died, is left out.

        Returns
        -------
        Communicator
            This rank's communicator among the survivors; its ``parent_ranks`` are the
            survivors' ranks here.

        Raises
        ------
        PeerLostError
            This rank was left out by the others (it came after their timeout).
        ShmtreeError
            The communicator is closed, or spans nodes (shrink across nodes needs MPI's ULFM
            interface, which shmtree does not use).

        Examples
        --------
        >>> import os, numpy as np, shmtree
        >>> def step(comm):
        ...     if comm.rank == 1:
        ...         os._exit(1)                    # dies
        ...     try:
        ...         comm.allreduce(np.ones(2))
        ...     except shmtree.PeerLostError:
        ...         comm = comm.shrink()           # ranks 0 and 2 go on, as 0 and 1
        ...     return comm.rank, comm.size, comm.allreduce(np.ones(2)).tolist()
        >>> shmtree.run(step, 3, on_failure="shrink")
        [(0, 2, [2.0, 2.0]), WorkerError('rank 1 failed: exited with code 1 without reporting a result'), (1, 2, [2.0, 2.0])]
        """
        local = self._sv_local("shrink")
        if _SHRINK is None:                 # (shmtree's __init__ imports launching.heal)
            raise ShmtreeError("shmtree: shrink needs shmtree.launching.heal (import shmtree)")
        return _SHRINK(local, timeout)


def _ulfm_text():
    """Whether the MPI library here offers ULFM, for the refusal's message."""
    try:
        import sys
        MPI = sys.modules.get("mpi4py.MPI")
        if MPI is None:
            return "which this process has not loaded"
        version = MPI.Get_library_version().strip().splitlines()[0]
        has = hasattr(MPI.Comm, "Shrink") and "ulfm" in MPI.Get_library_version().lower()
        return (f"which this MPI ({version}) offers, but shmtree does not use yet" if has else
                f"which this MPI ({version}) does not offer")
    except Exception:
        return "which this MPI does not offer"
