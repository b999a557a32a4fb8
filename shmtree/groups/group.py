"""Group: a group of ranks, its plan and its shared memory (docs/design.md).

A Group is created in one process (its creator) and handed to the members: inherited by fork,
pickled for spawn and forkserver (`__reduce__` / `_rebuild_group`: the plan and the memfd
travel, nobody plans again).  It holds what every member shares and what one member does to it:
the plan (trees, geometry), the segment (header, rank blocks, rings), joining as a rank (pinning,
NUMA placement of the rings this rank produces), the liveness of members, aborting and saying
why, and this process's mapping (close, drop).

Group.join admits a member (the header checked, the rank marked joined, pinned, its rings
placed) and hands it to the function that makes its communicator
(shmtree.launching.joining.join, the one place communicators are made); Group(size, inter=mpi_comm) makes a multinode.NodeGroup.  Both
modules sit above this one and register themselves when they are imported (shmtree's __init__
imports them): this module imports nothing above it.
"""
from __future__ import annotations

import inspect
import json
import os
from multiprocessing import reduction

from .. import _engine
from ..machine import plan as _plan
from ..codes import (ABORT_CLOSED, ABORT_CORRUPT, ABORT_DIED, ABORT_FAILED, ABORT_MEMBERSHIP,
                     ABORT_REVOKED, ABORT_TIMEOUT, NOTED, ST_BUSY)
from ..errors import PeerLostError, ShmtreeError
from ..machine.liveness import Watch, how_gone, identity
from ..machine.plan import SMALL_SLOTS, Plan, plan_group
from .transport import ChannelPlan, Layout, create_memfd, new_nonce
from .token import _TOKEN_FORMAT, _TOKEN_VERSION, _parse_token, _plan_to_data

__all__ = ["Group"]

MPOL_PREFERRED = 1
MPOL_INTERLEAVE = 3


def _plan_property(name, doc):
    return property(lambda self: getattr(self.plan, name), doc=doc)


class Group:
    """A group of `size` ranks: its plan (trees, geometry), its shared memory, its ring layout.

    Create it in the parent; hand it to the workers (inherited by fork, pickled for spawn and
    forkserver, with its plan: a spawned member never plans again); each worker calls
    `group.join(rank)` once.  `close()` (or leaving the `with` block) frees this process's
    mapping and descriptor; in the creator it also marks the group closed.

    Options (see shmtree.machine.plan): topology (Topology, spec string like "2x4", JSON path,
    or None to detect), tree ("auto", "topology", "chain", "binary", "flat", "ring" or an int k), chunk_bytes
    (bytes per pipelined chunk), pin (pin each rank to its core while it is a member; None: when
    ranks fit the usable cores of a detected topology), slots (ring slots per edge), placement
    ("compact" or "spread"), numa ("auto", "consumer", "producer", "interleave" or None: where
    ring pages live), small_bytes (largest message carried inline in the latency round), spin_us
    (busy-wait before yielding), nt_bytes (streaming stores from this size), stall_timeout
    (seconds a member waits on members that are idle in a Pool before failing; None: never).
    With inter= (an mpi4py communicator of one launcher per node; segment_bytes: bytes per
    step between the nodes) the group is one node of several: a multinode.NodeGroup.
    """

    # what Group(size, inter=mpi_comm) makes: one node's group of several, whose creator is the
    # node's proxy (multinode.NodeGroup, which registers itself: across_nodes=True)
    _across_nodes = None

    def __init_subclass__(cls, across_nodes=False, **kwargs):
        super().__init_subclass__(**kwargs)
        if across_nodes:
            Group._across_nodes = cls

    def __new__(cls, *args, inter=None, **options):
        if inter is not None and cls is Group:
            if Group._across_nodes is None:         # (shmtree's __init__ imports multinode)
                raise ShmtreeError("shmtree: inter= needs shmtree.internode.multinode "
                                   "(import shmtree)")
            cls = Group._across_nodes
        return super().__new__(cls)

    def __init__(self, size, *, topology=None, tree=None, chunk_bytes=None, pin=None, slots=None,
                 placement="compact", numa="auto", small_bytes=None, spin_us=None,
                 nt_bytes=None, stall_timeout=None, inter=None, segment_bytes=None):
        # (inter= is taken by __new__: Group(..., inter=mpi_comm) is a multinode.NodeGroup,
        # whose __init__ gives this one the rest of the options)
        if segment_bytes is not None:
            raise ValueError("shmtree: segment_bytes is an option of groups with inter=")
        self._closed = True                 # until the segment exists
        self._span = self._proxy = None
        self._adopt(plan_group(size, topology=topology, tree=tree, chunk_bytes=chunk_bytes,
                               pin=pin, slots=slots, placement=placement, numa=numa,
                               small_bytes=small_bytes, spin_us=spin_us, nt_bytes=nt_bytes,
                               stall_timeout=stall_timeout))
        self._nonce = new_nonce()
        self._creator = os.getpid()
        self._fd = create_memfd(self.layout.total)
        try:
            self._seg = _engine.Segment(self._fd, self.layout.total, self.size)
            self._seg.init_header(self._nonce, self.plan.digest())
        except BaseException:
            os.close(self._fd)
            raise
        self._closed = False

    def _adopt(self, plan: Plan):
        """Take a plan: the layout of the segment follows from it."""
        self.plan = plan
        self.size = plan.size
        # channel 0 also carries broadcast's first round: claims and description + the data
        channels = [ChannelPlan(plan.small_tree, SMALL_SLOTS,
                                max(plan.small_bytes, 64) + _engine.round_bytes(plan.size, 0)),
                    ChannelPlan(plan.large_tree, plan.slots, plan.chunk_bytes,
                                ring=plan.large_schedule == "ring")]
        if plan.ring_channel:
            # the bandwidth channel is a tree: broadcast, reduce, reduce_scatter and allgather
            # run around its depth-first order on rings of their own (each tree edge is used
            # once per direction by the ring)
            channels.append(ChannelPlan(plan.large_tree, max(plan.slots, 2), plan.chunk_bytes,
                                        ring=True))
        self.layout = Layout(plan.size, channels)
        self.numa_errno = None
        self._comm = None               # weak reference to this process's member, once joined
        self._procs = Watch()           # liveness.how_gone's cache of the members, by (rank, pid)

    topology = _plan_property("topology", "The machine the trees are laid on.")
    tree_kind = _plan_property("tree_kind", "The tree option as given (parsed).")
    placement = _plan_property("placement", "'compact' or 'spread'.")
    chunk_bytes = _plan_property("chunk_bytes", "Bytes per pipelined chunk.")
    slots = _plan_property("slots", "Ring slots per edge of the bandwidth channel.")
    small_bytes = _plan_property("small_bytes", "The largest message carried inline.")
    nt_bytes = _plan_property("nt_bytes", "Streaming stores for messages from this size.")
    spin_ns = _plan_property("spin_ns", "Busy-wait before yielding, in ns.")
    pin = _plan_property("pin", "Whether members are pinned to their cores.")
    cpu_of = _plan_property("cpu_of", "The core of each rank (None: not pinned).")
    node_of = _plan_property("node_of", "The NUMA node of each rank.")
    numa = _plan_property("numa", "The NUMA placement policy of ring pages (None: first touch).")
    large_schedule = _plan_property("large_schedule", "'tree' or 'ring' (bandwidth channel).")
    stall_timeout = _plan_property("stall_timeout", "Seconds before a Pool stall fails.")

    @property
    def trees(self):
        """(latency tree, bandwidth tree)."""
        return self.plan.small_tree, self.plan.large_tree

    # ---- pickling for spawn / forkserver: the plan and the memfd (as a descriptor) travel ----

    def __reduce__(self):
        if self._closed:
            raise ShmtreeError("shmtree: a closed group cannot be sent to another process")
        span = None
        if self._span is not None:          # (node, node sizes, segment, the mailbox)
            node, sizes, segment, box_fd = self._span
            span = (node, sizes, segment, reduction.DupFd(box_fd))
        return _rebuild_group, (self.plan, reduction.DupFd(self._fd), self._nonce,
                                self.layout.total) + ((span,) if span is not None else ())

    def rendezvous_token(self) -> bytes:
        """What an unrelated process of the same user (not a child: torchrun, mpiexec) needs to
        attach to this group with Group.from_token: the plan, this process's pid and the
        segment's descriptor number, the nonce and size.  Valid while this process keeps the
        group open.  Plain data (JSON): a token is parsed and checked, never executed - it
        travels through stores that others may be able to write (torch's TCP store)."""
        if self._closed:
            raise ShmtreeError("shmtree: a closed group has no rendezvous token")
        return json.dumps({"format": _TOKEN_FORMAT, "version": _TOKEN_VERSION,
                           "pid": os.getpid(), "fd": self._fd, "nonce": self._nonce.hex(),
                           "total": self.layout.total, "plan": _plan_to_data(self.plan)},
                          separators=(",", ":")).encode()

    @classmethod
    def from_token(cls, token: bytes) -> "Group":
        """Attach to the group of a rendezvous token (through /proc/<pid>/fd/<fd> of its
        creator: only a process of the same user can open it; the segment's size and header
        nonce, and the plan's digest, are checked as for a pickled group).  A token that is
        not one (anything but the JSON rendezvous_token writes) raises ShmtreeError."""
        plan, pid, fd_number, nonce, total = _parse_token(token)
        try:
            fd = os.open(f"/proc/{pid}/fd/{fd_number}", os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise ShmtreeError(f"shmtree: cannot attach to the group of process {pid}: {exc} "
                               "(it must be alive and run as the same user)") from None
        if os.fstat(fd).st_uid != os.getuid():
            os.close(fd)
            raise ShmtreeError("shmtree: the group's segment belongs to another user")
        return _rebuild_group(plan, _Detached(fd), nonce, total)

    def _attach(self, fd, nonce, total):
        """Map the segment in a spawned process, after checking that it is this group's (the
        caller closes fd if this raises)."""
        if os.fstat(fd).st_size != total or total != self.layout.total:
            raise ShmtreeError("shmtree: the group segment has the wrong size")
        self._nonce = nonce
        self._creator = None
        self._seg = _engine.Segment(fd, total, self.size)
        try:
            self._verify_header()
        except ShmtreeError:
            self._seg.unmap()
            raise
        self._fd = fd
        self._closed = False

    def _verify_header(self):
        """Refuse a segment whose header is not this group's (magic, version, ranks, size,
        nonce, plan digest): another group's memory, a corrupted one, or a member that planned
        the group differently."""
        magic, version, nranks, total, nonce, digest = self._seg.header()
        problems = [what for what, ok in (
            ("magic", magic == _engine.MAGIC), ("version", version == _engine.VERSION),
            ("rank count", nranks == self.size), ("size", total == self.layout.total),
            ("nonce", nonce == self._nonce), ("plan digest", digest == self.plan.digest()))
            if not ok]
        if problems:
            raise ShmtreeError(f"shmtree: the shared segment is not this group's or is corrupted "
                               f"(wrong {', '.join(problems)}); refusing to use it")

    # ---- membership ----

    def join(self, rank):
        """Join as `rank` (once per rank, in the worker process); returns its Communicator (a
        communicator across nodes in a group of a node of several)."""
        rank = self._admit(rank)
        return _joining(self, rank)

    def _admit(self, rank):
        """Admit this process as `rank`: the segment checked, the rank marked joined (once),
        the process pinned to its core, the rings it produces placed.  The rank, as an int."""
        self._check_open()
        if isinstance(rank, bool) or not hasattr(rank, "__index__") \
                or not 0 <= rank.__index__() < self.size:
            raise ValueError(f"shmtree: rank must be an int in [0, {self.size}), got {rank!r}")
        rank = rank.__index__()
        self._verify_header()
        reason, _ = self._seg.abort_state()
        if reason and not (self.__dict__.get("_join_lost") and reason in (ABORT_DIED,
                                                                       ABORT_REVOKED)):
            raise PeerLostError(f"shmtree: cannot join: {self.describe_abort()}")
            # (run(on_failure="shrink") joins one a death revoked: its calls raise, it shrinks)
        if _joining is None:                        # (shmtree's __init__ imports joining)
            raise ShmtreeError("shmtree: Group.join needs shmtree.launching.joining "
                               "(import shmtree)")
        pid, ctime = identity()
        if not self._seg.mark_joined(rank, pid, ctime):
            raise ShmtreeError(f"shmtree: rank {rank} has already joined this group")
        self._seg.set_state(rank, ST_BUSY)
        cpu = self.plan.cpu_of[rank]
        if self.plan.pin and cpu is not None:
            try:
                _plan.pin_to(cpu)
            except OSError:
                pass
        self._place_rings(rank)
        return rank

    def global_rank(self, rank) -> int:
        """The rank across nodes of this group's local `rank` (itself without inter=)."""
        if self._span is None:
            return rank
        node, sizes = self._span[0], self._span[1]
        return sum(sizes[:node]) + rank

    def _place_rings(self, rank):
        """Bind the rings this rank produces to the NUMA node(s) the policy names, then touch
        them (after pinning): their pages are allocated now, where they belong."""
        for off, length, consumers in self.layout.produced_rings(rank):
            nodes = self._ring_nodes(rank, consumers)
            if nodes:
                mode = MPOL_INTERLEAVE if len(nodes) > 1 else MPOL_PREFERRED
                self.numa_errno = self._seg.bind(off, length, mode, sorted(nodes)) or None
            self._seg.touch(off, length)

    def _ring_nodes(self, producer, consumers):
        """The NUMA nodes for a ring under the group's policy (empty: first touch decides)."""
        numa, node_of = self.plan.numa, self.plan.node_of
        if numa is None:
            return set()
        if numa == "interleave":
            return set(node_of)
        if numa == "producer" or not consumers:
            return {node_of[producer]}
        votes = [node_of[c] for c in consumers]           # consumer: where most readers are
        best = max(set(votes), key=lambda n: (votes.count(n), n == node_of[producer]))
        return {best}

    def ring_placement(self, ranks=None):
        """Where the pages of the rings produced by `ranks` (default: all) are: a list of dicts
        (producer, consumers, offset, bytes, pages per NUMA node).  None where the kernel refuses
        the query.  The query (move_pages) sees the pages this process has mapped: a producer
        sees all of its rings' pages (it touched them at join); elsewhere a page this process
        has not accessed yet counts under node -2.  For the bench and tests."""
        self._check_open()
        out = []
        for rank in (range(self.size) if ranks is None else ranks):
            for off, length, consumers in self.layout.produced_rings(rank):
                nodes = self._seg.page_nodes(off, length)
                if nodes is None:
                    return None
                counts = {}
                for n in nodes:
                    counts[n] = counts.get(n, 0) + 1
                out.append({"producer": rank, "consumers": consumers, "offset": off,
                            "bytes": length, "pages": counts})
        return out

    def death_of(self, r) -> str:
        """'' while rank r's process lives (or has not joined yet); else how it is gone: exited,
        a zombie nobody has reaped yet, or its pid now used by another process."""
        joined, pid, ctime = self._seg.member(r)
        if not joined:
            return ""                    # not started yet: nothing to say
        procs = self.__dict__.get("_procs")
        if procs is None:
            procs = self._procs = Watch()     # (how_gone's cache, per process)
        return how_gone(procs, (r, pid), pid, ctime)

    def claim_rank(self) -> int:
        """The next unclaimed rank (Pool workers); >= size once every rank has been handed out."""
        self._check_open()
        return self._seg.claim_rank()

    def abort(self, reason=ABORT_FAILED, rank=-1, note=None):
        """Abort the group: every rank waiting in (or later entering) a collective raises.  A
        member aborting in its own name (rank = its rank) may say why in `note`; the first
        abort wins, so a note is only written while the group is healthy."""
        if self._closed:
            return
        if note is not None and rank >= 0 and not self._seg.abort_state()[0]:
            self._seg.set_note(rank, note.encode("utf-8", "replace"))
        self._seg.set_abort(reason, rank)

    def aborted(self) -> bool:
        return (not self._closed) and self._seg.abort_state()[0] != 0

    def describe_abort(self) -> str:
        reason, who = self._seg.abort_state()
        note = self._seg.note(who) if reason in NOTED and who >= 0 else ""
        if note and reason != ABORT_FAILED:
            return f"{note}; the group is aborted"
        return {
            0: "the group is healthy",
            ABORT_DIED: f"rank {who} died",
            ABORT_TIMEOUT: f"rank {who} timed out in a collective",
            ABORT_FAILED: f"rank {who} failed ({note or 'raised or was interrupted'})",
            ABORT_CLOSED: "the group was closed",
            ABORT_CORRUPT: f"rank {who} found corrupted shared memory",
            ABORT_MEMBERSHIP: "a process tried to join a full group (a worker was replaced?)",
            ABORT_REVOKED: f"rank {who} revoked the communicator",
        }.get(reason, f"aborted (reason {reason}, rank {who})") + "; the group is aborted"

    def member(self, rank):
        return self._seg.member(rank)

    # ---- lifetime ----

    def _check_open(self):
        if self._closed:
            raise ShmtreeError("shmtree: the group is closed")

    def close(self):
        """Free this process's mapping and descriptor, and leave the group if this process
        joined it (its CPU mask is restored).  In the process that created the group this also
        marks the group closed, so members still inside a collective raise PeerLostError."""
        if self._closed:
            return
        comm = self._comm() if self._comm is not None else None
        mine = comm is not None and comm._pid == os.getpid()
        elsewhere = mine and comm._in_call_elsewhere()
        if mine and not elsewhere:
            comm.close()              # (its outstanding requests complete first)
        if self._creator == os.getpid():
            if elsewhere:             # another thread of this process is inside a call: the
                self._seg.set_abort(ABORT_CLOSED, -1)       # abort makes it raise
            if self._proxy is not None:
                # before the group is marked closed: the proxy's thread must not take this
                # close for a failure of the node (and tell the other nodes so, while they
                # finish their last call)
                self._proxy.close()
            self._seg.set_abort(ABORT_CLOSED, -1)           # (a no-op if set above)
        if elsewhere:
            comm.close()              # (the call has raised: nothing left to wait for)
        self._closed = True
        self._close_mailbox()
        procs = self.__dict__.get("_procs")
        if procs is not None:
            procs.close()                 # (its pidfds)
        self._seg = _ClosedSegment()
        try:
            os.close(self._fd)
        except OSError:
            pass

    def _close_mailbox(self):
        """A member's descriptor of its launcher's mailbox (the launcher's own is its proxy's)."""
        if self._span is not None and self._proxy is None and self._span[3] is not None:
            node, sizes, segment, fd = self._span
            self._span = (node, sizes, segment, None)
            try:
                os.close(fd)
            except OSError:
                pass

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        # every copy (the creator's, a forked child's, an unpickled one) holds a descriptor of
        # its own: dropping the copy closes it (the mapping goes with the last Segment user)
        try:
            if not self._closed:
                self._closed = True
                os.close(self._fd)
                self._close_mailbox()
        except Exception:
            pass

    def __repr__(self):
        state = "closed" if self._closed else "open"
        return (f"<shmtree.Group size={self.size} tree={self.plan.tree_kind!r} "
                f"chunk_bytes={self.plan.chunk_bytes} {state}>")


# Group(...)'s signature is its __init__'s (less self), not that of the __new__ that picks the type
Group.__signature__ = inspect.signature(Group.__init__).replace(
    parameters=list(inspect.signature(Group.__init__).parameters.values())[1:])

# the function that makes the communicator of a rank Group.join admitted:
# shmtree.launching.joining.join, registered by that module when it is imported (_made_by)
_joining = None


def _made_by(join):
    """Register `join(group, rank)`, which makes an admitted rank's communicator."""
    global _joining
    _joining = join


class _ClosedSegment:
    """Stands in for the unmapped segment of a closed group (Engine objects keep the real one
    alive until they go)."""

    def abort_state(self):
        return ABORT_CLOSED, -1

    def __getattr__(self, name):
        raise ShmtreeError("shmtree: the group is closed")


class _Detached:
    """A descriptor already open here, in the shape of multiprocessing's DupFd."""

    def __init__(self, fd):
        self._fd = fd

    def detach(self):
        return self._fd


def _rebuild_group(plan, dupfd, nonce, total, span=None):
    """Unpickle a group: its creator's plan, and the segment's descriptor (closed again here
    if anything is wrong with it); with inter=, the node's place and its proxy's mailbox."""
    fd = dupfd.detach()
    try:
        group = Group.__new__(Group)
        group._closed = True            # until attached
        group._span = group._proxy = None
        group._adopt(plan)
        group._attach(fd, nonce, total)
    except BaseException:
        os.close(fd)
        raise
    if span is not None:
        node, sizes, segment, box = span
        group._span = (node, sizes, segment, box.detach())
    return group
