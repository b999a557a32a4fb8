"""What point-to-point messages are made of (p2p/messages.py says how they travel): the
envelope and the descriptions of dtype and shape, ANY_SOURCE, ANY_TAG and Status, and the
operations a transport posts (sends, receives, kept messages)."""
from __future__ import annotations

import os
import pickle
import struct

import numpy as np

from .. import _moving, _p2p


__all__ = ["Status", "ANY_SOURCE", "ANY_TAG"]

# the transports' sizes and times
RING_BYTES = 1 << 20        # a channel's ring (pages are committed as they are first written)
CMA_BYTES = 4 << 20         # from this size the receiver copies straight from the sender's
                            # memory (process_vm_readv): one copy, no ring.  Below it the ring's
                            # two copies, in parallel through pages hot in cache, are faster
                            # (measured, sendrecv at P = 2, 2-vCPU AMD VM: 2 MiB 13.5 GB/s by
                            # the ring, 9.8 by the single copy; 4 MiB 11.9 and 12.8; 16 MiB 5.9
                            # and 9.0; from 256 KiB until 2026-12-04)
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
                            # relaying: relay.Relay, whose receives take any tag)


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
