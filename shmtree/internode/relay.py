"""inter=: the launcher of each node relays its workers' messages between nodes (Relay), over
the launchers' MPI communicator (remote.py: the workers' side, Remote)."""
from __future__ import annotations

import collections
import os
import threading
import time

import numpy as np

from ..codes import ABORT_FAILED
from ..p2p.messages import Transport
from ..p2p.records import ANY_TAG, _ENVELOPE, _G, _Recv, _Send, _flat, _header, _parse
from .remote import (CHUNK_BYTES, IDLE_S, IDLE_SLEEP_S, SLEEP_S, SPIN_S, TAG_DATA, TAG_HEAD,
                     TAG_ROUTE, _KEPT, free_comm)

__all__ = ["Relay"]


class _Ranks:
    """What a Transport needs of a communicator, for the launcher's rank in its node's messages:
    the rank after the node's members (they reach it as the rank of that number)."""

    def __init__(self, group):
        self.group = group
        self.size = group.size + 1
        self.rank = group.size
        self._closed = False

    def _p2p_nonce(self):
        return self.group._nonce

    def _p2p_pid(self, r):
        if r == self.rank:
            return os.getpid()
        joined, pid, _ = self.group._seg.member(r)
        return pid if joined else 0


class Relay:
    """A launcher's relay of its workers' messages to ranks of other nodes (inter=; started by
    multinode.start_proxy, and for a sub-communicator across nodes by its child proxy,
    mailbox.Proxy.start_relay: `group` is then this node's part of it, mapped by the launcher,
    and `members` its ranks on each node).  A worker sends such a message to the launcher (the
    rank after its node's members) through the node's transport, the destination folded into
    the tag (tag * size + destination: SpanningMessages._p2p_route); the launcher receives any
    tag from every worker, in order, and sends it over MPI (`comm`, a Dup of the launchers'
    communicator) to the destination's launcher: a route (source, destination, tag), the
    record header and the payload, as Remote does.  That launcher sends it on to the
    destination through its node's transport, the source folded into the tag, so the
    receiver's matching (per source and tag, in order), out=, kept messages and Requests are
    the local ones.  Failures travel as for collectives: a worker that fails aborts its node's
    group, which the launcher's proxy carries to every node."""

    def __init__(self, group, comm, members, peers=None, tags=0, owned=True):
        """members: the ranks of the communicator on each node (node = rank in `comm`; or, for
        a child proxy's relay on the communicator of its family, mailbox.Family: node j is
        rank peers[j], its messages' tags are offset by `tags`, and it does not free `comm`,
        `owned` False)."""
        from mpi4py import MPI
        self.MPI = MPI
        self.group = group
        self.comm = comm
        self.owned = owned
        self.tag_route, self.tag_head, self.tag_data = (tags + TAG_ROUTE, tags + TAG_HEAD,
                                                        tags + TAG_DATA)
        self.peers = list(range(comm.Get_size())) if peers is None else [int(p) for p in peers]
        self.node_of = {p: j for j, p in enumerate(self.peers)}
        self.node = self.node_of[comm.Get_rank()]
        self.members = [[int(g) for g in m] for m in members]
        self.where = {g: (n, i) for n, m in enumerate(self.members) for i, g in enumerate(m)}
        self.size = len(self.where)
        self.tr = Transport(_Ranks(group))
        self.tr.relay = True
        self.tr.stall_timeout = None
        self.status = MPI.Status()
        self.posted = {}              # worker -> its receive of any tag
        self.left = set()             # workers that left (their receive failed): never again
        self.next_look = 0.0          # when to look for channels of workers not seen yet
        self.sent = []                # (MPI requests, what they send)
        self.arriving = {}            # source node -> its messages being received, in order
        self.stop = False
        self.thread = threading.Thread(target=self._loop, name="shmtree-relay", daemon=True)
        self.thread.start()

    def _loop(self):
        tr, group, idle_since = self.tr, self.group, time.monotonic()
        while not self.stop:
            if group.closed or group.aborted():
                time.sleep(0.01)
                continue
            moved = False
            try:
                with tr.lock:
                    look = time.monotonic() >= self.next_look
                    if look:                   # (a channel is looked up in /proc at most
                        self.next_look = time.monotonic() + 0.05      # every 50 ms)
                    for a in range(group.size):
                        if a not in self.posted and a not in self.left and \
                                (a in tr.inn or look and tr._in_ring(a) is not None):
                            op = self.posted[a] = _Recv(a, ANY_TAG, None, None)
                            tr.post_recv(op)
                    moved = tr.progress()
                    got = [(a, op) for a, op in self.posted.items() if op.done]
                    for a, _ in got:
                        del self.posted[a]
                for a, op in got:
                    if op.error is None:
                        self._forward(a, op.tag, op.result)
                    else:                  # (it left: a receive posted again would fail at
                        self.left.add(a)   # once, again and again, and keep this thread busy)
                moved = self._receive() or moved or bool(got)
                self.sent = [s for s in self.sent if not self.MPI.Request.Testall(s[0])]
            except Exception as exc:       # (the node fails: its proxy tells the others)
                if not group.closed and not group.aborted():
                    group.abort(ABORT_FAILED, -1, note=f"the launcher's relay of messages "
                                f"between nodes failed: {type(exc).__name__}: {exc}")
                continue
            now = time.monotonic()
            if moved:
                idle_since = now
            if now - idle_since < SPIN_S:
                os.sched_yield()
            else:                        # (idle for long: a launcher's CPU is its workers')
                time.sleep(SLEEP_S if now - idle_since < IDLE_S else IDLE_SLEEP_S)

    def _forward(self, a, tag, array):
        """A worker's message for a rank of another node: over MPI to that node's launcher."""
        MPI = self.MPI
        g, t = tag % self.size, tag // self.size
        to = self.peers[self.where[g][0]]
        route = np.array([self.members[self.node][a], g, t], np.int64)
        nbytes = array.nbytes
        head = np.frombuffer(_header(array.dtype, array.shape, t, nbytes), np.uint8)
        flat = _flat(np.ascontiguousarray(array)) if nbytes else None
        reqs = [self.comm.Isend([route, MPI.BYTE], to, self.tag_route),
                self.comm.Isend([head, MPI.BYTE], to, self.tag_head)]
        for at in range(0, nbytes, CHUNK_BYTES):
            reqs.append(self.comm.Isend([flat[at:at + CHUNK_BYTES], MPI.BYTE], to,
                                        self.tag_data))
        self.sent.append((reqs, (route, head, flat)))

    def _receive(self):
        """Messages from other launchers for this node's workers: on to them.  Nothing here
        waits on MPI (a launcher thread blocked in MPI holds up the launcher's other relays
        and links, and with them other nodes): a source's messages are taken in the order
        sent, each its route, its header once it has come, then its payload's receives
        posted (MPI keeps a source's messages of one tag in order, so each lands where its
        header said), and handed to the workers in that order once complete."""
        MPI, comm, status, moved = self.MPI, self.comm, self.status, False
        while True:
            msg = comm.Improbe(MPI.ANY_SOURCE, self.tag_route, status)
            if msg is None:
                break
            route = np.empty(3, np.int64)
            msg.Recv([route, MPI.BYTE])
            self.arriving.setdefault(self.node_of[status.Get_source()],
                                     collections.deque()).append(
                [route, None, None])           # (route, the array, its payload's receives)
            moved = True
        for src_node, queue in self.arriving.items():
            for entry in queue:
                if entry[1] is not None:
                    continue
                msg = comm.Improbe(self.peers[src_node], self.tag_head, status)
                if msg is None:                # (the next header has not come yet)
                    break
                head = bytearray(status.Get_count(MPI.BYTE))
                msg.Recv([head, MPI.BYTE])
                _, tag, nbytes, meta_len = _ENVELOPE.unpack_from(head)[:4]
                dtype, shape = _parse(bytes(head[_G:_G + meta_len]))
                array = entry[1] = np.empty(shape, dtype)
                flat = _flat(array) if nbytes else None
                entry[2] = [comm.Irecv([flat[at:at + CHUNK_BYTES], MPI.BYTE],
                                       self.peers[src_node], self.tag_data)
                            for at in range(0, nbytes, CHUNK_BYTES)]
                moved = True
            while queue and queue[0][2] is not None and MPI.Request.Testall(queue[0][2]):
                route, array, _ = queue.popleft()
                src, g, t = route.tolist()
                with self.tr.lock:
                    self.tr.post_send(_Send(self.where[g][1], t * self.size + src, None,
                                            array, False))
                moved = True
        return moved

    def close(self):
        """(The launcher's group closes.)  Stop relaying; the launcher's transport closes (its
        messages still unread by workers that live wait for them, as a closing rank's do).
        True when MPI still holds requests of it (they and `comm` are kept, never freed)."""
        self.stop = True
        if self.thread is not threading.current_thread():
            self.thread.join(10)
        try:
            self.tr.close()
        except Exception:
            pass
        arriving = [e for q in self.arriving.values() for e in q if e[2]]
        kept = bool(self.sent or arriving)
        if kept:
            _KEPT.append((self.comm, self.sent, arriving))
        elif self.owned:
            free_comm(self.comm)
        return kept

