"""Point-to-point messages across nodes (docs/design.md, "How messages travel"): the calls of a
communicator that spans nodes (SpanningMessages, a mixin of nodes.Spanning) and the transport
between nodes (Remote).

Routing.  Each call is Messages' (messages.py: one description of its arguments and checks);
only the transport differs, chosen per peer (_p2p_route): a peer on this node is reached through
the node's own communicator (its local rank), as on one machine; a peer on another node through
Remote, over MPI, or with a launcher per node (inter=) through the node's own transport to the
launcher, which relays it (Relay, at the end).  A sendrecv whose two peers are reached by
different transports posts its receive first (an irecv), then sends.

Remote.  Made on first use from the communicator's message communicator (message_comm: a Dup of
the MPI communicator of a from_mpi communicator or of a sub-communicator across nodes, made
when it is formed, so that messages never mix with the collectives' traffic nor the program's
own; its ranks are the communicator's).  A message is an envelope, the same record header as on
one machine (tag, byte count, the description of dtype and shape: p2p.records._header), sent with
MPI tag TAG_HEAD, then its payload as bytes (pieces of at most CHUNK_BYTES: no int count
overflows) with TAG_DATA.  The receiver takes a sender's envelopes in order (Improbe, while a
receive from that sender is posted), matches each to its first posted receive with the same tag
or keeps it (a private copy), and posts the payload's receives at once, in envelope order: MPI
does not let messages of one sender and tag overtake each other, so each payload lands where its
envelope said.  A blocking call polls its MPI requests (Test) in the caller's thread, isend and
irecv on a message thread of their own, yielding the CPU between polls and sleeping briefly once
nothing has moved for a while.

Failure.  Between polls (every SLICE_S) a waiting call looks at the node's group (aborted: a
failure somewhere), the node's links, its deadline, and a control message (TAG_CTRL, this
communicator's epoch, then a text): a rank whose call times out or breaks aborts its node's
group and its links, and sends a control message to every rank, so that a peer on another node
waiting for it raises PeerLostError instead of hanging.  MPI requests left posted by a failure
are kept, with their buffers, for the life of the process (as inter.Link does).

Any source, any tag.  A receive of ANY_TAG from a named rank works as on one machine, within a
node and between nodes (Remote shares the matching).  A receive from ANY_SOURCE on a
communicator across nodes raises NotImplementedError: its messages come through two
transports (the node's and MPI's, or the launcher's relay), whose posting orders cannot be
merged; receive from each rank by name (or probe them in turn with irecv), or use a node's own
communicator.  ANY_TAG through a launcher's relay (inter=) is refused likewise: its tags fold
the destination in.
"""
from __future__ import annotations

import os
import threading
import time

import numpy as np

from ..codes import ABORT_FAILED, ABORT_TIMEOUT
from ..errors import CollectiveTimeoutError, PeerLostError, ShmtreeError
from ..p2p.matching import _Matching
from ..p2p.methods import Messages, _rank_arg, _tag_arg
from ..p2p.records import (ANY_SOURCE, ANY_TAG, _DISCARD, _ENVELOPE, _G, _MAGIC, _broken_text,
                           _flat, _parse)

__all__ = ["SpanningMessages", "Remote", "message_comm", "free_comm"]

TAG_HEAD, TAG_DATA, TAG_CTRL, TAG_ROUTE = 1, 2, 3, 4
CHUNK_BYTES = 1 << 30       # a payload's MPI messages (bytes, an int count each)
CTRL_BYTES = 512
EPOCH_BYTES = 8
SPIN_S = 0.002              # a waiting call yields between polls this long after anything
                            # moved (or was posted), then sleeps SLEEP_S between polls
SLEEP_S = 0.0005
IDLE_S, IDLE_SLEEP_S = 0.1, 0.005     # the launcher's relay, idle this long, sleeps longer
CLOSE_WAIT_S = 30.0         # close: how long outstanding isends have to complete

_TAG_LIMIT = 1 << 63
_KEPT = []                  # (communicator, requests, buffers) of transports that failed


def message_comm(mpi):
    """(Collective over the mpi4py communicator `mpi`.)  What carries the messages between
    nodes of a communicator whose ranks are mpi's: a Dup of it, and an epoch (the same random
    bytes on every rank) that its control messages carry.  (The Dup is made of a plain
    Intracomm on mpi's handle: mpi4py's Dup makes an object of mpi's own class, which a
    subclass of the caller's may not allow.)"""
    from mpi4py import MPI
    dup = MPI.Intracomm(mpi).Dup()
    try:
        epoch = bytes(dup.bcast(os.urandom(EPOCH_BYTES) if dup.Get_rank() == 0 else None,
                                root=0))
    except BaseException:
        dup.Free()
        raise
    return dup, epoch


class SpanningMessages(Messages):
    """Messages on a communicator across nodes (nodes.Spanning): Messages' calls, each peer
    reached through the node's communicator (same node) or, on another node, Remote (from_mpi's
    communicators and their sub-communicators) or the launcher's Relay (inter='s communicator,
    and each of its sub-communicators across nodes: a Relay of its own, mailbox.Proxy.
    start_relay)."""

    _p2p_mpi = None              # (mpi4py communicator, epoch): message_comm's
    _p2p_remote = None
    _posted = 0

    _p2p_relay = False           # inter=: the node's launcher relays between nodes (Relay)

    def _p2p_route(self, r, what, tag, tag_what="tag"):
        self._check_open()
        r = _rank_arg(self, r, what, any_ok=what == "source")
        if r == ANY_SOURCE:
            raise NotImplementedError(
                f"shmtree: recv from ANY_SOURCE is not supported on a communicator across "
                f"nodes (rank {self.rank} of {self.size}, on node {self.node}): its messages "
                "come through the node's transport and MPI's, whose posting orders cannot be "
                "merged; receive from each rank by name (irecv from each, then wait for the "
                "first: concurrent.futures.wait(..., return_when=FIRST_COMPLETED)), or use "
                "the node's own communicator")
        node, local = self._where[r]
        if node == self.node:
            return self.local._p2p(), local, tag
        if self._p2p_relay:          # to or from the launcher (the rank after the node's
            tag = _tag_arg(tag, tag_what, any_ok=what == "source")   # members), r folded in
            if tag == ANY_TAG:
                raise NotImplementedError(
                    f"shmtree: recv of ANY_TAG from rank {r} of another node is not supported "
                    f"with a launcher per node (inter=): its relay folds the destination into "
                    f"the tag; receive each tag by name")
            if tag >= _TAG_LIMIT // self.size:
                raise ValueError(f"shmtree: {tag_what} {tag} is too large for a message "
                                 f"between nodes with a launcher per node (inter=): at most "
                                 f"{_TAG_LIMIT // self.size - 1} with {self.size} ranks")
            tr = self.local._p2p()
            tr.relayed = self.size
            return tr, self.local.size, tag * self.size + r
        tr = self._p2p_remote
        if tr is None:
            if self._p2p_mpi is None:
                raise ShmtreeError(
                    f"shmtree: point-to-point messages between nodes of this communicator are "
                    f"not supported: rank {self.rank} (node {self.node}) and rank {r} (node "
                    f"{node}): it has neither a message communicator (from_mpi) nor a "
                    "launcher's relay (inter=)")
            tr = self._p2p_remote = Remote(self)
        return tr, r, tag

    def _messages_close(self):
        tr, self._p2p_remote = self._p2p_remote, None
        try:
            if tr is not None:
                tr.close()
        finally:
            mpi, self._p2p_mpi = self._p2p_mpi, None
            if mpi is not None and (tr is None or tr.comm_free):
                free_comm(mpi[0])


def free_comm(comm):
    """Free an mpi4py communicator of shmtree's own (unless MPI is finalized already)."""
    try:
        from mpi4py import MPI
        if not MPI.Is_finalized():
            comm.Free()
    except Exception:
        pass


class _NoQuick:
    """Remote's quick paths (p2p.methods.Messages tries them first): none, every message goes
    the general way."""

    @staticmethod
    def send(array, dest, tag):
        return False

    @staticmethod
    def recv(source, tag, out, deadline):
        return None


class Remote(_Matching):
    """The transport of a communicator's messages between nodes (see the module docstring);
    ranks are the communicator's (its message communicator's)."""

    THREAD = "shmtree-messages-mpi-rank{}"
    cma = False
    quick = _NoQuick()

    def __init__(self, span):
        from mpi4py import MPI
        self.MPI = MPI
        self.span = span
        self.group = span.group
        self.comm, self.epoch = span._p2p_mpi
        self.rank = span.rank
        self.lock = threading.Lock()
        self.closed = False
        self.comm_free = True        # close may free the message communicator
        self.sending = []            # (op, requests) of posted sends
        self.recvs = {}              # source -> posted _Recv, in order
        self.kept = {}               # source -> _Kept, in arrival order
        self.landing = []            # payloads being received: (requests, src, op, kept, dest,
                                     # out, buffer)
        self.failure = None
        self.moved_at = 0.0
        self.status = MPI.Status()
        self.ctrl_buf = bytearray(CTRL_BYTES)
        self.ctrl = self.comm.Irecv([self.ctrl_buf, MPI.BYTE], source=MPI.ANY_SOURCE,
                                    tag=TAG_CTRL)
        self.ctrl_got = False
        self.told = []               # control messages sent (requests, buffer)
        self._init_posting()

    # ---- posting (under the lock; post_recv: _Matching's) ----

    def post_send(self, op):
        """The envelope and the payload go to MPI at once (in posting order)."""
        MPI, dest = self.MPI, op.peer
        reqs = [self.comm.Isend([op.header, MPI.BYTE], dest, TAG_HEAD)]
        for at in range(0, op.nbytes, CHUNK_BYTES):
            reqs.append(self.comm.Isend([op.payload[at:at + CHUNK_BYTES], MPI.BYTE], dest,
                                        TAG_DATA))
        self.sending.append((op, reqs))
        self.moved_at = time.monotonic()

    def post_recv(self, op):
        super().post_recv(op)
        self.moved_at = time.monotonic()

    def quick_send(self, array, dest, tag):
        return False

    def _wake(self):
        pass                         # (the message thread polls)

    # ---- progress (under the lock) ----

    def progress(self):
        MPI = self.MPI
        testall = MPI.Request.Testall
        moved = False
        if self.sending:
            left = []
            for op, reqs in self.sending:
                if testall(reqs):
                    op.payload = None
                    op.finish()
                    moved = True
                else:
                    left.append((op, reqs))
            self.sending = left
        for src in [s for s, posted in self.recvs.items() if posted]:
            while self.recvs.get(src):
                msg = self.comm.Improbe(src, TAG_HEAD, self.status)
                if msg is None:
                    break
                head = bytearray(self.status.Get_count(MPI.BYTE))
                msg.Recv([head, MPI.BYTE])
                self._arrived(src, head)
                moved = True
        if self.landing:
            left = []
            for item in self.landing:
                if testall(item[0]):
                    self._whole(*item[1:6])
                    moved = True
                else:
                    left.append(item)
            self.landing = left
        if moved:
            self.moved_at = time.monotonic()
        return moved

    def _arrived(self, src, head):
        """An envelope from src: match it, post its payload's receives."""
        magic, tag, nbytes, meta_len, hdr_len = _ENVELOPE.unpack_from(head)[:5] \
            if len(head) >= _ENVELOPE.size else (0, 0, 0, 0, 0)
        if magic != _MAGIC or hdr_len != len(head) or _G + meta_len > hdr_len:
            raise ShmtreeError(f"shmtree: rank {self.rank}: a message from rank {src} between "
                               "nodes begins with no envelope (a stray MPI message on the "
                               "messages' communicator?)")
        dtype, shape = _parse(bytes(head[_G:_G + meta_len]))
        op, kept, dest, out = self._destination(src, tag, dtype, shape)
        buf = np.empty(nbytes, np.uint8) if dest is _DISCARD else \
            _flat(dest) if nbytes else None
        MPI = self.MPI
        reqs = [self.comm.Irecv([buf[at:at + CHUNK_BYTES], MPI.BYTE], src, TAG_DATA)
                for at in range(0, nbytes, CHUNK_BYTES)]
        if reqs:
            self.landing.append((reqs, src, op, kept, dest, out, buf))
        else:
            self._whole(src, op, kept, dest, out)

    # ---- waiting ----

    def conds(self):
        return None, False, None

    def _wait(self, conds, missing, made, budget):
        if time.monotonic() - self.moved_at < SPIN_S:
            os.sched_yield()
        else:
            time.sleep(min(SLEEP_S, max(budget, 0.0)))

    def all_ops(self):
        ops = [op for op, _ in self.sending]
        ops += [op for posted in self.recvs.values() for op in posted]
        ops += self.any_recvs           # (none: refused across nodes, SpanningMessages)
        ops += [item[2] for item in self.landing if item[2] is not None]
        ops += [k.claimant for ks in self.kept.values() for k in ks if k.claimant is not None]
        return [op for op in ops if not op.done]

    def check(self, now):
        """Between slices (under the lock): the communicator, failures anywhere, deadlines."""
        if self.closed or self.span._closed:
            self.fail_all(ShmtreeError("shmtree: this communicator is closed"))
            return
        failure = self._failure()
        if failure is not None:
            self.fail_all(PeerLostError(f"shmtree: rank {self.rank}: {failure}"))
            return
        for op in self.all_ops():
            if op.deadline is not None and now >= op.deadline:
                text = (f"rank {self.rank} timed out in {op.kind} "
                        f"{'to' if op.kind == 'send' else 'from'} rank {op.peer} (tag {op.tag}) "
                        "between nodes")
                self._abort(ABORT_TIMEOUT, text)
                self.fail_all(CollectiveTimeoutError(f"shmtree: {text}; the communicator is "
                                                     "aborted"), op)
                return

    def _failure(self):
        """The text of a failure of the communicator (this node's group aborted, a link's
        failure, another rank's control message), or None.  One of this node is told to every
        rank; one told by another rank aborts this node's group."""
        if self.failure is not None:
            return self.failure
        span = self.span
        text = span._node_failed()
        for link in (span._link, span._lane):
            if text is None and link is not None and link.failure is not None:
                text = link.failure
        if text is not None:
            self.failure = text
            self._tell(text)
            return text
        if self._ctrl_arrived():
            self.failure = text = bytes(self.ctrl_buf[EPOCH_BYTES:]).split(b"\0", 1)[0] \
                .decode("utf-8", "replace") or "another rank failed"
            group = self.group
            if not group.closed and not group.aborted():
                group.abort(ABORT_FAILED, span.node_rank, note=text)
            return text
        return None

    def _ctrl_arrived(self):
        if self.ctrl_got:
            return False
        if not self.ctrl.Test():
            return False
        if bytes(self.ctrl_buf[:EPOCH_BYTES]) != self.epoch:   # (an earlier communicator's)
            self.ctrl = self.comm.Irecv([self.ctrl_buf, self.MPI.BYTE],
                                        source=self.MPI.ANY_SOURCE, tag=TAG_CTRL)
            return False
        self.ctrl_got = True
        return True

    def _abort(self, reason, text):
        """This rank failed in a message between nodes: abort its node's group and links, and
        tell every rank."""
        self.failure = self.failure or text
        span, group = self.span, self.group
        if not group.closed and not group.aborted():
            group.abort(reason, span.node_rank, note=text)
        for link in {span._link, span._lane} - {None}:
            link.abort(text)
        self._tell(text)

    def _tell(self, text):
        if self.told:
            return
        data = bytearray(self.epoch + text.encode("utf-8", "replace")
                         [:CTRL_BYTES - EPOCH_BYTES - 1])
        data += bytes(CTRL_BYTES - len(data))
        reqs = []
        for r in range(self.comm.Get_size()):
            if r != self.rank:
                try:
                    reqs.append(self.comm.Isend([data, self.MPI.BYTE], r, TAG_CTRL))
                except Exception:
                    pass
        self.told = [reqs, data]

    def fail_all(self, exc, op=None):
        """Fail every posted operation: `op` with exc, the others with PeerLostError (op None:
        all with exc).  Receives still posted in MPI are cancelled; every request left, and its
        buffer, is kept."""
        lost = exc if op is None else PeerLostError(
            f"shmtree: rank {self.rank}: {self.failure or 'the communicator is aborted'}")
        self._fail_ops(exc, op, lost)
        if self.sending or self.landing:
            for item in self.landing:
                for r in item[0]:
                    try:
                        r.Cancel()
                    except Exception:
                        pass
            _KEPT.append((self.comm, self.sending, self.landing))
            self.comm_free = False
        self.sending, self.landing = [], []

    def _broken(self, exc):
        what = _broken_text(exc)
        with self.lock:
            if self.failure is None:
                self._abort(ABORT_FAILED, f"rank {self.rank}: {what}")
            self.fail_all(exc if isinstance(exc, ShmtreeError) else ShmtreeError(
                f"shmtree: rank {self.rank}: {what} between nodes; the communicator is aborted"))
            finished = self._finished_requests()
        self._complete(finished)

    # ---- closing ----

    def close(self):
        """(The communicator closes.)  Outstanding isends complete first while the communicator
        is sound (at most CLOSE_WAIT_S); what is still posted fails; the message thread stops;
        the control receive is cancelled."""
        if self.MPI.Is_finalized():
            self.closed, self.comm_free = True, False
            return
        limit = time.monotonic() + CLOSE_WAIT_S
        while True:
            with self.lock:
                try:
                    self.progress()
                    pending = any(op.request is not None for op, _ in self.sending) and \
                        self._failure() is None
                except Exception:
                    pending = False
                finished = self._finished_requests()
            self._complete(finished)
            if not pending or time.monotonic() >= limit:
                break
            time.sleep(SLEEP_S)
        self._stop()
        try:
            if not self.ctrl_got and not self.ctrl.Test():
                self.ctrl.Cancel()
                self.ctrl.Wait()
            if self.told:
                self.told[0] = [r for r in self.told[0] if not r.Test()]
                if self.told[0]:
                    _KEPT.append((self.comm, self.told))
                    self.comm_free = False
        except Exception:
            self.comm_free = False
