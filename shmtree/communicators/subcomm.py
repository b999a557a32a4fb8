"""Sub-communicators (docs/design.md, "How sub-communicators are made"): comm.split(color, key),
comm.dup() and comm.split_by(level), for every communicator kind (Front's methods call
make_split, registered here into front.py: front imports nothing of this module).

A split is a collective over the parent communicator, made of three of its allgathers, each of
one small record per rank (a structured dtype of its own, so that a rank making another
collective meanwhile is a CollectiveMismatchError on every rank, as for any two calls that
differ):

  1. (color, key) of every rank: every rank computes the same table, the new groups, and for
     each its members in the order (key, parent rank) - their ranks in it - and its plan
     (sub_plan: the parent's options on the sub-machine of the members' slots, computed from
     the parent's plan alone, so every member computes the same plan without sending it);
  2. the leader of each new group (its rank 0) creates its segment (one memfd, as Group does)
     and says (pid, descriptor number, nonce); every other member attaches through
     /proc/<pid>/fd/<n> (same user only: the rendezvous of Group.from_token and from_mpi),
     checks the header (nonce, plan digest) and joins;
  3. whether every member could: then the descriptors are closed (the mappings keep the
     memory; memfds have no names), and a group one of whose members failed is closed by
     all of its members, which raise naming that member and its error (the other groups are
     made: they did not depend on it).

The new communicator (SubCommunicator) is a full Communicator of its own group: every
collective, nonblocking calls, shared arrays, split again.  It is never this process's
current() (module-level calls keep the communicator the process joined), never pins nor
unpins (its members keep the mask their parent membership gave them; the parent's close
restores every thread shmtree pinned, the sub's progress thread included), and closing it is
local and frees its mapping at once.  A member's death is seen by the group's own liveness
checks, so every communicator the member belongs to fails and the others go on.

Across nodes (nodes.Spanning), the rounds cross the nodes, and each new communicator's members
on one node form its node-local part, made as above.  One that spans nodes is a SubSpanning
around this node's part: from_mpi's leaders' Link is made by splitting the parent's MPI
communicator (_across_nodes); with a launcher per node (inter=), whose workers have no MPI, the
launchers split theirs and start a proxy per new communicator (_across_proxies,
mailbox.Proxy.split).
"""
from __future__ import annotations

import os
import weakref

import numpy as np

from ..frontend import front as _front
from ..groups import session
from ..codes import ABORT_FAILED, ST_IDLE, ST_LEFT, ranks_text
from .communicator import Communicator
from ..errors import CollectiveMismatchError, ShmtreeError
from ..internode.inter import Link
from ..internode.nodes import Spanning
from ..internode.remote import free_comm, message_comm
from ..groups.subgroup import SubGroup, sub_plan

__all__ = ["make_split", "make_split_by", "level_color", "sub_plan", "SubGroup",
           "SubCommunicator", "SubSpanning", "LEVELS"]

LEVELS = ("socket", "numa", "l3", "node")
_I8_MAX = (1 << 63) - 1

# the three rounds' records (distinct structured dtypes: another collective never matches them)
_ASK = np.dtype([("shmtree_split_color", "<i8"), ("shmtree_split_key", "<i8")])
_OFFER = np.dtype([("shmtree_split_pid", "<i8"), ("shmtree_split_fd", "<i8"),
                   ("shmtree_split_nonce", "V16")])
_DONE = np.dtype([("shmtree_split_ok", "<i8")])


# ---------------------------------------------------------------------------------------------
# the plan and the group of a sub-communicator: subgroup.py (the launchers' proxies map a
# node's part too, mailbox.Proxy.start_relay)


class SubCommunicator(Communicator):
    """A communicator made by split (a Communicator of its own group).  `parent_ranks`: the
    rank in the parent communicator of each rank here; `parent`: the parent's rank."""

    _restores_mask = False              # (never pinned: see the module docstring)

    def __init__(self, group, rank, parent_ranks, local, local_ranks):
        """`local`: the parent's communicator on this node (the parent itself on one machine),
        `local_ranks`: the members' ranks in it."""
        super().__init__(group, rank)
        self.parent_ranks = tuple(parent_ranks)
        # the joined communicator at the root of the splits (a Pool worker's), and the members'
        # ranks in it: whose member states (idle in the pool) the stall detector reads
        if isinstance(local, SubCommunicator):
            self._root = local._root
            self._root_ranks = [local._root_ranks[r] for r in local_ranks]
        else:
            self._root = weakref.ref(local)
            self._root_ranks = list(local_ranks)

    def close(self):
        """Leave (local, not a collective): as Communicator.close, and this process's mapping
        of the group goes at once."""
        if self._closed:
            return
        super().close()
        self.group.close()
        if self._engine is None:        # (else another thread's call still runs on it)
            self._seg = self.group._seg     # (the closed stand-in: the mapping goes now)

    def __del__(self):
        """Collected while open (dropped without close()): what close() does, less every wait
        (a collection runs in whatever thread, inside whatever call): this rank leaves the
        group, so that a peer waiting for it fails at once, and the memory files of its
        messages are closed now (their mappings go with the objects; a message a receiver had
        not mapped yet is lost, as if this process had exited: close() waits for those).  The
        group's own descriptors go with SubGroup.__del__."""
        try:
            if self._closed or self._pid != os.getpid() or self._gen != session._fork_gen:
                return
            self._closed = True
            try:
                self._seg.set_state(self.rank, ST_LEFT)
            except ShmtreeError:
                pass
            tr = self.__dict__.get("_p2p_transport")
            if tr is not None and tr.pid == os.getpid():
                self._p2p_transport = self._p2p_quick = None
                _drop_descriptors(tr)
        except Exception:
            pass

    def __repr__(self):
        return f"<shmtree.Communicator rank={self.rank} size={self.size} (split)>"

    def _absent(self, seq):
        """As Communicator's, with the state a member has in a Pool's group: a member idle in
        the pool (its task done) is idle here too, for the stall detector."""
        absent = super()._absent(seq)
        if not absent:
            return absent
        root = self._root()
        if root is None or root._closed or root.group.closed:
            return absent
        seg = root._seg
        return [(r, ST_IDLE if seg.state(self._root_ranks[r]) == ST_IDLE else st)
                for r, st in absent]


class SubSpanning(Spanning):
    """A sub-communicator across nodes: a Spanning around this node's part (a
    SubCommunicator), the leaders' Link on an MPI communicator split from the parent's; its
    own MPI communicator (`_mpi`, kept for splitting it again) is freed when it closes."""

    _mpi = None

    def close(self):
        if self._closed:
            return
        try:
            super().close()
        finally:
            mpi, self._mpi = self._mpi, None
            if mpi is not None:
                free_comm(mpi)

    def __repr__(self):
        return super().__repr__()[:-1] + " (split)>"


# ---------------------------------------------------------------------------------------------
# split


def _check_color(color):
    if color is None:
        return -1
    if isinstance(color, bool) or not hasattr(color, "__index__") \
            or not 0 <= color.__index__() <= _I8_MAX:
        raise ValueError(f"shmtree: split's color must be an int >= 0 or None, got {color!r}")
    return color.__index__()


def _check_key(key, rank):
    if key is None:
        return rank
    if isinstance(key, bool) or not hasattr(key, "__index__") \
            or not -_I8_MAX - 1 <= key.__index__() <= _I8_MAX:
        raise ValueError(f"shmtree: split's key must be an int (64 bits) or None, got {key!r}")
    return key.__index__()


def _where(comm):
    """(node of each rank, its rank in its node's group, this node's communicator)."""
    local = getattr(comm, "local", None)
    if local is None:                   # one machine's communicator
        return [0] * comm.size, list(range(comm.size)), comm
    nodes, ranks = [0] * comm.size, [0] * comm.size
    for g, (n, r) in comm._where.items():
        nodes[g], ranks[g] = n, r
    return nodes, ranks, local


def make_split(comm, color, key=None):
    """comm.split(color, key) (front.Front.split): see the module docstring."""
    color = _check_color(color)
    key = _check_key(key, comm.rank)
    ask = np.zeros(1, _ASK)
    ask["shmtree_split_color"], ask["shmtree_split_key"] = color, key
    table = _round(comm, ask)
    colors, keys = table["shmtree_split_color"].tolist(), table["shmtree_split_key"].tolist()
    groups = {}
    for r, c in enumerate(colors):
        if c >= 0:
            groups.setdefault(c, []).append(r)
    for c in groups:
        groups[c].sort(key=lambda r: (keys[r], r))
    nodes, local_ranks, local = _where(comm)
    spanning = sorted(c for c, m in groups.items() if len({nodes[r] for r in m}) > 1)
    # the node-local part of each new communicator: its members on this rank's node
    members = [r for r in groups[color] if nodes[r] == nodes[comm.rank]] if color >= 0 \
        else None
    me = members.index(comm.rank) if members is not None else -1
    group = sub = None
    err = None
    offer = np.zeros(1, _OFFER)
    try:
        try:
            if members is not None:
                plan = sub_plan(local.group.plan, [local_ranks[r] for r in members])
            if me == 0:
                group = SubGroup.create(plan)
                offer["shmtree_split_pid"], offer["shmtree_split_fd"] = os.getpid(), group._fd
                offer["shmtree_split_nonce"] = np.void(group._nonce)
        except Exception as exc:
            err = exc
        offers = _round(comm, offer)
        try:
            if err is None and members is not None:
                if me != 0:
                    o = offers[members[0]]
                    if int(o["shmtree_split_pid"]) == 0:
                        raise ShmtreeError(f"the leader, rank {members[0]}, could not make the "
                                           "segment")
                    group = SubGroup.attach(plan, int(o["shmtree_split_pid"]),
                                            int(o["shmtree_split_fd"]),
                                            bytes(o["shmtree_split_nonce"]))
                rank = group._admit(me)
                sub = SubCommunicator(group, rank, members, local,
                                      [local_ranks[r] for r in members])
                group._comm = weakref.ref(sub)
                if me != 0:
                    group.release_descriptor()      # (the leader's stays until round 3)
        except Exception as exc:
            err = exc
        done = np.zeros(1, _DONE)
        done["shmtree_split_ok"] = 0 if err is None else 1
        oks = _round(comm, done)["shmtree_split_ok"].tolist()
    except BaseException as exc:
        _discard(sub, group)
        if not isinstance(exc, Exception):      # (an interrupt between the rounds: the others
            local.group.abort(ABORT_FAILED, local.rank,    # would wait for this rank forever)
                              note=f"interrupted inside split: {type(exc).__name__}")
        raise
    if spanning:                        # (every rank takes part in MPI's splits)
        try:                            # (the leaders' descriptors: the launchers map the
            if getattr(comm, "_mpi", None) is not None:     # parts, _across_proxies)
                sub = _across_nodes(comm, sub, color, groups, nodes, spanning, oks)
            else:
                sub = _across_proxies(comm, sub, color, groups, nodes, spanning, oks,
                                      offers, local_ranks)
        finally:
            if group is not None and not group.closed:
                group.release_descriptor()
    elif group is not None:
        group.release_descriptor()
    if members is None:
        return None
    failed = [r for r in groups[color] if oks[r]]
    if failed:
        _discard(sub, group)
        text = (f"shmtree: split: the sub-communicator of color {color} could not be made: "
                f"{ranks_text(failed)} failed")
        if err is not None:
            raise ShmtreeError(f"{text} (here: {type(err).__name__}: "
                               f"{str(err).removeprefix('shmtree: ')})") from err
        raise ShmtreeError(text)
    return sub


def _across_nodes(comm, part, color, groups, nodes, spanning, oks):
    """The communicators that span nodes (from_mpi's): around each node-local part (`part`,
    this rank's), a Spanning whose leaders' Link is made by splitting comm's MPI communicator
    (collective over it: every rank of comm, in the same order).  The new one's own MPI
    communicator (its ranks in its order) is kept for splitting it again."""
    from mpi4py import MPI
    mine = groups[color] if color >= 0 and color in spanning else None
    if mine is not None and any(oks[r] for r in mine):
        mine = None                     # (it failed: its members raise, after the splits)
    sub_mpi = comm._mpi.Split(spanning.index(color) if mine is not None else MPI.UNDEFINED,
                              key=mine.index(comm.rank) if mine is not None else 0)
    if mine is None:
        if sub_mpi != MPI.COMM_NULL:
            sub_mpi.Free()
        return part
    order = list(dict.fromkeys(nodes[r] for r in mine))     # nodes by their smallest new rank
    node = order.index(nodes[comm.rank])
    members = [[k for k, r in enumerate(mine) if nodes[r] == n] for n in order]
    try:
        leaders = sub_mpi.Split(0 if part.rank == 0 else MPI.UNDEFINED, key=node)
        link = Link(leaders, part.group) if part.rank == 0 else None
    except BaseException:
        _discard(part, None)
        sub_mpi.Free()
        raise
    span = SubSpanning(part, link, mine.index(comm.rank), members, node, comm._segment)
    span._mpi = sub_mpi
    span._p2p_mpi = message_comm(sub_mpi)           # (messages between nodes: remote.py)
    span.parent_ranks = tuple(mine)
    return span


def _across_proxies(comm, part, color, groups, nodes, spanning, oks, offers, local_ranks):
    """The communicators that span nodes with a launcher per node (inter=: the workers have no
    MPI): the leader of each node asks its launcher (one SPLIT step through its mailbox,
    mailbox.Proxy.split) for a proxy per new communicator with members on this node, made on
    a Split of the launchers' communicator; the answers, (launcher pid, mailbox descriptor) per
    new communicator, reach the node's ranks in a broadcast of the node's communicator; the
    new communicator's leader on this node maps its mailbox (its ProxyLink closes the proxy
    when the communicator closes).  Each proxy relays its communicator's messages between
    nodes (mailbox.Proxy.start_relay: the launcher maps this node's part, whose leader still
    holds its segment's descriptor here), the launcher's pid known to the part's members."""
    from ..internode.mailbox import Mailbox, Proxy, split_record
    from ..internode.proxylink import ProxyLink
    here = nodes[comm.rank]
    keys, extra = [], []
    for c in spanning:
        m = groups[c]
        order = list(dict.fromkeys(nodes[r] for r in m))
        key = order.index(here) if here in order and not any(oks[r] for r in m) else -1
        keys.append(key)
        if key < 0:
            extra += split_record(0, -1, bytes(16), [], [])
            continue
        mine = [r for r in m if nodes[r] == here]
        o = offers[mine[0]]
        extra += split_record(int(o["shmtree_split_pid"]), int(o["shmtree_split_fd"]),
                              bytes(o["shmtree_split_nonce"]),
                              [order.index(nodes[r]) for r in m], [local_ranks[r] for r in mine])
    local = comm.local
    answer = np.zeros((len(spanning) + 1, 2), np.int64)     # (last row: ok)
    if local.rank == 0:
        try:
            answer[:-1] = comm._link.run(Proxy.split, keys, extra)
        except Exception as exc:
            answer[-1] = -1
            err = exc
    answer = local.broadcast(answer, root=0) if local.size > 1 else answer
    if answer[-1, 0] < 0:
        _discard(part, None)
        if local.rank == 0:
            raise err
        raise ShmtreeError("shmtree: split: this node's launcher could not make the proxies of "
                           "the new communicators across nodes (its leader raised)")
    if color < 0 or color not in spanning or keys[spanning.index(color)] < 0:
        return part
    mine = groups[color]
    order = list(dict.fromkeys(nodes[r] for r in mine))
    members = [[k for k, r in enumerate(mine) if nodes[r] == n] for n in order]
    link = None
    pid, fd = answer[spanning.index(color)].tolist()
    part.group._relay_pid = pid         # (its relay: remote.SpanningMessages, messages.py)
    if part.rank == 0:
        try:
            link = ProxyLink(Mailbox.open(pid, fd, comm._segment), owned=True)
        except BaseException:
            _discard(part, None)
            raise
    span = SubSpanning(part, link, mine.index(comm.rank), members, order.index(here),
                       comm._segment)
    span.parent_ranks = tuple(mine)
    span._p2p_relay = True              # (messages between nodes: through the launcher)
    return span


def _round(comm, record):
    """One allgather of the split's agreement over `comm`; a mismatch says it was a split."""
    try:
        return comm.allgather(record)[:, 0]
    except CollectiveMismatchError as exc:
        raise CollectiveMismatchError(
            f"shmtree: split (a collective over the parent communicator, agreed through "
            f"allgathers of records of dtype {record.dtype.names[0]!r}...): "
            f"{str(exc).removeprefix('shmtree: ')}") from None


def _drop_descriptors(tr):
    """The memory files a messages.Transport holds (its channels out, its home), closed without
    waiting for anyone (SubCommunicator.__del__; Transport.close is the waiting one)."""
    for fd, _, _ in list(tr.out.values()):
        try:
            os.close(fd)
        except OSError:
            pass
    tr.out.clear()
    fd, tr.home_fd = tr.home_fd, None
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def _discard(sub, group):
    for thing in (sub, group):
        if thing is not None:
            try:
                thing.close()
            except Exception:
                pass


# ---------------------------------------------------------------------------------------------
# split_by


def level_color(comm, level):
    """This rank's color for split_by(level): the socket, NUMA node or L3 group of its slot in
    the plan (a rank the plan does not pin, whose CPU mask lies within one such group of a
    detected machine, takes that group), or its node; a color unique to its node across
    nodes."""
    if level not in LEVELS:
        raise ValueError(f"shmtree: split_by's level must be one of {LEVELS}, got {level!r}")
    nodes, local_ranks, local = _where(comm)
    node = nodes[comm.rank]
    if level == "node":
        return node
    plan = local.group.plan
    r = local.rank
    slot = plan.topology.placement(plan.size, plan.placement)[r]
    value = getattr(slot, level)
    if not (plan.pin and plan.cpu_of[r] is not None) and not plan.topology.synthetic:
        mask = os.sched_getaffinity(0)
        values = {getattr(s, level) for s in plan.topology.slots if s.cpu in mask}
        if len(values) == 1:
            value = values.pop()
    return (node << 32) | value


def make_split_by(comm, level):
    return make_split(comm, level_color(comm, level), comm.rank)


_front._made_by(make_split, make_split_by)
