"""Forming communicators across nodes (docs/design.md, "Across nodes (MPI)"): nodes.Spanning
made from an MPI job (from_mpi), or from a launcher per node (Group(size, inter=mpi_comm), run
and Pool with inter=: NodeGroup, start_proxy, spanning_member).

from_mpi: the processes of an MPI job that share a node form a shmtree group of their own (one
creates the segment, the others attach through a rendezvous token: same user only), local rank
0 of each node is its leader and owns the inter-node Link (shmtree.internode.inter), and the
communicator returned spans every node.  With a launcher per node, the leader's link is a
ProxyLink to its launcher (shmtree.internode.proxylink) instead of MPI in the leader itself.
"""
from __future__ import annotations

import atexit
import os

import numpy as np

from . import nodes as _nodes
from ..groups import session
from ..machine import plan as _plan
from ..errors import ShmtreeError
from ..groups.group import Group
from .inter import Link
from .remote import message_comm

__all__ = ["from_mpi", "NodeGroup", "start_proxy", "refuse_proxy", "spanning_member"]


class NodeGroup(Group, across_nodes=True):
    """What Group(size, inter=mpi_comm, segment_bytes=None, ...) makes (group.py dispatches to
    it): the group of one node of several, in that node's launcher, which is the node's proxy
    between the nodes (shmtree.internode.mailbox).  Collective over `inter` (the launchers' mpi4py
    communicator): the launchers agree that every one of them could start before any step, so
    one that cannot (a bad option, no memory) raises its error and the others a ShmtreeError
    naming its node (start_proxy, refuse_proxy).  Its members (workers it hands the group to)
    get a plain Group that knows its node's place; joining one gives a Spanning."""

    def __init__(self, size, *, inter, segment_bytes=None, **options):
        try:
            super().__init__(size, **options)
        except Exception as exc:        # the other launchers wait to agree with this one:
            refuse_proxy(inter, exc)    # they raise too, naming this node
            raise
        try:
            self._span, self._proxy = start_proxy(self, inter, segment_bytes)
        except BaseException:
            self.close()
            raise


def start_proxy(group, inter, segment_bytes):
    """In a launcher creating its node's group: agree with the other launchers (collective over
    `inter`) and start the proxy.  (span, proxy) for the group; (None, None) with one node.
    Whether every launcher could start is agreed before any step of all of them: one that
    cannot (bad option, no memory for its mailbox) raises its error, the others a ShmtreeError
    naming it, none waits for it in MPI."""
    from mpi4py import MPI
    from .mailbox import Mailbox, Proxy
    segment, box, err = None, None, None
    try:
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise ShmtreeError("shmtree: inter= needs MPI initialised with "
                               "MPI_THREAD_MULTIPLE (the proxy runs MPI on a thread of its "
                               "own); leave mpi4py.rc.thread_level at its default, 'multiple'")
        segment = _nodes.SEGMENT_BYTES if segment_bytes is None else int(segment_bytes)
        if segment < 4096:
            raise ValueError(f"shmtree: segment_bytes must be at least 4096, got "
                             f"{segment_bytes!r}")
        if inter.Get_size() > 1:
            box = Mailbox.create(segment)
    except Exception as exc:
        err = exc
    info = _agree_start(inter, group.size, segment, err)
    failed = [(n, e) for n, (_, _, e) in enumerate(info) if e is not None]
    if failed and box is not None:
        os.close(box[1])
    if err is not None:
        raise err
    if failed:
        raise ShmtreeError("shmtree: the launcher" + ("s" if len(failed) > 1 else "") +
                           " of " + "; ".join(f"node {n} could not start its group: {e}"
                                              for n, e in failed))
    if len({g for _, g, _ in info}) > 1:
        raise ValueError(f"shmtree: the launchers passed different segment_bytes: "
                         f"{[g for _, g, _ in info]}")
    if len(info) == 1:
        return None, None
    proxy = Proxy(group, inter, segment, box)
    from .relay import Relay  # (messages between nodes: the launcher relays them)
    starts = np.concatenate([[0], np.cumsum([s for s, _, _ in info])]).tolist()
    proxy.relay = Relay(group, inter.Dup(), [range(starts[n], starts[n + 1])
                                             for n in range(len(info))])
    proxy.box.put_u64(16, os.getpid())     # (where the workers find the relay)
    return (inter.Get_rank(), [s for s, _, _ in info], segment, proxy.fd), proxy


def _agree_start(inter, size, segment, err):
    """The launchers' one agreement before any step (collective over `inter`): by node, its
    group size, segment bytes and its error's text (None: it could start)."""
    return inter.allgather((size, segment,
                            None if err is None else f"{type(err).__name__}: {err}"))


def refuse_proxy(inter, err):
    """In a launcher whose group could not even be made (a bad option, no memory): take part in
    start_proxy's agreement with its error, so that the other launchers raise naming this node
    instead of waiting for it in MPI."""
    _agree_start(inter, 0, 0, err)


def spanning_member(group, comm):
    """Joining a group of a node of several (joining.join): the communicator across nodes
    around the node's own (`comm`); local rank 0 reaches the other nodes through its
    launcher."""
    from .mailbox import Mailbox
    from .proxylink import ProxyLink
    node, sizes, segment, box_fd = group._span
    starts = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    members = [list(range(starts[n], starts[n + 1])) for n in range(len(sizes))]
    link = ProxyLink(Mailbox(box_fd, segment)) if comm.rank == 0 else None
    span = _nodes.Spanning(comm, link, starts[node] + comm.rank, members, node, segment)
    span._p2p_relay = True            # (messages between nodes: through the launcher, Relay)
    return span


# ---------------------------------------------------------------------------------------------
# forming the communicator from an MPI job


def _host_ranks(mpi_comm, node_comm, node_size, rank, MPI):
    """How many processes of mpi_comm share this machine (collective over mpi_comm when
    node_size simulates nodes: then a node is not the machine)."""
    if node_size is None:
        return node_comm.Get_size()
    host = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    try:
        return host.Get_size()
    finally:
        host.Free()


def from_mpi(mpi_comm, *, node_size=None, segment_bytes=None, **group_options):
    """A communicator spanning the processes of `mpi_comm` (mpi4py), one shmtree group per node.

    Collective over mpi_comm.  Processes that share a node (MPI's COMM_TYPE_SHARED split; with
    `node_size=k`, consecutive blocks of k ranks instead, to simulate nodes on one machine)
    form a group through a rendezvous: the node's first process creates the segment, the others
    attach (same user only).  comm.rank == mpi_comm.rank.  group_options are Group's (pin
    defaults to False here: the MPI launcher places the processes; spin_us to 0 when the
    machine has more of mpi_comm's processes than cores, as a group of that many would)."""
    from mpi4py import MPI
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise ShmtreeError("shmtree.from_mpi: MPI was initialised without MPI_THREAD_MULTIPLE "
                           "(the inter-node step runs on a thread of its own); leave "
                           "mpi4py.rc.thread_level at its default, 'multiple'")
    rank = mpi_comm.Get_rank()
    if node_size is None:
        node_comm = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    else:
        if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1:
            raise ValueError(f"shmtree.from_mpi: node_size must be a positive int, got "
                             f"{node_size!r}")
        node_comm = mpi_comm.Split(rank // node_size, key=rank)
    try:
        node_rank, nsize = node_comm.Get_rank(), node_comm.Get_size()
        first = node_comm.allreduce(rank, op=MPI.MIN)
        everyone = mpi_comm.allgather((first, node_rank))
        firsts = sorted({f for f, _ in everyone})
        members = [[] for _ in firsts]
        for g, (f, r) in enumerate(everyone):
            members[firsts.index(f)].append((r, g))
        members = [[g for _, g in sorted(m)] for m in members]
        node = firsts.index(first)
        options = dict(group_options)
        options.setdefault("pin", False)
        if _host_ranks(mpi_comm, node_comm, node_size, rank, MPI) > _plan.usable_count():
            options.setdefault("spin_us", 0)      # (more processes than cores on this machine,
                                                  # however many a node's group has: a rank
        token, err, group, local = None, None, None, None    # that spins keeps a peer out)
        if node_rank == 0:
            try:
                group = _nodes.Group(nsize, **options)
                token = group.rendezvous_token()
            except Exception as exc:
                err = f"rank {rank}: {type(exc).__name__}: {exc}"
        token, err = node_comm.bcast((token, err), root=0)
        if err is None:
            try:
                if node_rank != 0:
                    group = _nodes.Group.from_token(token)
                local = group.join(node_rank)
            except Exception as exc:
                err = f"rank {rank}: {type(exc).__name__}: {exc}"
        # success is agreed over the whole communicator before any step of all of it: a node
        # that could not form its group makes every rank of every node raise, none waits
        every = mpi_comm.allgather(err)
        failed = sorted({g for g, e in enumerate(every) if e is not None})
        if failed:
            if local is not None:
                local.close()
            if group is not None:
                group.close()
            bad = sorted({firsts.index(everyone[g][0]) for g in failed})
            texts = "; ".join(dict.fromkeys(e for e in every if e is not None))
            raise ShmtreeError(
                f"shmtree.from_mpi: the processes of node{'s' if len(bad) > 1 else ''} "
                f"{','.join(map(str, bad))} could not form a group: {texts}")
        node_comm.Barrier()            # every member attached before the creator goes on
    finally:
        node_comm.Free()
    link = lane = None
    if len({len(m) for m in members}) == 1 and len(members) > 1 and nsize > 1:
        # nodes of one size: every rank links to its local rank's peers on the other nodes
        # (a lane); lane 0 joins the leaders
        lane = Link(mpi_comm.Split(node_rank, key=node), group)
        link = lane if node_rank == 0 else None
    else:
        leaders = mpi_comm.Split(0 if node_rank == 0 else MPI.UNDEFINED, key=node)
        if node_rank == 0 and len(members) > 1:
            link = Link(leaders, group)
        elif leaders != MPI.COMM_NULL:
            leaders.Free()
    segment = _nodes.SEGMENT_BYTES if segment_bytes is None else segment_bytes
    comm = _nodes.Spanning(local, link, rank, members, node, segment, lane=lane)
    if len(members) > 1:
        comm._p2p_mpi = message_comm(mpi_comm)      # (messages between nodes: remote.py)
    comm._mpi = mpi_comm          # (split: new communicators that span nodes split it, subcomm)
    session._set_current(comm)
    return comm


@atexit.register
def _close_all():
    """Before mpi4py finalizes MPI (its atexit hook was registered before this one): stop every
    link thread."""
    for comm in list(_nodes._ALIVE):
        try:
            comm.close()
        except Exception:
            pass

