# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Point-to-point messages, the native half (shmtree/messages.py; docs/design.md, "How messages
travel").

Two kinds of shared pages, each a sealed memfd of its own (mapped with _moving.Mapping):

- a rank's **home** (one page): its futex *bell* and *sleepers* count, and the count of
  channels made to it (*made*: a sender adds one, then rings, when it makes its channel to
  this rank, so that a receive from any source looks for new channels only when it moved).
  Whatever a rank's messages may wait for (data from any peer, room in any channel to a peer,
  a new channel) rings this one bell, so one thread waits for any number of channels on one
  futex.
- a **channel** from a sender to a receiver, made by the sender on its first message to that
  receiver: a header page and a byte ring (a power of two).  The sender alone writes `head`,
  the receiver alone `tail` (release stores; the other side's acquire loads: _csrc/shm_sync.h),
  each on its own 128-byte line: a lock-free single-producer single-consumer ring.  Messages
  are records of 64-byte granules (envelope and description, then the payload), so a payload
  larger than the ring streams through it in pieces while the receiver copies them out.

Publishing and waking follow the engine's protocol (engine/wait.pxi): the publisher stores its
counter, issues a full fence and rings the peer's bell only when the peer's sleepers count is
up; a waiter raises its count, fences, reads the bell, looks again and only then sleeps with the
bell value it read.  No wake-up is lost.
"""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.exc cimport PyErr_CheckSignals
from cpython.pythread cimport (NOWAIT_LOCK, PY_LOCK_ACQUIRED, PyLockStatus, PyThread_acquire_lock,
                               PyThread_allocate_lock, PyThread_free_lock,
                               PyThread_release_lock, PyThread_type_lock)
from cpython.ref cimport Py_INCREF
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp, memcpy

import os

import numpy as np
cimport numpy as cnp

cnp.import_array()

cdef extern from "numpy/arrayobject.h":
    object PyArray_Empty(int nd, cnp.npy_intp *dims, cnp.PyArray_Descr *descr, int fortran)  # steals descr


cdef extern from *:
    """
    #ifdef Py_GIL_DISABLED
    #define SHMTREE_NO_GIL 1
    #else
    #define SHMTREE_NO_GIL 0
    #endif
    """
    const bint NO_GIL "SHMTREE_NO_GIL"     # (a free-threaded Python: _p2p.Lock's token is the
                                          # lock itself)

cdef extern from "pythread.h":
    PyLockStatus PyThread_acquire_lock_timed(PyThread_type_lock lock, long long microseconds,
                                             int intr_flag) nogil

cdef extern from "sched.h" nogil:
    int sched_yield()

cdef extern from "_csrc/shm_sync.h" nogil:
    uint64_t shm_load_acquire64(const volatile uint64_t *p)
    uint64_t shm_load_relaxed64(const volatile uint64_t *p)
    void shm_store_release64(volatile uint64_t *p, uint64_t v)
    uint32_t shm_load_seqcst32(const volatile uint32_t *p)
    void shm_store_seqcst32(volatile uint32_t *p, uint32_t v)
    uint32_t shm_fetch_add32(volatile uint32_t *p, uint32_t v)
    void shm_fence()
    void shm_cpu_relax()
    int64_t shm_now_ns()
    int shm_futex_wait(volatile uint32_t *addr, uint32_t expected, int64_t timeout_ns)
    void shm_futex_wake_all(volatile uint32_t *addr)

# ---- layout (bytes) ----
cdef enum:
    HOME_BYTES = 4096
    CHAN_HEADER = 4096
    OFF_MAGIC = 0             # u64
    OFF_NONCE = 8             # 16 bytes: the group's nonce
    OFF_SRC = 24              # u32 sender rank (a home: its rank)
    OFF_DST = 28              # u32 receiver rank
    OFF_RING = 32             # u64 ring bytes
    OFF_SPID = 40             # u64 sender pid
    OFF_SHOME = 48            # u64 sender's home descriptor (in the sender)
    OFF_HEAD = 128            # u64, the sender's
    OFF_TAIL = 256            # u64, the receiver's
    OFF_ATTACHED = 384        # u32: the receiver has mapped the channel and the sender's home
    OFF_RPID = 392            # u64 receiver pid
    OFF_RHOME = 400           # u64 receiver's home descriptor
    HOME_BELL = 128           # u32
    HOME_SLEEPERS = 256       # u32 count of this rank's threads asleep on the bell
    HOME_MADE = 384           # u32 count of the channels made to this rank (by their senders)
    GRANULE = 64

DEF HOME_MAGIC = 0x454d4f485453504d
DEF CHAN_MAGIC = 0x4e414843545350d0
PAGE_BYTES = HOME_BYTES
HEADER_BYTES = CHAN_HEADER
RECORD_GRANULE = GRANULE
PIECE = 65536             # a copy publishes (and rings) after every piece: the peer starts early

DEF MAX_CONDS = 256
DEF MEMO_DIMS = 64        # (numpy's most dimensions)
DEF MEMO_META = 512       # the quick paths remember descriptions of at most this many bytes
DEF C_PIECE = 65536
DEF YIELD_NS = 200000
DEF BUSY_YIELD_NS = 50000   # a sched_yield that took this long: another thread ran
DEF BUSY_FOR_NS = 200000000  # and for this long, waits sleep without yielding
DEF SLEEP_NS = 5000000
DEF NOGIL_BYTES = 16384   # a quick path's copy releases the GIL only when larger: releasing
                          # and taking it back costs more than a small copy (~0.1 us)


cdef inline void ring_bell(volatile uint32_t *bell, volatile uint32_t *sleepers) noexcept nogil:
    """After a publication: wake the peer if it sleeps (fence first: pairs with the sleeper's)."""
    shm_fence()
    if sleepers != NULL and shm_load_seqcst32(sleepers) != 0:
        shm_fetch_add32(bell, 1)
        shm_futex_wake_all(bell)


cdef struct Cond:
    volatile uint64_t *head
    volatile uint64_t *tail
    uint64_t size
    uint64_t need
    bint sender


cdef inline bint cond_ready(Cond *c) noexcept nogil:
    if c.sender:
        return c.size - (shm_load_acquire64(c.head) - shm_load_acquire64(c.tail)) >= c.need
    return shm_load_acquire64(c.head) - shm_load_acquire64(c.tail) >= c.need


include "p2p/rings.pxi"
include "p2p/quick.pxi"


# ---- Messages.send, recv and sendrecv (bound as methods: cyfunctions) ----
#
# A plain communicator's blocking send, recv and sendrecv begin here, natively, with the quick
# path (Quick._send, Quick._recv: they check that the communicator is usable first), and call
# the general path, in Python, only when it declines: messages.Messages._send_general,
# _recv_general and _sendrecv_general (set_general), which check every argument and raise
# what is wrong.

cdef object _send_general = None, _recv_general = None, _sendrecv_general = None
cdef object _deadline_of = None, _set_status = None


def set_general(send_general, recv_general, sendrecv_general, deadline_of, set_status):
    """(messages.py, once.)  The general paths of send, recv and sendrecv, calls.deadline_of
    (the one rule of a timeout), and what fills a Status of a received message (status,
    source, tag, array)."""
    global _send_general, _recv_general, _sendrecv_general, _deadline_of, _set_status
    _send_general, _recv_general, _deadline_of = send_general, recv_general, deadline_of
    _sendrecv_general, _set_status = sendrecv_general, set_status


def messages_send(self, array, dest, *, tag=0, timeout=None):
    """Send `array` to rank `dest` (a copy: the array may be modified once send returns).
    Returns when the message is in the channel (a large one: once the receiver has taken
    all but a ring's worth); may wait until the matching recv is posted."""
    quick = self._p2p_quick
    if type(quick) is Quick:
        if (<Quick>quick)._send(array, dest, tag):
            return None
        return _send_general(self, array, dest, tag, timeout, True)
    return _send_general(self, array, dest, tag, timeout, False)


def messages_recv(self, source, *, tag=0, out=None, timeout=None, status=None):
    """Receive the next message from rank `source` (shmtree.ANY_SOURCE: from any rank) with
    tag `tag` (shmtree.ANY_TAG: any tag): a new array of the sender's shape and dtype, or
    `out` (same shape and dtype: else ValueError, and the message is consumed).  status: a
    shmtree.Status, given the message's source, tag and size.  Messages from one source with
    one tag arrive in the order sent; receives match in the order they were posted."""
    quick = self._p2p_quick
    if type(quick) is Quick:
        deadline = None
        if timeout is not None:
            try:
                deadline = _deadline_of(timeout)
            except ValueError:      # (said after the general path's checks, as ever)
                return _recv_general(self, source, tag, out, timeout, None, False, status)
        got = (<Quick>quick)._recv(source, tag, out, deadline)   # (declines ANY_SOURCE and
        if got is not None:                                      # ANY_TAG: negative)
            if status is not None:
                _set_status(status, source, tag, got)
            return got
        return _recv_general(self, source, tag, out, timeout, deadline, True, status)
    return _recv_general(self, source, tag, out, timeout, None, False, status)


def messages_sendrecv(self, array, dest, source, *, sendtag=0, recvtag=0, out=None,
                      timeout=None, status=None):
    """Send `array` to `dest` and receive from `source` at once (neither waits for the other
    to finish): the received array (or `out`).  source and recvtag may be ANY_SOURCE and
    ANY_TAG, and status a shmtree.Status, as recv's.

    The quick path (a halo exchange's small messages): Quick._send, then Quick._recv, when
    the receive's arguments are ones the general path takes as they are (an int source with
    a channel already, so a rank; an int tag in range; `out` an ndarray or None), so that
    nothing is sent by a call that the general path would refuse; the receive goes the
    general way when Quick._recv declines after the send.  (ANY_SOURCE, ANY_TAG: the general
    way, since no channel is under -1 and a tag must be >= 0 here.)"""
    quick = self._p2p_quick
    deadline = None
    if type(quick) is Quick and type(source) is int and type(recvtag) is int \
            and 0 <= recvtag < 2**63 and (out is None or type(out) is _NDARRAY) \
            and source in (<Quick>quick).inn:
        if timeout is not None:
            try:
                deadline = _deadline_of(timeout)
            except Exception:       # (raised by the general path, after its own checks)
                return _sendrecv_general(self, array, dest, source, sendtag, recvtag, out,
                                         timeout, status)
        if (<Quick>quick)._send(array, dest, sendtag):
            got = (<Quick>quick)._recv(source, recvtag, out, deadline)
            if got is not None:
                if status is not None:
                    _set_status(status, source, recvtag, got)
                return got
            return _recv_general(self, source, recvtag, out, timeout, deadline, True, status)
    return _sendrecv_general(self, array, dest, source, sendtag, recvtag, out, timeout,
                             status)


cdef inline char *_b(m) except NULL:
    if m.size < CHAN_HEADER:
        raise ValueError("shmtree: a mapping too small for a message page")
    return <char *><size_t>m.address


def init_home(m, bytes nonce, int rank):
    (<uint64_t *>(_b(m) + OFF_MAGIC))[0] = HOME_MAGIC
    memcpy(_b(m) + OFF_NONCE, <const char *>nonce, 16)
    (<uint32_t *>(_b(m) + OFF_SRC))[0] = rank


def check_home(m, bytes nonce, int rank):
    return ((<uint64_t *>(_b(m) + OFF_MAGIC))[0] == HOME_MAGIC and
            _b(m)[OFF_NONCE:OFF_NONCE + 16] == nonce and
            (<uint32_t *>(_b(m) + OFF_SRC))[0] == <uint32_t>rank)


def init_channel(m, bytes nonce, int src, int dst, uint64_t ring, uint64_t pid,
                 uint64_t home_fd):
    (<uint64_t *>(_b(m) + OFF_MAGIC))[0] = CHAN_MAGIC
    memcpy(_b(m) + OFF_NONCE, <const char *>nonce, 16)
    (<uint32_t *>(_b(m) + OFF_SRC))[0] = src
    (<uint32_t *>(_b(m) + OFF_DST))[0] = dst
    (<uint64_t *>(_b(m) + OFF_RING))[0] = ring
    (<uint64_t *>(_b(m) + OFF_SPID))[0] = pid
    (<uint64_t *>(_b(m) + OFF_SHOME))[0] = home_fd


def channel_header(m):
    """(ok, src, dst, ring bytes, sender pid, sender home fd) of a mapped channel, given the
    nonce check by the caller (nonce bytes returned first)."""
    return (_b(m)[OFF_NONCE:OFF_NONCE + 16], (<uint64_t *>(_b(m) + OFF_MAGIC))[0] == CHAN_MAGIC,
            (<uint32_t *>(_b(m) + OFF_SRC))[0], (<uint32_t *>(_b(m) + OFF_DST))[0],
            (<uint64_t *>(_b(m) + OFF_RING))[0], (<uint64_t *>(_b(m) + OFF_SPID))[0],
            (<uint64_t *>(_b(m) + OFF_SHOME))[0])


def set_receiver(m, uint64_t pid, uint64_t home_fd):
    (<uint64_t *>(_b(m) + OFF_RPID))[0] = pid
    (<uint64_t *>(_b(m) + OFF_RHOME))[0] = home_fd


def receiver_of(m):
    return (<uint64_t *>(_b(m) + OFF_RPID))[0], (<uint64_t *>(_b(m) + OFF_RHOME))[0]


# ---- single copy of large messages: the receiver reads the sender's memory (CMA) ----

cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void *iov_base
        size_t iov_len
    ssize_t process_vm_readv(int pid, const iovec *local, unsigned long liovcnt,
                             const iovec *remote, unsigned long riovcnt, unsigned long flags)

cdef extern from "<errno.h>" nogil:
    int errno


def cma_read(long pid, size_t remote, size_t local, size_t n):
    """Copy n bytes at `remote` in process pid to `local` here (process_vm_readv, the GIL
    released): 0, or the errno of the failure."""
    cdef iovec l, r
    cdef ssize_t got
    cdef size_t done = 0
    cdef int err = 0
    with nogil:
        while done < n:
            l.iov_base = <void *>(local + done)
            l.iov_len = n - done
            r.iov_base = <void *>(remote + done)
            r.iov_len = n - done
            got = process_vm_readv(<int>pid, &l, 1, &r, 1, 0)
            if got <= 0:
                err = errno if got < 0 else 5
                break
            done += got
    return err
