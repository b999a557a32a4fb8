"""The launcher-per-node way across nodes: `Group(size, inter=mpi_comm)` (and run / Pool).

mpiexec starts one launching process per node; each creates its node's group with `inter=`, a
communicator of the launchers (its rank is the node's index), and forks or spawns its workers as
usual.  Workers never call MPI: the launcher is the node's proxy.  It holds the Link of
shmtree.internode.inter (MPI between the launchers) and a thread serving a mailbox (Proxy,
here): a shared memory file through which the node's leader (worker of local rank 0) hands it
the steps that cross the node boundary, the same steps a from_mpi leader runs on its own link.
The worker side (ProxyLink, proxylink.py) has the Link's interface (submit / wait / run /
abort / failure), so the collectives of shmtree.internode.nodes are the same code for both
ways in.

The mailbox: a header page, then SLOTS slots, each a control page and SEGMENT bytes of data:

    header  +0  u32 abort request (the leader failed: text at +64)
            +4  u32 failed (the proxy's link failed: text at +1024)
            +8  u32 closed (a sub-communicator's leader closed it: its proxy stops)
            +16 u64 the launcher's pid (its workers reach its relay of messages between
                nodes: relay.Relay; a child's is said in the SPLIT step's answer too)
    slot    +0  u32 state: IDLE, SUBMITTED (by the leader), DONE / FAILED (by the proxy)
            +8  u32 step: ALLREDUCE, BCAST, ALLGATHERV, EXCHANGE   +12 i32 root
            +16 u64 bytes of the buffer                    +24 u64 bytes received (allgatherv)
            +64 op name, +96 dtype (numpy str, or "bfloat16"), 32 bytes each
            +1024 the failure text
    data    allreduce/bcast: the buffer, in place; allgatherv: N u64 counts, send, receive;
            exchange: N u64 send sizes, N u64 receive sizes, the sends back to back (node
            order), the receives back to back; split: K i64 keys, then K (pid, fd) i64 pairs,
            then a record per key (split_record; +24 u64: its words)

Sub-communicators across nodes (subcomm.py): a split of the communicator is one more step,
SPLIT, with a key per new communicator that spans nodes (this node's index in it, -1 where it
has no member here): the proxies gather every launcher's keys over the link (the steps are in
the same order on every node) and start a proxy of their own (a child: a mailbox, and a Link
on the communicator of the group's family of proxies, Family, whose nodes are the launchers
with a key, its `peers`, and whose messages have tags of their own) for each new communicator
with members here; no MPI call blocks and no communicator is made.  The step's answer is the
child's (launcher pid, mailbox descriptor), through which the new communicator's leader on this
node maps the mailbox (/proc/<pid>/fd, same user).  A child relays the new communicator's messages between nodes (start_relay: it
maps the node's part of the communicator, and watches it), stops when its leader closes the
communicator (`closed`) and the node's other members have too, and with its parent at the
latest.

The leader submits to slots in turn (0, 1, 0, ...) and waits for each in order; the proxy serves
them in the same order.  Words are stored sequentially consistent and waited on with futexes
(_moving.word_wait), the waiting side spinning briefly first.
"""
from __future__ import annotations

import itertools
import os
import threading

import numpy as np

from .. import _moving
from ..codes import ST_LEFT
from ..errors import ShmtreeError
from ..groups.transport import create_memfd
from .inter import _KEPT, Link, global_ranks

__all__ = ["Proxy", "Mailbox", "Family", "split_record"]

PAGE = 4096
SLOTS = 2
IDLE, SUBMITTED, DONE, FAILED = 0, 1, 2, 3
ALLREDUCE, BCAST, ALLGATHERV, EXCHANGE, SPLIT = 1, 2, 3, 4, 5
TEXT = 512
TAGS_PER_CHILD = 32         # MPI tags of one child proxy (its link's and its relay's) on its
                            # family's communicator: from (id + 1) * TAGS_PER_CHILD
POLL_S = 0.01               # the proxy looks at the group and the link this often when idle
WAIT_SLICE_S = 0.05


class Mailbox:
    """A mapping of the mailbox file: `segment` data bytes per slot."""

    def __init__(self, fd, segment):
        self.segment = int(segment)
        self.slot_bytes = PAGE + self.segment
        self.size = PAGE + SLOTS * self.slot_bytes
        self.map = _moving.Mapping(fd, self.size)
        self.bytes = np.frombuffer(self.map, np.uint8)

    @classmethod
    def open(cls, pid, fd, segment):
        """Map another process's mailbox (its descriptor `fd`: /proc/<pid>/fd, same user)."""
        try:
            mine = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise ShmtreeError(f"shmtree: cannot map the launcher's mailbox (process {pid}): "
                               f"{exc}") from None
        try:
            if os.fstat(mine).st_uid != os.getuid():
                raise ShmtreeError("shmtree: the launcher's mailbox belongs to another user")
            return cls(mine, segment)
        finally:
            os.close(mine)

    @classmethod
    def create(cls, segment):
        fd = create_memfd(PAGE + SLOTS * (PAGE + int(segment)))
        return cls(fd, segment), fd

    def ctl(self, k):
        return PAGE + k * self.slot_bytes

    def data(self, k):
        at = self.ctl(k) + PAGE
        return self.bytes[at:at + self.segment]

    def put_u64(self, at, value):
        self.bytes[at:at + 8].view(np.uint64)[0] = value

    def get_u64(self, at):
        return int(self.bytes[at:at + 8].view(np.uint64)[0])

    def put_text(self, at, text, size=TEXT):
        raw = text.encode("utf-8", "replace")[:size - 1]
        self.bytes[at:at + size] = 0
        self.bytes[at:at + len(raw)] = np.frombuffer(raw, np.uint8)

    def get_text(self, at, size=TEXT):
        return self.bytes[at:at + size].tobytes().split(b"\0", 1)[0].decode("utf-8", "replace")

    def word(self, at):
        return _moving.word_load(self.map, at)

    def set_word(self, at, value):
        _moving.word_store(self.map, at, value)

    def wait_word(self, at, while_value, timeout_s):
        return _moving.word_wait(self.map, at, while_value, timeout_s)


def _dtype_key(dtype):
    return "bfloat16" if dtype.name == "bfloat16" else dtype.str


def _dtype_of(key):
    if key == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(key)


def split_record(pid, fd, nonce, node_of, local_ranks):
    """What the launcher needs, in a SPLIT step, to relay the messages of a new communicator
    across nodes (Proxy.start_relay): the leader of its node's part (pid, descriptor of its
    segment, its nonce), the node of each of its ranks, and its members' ranks in the parent's
    part of this node; int64 words (where the key is -1: split_record(0, -1, bytes(16), [],
    []))."""
    return [pid, fd] + np.frombuffer(bytes(nonce), np.int64).tolist() + \
        [len(node_of)] + list(node_of) + [len(local_ranks)] + list(local_ranks)


def _split_record(extra, at):
    """(pid, fd, nonce, node_of, local_ranks) of split_record's words from `at`, and where the
    next begins."""
    pid, fd, n0, n1, size = extra[at:at + 5]
    at += 5
    node_of = extra[at:at + size]
    at += size
    nlocal = extra[at]
    local_ranks = extra[at + 1:at + 1 + nlocal]
    return (pid, fd, np.array([n0, n1], np.int64).tobytes(), node_of, local_ranks), \
        at + 1 + nlocal


# ---------------------------------------------------------------------------------------------
# the launcher side


class Family:
    """The MPI communicator that the child proxies of one launchers' group share (every
    sub-communicator across nodes made from the group, at any depth): a Dup of the launchers'
    communicator, made with the group's proxy, so that a split makes no MPI communicator
    (MPI's Split and Dup block, spinning; its Idup may hang when several threads of a process
    make communicators at once).  A child is told apart by its MPI tags: TAGS_PER_CHILD from
    (id + 1) * TAGS_PER_CHILD, its id drawn by the launcher of its link's first node from that
    launcher's own residue class (rank + size * k), unique across the launchers without
    agreeing on anything; ids are never reused."""

    def __init__(self, comm):
        from mpi4py import MPI
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.tag_ub = int(comm.Get_attr(MPI.TAG_UB))
        self._drawn = itertools.count()
        self.kept = False             # a child's link or relay left requests with MPI

    def new_tags(self):
        """A new child's first tag; -1 once this MPI's tags are used up."""
        tags = (self.rank + self.size * next(self._drawn) + 1) * TAGS_PER_CHILD
        return tags if tags + TAGS_PER_CHILD - 1 <= self.tag_ub else -1

    def close(self):
        """(The group's proxy closes, after its children.)"""
        from .remote import free_comm
        if self.kept:
            _KEPT.append((self.comm,))
        else:
            free_comm(self.comm)


class Proxy:
    """The launcher's part: the mailbox, the Link to the other launchers, the thread serving the
    mailbox.  `group` is the node's Group (this process created it)."""

    def __init__(self, group, inter, segment, box=None, family=None, peers=None, tags=0):
        """A child's (a sub-communicator's across nodes; `group` and `inter` are None): its
        link is on `family`'s communicator, its nodes there the ranks `peers`, its tags from
        `tags` (Family)."""
        self.group = group
        self.box, self.fd = box if box is not None else Mailbox.create(segment)
        self.top = family is None
        if self.top:              # (its messages never meet the program's)
            self.link = Link(inter.Dup(), group)
            self.family = Family(inter.Dup())
        else:
            self.link = Link(family.comm, None, peers, tags, owned=False)
            self.family = family
        self.link.interrupt = self._interrupt
        self._stop = False
        self._closed = False
        self._close_lock = threading.Lock()
        self._done = threading.Event()           # close() has ended
        self._busy = False                       # a step is being served
        self.children = []                       # proxies of sub-communicators (split)
        self.relay = None                        # relay.Relay: messages between nodes
        self.plan = group.plan if group is not None else None   # (of the node's part)
        self.watched = None          # a child's: the node's part of its communicator (the
        self.ranks = None            # launcher's own mapping) and that part's ranks in it
        self._thread = threading.Thread(target=self._serve, name="shmtree-proxy", daemon=True)
        self._thread.start()

    def _serve(self):
        box, k = self.box, 0
        told = False
        while not self._stop:
            ctl = box.ctl(k)
            state = box.wait_word(ctl, IDLE, POLL_S)
            if state == SUBMITTED:
                self._step(k)
                k = (k + 1) % SLOTS
                continue
            if state in (DONE, FAILED):       # (the leader reuses a slot: its state stays
                state = box.wait_word(ctl, state, POLL_S)   # DONE until it submits again)
                if state == SUBMITTED:
                    self._step(k)
                    k = (k + 1) % SLOTS
                    continue
            if not told:
                told = self._watch()
            if box.word(8) and self._members_gone():    # (a child: its sub-communicator was
                self.close()                              # closed, and its relay is idle)
                return

    def _members_gone(self):
        """A child whose leader closed its communicator: have this node's other members closed
        it too (or died)?  Their messages between nodes go through its relay until then."""
        part = self.watched
        if part is None or part.closed or part.aborted():
            return True
        return all(part._seg.state(r) == ST_LEFT or part.death_of(r) for r in range(part.size))

    def _interrupt(self):
        """Checked by the link while a step waits on MPI: this node failed (the leader asked
        to abort, or the group is aborted): the text, else None."""
        box = self.box
        if box.word(0):
            return box.get_text(64)
        if self.group is not None and not self.group.closed and self.group.aborted():
            return self._node_text()
        part = self.watched
        if part is not None and not part.closed and part.aborted():
            return f"node {self.link.me}: " + global_ranks(part.describe_abort(), self.ranks)
        return None

    def _node_text(self):
        """This node's group aborted, in global ranks."""
        group = self.group
        return f"node {self.link.me}: " + global_ranks(
            group.describe_abort(), [group.global_rank(r) for r in range(group.size)])

    def _watch(self) -> bool:
        """Idle: carry a failure of this node to the others, and another node's to this one's
        leader.  True once the link has failed (nothing more to watch)."""
        box, link = self.box, self.link
        if box.word(0) and link.failure is None:
            link.abort(box.get_text(64))
        elif link.failure is None and self._interrupt():
            link.abort(self._interrupt())
        if link.failure is not None:
            box.put_text(1024, link.failure)
            box.set_word(4, 1)
            return True
        return False

    def _step(self, k):
        box, link = self.box, self.link
        ctl, data = box.ctl(k), box.data(k)
        self._busy = True
        step = int(box.bytes[ctl + 8:ctl + 12].view(np.uint32)[0])
        nbytes = box.get_u64(ctl + 16)
        try:
            if step == ALLREDUCE:
                dtype = _dtype_of(box.get_text(ctl + 96, 32))
                op = box.get_text(ctl + 64, 32)
                link.run(Link.allreduce, data[:nbytes].view(dtype), op)
            elif step == BCAST:
                root = int(box.bytes[ctl + 12:ctl + 16].view(np.int32)[0])
                link.run(Link.bcast, data[:nbytes], root)
            elif step == ALLGATHERV:
                n = link.n
                counts = data[:8 * n].view(np.uint64).astype(np.int64).tolist()
                recv_bytes = box.get_u64(ctl + 24)
                send = data[8 * n:8 * n + nbytes]
                recv = data[8 * n + nbytes:8 * n + nbytes + recv_bytes]
                link.run(Link.allgatherv, send, recv, counts)
            elif step == SPLIT:
                keys = data[:8 * nbytes].view(np.int64).tolist()
                extra = data[24 * nbytes:24 * nbytes + 8 * box.get_u64(ctl + 24)] \
                    .view(np.int64).tolist()
                data[8 * nbytes:8 * nbytes * 3].view(np.int64)[:] = \
                    np.array(self.split(keys, extra), np.int64).reshape(-1)
            elif step == EXCHANGE:
                n = link.n
                sizes = data[:16 * n].view(np.uint64).astype(np.int64).tolist()
                at, sends, recvs = 16 * n, [], []
                for size in sizes[:n]:
                    sends.append(data[at:at + size])
                    at += size
                for size in sizes[n:]:
                    recvs.append(data[at:at + size])
                    at += size
                link.run(Link.exchange, sends, recvs)
            else:
                raise ShmtreeError(f"shmtree: unknown proxy step {step}")
            self._busy = False               # (before the leader can see it done)
            box.set_word(ctl, DONE)
        except BaseException as exc:
            text = link.failure or f"{type(exc).__name__}: {exc}"
            box.put_text(ctl + 1024, text)
            box.put_text(1024, text)
            box.set_word(4, 1)
            self._busy = False
            box.set_word(ctl, FAILED)

    def split(self, keys, extra):
        """The SPLIT step: for each key (this node's index in a new communicator that spans
        nodes, -1: no member here), a child proxy where the key is >= 0, with a relay of its
        own (start_relay).  `extra`: a record per key (_split_record).  Its (pid, mailbox
        descriptor) per key, (0, -1) where none.  No MPI call blocks, no communicator is
        made: the launchers' keys (and the first node's tags for each child, Family) are
        gathered over the link, and a child's nodes are the launchers with a key, in key
        order."""
        link, k = self.link, len(keys)
        tags = [self.family.new_tags() for _ in keys] if link.me == 0 else [0] * k
        row = np.array(list(keys) + tags, np.int64)
        every = np.empty((link.n, 2 * k), np.int64)
        link.run(Link.allgatherv, row.view(np.uint8), every.reshape(-1).view(np.uint8),
                 [16 * k] * link.n)
        if (every[0, k:] < 0).any():
            raise ShmtreeError(f"shmtree: this MPI's tags (MPI_TAG_UB {self.family.tag_ub}) "
                               "are used up by the sub-communicators across nodes made from "
                               "this group; make fewer of them per group (or a new group)")
        out, at = [], 0
        for i, key in enumerate(keys):
            record, at = _split_record(extra, at)
            if key < 0:
                out.append((0, -1))
                continue
            order = sorted((j for j in range(link.n) if every[j, i] >= 0),
                           key=lambda j: every[j, i])
            child = Proxy(None, None, self.box.segment, family=self.family,
                          peers=[link.peers[j] for j in order], tags=int(every[0, k + i]))
            self.children.append(child)
            child.start_relay(self.plan, key, *record)
            out.append((os.getpid(), child.fd))
        self.children = [c for c in self.children if not c._closed]
        return out

    def start_relay(self, parent_plan, node, pid, fd, nonce, node_of, local_ranks):
        """A child's relay of its communicator's messages between nodes (relay.Relay, on its
        family's communicator, as its link): this launcher maps the node's part of the
        communicator (the segment its leader made, process `pid`'s descriptor `fd`; its plan is
        the parent part's, subgroup.sub_plan, on its members' ranks in the parent part,
        `local_ranks`) to reach its members' channels and see their failures; `node_of`: the
        node of each rank of the new communicator.  Another node's failure aborts this node's
        part (the link's), and this part's failure reaches the other nodes (_interrupt)."""
        from .relay import Relay
        from ..groups.subgroup import SubGroup, sub_plan
        members = [[g for g, n in enumerate(node_of) if n == k]
                   for k in range(max(node_of) + 1)]
        link = self.link
        try:
            self.plan = sub_plan(parent_plan, local_ranks)
            part = SubGroup.attach(self.plan, pid, fd, nonce)
            part._creator = None
            self.ranks = members[node]
            self.watched = link.group = part
            self.relay = Relay(part, self.family.comm, members, link.peers, link.tags,
                               owned=False)
        except BaseException as exc:
            link.abort(f"node {node}: the launcher could not start the relay of a "
                       f"communicator across nodes: {type(exc).__name__}: {exc}")
            self.close()
            raise
        self.box.put_u64(16, os.getpid())

    def close(self):
        """Stop serving (Group.close in the launcher, before the group is marked closed).  A
        clean close (no step in flight, the node healthy) tells the other nodes nothing: they
        may still be finishing their last call.  A failure of this node that the thread has
        not carried yet, or a step still in flight, fails the other nodes too.  The children
        (sub-communicators' proxies) close first, and the family's communicator (Family) is
        freed last, unless MPI still holds requests of a child (then it is kept)."""
        with self._close_lock:
            closing, self._closed = self._closed, True
        if closing:               # (another thread is closing it: the family's communicator
            if threading.current_thread() is not self._thread:     # may be freed only after)
                self._done.wait(10)
            return
        for child in self.children:
            child.close()
        kept = self.relay is not None and self.relay.close()
        self._stop = True
        mine = threading.current_thread() is self._thread
        if self._thread.is_alive() and not mine and not self._busy:
            self._thread.join(5)
        if self.link.failure is None:
            text = self._interrupt()
            if text is None and (self._busy or (self._thread.is_alive() and not mine)):
                text = f"node {self.link.me}: its group was closed during an inter-node step"
            if text is not None:
                self.link.abort(text)
        if self._thread.is_alive() and not mine:
            self._thread.join(5)
        kept = self.link.close() or kept
        if self.watched is not None:
            self.watched.close()
        try:
            os.close(self.fd)
        except OSError:
            pass
        if self.top:
            self.family.close()
        elif kept:
            self.family.kept = True
        self._done.set()
