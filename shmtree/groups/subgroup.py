"""The plan and the group of a sub-communicator (docs/design.md, "How sub-communicators are
made"): sub_plan, a pure function of the parent's plan that every member computes alike, and
SubGroup, the group a split makes (subcomm.py) and a launcher maps to relay the messages of a
node's part of a sub-communicator across nodes (mailbox.Proxy.start_relay)."""
from __future__ import annotations

import os

from .. import _engine
from ..machine import plan as _plan
from ..errors import ShmtreeError
from .group import MPOL_INTERLEAVE as _MPOL_INTERLEAVE, MPOL_PREFERRED as _MPOL_PREFERRED
from .group import Group
from ..machine.plan import Plan
from ..machine.topology import Topology
from .transport import create_memfd, new_nonce

__all__ = ["sub_plan", "SubGroup"]


# ---------------------------------------------------------------------------------------------
# the plan of a sub-communicator


class _MemberTopology(Topology):
    """The sub-machine of a sub-communicator: the members' slots (each once; a slot shared by
    several members in an oversubscribed parent counts once), and a placement that puts sub
    rank i on its member's slot (the tree builders group ranks by placement(size) only)."""

    def __init__(self, member_slots, name):
        super().__init__(list(dict.fromkeys(member_slots)), name=name)
        self._members = tuple(member_slots)

    def placement(self, nranks, policy="compact"):
        return [self._members[i % len(self._members)] for i in range(nranks)]


def _default_spin_ns(size, ncpus):
    return 0 if size > ncpus else int(_plan.DEFAULT_SPIN_US * 1000)


def _default_small_bytes(size, ncpus):
    return _plan.OVERSUBSCRIBED_SMALL_BYTES if size > ncpus else _plan.DEFAULT_SMALL_BYTES


def sub_plan(parent: Plan, members) -> Plan:
    """The plan of the group of `members` (ranks of the parent's group, in the new ranks'
    order): the parent's options (tree kind, placement, chunk bytes, slots, streaming stores,
    NUMA policy, stall timeout; the machine's usable cores) laid on the members' slots; the
    inline limit and spinning as given to the parent, or where the parent had its size's
    defaults, the defaults of a group of this size; never pinned (the members keep their
    cores).  A pure function of the parent's plan: every member computes the same plan (its
    digest is in the header)."""
    members = list(members)
    n = len(members)
    where = parent.topology.placement(parent.size, parent.placement)
    name = f"{parent.topology.name}, ranks {','.join(map(str, members))}"
    if len(name) > 120:
        name = f"{parent.topology.name}, {n} of {parent.size} ranks"
    topo = _MemberTopology([where[r] for r in members], name)
    # the waiting policy and the inline limit a group of n ranks gets by default (no spinning
    # and the larger limit when ranks outnumber the cores), where the parent had its own
    # size's defaults: a sub-communicator of 2 of an oversubscribed parent of 4 on 2 cores
    # spins as a group of 2 does (its 8-byte allreduce took 3-4 times as long without)
    spin_ns, small_bytes = parent.spin_ns, parent.small_bytes
    if spin_ns == _default_spin_ns(parent.size, parent.ncpus):
        spin_ns = _default_spin_ns(n, parent.ncpus)
    if small_bytes == _default_small_bytes(parent.size, parent.ncpus):
        small_bytes = _default_small_bytes(n, parent.ncpus)
    small, large, schedule = _plan._trees(parent.tree_kind, n, topo, parent.placement,
                                          small_bytes, parent.chunk_bytes, parent.ncpus)
    return Plan(size=n, topology=topo, tree_kind=parent.tree_kind, placement=parent.placement,
                ncpus=parent.ncpus, small_tree=small, large_tree=large, large_schedule=schedule,
                chunk_bytes=parent.chunk_bytes,
                slots=max(parent.slots, 2) if schedule == "ring" else parent.slots,
                small_bytes=small_bytes, nt_bytes=parent.nt_bytes, spin_ns=spin_ns, pin=False,
                cpu_of=tuple(parent.cpu_of[r] if parent.pin else None for r in members),
                node_of=tuple(parent.node_of[r] for r in members), numa=parent.numa,
                stall_timeout=parent.stall_timeout)


# ---------------------------------------------------------------------------------------------
# the group and the communicator


class SubGroup(Group):
    """The group of a sub-communicator: made by split, joined by its members at once, never
    sent to another process.  Closing it is local (no process marks it closed for the others:
    a member that is done with it must not fail the others' last call)."""

    @classmethod
    def create(cls, plan):
        """The leader's: a new segment for `plan` (what Group.__init__ does after planning)."""
        g = cls.__new__(cls)
        g._closed = True
        g._span = g._proxy = None
        g._adopt(plan)
        g._nonce = new_nonce()
        g._creator = None               # (closing is local: see the class docstring)
        g._fd = create_memfd(g.layout.total)
        try:
            g._seg = _engine.Segment(g._fd, g.layout.total, g.size)
            g._seg.init_header(g._nonce, plan.digest())
        except BaseException:
            os.close(g._fd)
            raise
        g._closed = False
        return g

    @classmethod
    def attach(cls, plan, pid, fd_number, nonce):
        """A member's: the leader's segment, through /proc/<pid>/fd/<fd_number> (same user),
        its header checked against `plan` and `nonce`."""
        try:
            fd = os.open(f"/proc/{pid}/fd/{fd_number}", os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise ShmtreeError(f"shmtree: cannot attach to the segment of process {pid}: "
                               f"{exc}") from None
        g = cls.__new__(cls)
        try:
            if os.fstat(fd).st_uid != os.getuid():
                raise ShmtreeError("shmtree: the segment belongs to another user")
            g._closed = True
            g._span = g._proxy = None
            g._adopt(plan)
            g._attach(fd, nonce, g.layout.total)
        except BaseException:
            os.close(fd)
            raise
        return g

    def _place_rings(self, rank):
        """Bind the rings this rank produces to the NUMA node(s) of the policy, as Group's does,
        but leave their pages to be faulted in on first use (the bound policy still places
        them): touching 2 MiB per rank made a split cost several times its agreement."""
        for off, length, consumers in self.layout.produced_rings(rank):
            nodes = self._ring_nodes(rank, consumers)
            if nodes:
                mode = _MPOL_INTERLEAVE if len(nodes) > 1 else _MPOL_PREFERRED
                self.numa_errno = self._seg.bind(off, length, mode, sorted(nodes)) or None

    def release_descriptor(self):
        """Every member holds the mapping: the descriptor is no longer needed."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass

    def __reduce__(self):
        raise ShmtreeError("shmtree: the group of a sub-communicator cannot be sent to another "
                           "process (its members joined it when it was made)")

    def rendezvous_token(self):
        raise ShmtreeError("shmtree: the group of a sub-communicator has no rendezvous token "
                           "(its members joined it when it was made)")

    def __repr__(self):
        return super().__repr__().replace("shmtree.Group", "shmtree sub-group", 1)
