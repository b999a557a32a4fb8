"""Point-to-point messages (docs/design.md, "How messages travel"): send, recv, sendrecv,
isend, irecv on one machine's communicator (the Messages mixin) and the transport under them.

Channels.  Each directed pair of ranks that talks has a channel of its own, made on first use by
the sender: a sealed memfd (a header page and a byte ring, _p2p.Ring) that the receiver maps
through /proc/<sender pid>/fd/<fd> when it first waits for a message from that sender.  Each
rank also has a home page (one futex bell, _p2p.Home), made with its first message call, that
every peer it talks with rings when it publishes data for it or frees room in a ring it fills:
one thread waits for any number of channels on one futex.  A rank therefore holds what its
traffic needs, O(talking peers), never O(P^2) for the group.  The memfds carry names
("shmtree-p2p-<group nonce>-<src>-<dst>", "...-h<rank>") that the peers look up in the owner's
descriptor table (same user only, as shared arrays); nothing appears in /dev/shm.

Messages.  A message is a record in the sender's ring: a 64-byte envelope (tag, payload bytes,
the description's length), the description (dtype and shape, pickled; plain dtypes by their
str), the payload, padding to 64 bytes.  The sender writes it as room allows (a payload larger
than the ring streams through it, 64 KiB pieces published one by one, while the receiver copies
them out); so `send` returns once its last byte is in the ring (the array may then be modified),
and a large send waits for the receiver.  The receiver reads records in the order sent, matches
each to its first posted receive from that sender with the same tag (non-overtaking per tag), or
keeps it (a private copy) until one is posted: tags may be received out of order.

Any source, any tag.  A receive may name ANY_SOURCE and ANY_TAG (-1, as MPI's); its Status (or
an irecv's Request.status) then says the message's source, tag and size.  Receives match in the
order they were posted: a message goes to the first posted receive that takes it, whether that
names its source or ANY_SOURCE (each receive has a posting number); a receive posted later takes
the earliest-arrived kept message it matches (each kept message has an arrival number), and
messages of one source with one tag are never reordered.  An ANY_SOURCE receive waits on every
channel to this rank, including those of senders it has not heard from yet: channels are made
lazily by their senders, so a sender counts each channel it makes in the receiver's home
(_p2p.Home.note_made) before ringing it, and the receiver looks senders up in /proc only when
that count moved.  It fails once no other rank can ever send (each died, or left with nothing
unread: PeerLostError when one died) or at its timeout (CollectiveTimeoutError); while another
rank lives it waits.  (Between nodes: ANY_TAG, not ANY_SOURCE: remote.py.)

Progress.  The transport's state (posted sends per destination, posted receives per source, the
message being read from each source, the unmatched messages) lives under one lock; whoever
waits - a blocking call in the caller's thread, or the communicator's message thread for isend
and irecv - advances every posted operation, then waits outside the lock on the home bell (spin,
yield, futex: _p2p.Home.wait).  Messages never go through the collectives' executor or progress
thread, so a pending message never holds up a collective, nor a collective a message.

Across nodes (remote.py): the same calls, each peer routed (Messages._p2p_route) to its node's
Transport or to remote.Remote (MPI between nodes), which shares the matching (_Matching).
"""
from __future__ import annotations

import fcntl
import os
import time
from collections import deque

import numpy as np

from .. import _moving, _p2p
from ..codes import ABORT_CORRUPT, ABORT_FAILED, ST_LEFT
from ..errors import ShmtreeError
from .matching import _Matching
from .records import (CLOSE_WAIT_S, QUICK_BYTES, RING_BYTES, SLICE_NS, _CMA, _DISCARD, _G,
                      _Incoming, _MAGIC, _addr, _flat, _header, _headers, _parse, _up,
                      _yama_allows)
from .waiting import _Waiting

__all__ = ["Transport"]


class Transport(_Waiting, _Matching):
    """The transport of one communicator on one machine: its channels and its home, the posted
    operations and their progress (waiting and failing: waiting.py; the matching: matching.py)."""

    def __init__(self, comm):
        self.comm = comm
        self.group = comm.group
        self.rank = comm.rank
        self.size = comm.size
        self.pid = os.getpid()
        self.nonce = bytes(comm._p2p_nonce())
        self.key = self.nonce.hex()
        plan = self.group.plan
        self.spin_ns = int(plan.spin_ns)
        self.stall_timeout = plan.stall_timeout
        self.lock = _p2p.Lock()           # (a threading.Lock that Quick takes with no call)
        self.home_fd, self.home_map = self._memfd(f"h{self.rank}", _p2p.PAGE_BYTES)
        _p2p.init_home(self.home_map, self.nonce, self.rank)
        self.home = _p2p.Home(self.home_map)
        probe = np.zeros(1, np.uint8)        # may this process read another's memory (CMA)?
        self.cma = _p2p.cma_read(self.pid, _addr(np.ones(1, np.uint8)), _addr(probe), 1) == 0 \
            and os.environ.get("SHMTREE_P2P_CMA", "1") != "0" and _yama_allows()
        self.out = {}               # dest -> (fd, mapping, ring)
        self.inn = {}               # source -> (mapping, ring, sender's home mapping)
        self.sends = {}             # dest -> deque of _Send (the head one is being written)
        self.recvs = {}             # source -> list of posted _Recv, in order
        self.incoming = {}          # source -> _Incoming (a message being read)
        self.kept = {}              # source -> list of _Kept, in arrival order
        self.made_seen = None       # the count of channels made to this rank (_p2p.Home.made)
                                    # when senders were last looked for (_find_senders)
        self.looked_at = 0.0        # when they were (a look is made again every LOOK_S while
                                    # an ANY_SOURCE receive waits: a lookup that failed for
                                    # want of a mapping is tried again)
        self.turn = 0               # where the pumping of every source begins (ANY_SOURCE:
                                    # no source is always read first)
        self.scratch = None         # for discarded payloads
        self.idle_since = {}        # Pool: peer -> when it was first seen idle
        self.relay = False          # the launcher's (relay.Relay): peers that leave are no error
        self.relayed = 0            # inter=: the size of the communicator across nodes whose
                                    # messages to other nodes go through the launcher (their
                                    # tags fold the global rank: remote.SpanningMessages)
        self._init_posting()
        self.quick = _p2p.Quick(self, _headers, _parse, time.monotonic, SLICE_NS)

    @property
    def closed(self):
        return self.quick.closed

    @closed.setter
    def closed(self, value):
        self.quick.closed = value

    # ---- memfds ----

    def _memfd(self, what, size):
        fd = os.memfd_create(f"shmtree-p2p-{self.key}-{what}",
                             os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            return fd, _moving.Mapping(fd, size)
        except BaseException:
            os.close(fd)
            raise

    def _peer_pid(self, r):
        if r == self.rank:
            return self.pid
        return self.comm._p2p_pid(r)

    def _lookup(self, r, name):
        """The descriptor number under which rank r's process holds the memfd `name`, or None."""
        pid = self._peer_pid(r)
        if not pid:
            return None, None
        want = f"/memfd:shmtree-p2p-{self.key}-{name} (deleted)"
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            return pid, None
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == want:
                    return pid, int(fd)
            except OSError:
                continue
        return pid, None

    def _map(self, pid, fd, name, least):
        """Map a peer's memfd `name` through /proc (None when it is gone).  The descriptor
        opened is checked to be that memfd, of at least `least` bytes (its size is sealed):
        the peer may have closed the number meanwhile and reused it for another file, whose
        mapping could be shorter than what is read (a SIGBUS)."""
        try:
            peer_fd = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            if os.readlink(f"/proc/self/fd/{peer_fd}") != self._link_text(name):
                return None
            size = os.fstat(peer_fd).st_size
            if size < least:
                return None
            return _moving.Mapping(peer_fd, size)
        except OSError:
            return None
        finally:
            os.close(peer_fd)

    def _link_text(self, name):
        return f"/memfd:shmtree-p2p-{self.key}-{name} (deleted)"

    # ---- channels ----

    def _out_ring(self, dest):
        got = self.out.get(dest)
        if got is not None:
            return got[2]
        fd, m = self._memfd(f"{self.rank}-{dest}", _p2p.HEADER_BYTES + RING_BYTES)
        _p2p.init_channel(m, self.nonce, self.rank, dest, RING_BYTES, self.pid, self.home_fd)
        ring = _p2p.Ring(m, True)
        self.out[dest] = (fd, m, ring)
        # the receiver may already wait for this channel (on its home bell, a receive from any
        # source for any new channel): count it there, and ring
        pid, hfd = self._lookup(dest, f"h{dest}")
        if hfd is not None:
            home = self._map(pid, hfd, f"h{dest}", _p2p.PAGE_BYTES)
            if home is not None and _p2p.check_home(home, self.nonce, dest):
                ring.set_peer(home)
                _p2p.Home(home).note_made()
        return ring

    def _link_receiver(self, ring, dest):
        """The receiver has attached: map its home (it is rung from now on)."""
        m = self.out[dest][1]
        pid, hfd = _p2p.receiver_of(m)
        home = self._map(pid, hfd, f"h{dest}", _p2p.PAGE_BYTES)
        if home is None or not _p2p.check_home(home, self.nonce, dest):
            return False
        ring.set_peer(home)
        ring.wake()
        return True

    def _in_ring(self, src):
        got = self.inn.get(src)
        if got is not None:
            return got[1]
        pid, fd = self._lookup(src, f"{src}-{self.rank}")
        if fd is None:
            return None
        m = self._map(pid, fd, f"{src}-{self.rank}", _p2p.HEADER_BYTES + _G)
        if m is None:
            return None
        head = _p2p.channel_header(m)
        nonce, ok, s, d, ring_bytes, spid, shome = head
        if not (ok and nonce == self.nonce and s == src and d == self.rank and spid == pid):
            return None
        home = self._map(pid, shome, f"h{src}", _p2p.PAGE_BYTES)
        if home is None or not _p2p.check_home(home, self.nonce, src):
            return None
        ring = _p2p.Ring(m, False)
        ring.set_peer(home)
        _p2p.set_receiver(m, self.pid, self.home_fd)
        ring.attach()
        self.inn[src] = (m, ring, home, pid)
        return ring

    def _find_senders(self):
        """(An ANY_SOURCE receive is posted.)  Map the channels of senders not heard from yet:
        looked up in /proc only when the count of channels made to this rank has moved since
        the last look (a sender counts its channel, then rings, once it can be looked up; the
        first look finds those made before this rank's home was)."""
        made = self.home.made()
        if made == self.made_seen:
            return made
        self.made_seen, self.looked_at = made, time.monotonic()
        for r in range(self.size):
            if r not in self.inn:
                self._in_ring(r)
        return made

    # ---- the quick path of the blocking calls: a whole record at once (natively) ----

    def quick_send(self, array, dest, tag):
        """Send a small message whole when nothing else is being sent to dest and it fits in
        the ring now (_p2p.Quick.send); the arguments are checked already.  False: nothing was
        done, take the general path.  (self.quick.recv is the receiving side.)"""
        if array.nbytes > QUICK_BYTES:
            return False
        _header(array.dtype, array.shape, tag, array.nbytes)     # (known to the native path)
        return self.quick.send(array, dest, tag)

    # ---- posting (under the lock; post_recv: _Matching's) ----

    def post_send(self, op):
        q = self.sends.get(op.peer)
        if q is None:
            q = self.sends[op.peer] = deque()
        q.append(op)

    # ---- progress (under the lock) ----

    def progress(self):
        """Advance every posted operation as far as it goes now.  True when anything moved."""
        moved = False
        for dest, q in list(self.sends.items()):
            while q:
                op = q[0]
                if op.done:          # (failed)
                    q.popleft()
                    continue
                m = self._step_send(op)
                moved = moved or m
                if not op.done:
                    break
                q.popleft()
            if not q:
                del self.sends[dest]
        for src in list(set(self.recvs) | set(self.incoming)):
            m = self._pump(src)
            moved = moved or m
        if self.any_recvs:              # every source, from a turning start
            self._find_senders()
            srcs = sorted(self.inn)
            if srcs:
                k = self.turn = (self.turn + 1) % len(srcs)
                for src in srcs[k:] + srcs[:k]:
                    m = self._pump(src)
                    moved = moved or m
                    if not self.any_recvs:
                        break
        return moved

    def _step_send(self, op):
        ring = self._out_ring(op.peer)
        if not ring.has_peer and ring.is_attached():
            self._link_receiver(ring, op.peer)
        moved = False
        if op.phase == 0:
            n = op.header.size
            k = ring.write(_addr(op.header) + op.pos, n - op.pos)
            op.pos += k
            moved = k > 0
            if op.pos < n:
                return moved
            op.phase, op.pos = 1, 0
        if op.phase == 1:
            if op.pos < op.nbytes:
                k = ring.write(_addr(op.payload) + op.pos, op.nbytes - op.pos)
                op.pos += k
                moved = moved or k > 0
                if op.pos < op.nbytes:
                    return moved
            op.phase = 2
        if op.phase == 2:
            if op.pad:
                if ring.room() < op.pad:
                    return moved
                ring.skip_write(op.pad)
                op.pad = 0
            if op.cma:            # done once the receiver has read it (and freed the record)
                if not ring.has_peer and ring.is_attached():
                    self._link_receiver(ring, op.peer)
                if ring.unread():
                    return moved
            op.payload = None
            op.finish()
            if not ring.has_peer and ring.is_attached():
                self._link_receiver(ring, op.peer)
            return True
        return moved

    def _pump(self, src):
        """Read from source src: envelopes, matching, payloads."""
        ring = self._in_ring(src)
        if ring is None:
            return False
        moved = False
        while True:
            inc = self.incoming.get(src)
            if inc is None:
                if not self.recvs.get(src) and not self.any_recvs and not any(
                        k.claimant is not None for k in self.kept.get(src, ())):
                    return moved      # (nobody waits for a message from src)
                inc = self._envelope(src, ring)
                if inc is None:
                    return moved
                moved = True
            if not self._payload(src, ring, inc):
                return moved
            moved = True

    def _envelope(self, src, ring):
        env = ring.envelope()
        if env is None:
            return None
        magic, tag, nbytes, meta_len, hdr_len, have, flags, address = env
        if magic != _MAGIC or hdr_len != _G + _up(meta_len) or hdr_len > ring.capacity:
            self.group.abort(ABORT_CORRUPT, self.rank)
            raise ShmtreeError(f"shmtree: rank {self.rank}: the channel from rank {src} holds "
                               "no message where one should begin (corrupted shared memory)")
        if have < hdr_len:
            return None
        dtype, shape = _parse(ring.description(meta_len))
        cma = None
        if flags & _CMA:            # (the header stays until the payload is read)
            cma = (self.inn[src][3], address, hdr_len)
        else:
            ring.skip_read(hdr_len)
        inc = _Incoming()
        inc.tag, inc.dtype, inc.shape, inc.nbytes = tag, dtype, shape, nbytes
        inc.pad, inc.pos = _up(nbytes) - nbytes, 0
        inc.cma = cma
        inc.op, inc.kept, inc.dest, inc.out = self._destination(src, tag, dtype, shape)
        inc.flat = None if inc.dest is _DISCARD else _flat(inc.dest)
        self.incoming[src] = inc
        return inc

    def _payload(self, src, ring, inc):
        """Copy what is there of the message's payload; True when the message is complete."""
        if inc.cma is not None:
            pid, address, hdr_len = inc.cma
            if inc.dest is not _DISCARD and inc.nbytes:
                err = _p2p.cma_read(pid, address, _addr(inc.flat), inc.nbytes)
                if err:
                    self._cma_failed(src, err)
            ring.skip_read(hdr_len)
            inc.pos, inc.pad = inc.nbytes, 0
        elif inc.pos < inc.nbytes:
            if inc.dest is _DISCARD:
                if self.scratch is None:
                    self.scratch = np.empty(_p2p.PIECE, np.uint8)
                while inc.pos < inc.nbytes:
                    k = ring.read(_addr(self.scratch), min(_p2p.PIECE, inc.nbytes - inc.pos))
                    if not k:
                        return False
                    inc.pos += k
            else:
                inc.pos += ring.read(_addr(inc.flat) + inc.pos, inc.nbytes - inc.pos)
                if inc.pos < inc.nbytes:
                    return False
        if inc.pad:
            if ring.avail() < inc.pad:
                return False
            ring.skip_read(inc.pad)
            inc.pad = 0
        del self.incoming[src]
        self._whole(src, inc.op, inc.kept, inc.dest, inc.out)
        return True

    def _cma_failed(self, src, err):
        text = (f"rank {self.rank} cannot read rank {src}'s message from its memory "
                f"(process_vm_readv: {os.strerror(err)}); ranks must run as the same user, and "
                "the kernel must allow it (ptrace access)")
        self._abort(ABORT_FAILED, text)
        raise ShmtreeError(f"shmtree: {text}; the group is aborted")

    # ---- closing ----

    def drain_sends(self):
        """(Communicator.close, before leaving.)  Let the outstanding isends finish (as close
        waits for outstanding collectives): while their receivers live and stay in the group,
        at most CLOSE_WAIT_S.  Outstanding irecvs are not waited for (close fails them)."""
        limit = time.monotonic() + CLOSE_WAIT_S
        group = self.group
        while True:
            with self.lock:
                self.progress()
                finished = self._finished_requests()
                pending = [op for op in self.nonblocking if op.kind == "send" and not op.done
                           and op.peer != self.rank]
                if pending and not (group._closed or group.aborted()):
                    pending = [op for op in pending if op.peer >= group.size or (
                        not group.death_of(op.peer) and group._seg.state(op.peer) != ST_LEFT)]
                else:
                    pending = []
                conds, _, _ = self.conds()
            self._complete(finished)
            if not pending or time.monotonic() >= limit:
                return
            self.home.wait(conds, SLICE_NS, self.spin_ns)

    def close(self):
        """(Communicator.close, once this rank has left.)  Wait until every receiver of a
        message still in a ring has mapped its channel (else the message would go with this
        process) while the receiver lives and stays in the group, at most CLOSE_WAIT_S; fail
        what is still posted; drop every channel."""
        deadline_note = time.monotonic()
        while time.monotonic() - deadline_note < CLOSE_WAIT_S:
            with self.lock:
                pending = [d for d, (_, _, ring) in self.out.items()
                           if ring.unread() and not ring.is_attached() and d != self.rank]
                if not pending or self.group._closed or self.group.aborted():
                    break
                pending = [d for d in pending if d >= self.group.size or (
                    not self.group.death_of(d) and self.group._seg.state(d) != ST_LEFT)]
                if not pending:
                    break
            time.sleep(0.005 if time.monotonic() - deadline_note < 1 else 0.05)
        self._stop()
        with self.lock:
            for fd, _, _ in self.out.values():
                os.close(fd)
            self.out.clear()
            self.inn.clear()
            self.kept.clear()
            if self.home_fd is not None:
                os.close(self.home_fd)
                self.home_fd = None
