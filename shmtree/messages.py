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
import operator
import os
import pickle
import struct
import threading
import time
from collections import deque

import numpy as np

from . import _moving, _p2p, session
from .calls import deadline_of, movable
from .codes import (ABORT_CORRUPT, ABORT_DIED, ABORT_FAILED, ABORT_LEFT, ABORT_STALL,
                    ABORT_TIMEOUT, ST_BUSY, ST_IDLE, ST_LEFT)
from .errors import CollectiveTimeoutError, PeerLostError, ShmtreeError
from .requests import Request
from .survive import lost_error

__all__ = ["Messages", "Transport", "Status", "ANY_SOURCE", "ANY_TAG"]

RING_BYTES = 1 << 20        # a channel's ring (pages are committed as they are first written)
CMA_BYTES = 256 << 10       # from this size the receiver copies straight from the sender's
                            # memory (process_vm_readv): one copy, no ring
CLOSE_WAIT_S = 30.0         # how long close() waits for receivers to map a channel that holds
                            # messages they have not read
SLICE_S = 0.02              # between two checks of the peers, the deadline, the group
LOOK_S = 5.0                # an ANY_SOURCE receive looks for new senders at least this often
                            # (else only when one counts its new channel: _find_senders)
SLICE_NS = int(SLICE_S * 1e9)
_ENVELOPE = struct.Struct("<8Q")
_MAGIC = 0x3147534d54534d53  # "SMSTMSG1"
_G = _p2p.RECORD_GRANULE


def _yama_allows() -> bool:
    """May a rank read a sibling's memory?  Reading its own (the probe) always works, but the
    Yama LSM (Ubuntu's default: ptrace_scope 1) lets a process read only its descendants', so
    two workers of one pool could not: then large messages stream through the ring instead."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return f.read().strip() == "0"
    except (OSError, ValueError):
        return True                          # (no Yama: the usual same-user check)


def _up(n):
    return (n + 63) & -64


def _addr(a):
    return _moving.address(a)


# ---------------------------------------------------------------------------------------------
# descriptions of what a message holds

_described = {}             # (dtype, shape) -> description bytes (the sender's cache)
_parsed = {}                # description bytes -> (dtype, shape) (the receiver's cache)


def _describe(dtype, shape) -> bytes:
    key = (dtype, shape)
    got = _described.get(key)
    if got is None:
        try:
            plain = (dtype.fields is None and dtype.subdtype is None
                     and np.dtype(dtype.str) == dtype)
        except TypeError:
            plain = False
        got = pickle.dumps((dtype.str if plain else dtype, shape), protocol=4)
        if len(_described) < 4096:
            _described[key] = got
    return got


def _parse(meta: bytes):
    got = _parsed.get(meta)
    if got is None:
        dt, shape = pickle.loads(meta)    # (same-user peers only: docs/design.md)
        got = (np.dtype(dt), tuple(shape))
        if len(_parsed) < 4096:
            _parsed[meta] = got
    return got


_headers = {}               # (dtype, shape, tag) -> the record's header (the sender's cache)


def _header(dtype, shape, tag, nbytes, address=0) -> bytes:
    """A record's header; address: the payload stays in the sender's memory, where the
    receiver reads it (single copy, flag _CMA)."""
    key = (dtype, shape, tag)
    got = None if address else _headers.get(key)
    if got is None:
        meta = _describe(dtype, shape)
        hdr_len = _G + _up(len(meta))
        got = _ENVELOPE.pack(_MAGIC, tag, nbytes, len(meta), hdr_len, _CMA if address else 0,
                             address, 0) + meta
        got += bytes(hdr_len - len(got))
        if len(_headers) < 4096 and not address:
            _headers[key] = got
    return got


# ---------------------------------------------------------------------------------------------
# operations


ANY_SOURCE = -1             # a receive from any rank (MPI.ANY_SOURCE's value)
ANY_TAG = -1                # a receive of any tag (MPI.ANY_TAG's value; also inter='s launcher
                            # relaying: remote.Relay, whose receives take any tag)


class Status:
    """What a receive got, as mpi4py's Status: pass one as recv(..., status=) or
    sendrecv(..., status=), or read an irecv's Request.status once it is done.

    source, tag: the message's (useful after ANY_SOURCE and ANY_TAG); count: its payload's
    bytes (also nbytes); dtype, shape: the array's.  Get_source(), Get_tag(), Get_count(dtype):
    mpi4py's names (Get_count() counts bytes, Get_count(dtype) items of that dtype)."""

    __slots__ = ("source", "tag", "count", "dtype", "shape")

    def __init__(self):
        self.source = ANY_SOURCE
        self.tag = ANY_TAG
        self.count = 0
        self.dtype = None
        self.shape = None

    @property
    def nbytes(self):
        return self.count

    def Get_source(self):
        return self.source

    def Get_tag(self):
        return self.tag

    def Get_count(self, dtype=None):
        """The payload's bytes, or its number of items of `dtype` (a numpy dtype or what
        np.dtype takes)."""
        if dtype is None:
            return self.count
        size = np.dtype(dtype).itemsize
        if not size or self.count % size:
            raise ValueError(f"shmtree: Status.Get_count: {self.count} bytes are not a whole "
                             f"number of {np.dtype(dtype)} items")
        return self.count // size

    def __repr__(self):
        return (f"shmtree.Status(source={self.source}, tag={self.tag}, count={self.count}, "
                f"dtype={self.dtype}, shape={self.shape})")


def _status_arg(status):
    if status is not None and not isinstance(status, Status):
        raise TypeError(f"shmtree: recv: status must be a shmtree.Status, got "
                        f"{type(status).__name__}")
    return status


def _set_status(status, source, tag, array):
    """Fill a Status (recv's status=) with a received message's."""
    _status_arg(status)
    status.source, status.tag = source, tag
    status.count, status.dtype, status.shape = array.nbytes, array.dtype, array.shape
    return status


class _Op:
    __slots__ = ("kind", "peer", "tag", "deadline", "done", "result", "error", "request",
                 "what", "__weakref__")

    def __init__(self, kind, peer, tag, deadline):
        self.kind = kind
        self.peer = peer
        self.tag = tag
        self.deadline = deadline
        self.done = False
        self.result = None
        self.error = None
        self.request = None

    def finish(self, result=None, error=None):
        if not self.done:
            self.done = True
            self.result = result
            self.error = error


class _Send(_Op):
    __slots__ = ("header", "payload", "nbytes", "pos", "phase", "pad", "cma")

    def __init__(self, peer, tag, deadline, array, cma=False):
        super().__init__("send", peer, tag, deadline)
        nbytes = array.nbytes
        if nbytes:
            if not array.flags.c_contiguous:
                array = np.array(array, order="C", copy=True)
            self.payload = _flat(array)
        else:
            self.payload = None
        self.cma = cma = cma and nbytes >= CMA_BYTES
        self.header = np.frombuffer(_header(array.dtype, array.shape, tag, nbytes,
                                            _addr(self.payload) if cma else 0), np.uint8)
        if cma:                   # (the receiver reads the payload where it is)
            nbytes = 0
        self.nbytes = nbytes
        self.pad = _up(nbytes) - nbytes
        self.pos = 0
        self.phase = 0


class _Recv(_Op):
    """A posted receive.  peer, tag: as the transport knows them (ANY_SOURCE, ANY_TAG until
    it matches a message: then the message's); asked: (source, tag) as the caller named them
    in its communicator's ranks and tags, None for ANY_SOURCE / ANY_TAG (a communicator across
    nodes translates them for its transports); seq: its posting number (post_recv)."""
    __slots__ = ("out", "asked", "seq")

    def __init__(self, peer, tag, deadline, out, asked=None):
        super().__init__("recv", peer, tag, deadline)
        self.out = out
        self.asked = asked
        self.seq = 0

    def status(self, into=None):
        """The Status of the message received (once done): `into` filled, or a new one."""
        src, tag = self.asked if self.asked is not None else (None, None)
        return _set_status(Status() if into is None else into, self.peer if src is None else src,
                           self.tag if tag is None else tag, self.result)


class _Kept:
    """A message that arrived before its receive was posted (a private copy); order: its
    arrival number (which of two kept messages an ANY_SOURCE receive takes)."""
    __slots__ = ("tag", "array", "complete", "claimant", "order")

    def __init__(self, tag, array, order=0):
        self.tag = tag
        self.array = array
        self.complete = False
        self.claimant = None
        self.order = order


class _Incoming:
    """The message being read from one source."""
    __slots__ = ("tag", "dtype", "shape", "nbytes", "pad", "pos", "dest", "flat", "op",
                 "kept", "out", "cma")


_DISCARD = object()
_CMA = 1                    # envelope flag: the payload is read from the sender's memory
QUICK_BYTES = _p2p.QUICK_BYTES  # a message of at most this is written whole when the ring has
                                # room (the quick paths)


def _check_out(out, dtype, shape):
    """'' when out can take a message of dtype and shape, else what is wrong."""
    if not isinstance(out, np.ndarray):
        return f"out must be a numpy array, got {type(out).__name__}"
    if out.dtype != dtype or out.shape != shape:
        return (f"out has shape {out.shape} and dtype {out.dtype}, the message shape {shape} "
                f"and dtype {dtype}")
    if not out.flags.writeable:
        return "out is read-only"
    return ""


def _launcher_pid(group):
    """The pid of the launcher of a node's group (inter=): in its mailbox's header (+16, u64:
    mailbox.py), which every worker of the node holds a descriptor of; 0 when unknown.  (The
    node's part of a sub-communicator across nodes: the launcher pid its split said, subcomm.)"""
    pid = getattr(group, "_relay_pid", 0)
    if pid:
        return pid
    span = getattr(group, "_span", None)
    if span is None or span[3] is None:
        return 0
    try:
        return int.from_bytes(os.pread(span[3], 8, 16), "little")
    except OSError:
        return 0


def _broken_text(exc):
    """What broke a send or recv (an exception, or an interrupt), in words."""
    return f"{type(exc).__name__} in send/recv: {exc}" if isinstance(exc, Exception) \
        else "interrupted in send/recv"


def _consumed(op, wrong):
    """The error of a recv whose out does not fit the message it matched."""
    return ValueError(f"shmtree: recv from rank {op.peer} (tag {op.tag}): {wrong}; the message "
                      "is consumed")


def _flat(a):
    """A C-contiguous array's bytes as a flat uint8 array (0-d and empty included)."""
    return a.reshape(-1).view(np.uint8) if a.ndim else a.reshape(1).view(np.uint8)


# ---------------------------------------------------------------------------------------------
# the transport of one communicator


class _Matching:
    """What both transports share (Transport on one machine, remote.Remote between nodes):
    matching arrived messages to posted receives (recvs: source -> posted _Recv in order; kept:
    source -> _Kept in arrival order), driving (run: progress, check, _wait of the transport),
    and the message thread of isend and irecv."""

    THREAD = "shmtree-messages-rank{}"

    def _init_posting(self):
        self.thread = None          # the message thread (isend/irecv)
        self.wake_thread = threading.Condition(threading.Lock())
        self.nonblocking = []       # posted nonblocking ops not yet done
        self.any_recvs = []         # posted receives from ANY_SOURCE, in order (one list for
                                    # good: the native quick path holds it)
        self.posted_count = 0       # receives posted (their posting numbers)
        self.arrived_count = 0      # messages kept (their arrival numbers)

    # ---- posting (under the lock) ----

    def post_recv(self, op):
        """Post a receive: it takes the earliest-arrived kept message it matches (from its
        source; ANY_SOURCE: from any, the first of each source being the one it may take), or
        waits, in posting order, among the receives of its source or of ANY_SOURCE."""
        self.posted_count += 1
        op.seq = self.posted_count
        if op.peer == ANY_SOURCE:
            best = None
            for src, kept in self.kept.items():
                for i, k in enumerate(kept):
                    if k.claimant is None and (k.tag == op.tag or op.tag == ANY_TAG):
                        if best is None or k.order < best[2].order:
                            best = (src, i, k)
                        break             # (a source's later messages may not overtake it)
            if best is None:
                self.any_recvs.append(op)
                return
            src, i, k = best
            op.peer = src
            self._take_kept(op, self.kept[src], i, k)
            return
        kept = self.kept.get(op.peer)
        if kept:
            for i, k in enumerate(kept):
                if (k.tag == op.tag or op.tag == ANY_TAG) and k.claimant is None:
                    self._take_kept(op, kept, i, k)
                    return
        self.recvs.setdefault(op.peer, []).append(op)

    def _take_kept(self, op, kept, i, k):
        op.tag = k.tag
        del kept[i]
        if k.complete:
            self._deliver(op, k.array)
        else:
            k.claimant = op

    def _deliver(self, op, array):
        """A recv op gets a kept message (a private copy)."""
        if op.out is None:
            op.finish(array)
            return
        wrong = _check_out(op.out, array.dtype, array.shape)
        if wrong:
            op.finish(error=_consumed(op, wrong))
        else:
            np.copyto(op.out, array, casting="no")
            op.finish(op.out)

    def _destination(self, src, tag, dtype, shape):
        """A message from src arrives (its description read): (op, kept, dest, out) - the first
        posted recv from src with its tag (None: none, the message is kept, `kept`), the array
        its payload goes into (_DISCARD: op's out does not fit, op failed: the message is
        consumed), and op's out when it is not dest itself (copied into at the end)."""
        posted = self.recvs.get(src)
        op = None
        if posted:
            for i, r in enumerate(posted):
                if r.tag == tag or r.tag == ANY_TAG:
                    op = r
                    break
        anys = self.any_recvs
        if anys:                      # (the first posted of the two receives that take it)
            for j, r in enumerate(anys):
                if r.tag == tag or r.tag == ANY_TAG:
                    if op is None or r.seq < op.seq:
                        op = anys.pop(j)
                        op.peer = src
                        posted = None
                    break
        if posted is not None and op is not None:
            posted.pop(i)
            if not posted:
                del self.recvs[src]
        if op is None:
            self.arrived_count += 1
            k = _Kept(tag, np.empty(shape, dtype), self.arrived_count)
            self.kept.setdefault(src, []).append(k)
            return None, k, k.array, None
        op.tag = tag
        if op.out is None:
            return op, None, np.empty(shape, dtype), None
        wrong = _check_out(op.out, dtype, shape)
        if wrong:
            op.finish(error=_consumed(op, wrong))
            return op, None, _DISCARD, None
        if op.out.flags.c_contiguous:
            return op, None, op.out, op.out
        return op, None, np.empty(shape, dtype), op.out

    def _whole(self, src, op, kept, dest, out):
        """A message from src has arrived whole (as _destination placed it)."""
        if kept is not None:
            kept.complete = True
            if kept.claimant is not None:
                self.kept[src].remove(kept)
                self._deliver(kept.claimant, kept.array)
        elif dest is not _DISCARD:
            if out is not None:
                if out is not dest:
                    np.copyto(out, dest, casting="no")
                op.finish(out)
            else:
                op.finish(dest)

    def _fail_ops(self, exc, op, lost):
        """Fail every posted operation: `op` with exc, the others with `lost`; nothing is
        posted any more (kept messages stay, for later receives)."""
        for o in self.all_ops():
            o.finish(error=exc if o is op else lost)
        self.recvs.clear()
        self.any_recvs.clear()
        for ks in self.kept.values():
            ks[:] = [k for k in ks if k.claimant is None]

    def _stop(self):
        """(close) Fail what is still posted, complete its Requests, end the message
        thread."""
        with self.lock:
            self.closed = True
            self.fail_all(ShmtreeError("shmtree: this communicator is closed"))
            finished = self._finished_requests()
        self._complete(finished)
        with self.wake_thread:
            self.wake_thread.notify()
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    # ---- driving ----

    def run(self, ops):
        """Drive the transport until every op of `ops` is done (the caller's thread), completing
        the Requests of nonblocking operations as they finish.  Any exception on the way (an
        interrupt included) may leave messages half-moved: it fails every posted operation and
        aborts the group, as an interrupted collective does."""
        next_check = time.monotonic() + SLICE_S
        moving = False
        try:
            while True:
                with self.lock:
                    moving = True
                    self.progress()
                    done = all(op.done for op in ops)
                    if not done:
                        now = time.monotonic()
                        if now >= next_check or any(op.deadline is not None and
                                                    now >= op.deadline for op in ops):
                            self.check(now)
                            next_check = now + SLICE_S
                            done = all(op.done for op in ops)
                    finished = self._finished_requests()
                    if not done:
                        conds, missing, made = self.conds()
                        budget = SLICE_S
                        for op in ops:
                            if op.deadline is not None:
                                budget = min(budget, max(0.0, op.deadline - now))
                    moving = False
                if finished:
                    self._complete(finished)
                if done:
                    return
                self._wait(conds, missing, made, budget)
        except BaseException as exc:
            if moving or not all(op.done for op in ops):
                self._broken(exc)
            raise

    def _finished_requests(self):
        done = [op for op in self.nonblocking if op.done]
        if done:
            self.nonblocking = [op for op in self.nonblocking if not op.done]
        return done

    @staticmethod
    def _complete(ops):
        for op in ops:
            req = op.request
            if req is None or req.done():
                continue
            if op.error is not None:
                req.set_exception(op.error)
            else:
                if op.kind == "recv":
                    req.status = op.status()     # (before its waiters wake)
                req.set_result(op.result)

    # ---- the message thread (isend, irecv) ----

    def post_nonblocking(self, op, request):
        op.request = request
        self.nonblocking.append(op)
        with self.wake_thread:
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, daemon=True,
                                               name=self.THREAD.format(self.rank))
                self.thread.start()
            self.wake_thread.notify()
        self._wake()                 # (the thread may be waiting for other messages)

    def _loop(self):
        self.ident = threading.get_ident()
        while True:
            with self.wake_thread:
                while not self.nonblocking and not self.closed:
                    self.wake_thread.wait()
                if self.closed and not self.nonblocking:
                    return
                ops = list(self.nonblocking)
            try:
                self.run(ops[:1])
            except BaseException:
                with self.lock:
                    finished = self._finished_requests()
                self._complete(finished)

    def is_current_thread(self):
        return self.thread is not None and threading.get_ident() == getattr(self, "ident", None)


class Transport(_Matching):
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
        self.relay = False          # the launcher's (remote.Relay): peers that leave are no error
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

    # ---- waiting ----

    def conds(self):
        """What the posted operations wait for: (ring, bytes) pairs for Home.wait, whether
        some source's channel is still missing, and (an ANY_SOURCE receive posted) the count
        of channels made to this rank that a new sender's channel changes (else None)."""
        conds, missing = [], False
        for dest, q in self.sends.items():
            got = self.out.get(dest)
            if got is not None and q:
                op = q[0]
                if op.phase == 0:
                    need = op.header.size - op.pos
                elif op.phase == 1:
                    need = min(op.nbytes - op.pos, _p2p.PIECE)
                elif op.cma and not op.pad:
                    need = got[2].capacity          # (the ring empty: the record read)
                else:
                    need = op.pad
                conds.append((got[2], max(1, min(need, got[2].capacity))))
        for src in set(self.recvs) | set(self.incoming):
            got = self.inn.get(src)
            if got is None:
                missing = True
                continue
            inc = self.incoming.get(src)
            if inc is None:
                need = _G
            elif inc.pos < inc.nbytes:
                need = min(inc.nbytes - inc.pos, _p2p.PIECE)
            else:
                need = inc.pad
            conds.append((got[1], max(1, need)))
        made = None
        if self.any_recvs:              # (every other channel: its next record)
            made = self.made_seen if self.made_seen is not None else self.home.made()
            for src, got in self.inn.items():
                if src not in self.recvs and src not in self.incoming:
                    conds.append((got[1], _G))
        return conds, missing, made

    def peers_waited_for(self):
        peers = set(self.sends) | set(self.recvs) | set(self.incoming)
        return peers | set(range(self.size)) if self.any_recvs else peers

    def all_ops(self):
        ops = [op for q in self.sends.values() for op in q]
        ops += [op for rs in self.recvs.values() for op in rs]
        ops += self.any_recvs
        ops += [inc.op for inc in self.incoming.values() if inc.op is not None]
        ops += [k.claimant for ks in self.kept.values() for k in ks if k.claimant is not None]
        return [op for op in ops if not op.done]

    def check(self, now):
        """Between slices (under the lock): the group, the peers, the deadlines.  Raises (after
        aborting the group) or fails the operations it concerns."""
        comm = self.comm
        group = self.group
        if self.closed or comm._closed:
            self.fail_all(ShmtreeError("shmtree: this communicator is closed"))
            return
        if group._closed:
            self.fail_all(ShmtreeError("shmtree: the group is closed"))
            return
        if group.aborted():
            self.fail_all(None)
            return
        ops = self.all_ops()
        for op in ops:
            p = op.peer
            if p == ANY_SOURCE:
                if self._check_any(op, now):
                    return
                continue
            if p == self.rank:
                continue
            member = p < group.size       # (else the node's launcher, inter=: remote.Relay)
            state = group._seg.state(p) if member else ST_BUSY
            how = group.death_of(p) if state != ST_LEFT and member else ""
            if self.relay and (state == ST_LEFT or how):
                op.finish(error=ShmtreeError(f"shmtree: rank {p} left"))    # (the launcher:
                continue                                                   # not an error)
            if state == ST_LEFT or how:
                self.progress()       # (what the peer did before it went counts: look again)
                if op.done:
                    continue
            if state == ST_LEFT and self._never(op):
                text = (f"rank {p} left the group (closed its communicator or returned from its "
                        f"function) while rank {self.rank} waited in {op.kind} "
                        f"{'to' if op.kind == 'send' else 'from'} it (tag {op.tag})")
                self._abort(ABORT_LEFT, text)
                self.fail_all(ShmtreeError(f"shmtree: rank {self.rank}: {text}; the group is "
                                           "aborted"), op)
                return
            if how:
                group.abort(ABORT_DIED, p)
                self.fail_all(PeerLostError(f"shmtree: rank {self.rank}: rank {p} died ({how}) "
                                            f"while rank {self.rank} waited in {op.kind} "
                                            f"{'to' if op.kind == 'send' else 'from'} it; the "
                                            "group is aborted"), op)
                return
            if op.deadline is not None and now >= op.deadline:
                peer, tag = (f"rank {p}", op.tag) if member or not self.relayed else \
                    (f"global rank {op.tag % self.relayed} of another node, through the "
                     "launcher", op.tag // self.relayed)
                text = (f"rank {self.rank} timed out in {op.kind} "
                        f"{'to' if op.kind == 'send' else 'from'} {peer} (tag {tag})")
                self._abort(ABORT_TIMEOUT, text)
                self.fail_all(CollectiveTimeoutError(f"shmtree: {text}; the group is aborted"),
                              op)
                return
            if self.stall_timeout is not None and state == ST_IDLE:
                since = self.idle_since.setdefault(p, now)
                if now - since >= self.stall_timeout:
                    text = (f"{op.kind} {'to' if op.kind == 'send' else 'from'} rank {p} cannot "
                            f"complete in the Pool: rank {self.rank} waited for it for "
                            f"{now - since:.1f} s while rank {p} was idle (no task, or finished "
                            f"its task without making the matching call)")
                    self._abort(ABORT_STALL, text)
                    self.fail_all(ShmtreeError(f"shmtree: rank {self.rank}: {text}; the group "
                                               "is aborted"), op)
                    return
            else:
                self.idle_since.pop(p, None)

    def _check_any(self, op, now):
        """check() of a receive from ANY_SOURCE: it fails (True: after failing every posted
        operation, as for one peer) once no other rank can ever send it anything - each died,
        or left with nothing unread (PeerLostError when one died) - or at its deadline, or in a
        Pool when every other rank has been idle for the stall timeout; while one lives and
        may send, it waits."""
        group = self.group
        if now - self.looked_at >= LOOK_S:
            self.made_seen = None     # (the next progress looks again)
        others = [p for p in range(self.size) if p != self.rank]
        gone = {}
        for p in others:
            state = group._seg.state(p)
            how = group.death_of(p) if state != ST_LEFT else ""
            if state != ST_LEFT and not how:
                break
            gone[p] = how or "left"
        if others and len(gone) == len(others):
            self.progress()           # (what they sent before they went counts: look again)
            self._find_senders()
            if op.done or any(self._unread(p) for p in others):
                return False
            died = [p for p, how in gone.items() if how != "left"]
            said = "; ".join(f"rank {p} {'left the group' if how == 'left' else f'died ({how})'}"
                             for p, how in gone.items())
            text = (f"every other rank is gone ({said}) while rank {self.rank} waited in recv "
                    f"from ANY_SOURCE (tag {'ANY_TAG' if op.tag == ANY_TAG else op.tag}): no "
                    "message can come")
            if died:
                group.abort(ABORT_DIED, died[0])
                self.fail_all(PeerLostError(f"shmtree: rank {self.rank}: {text}; the group is "
                                            "aborted"), op)
            else:
                self._abort(ABORT_LEFT, text)
                self.fail_all(ShmtreeError(f"shmtree: rank {self.rank}: {text}; the group is "
                                           "aborted"), op)
            return True
        if op.deadline is not None and now >= op.deadline:
            text = (f"rank {self.rank} timed out in recv from ANY_SOURCE (tag "
                    f"{'ANY_TAG' if op.tag == ANY_TAG else op.tag})")
            self._abort(ABORT_TIMEOUT, text)
            self.fail_all(CollectiveTimeoutError(f"shmtree: {text}; the group is aborted"), op)
            return True
        if self.stall_timeout is not None and others:
            idle = []
            for p in others:
                if group._seg.state(p) == ST_IDLE:
                    idle.append(now - self.idle_since.setdefault(p, now))
                else:
                    self.idle_since.pop(p, None)
            if len(idle) == len(others) and min(idle) >= self.stall_timeout:
                text = (f"recv from ANY_SOURCE cannot complete in the Pool: rank {self.rank} "
                        f"waited for it for {min(idle):.1f} s while every other rank was idle "
                        "(no task, or finished its task without sending)")
                self._abort(ABORT_STALL, text)
                self.fail_all(ShmtreeError(f"shmtree: rank {self.rank}: {text}; the group is "
                                           "aborted"), op)
                return True
        return False

    def _unread(self, p):
        """Bytes in rank p's channel to this rank not yet read (0: none, or no channel)."""
        got = self.inn.get(p)
        ring = got[1] if got is not None else self._in_ring(p)
        return 0 if ring is None else ring.unread()

    def _never(self, op):
        """The peer has left: can op never complete?  (A recv still can while the ring holds
        data: the state was read first.)"""
        if op.kind == "send":
            return True
        got = self.inn.get(op.peer)
        ring = got[1] if got is not None else self._in_ring(op.peer)
        return ring is None or ring.unread() == 0

    def _abort(self, reason, text):
        self.group.abort(reason, self.rank, note=text)

    def fail_all(self, exc, op=None):
        """Fail every posted operation (the group is aborted, closed): `op` with exc, the
        others with PeerLostError (exc None: all of them)."""
        lost = lost_error(self.group)(f"shmtree: rank {self.rank}: "
                                      f"{self.group.describe_abort()}") \
            if not self.group._closed else ShmtreeError("shmtree: the group is closed")
        if exc is not None and op is None:
            lost = exc
        self._fail_ops(exc, op, lost)
        self.sends.clear()
        self.incoming.clear()

    def _broken(self, exc):
        what = _broken_text(exc)
        if not self.group._closed and not self.group.aborted():
            self._abort(ABORT_FAILED, f"rank {self.rank}: {what}")
        with self.lock:
            self.fail_all(exc if isinstance(exc, ShmtreeError) else
                          ShmtreeError(f"shmtree: rank {self.rank}: {what}; the group is aborted"))
            finished = self._finished_requests()
        self._complete(finished)

    def _wait(self, conds, missing, made, budget):
        """Wait (outside the lock) for what conds() said: the conds, a missing sender's channel
        (looked up again after each ring), a new channel for an ANY_SOURCE receive (made: the
        count of channels made to this rank when its senders were last looked for)."""
        ns = max(100_000, int(budget * 1e9))
        if missing:                  # a sender's channel to look for: it rings when it makes it
            seen = self.home.hold()
            try:
                with self.lock:
                    for src in set(self.recvs) | set(self.incoming):
                        if src not in self.inn and self._in_ring(src) is not None:
                            return
                    if made is not None and self.home.made() != made:
                        return
                    ready = any(r.avail() >= n if not r.sender else r.room() >= n
                                for r, n in conds)
                if not ready:
                    self.home.sleep(seen, ns)
            finally:
                self.home.unhold()
        else:
            self.home.wait(conds, ns, self.spin_ns, -1 if made is None else made)

    def _wake(self):
        self.home.ring()

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


# ---------------------------------------------------------------------------------------------
# the public calls (a mixin of Communicator)


def _rank_arg(comm, r, what, any_ok=False):
    """A rank argument checked: an int in 0..size-1, or (any_ok: a receive's source)
    ANY_SOURCE."""
    try:
        r = operator.index(r)
    except TypeError:
        raise TypeError(f"shmtree: {what} must be an int, got {type(r).__name__}") from None
    if not 0 <= r < comm.size:
        if r == ANY_SOURCE:
            if any_ok:
                return r
            raise ValueError(f"shmtree: {what} ANY_SOURCE ({ANY_SOURCE}) is for receives only: "
                             f"a message goes to a rank in 0..{comm.size - 1}")
        raise ValueError(f"shmtree: {what} {r} is outside 0..{comm.size - 1}")
    return r


def _tag_arg(tag, what="tag", any_ok=False):
    """A tag checked: an int >= 0, or (any_ok: a receive's) ANY_TAG."""
    try:
        tag = operator.index(tag)
    except TypeError:
        raise TypeError(f"shmtree: {what} must be an int >= 0, got {type(tag).__name__}") \
            from None
    if not 0 <= tag < 2**63:
        if tag == ANY_TAG:
            if any_ok:
                return tag
            raise ValueError(f"shmtree: {what} ANY_TAG ({ANY_TAG}) is for receives only: a "
                             "message's tag is an int >= 0")
        raise ValueError(f"shmtree: {what} must be an int >= 0, got {tag}")
    return tag


def _asked(source, tag):
    """(source, tag) as a receive named them, None for ANY_SOURCE / ANY_TAG (_Recv.asked)."""
    return (None if source == ANY_SOURCE else source, None if tag == ANY_TAG else tag)


def _out_arg(out):
    if out is None:
        return None
    if not isinstance(out, np.ndarray):
        raise TypeError(f"shmtree: recv: out must be a numpy array, got {type(out).__name__}")
    if not out.flags.writeable:
        raise ValueError("shmtree: recv: out is read-only")
    return out


# (Messages.send, recv, sendrecv)
_native_send, _native_recv = _p2p.messages_send, _p2p.messages_recv
_native_sendrecv = _p2p.messages_sendrecv
for _f, _name in ((_native_send, "send"), (_native_recv, "recv"),
                  (_native_sendrecv, "sendrecv")):
    _f.__name__, _f.__qualname__, _f.__module__ = _name, f"Messages.{_name}", __name__


class Messages:
    """Point-to-point messages of a communicator (docs/design.md, "How messages travel")."""

    _p2p_transport = None
    _p2p_quick = None           # the transport's Quick, once made, when _p2p_route is this
                                # class's (send and recv call it first: see send)

    def _p2p_nonce(self):
        """What names this communicator's channels: its group's nonce (a sub-communicator
        has a group, and so a nonce, of its own)."""
        return self.group._nonce

    def _p2p_pid(self, r):
        """The pid of rank r's process (0 while it has not joined): from its join record in
        the group's segment.  (A communicator whose ranks are not its group's overrides this
        and _p2p_nonce.)"""
        if r >= self.group.size:         # (inter=: the node's launcher, relaying between nodes)
            return _launcher_pid(self.group)
        joined, pid, _ = self.group._seg.member(r)
        return pid if joined else 0

    def _p2p_route(self, r, what, tag, tag_what="tag"):
        """(transport, rank in it, tag in it) that carry messages with `tag` to or from rank r
        (`what`, `tag_what` name them): here the one transport, r and tag as given (the native
        quick path checks what it takes, the calls check them otherwise).  (A communicator
        across nodes routes each peer, checked and translated: remote.SpanningMessages.)"""
        return self._p2p(), r, tag

    def _p2p(self):
        tr = self._p2p_transport
        if self._closed or self._gen != session._fork_gen or self.group._closed \
                or self.group.aborted():
            self._check_usable()      # (raises: closed, a forked child's, aborted)
        if tr is None:
            tr = self._p2p_transport = Transport(self)
            if type(self)._p2p_route is Messages._p2p_route:
                self._p2p_quick = tr.quick    # (routed across nodes: never, each call routes)
        return tr

    # A plain communicator's send, recv and sendrecv begin natively (_p2p.messages_send,
    # messages_recv, messages_sendrecv: the quick path first, with no Python-level check, as
    # it checks what _p2p does, Quick._usable, and declines, nothing done, whatever it does
    # not take), and come to these general paths, which raise what is wrong, when it declines.
    send = _native_send
    recv = _native_recv
    sendrecv = _native_sendrecv

    def _send_general(self, array, dest, tag, timeout, tried):
        """send, past the quick path (tried: already, by _p2p.messages_send)."""
        tr, dest, tag = self._p2p_route(dest, "dest", tag)
        if not tried and tr.quick.send(array, dest, tag):   # (described as one sent before)
            return None
        dest, tag, array = _rank_arg(self, dest, "dest"), _tag_arg(tag), movable(array, "send")
        if tr.quick_send(array, dest, tag):
            return None
        op = _Send(dest, tag, deadline_of(timeout), array, tr.cma)
        with tr.lock:
            tr.post_send(op)
        tr.run([op])
        if op.error is not None:
            raise op.error
        return None

    def _recv_general(self, source, tag, out, timeout, deadline, tried, status=None):
        """recv, past the quick path (tried: already, by _p2p.messages_recv, with the deadline
        given; else the deadline is timeout's, found here)."""
        asked = self._p2p_asked(source, tag)
        tr, source, tag = self._p2p_route(source, "source", tag)
        _status_arg(status)
        if not tried:
            deadline = deadline_of(timeout)
            got = tr.quick.recv(source, tag, out, deadline)      # (checks what it takes)
            if got is not None:
                if status is not None:
                    _set_status(status, asked[0], asked[1], got)
                return got
        source, tag = _rank_arg(self, source, "source", True), _tag_arg(tag, any_ok=True)
        op = _Recv(source, tag, deadline, _out_arg(out), asked)
        with tr.lock:
            tr.post_recv(op)
        tr.run([op])
        if op.error is not None:
            raise op.error
        if status is not None:
            op.status(status)
        return op.result

    def _p2p_asked(self, source, tag):
        """(_Recv.asked) A receive's source and tag as named, in this communicator's ranks and
        tags: None for ANY_SOURCE / ANY_TAG (then the message's, once matched), the rest
        checked (a communicator across nodes translates them for its transports)."""
        try:
            source, tag = operator.index(source), operator.index(tag)
        except TypeError:
            return (None, None)           # (the route's checks raise what is wrong)
        return _asked(source, tag)

    def _sendrecv_general(self, array, dest, source, sendtag, recvtag, out, timeout,
                          status=None):
        """sendrecv, past the quick path (_p2p.messages_sendrecv)."""
        asked = self._p2p_asked(source, recvtag)
        tr, dest, sendtag = self._p2p_route(dest, "dest", sendtag, "sendtag")
        from_tr, source, recvtag = self._p2p_route(source, "source", recvtag, "recvtag")
        deadline = deadline_of(timeout)
        dest, sendtag = _rank_arg(self, dest, "dest"), _tag_arg(sendtag, "sendtag")
        source = _rank_arg(self, source, "source", True)
        recvtag = _tag_arg(recvtag, "recvtag", True)
        array, out, status = movable(array, "send"), _out_arg(out), _status_arg(status)
        if from_tr is not tr:           # (across nodes: one peer on this node, one elsewhere)
            request = self._p2p_post(from_tr, _Recv(source, recvtag, deadline, out, asked),
                                     "irecv")
            op = _Send(dest, sendtag, deadline, array, tr.cma)
            with tr.lock:
                tr.post_send(op)
            tr.run([op])
            if op.error is not None:
                raise op.error
            got = request.result()
            if status is not None:
                for name in Status.__slots__:
                    setattr(status, name, getattr(request.status, name))
            return got
        if tr.quick_send(array, dest, sendtag):      # (a small message: sent already)
            got = tr.quick.recv(source, recvtag, out, deadline)
            if got is not None:
                if status is not None:
                    _set_status(status, asked[0], asked[1], got)
                return got
            ops = [_Recv(source, recvtag, deadline, out, asked)]
        else:
            ops = [_Send(dest, sendtag, deadline, array, tr.cma),
                   _Recv(source, recvtag, deadline, out, asked)]
        with tr.lock:
            for op in ops:
                (tr.post_send if op.kind == "send" else tr.post_recv)(op)
        tr.run(ops)
        for op in ops:
            if op.error is not None:
                raise op.error
        if status is not None:
            ops[-1].status(status)
        return ops[-1].result

    def isend(self, array, dest, *, tag=0, timeout=None):
        """send, nonblocking: a Request (the array must not be modified until it is done)."""
        tr, dest, tag = self._p2p_route(dest, "dest", tag)
        op = _Send(_rank_arg(self, dest, "dest"), _tag_arg(tag), deadline_of(timeout),
                   movable(array, "send"), tr.cma)
        return self._p2p_post(tr, op, "isend")

    def irecv(self, source, *, tag=0, out=None, timeout=None):
        """recv, nonblocking: a Request whose result is the received array, and whose
        `status` (a shmtree.Status) says the message's source, tag and size once it is done.
        source and tag may be ANY_SOURCE and ANY_TAG, as recv's."""
        asked = self._p2p_asked(source, tag)
        tr, source, tag = self._p2p_route(source, "source", tag)
        op = _Recv(_rank_arg(self, source, "source", True), _tag_arg(tag, any_ok=True),
                   deadline_of(timeout), _out_arg(out), asked)
        return self._p2p_post(tr, op, "irecv")

    def _p2p_post(self, tr, op, name):
        n = self._posted = self._posted + 1
        request = Request(name, n, tr)
        with tr.lock:
            if op.kind == "send":
                tr.post_send(op)
            else:
                tr.post_recv(op)
            tr.post_nonblocking(op, request)
        return request

    def _messages_drain(self):
        tr = self._p2p_transport
        if tr is not None and tr.pid == os.getpid() and tr.nonblocking:
            tr.drain_sends()

    def _messages_close(self):
        tr = self._p2p_transport
        if tr is not None and tr.pid == os.getpid():
            self._p2p_transport = self._p2p_quick = None
            tr.close()


_p2p.set_general(Messages._send_general, Messages._recv_general, Messages._sendrecv_general,
                 deadline_of, _set_status)
