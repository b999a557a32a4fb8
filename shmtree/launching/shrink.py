"""Shrink: the new communicator of the survivors, comm.shrink() (docs/design.md, "Survive";
registered into shmtree.groups.survive, whose mixin every communicator has).  A loop of

  1. an agreement over the old communicator (survive.agree_round): who is alive;
  2. the lowest survivor (the new rank 0) makes the new group's segment (subgroup.SubGroup, a
     plan over the survivors' slots: subgroup.sub_plan) and offers it in its words of the old
     group's survive region (pid, descriptor, nonce, tagged with the agreement's epoch); the
     others attach through /proc/<pid>/fd/<n> (same user) and join by their new ranks;
  3. a second agreement: did every survivor join?  The survivors are the same as in 1: the
     communicator is made (the leader's descriptor is closed: every member maps the segment).
     Else (a rank died meanwhile, the leader among them) every survivor drops what it made and
     goes round again.
"""
from __future__ import annotations

import os
import time
import weakref

from ..communicators.communicator import Communicator
from ..errors import PeerLostError, ShmtreeError
from ..groups import session, survive
from ..groups.subgroup import SubGroup, sub_plan

__all__ = ["ShrunkCommunicator", "shrink"]

SHRINK_ROUNDS = 8           # shrink gives up after this many rounds in which ranks kept dying


class ShrunkCommunicator(Communicator):
    """A communicator made by shrink: a Communicator of its own group (never pinned, closing it
    is local and frees its mapping at once).  `parent_ranks`: the rank in the shrunk
    communicator of each rank here."""

    _restores_mask = False              # (the members keep the mask their first group gave)

    def __init__(self, group, rank, parent_ranks):
        super().__init__(group, rank)
        self.parent_ranks = tuple(parent_ranks)

    def close(self):
        if self._closed:
            return
        super().close()
        self.group.close()
        if self._engine is None:
            self._seg = self.group._seg

    def __repr__(self):
        return f"<shmtree.Communicator rank={self.rank} size={self.size} (shrunk)>"


def shrink(comm, timeout=None):
    """comm.shrink() of a one-machine communicator (survive.Survive.shrink): see the module
    docstring."""
    reg = None
    for _ in range(SHRINK_ROUNDS):
        _, failed = survive.agree_round(comm, True, timeout)
        epoch = comm._sv_epoch
        reg = comm._sv_region
        members = [r for r in range(comm.size) if r not in failed]
        me = members.index(comm.rank)
        group = new = None
        err = None
        try:
            plan = sub_plan(comm.group.plan, members)
            if me == 0:
                group = SubGroup.create(plan)
                reg.offer(comm.rank, epoch, os.getpid(), group._fd, group._nonce)
            else:
                pid, fd, nonce = _offer(comm, reg, members[0], epoch, timeout)
                group = SubGroup.attach(plan, pid, fd, nonce)
            rank = group._admit(me)
            new = ShrunkCommunicator(group, rank, members)
            group._comm = weakref.ref(new)
        except Exception as exc:
            err = exc
        ok, again = survive.agree_round(comm, err is None, timeout)
        if ok and again == failed:
            group.release_descriptor()
            new._sv_failed = frozenset()
            if session._current is comm:
                session._set_current(new)
            return new
        for thing in (new, group):
            if thing is not None:
                try:
                    thing.close()
                except Exception:
                    pass
    raise PeerLostError(f"shmtree: rank {comm.rank}: shrink gave up after {SHRINK_ROUNDS} "
                        "rounds in which ranks kept dying")


def _offer(comm, reg, leader, epoch, timeout):
    """The new group's segment as the leader offered it: (pid, fd, nonce); ShmtreeError if the
    leader died (or its timeout ran out) before it offered."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        seen = reg.bell()
        got = reg.offer_of(leader, epoch)
        if got is not None:
            return got
        how = survive.gone(comm.group, leader)
        if how:
            raise ShmtreeError(f"shmtree: shrink: the new rank 0 (rank {leader}) {how} before "
                               "it made the new group")
        if deadline is not None and time.monotonic() >= deadline:
            raise ShmtreeError(f"shmtree: shrink: the new rank 0 (rank {leader}) did not make "
                               "the new group in time")
        reg.sleep(seen)


survive._made_by(shrink)
