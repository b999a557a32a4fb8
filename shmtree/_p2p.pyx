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


cdef class Home:
    """This rank's (or a peer's) home page."""
    cdef object m
    cdef char *base
    cdef volatile uint32_t *bell
    cdef volatile uint32_t *sleepers
    cdef int64_t busy_until           # until then, a wait skips its yield phase (_wait)
    cdef volatile uint32_t *made_count

    def __cinit__(self, m):
        if m.size < HOME_BYTES:
            raise ValueError("shmtree: a home page is 4 KiB")
        self.m = m
        self.base = <char *><size_t>m.address
        self.bell = <volatile uint32_t *>(self.base + 128)
        self.sleepers = <volatile uint32_t *>(self.base + 256)
        self.made_count = <volatile uint32_t *>(self.base + HOME_MADE)

    def ring(self):
        ring_bell(self.bell, self.sleepers)

    def made(self):
        """How many channels senders have made to this rank (each adds one, then rings)."""
        return shm_load_seqcst32(self.made_count)

    def note_made(self):
        """(A sender, once its channel to this home's rank is made and can be looked up.)
        Count it, then ring: a receive from any source waiting here looks for it."""
        shm_fetch_add32(self.made_count, 1)
        ring_bell(self.bell, self.sleepers)

    def hold(self):
        """Count this thread as a sleeper (before looking at anything it will then wait for):
        a peer that publishes meanwhile rings the bell.  Returns the bell's value."""
        shm_fetch_add32(self.sleepers, 1)
        shm_fence()
        return shm_load_seqcst32(self.bell)

    def unhold(self):
        shm_fetch_add32(self.sleepers, <uint32_t>-1)

    def sleep(self, uint32_t seen, int64_t ns):
        """(Between hold and unhold.)  Sleep while the bell still reads `seen`, at most ns."""
        cdef int64_t end = shm_now_ns() + ns, now
        with nogil:
            while True:
                if shm_load_seqcst32(self.bell) != seen:
                    break
                now = shm_now_ns()
                if now >= end:
                    break
                shm_futex_wait(self.bell, seen, min(end - now, <int64_t>SLEEP_NS))

    def wait(self, list conds, int64_t slice_ns, int64_t spin_ns, int64_t made=-1):
        """Wait until one of `conds` holds, at most slice_ns (GIL released): spin (pause) for
        spin_ns, yield for 200 us, then sleep on the bell.  conds: (Ring, need) pairs: a sender's
        ring waits for `need` bytes of room, a receiver's for `need` bytes of data; made >= 0:
        also until the count of channels made to this rank is no longer `made` (a receive from
        any source: a sender it has not heard from made its channel).  Returns True when one
        holds (or the bell rang), False when the slice ran out."""
        cdef int n = len(conds), i
        if n > MAX_CONDS:
            n = MAX_CONDS
        cdef Cond cs[MAX_CONDS]
        cdef Ring rg
        cdef bint ok
        for i in range(n):
            r, need = conds[i]
            rg = <Ring?>r
            _cond(&cs[i], rg, need)
        with nogil:
            ok = self._wait(cs, n, slice_ns, spin_ns, made)
        return ok

    cdef bint _wait(self, Cond *cs, int n, int64_t slice_ns, int64_t spin_ns,
                    int64_t made=-1) noexcept nogil:
        cdef int64_t start, now, end
        cdef uint32_t seen
        cdef bint ok = False, spinning = spin_ns > 0
        cdef int i, spins = 0
        start = shm_now_ns()
        end = start + slice_ns
        while True:
            for i in range(n):
                if cond_ready(&cs[i]):
                    return True
            if made >= 0 and shm_load_seqcst32(self.made_count) != <uint32_t>made:
                return True
            # one pause per look, the clock read every 32 looks (as the engine's idle): 32
            # pauses per look made a ping-pong's message 0.3-0.4 us slower (a pause is some
            # 40-140 cycles)
            spins += 1
            if spinning and (spins & 31):
                shm_cpu_relax()
                continue
            now = shm_now_ns()
            if now >= end:
                return False
            if now - start < spin_ns:
                shm_cpu_relax()
            elif now - start < spin_ns + YIELD_NS and now >= self.busy_until:
                spinning = False
                sched_yield()
                if shm_now_ns() - now > BUSY_YIELD_NS:    # (another thread had this CPU:
                    self.busy_until = shm_now_ns() + BUSY_FOR_NS    # sleep, as the engine's
            else:                                                   # idle, wait.pxi)
                shm_fetch_add32(self.sleepers, 1)
                shm_fence()
                seen = shm_load_seqcst32(self.bell)
                for i in range(n):
                    if cond_ready(&cs[i]):
                        ok = True
                        break
                if made >= 0 and shm_load_seqcst32(self.made_count) != <uint32_t>made:
                    ok = True
                if not ok:
                    shm_futex_wait(self.bell, seen, min(end - now, <int64_t>SLEEP_NS))
                shm_fetch_add32(self.sleepers, <uint32_t>-1)
                if ok or shm_load_seqcst32(self.bell) != seen:
                    return True


cdef inline void _cond(Cond *c, Ring rg, uint64_t need) noexcept:
    c.head = rg.head
    c.tail = rg.tail
    c.size = rg.size
    c.sender = rg.sender
    c.need = need


cdef class Ring:
    """One side of a channel (the sender's or the receiver's)."""
    cdef object m
    cdef object peer_m
    cdef char *data
    cdef volatile uint64_t *head
    cdef volatile uint64_t *tail
    cdef volatile uint32_t *attached
    cdef uint64_t size
    cdef uint64_t mask
    cdef readonly bint sender
    cdef volatile uint32_t *pbell
    cdef volatile uint32_t *psleepers
    # the quick paths' memo of the last message on this channel (Quick.send, Quick.recv): its
    # dtype, shape and tag; the sender's record header, the receiver's description bytes
    cdef object q_dtype
    cdef object q_tag
    cdef bytes q_bytes
    cdef int q_nd
    cdef cnp.npy_intp q_dims[MEMO_DIMS]

    def __cinit__(self, m, bint sender):
        cdef char *base = <char *><size_t>m.address
        cdef uint64_t size = (<uint64_t *>(base + OFF_RING))[0]
        if size == 0 or size & (size - 1) or CHAN_HEADER + size > <uint64_t>m.size:
            raise ValueError("shmtree: not a message channel (bad ring size)")
        self.m = m
        self.sender = sender
        self.size = size
        self.mask = size - 1
        self.data = base + CHAN_HEADER
        self.head = <volatile uint64_t *>(base + OFF_HEAD)
        self.tail = <volatile uint64_t *>(base + OFF_TAIL)
        self.attached = <volatile uint32_t *>(base + OFF_ATTACHED)

    def set_peer(self, home):
        """The peer's home: rung after every publication (the peer may wait for it)."""
        cdef char *base = <char *><size_t>home.address
        self.peer_m = home
        self.pbell = <volatile uint32_t *>(base + 128)
        self.psleepers = <volatile uint32_t *>(base + 256)

    @property
    def has_peer(self):
        return self.pbell != NULL

    def is_attached(self):
        return shm_load_seqcst32(self.attached) != 0

    def attach(self):
        """(The receiver, once it maps the channel and the sender's home.)  Then look again:
        pairs with the sender's fence after publishing."""
        shm_store_seqcst32(self.attached, 1)
        shm_fence()

    def wake(self):
        ring_bell(self.pbell, self.psleepers)

    def room(self):
        return self.size - (shm_load_relaxed64(self.head) - shm_load_acquire64(self.tail))

    def avail(self):
        return shm_load_acquire64(self.head) - shm_load_relaxed64(self.tail)

    def unread(self):
        """(Either side.)  Bytes published and not yet consumed."""
        return shm_load_acquire64(self.head) - shm_load_acquire64(self.tail)

    @property
    def capacity(self):
        return self.size

    def write(self, size_t addr, size_t n):
        """Copy up to n bytes from addr into the ring, as room allows, publishing after every
        piece (GIL released).  Returns the bytes written."""
        cdef const char *src = <const char *>addr
        cdef uint64_t h, t, room, k, pos, first
        cdef size_t done = 0
        with nogil:
            h = shm_load_relaxed64(self.head)
            while done < n:
                t = shm_load_acquire64(self.tail)
                room = self.size - (h - t)
                if room == 0:
                    break
                k = min(min(<uint64_t>(n - done), room), <uint64_t>C_PIECE)
                pos = h & self.mask
                first = min(k, self.size - pos)
                memcpy(self.data + pos, src + done, first)
                if k > first:
                    memcpy(self.data, src + done + first, k - first)
                h += k
                done += k
                shm_store_release64(self.head, h)
                ring_bell(self.pbell, self.psleepers)
        return done

    def skip_write(self, uint64_t n):
        """Advance the head by n bytes of padding (there must be room)."""
        shm_store_release64(self.head, shm_load_relaxed64(self.head) + n)
        ring_bell(self.pbell, self.psleepers)

    def read(self, size_t addr, size_t n, bint consume=True):
        """Copy up to n bytes of data out of the ring into addr (GIL released), releasing the
        room after every piece unless consume is False (a peek: from the tail, nothing
        released).  Returns the bytes read."""
        cdef char *dst = <char *>addr
        cdef uint64_t h, t, have, k, pos, first
        cdef size_t done = 0
        with nogil:
            t = shm_load_relaxed64(self.tail)
            while done < n:
                h = shm_load_acquire64(self.head)
                have = h - t
                if have == 0:
                    break
                k = min(min(<uint64_t>(n - done), have), <uint64_t>C_PIECE)
                pos = t & self.mask
                first = min(k, self.size - pos)
                memcpy(dst + done, self.data + pos, first)
                if k > first:
                    memcpy(dst + done + first, self.data, k - first)
                t += k
                done += k
                if consume:
                    shm_store_release64(self.tail, t)
                    ring_bell(self.pbell, self.psleepers)
        return done

    cdef void _copy_in(self, uint64_t h, const char *src, uint64_t k) noexcept nogil:
        cdef uint64_t pos = h & self.mask, first = min(k, self.size - pos)
        memcpy(self.data + pos, src, first)
        if k > first:
            memcpy(self.data, src + first, k - first)

    cdef void _copy_out(self, uint64_t t, char *dst, uint64_t k) noexcept nogil:
        cdef uint64_t pos = t & self.mask, first = min(k, self.size - pos)
        memcpy(dst, self.data + pos, first)
        if k > first:
            memcpy(dst + first, self.data, k - first)

    cdef bint _put(self, const char *header, uint64_t n, const char *src, uint64_t nbytes,
                   uint64_t pad) noexcept:
        """A whole small record at once (header, payload, padding), published once: True, or
        False (nothing written) when the ring has not the room."""
        cdef uint64_t h = shm_load_relaxed64(self.head)
        if self.size - (h - shm_load_acquire64(self.tail)) < n + nbytes + pad:
            return False
        self._copy_in(h, header, n)
        if nbytes > NOGIL_BYTES:
            with nogil:
                self._copy_in(h + n, src, nbytes)
        elif nbytes:
            self._copy_in(h + n, src, nbytes)
        shm_store_release64(self.head, h + n + nbytes + pad)
        ring_bell(self.pbell, self.psleepers)
        return True

    cdef bint _same_shape(self, int nd, cnp.npy_intp *dims) noexcept:
        return nd == self.q_nd and memcmp(dims, self.q_dims, nd * sizeof(cnp.npy_intp)) == 0

    cdef void _memo_shape(self, int nd, cnp.npy_intp *dims) noexcept:
        self.q_nd = nd if nd <= MEMO_DIMS else -1
        if nd <= MEMO_DIMS:
            memcpy(self.q_dims, dims, nd * sizeof(cnp.npy_intp))

    def envelope(self):
        """(magic, tag, payload bytes, description bytes, header bytes, data available, flags,
        address) of the record at the tail, or None when its envelope is not all there."""
        cdef uint64_t t = shm_load_relaxed64(self.tail)
        cdef uint64_t have = shm_load_acquire64(self.head) - t
        cdef uint64_t env[8]
        if have < GRANULE:
            return None
        self._copy_out(t, <char *>env, GRANULE)
        return env[0], env[1], env[2], env[3], env[4], have, env[5], env[6]

    def description(self, uint64_t meta_len):
        """The description bytes of the record at the tail (its header must be there)."""
        cdef bytes b = bytes(meta_len)
        self._copy_out(shm_load_relaxed64(self.tail) + GRANULE, <char *>b, meta_len)
        return b

    cdef void _take(self, uint64_t hdr_len, char *dst, uint64_t nbytes, uint64_t pad) noexcept:
        """Consume a whole record that is all there: its payload into dst."""
        cdef uint64_t t = shm_load_relaxed64(self.tail)
        if nbytes > NOGIL_BYTES:
            with nogil:
                self._copy_out(t + hdr_len, dst, nbytes)
        elif nbytes:
            self._copy_out(t + hdr_len, dst, nbytes)
        shm_store_release64(self.tail, t + hdr_len + nbytes + pad)
        ring_bell(self.pbell, self.psleepers)

    def skip_read(self, uint64_t n):
        """Release n bytes (padding, or a record read by peeking)."""
        shm_store_release64(self.tail, shm_load_relaxed64(self.tail) + n)
        ring_bell(self.pbell, self.psleepers)


# ---- the blocking calls' quick paths (messages.Transport.quick: Quick.send, Quick.recv) ----
#
# A whole small record at once, under the transport's lock, with no Python-level work when the
# message is described as the last one on its channel was (the ring's memo): the hot path of a
# ping-pong or a halo exchange.  Anything unusual returns False / None with nothing done, and the
# caller takes the general path, which also checks and names every bad argument.

cdef object _NDARRAY = np.ndarray
cdef object _COPY = np.array
DEF MAGIC = 0x3147534d54534d53      # "SMSTMSG1" (messages._MAGIC)
DEF FLAG_CMA = 1                    # the payload stays in the sender's memory (messages._CMA)
QUICK_BYTES = 1 << 19               # (half the ring)


cdef inline uint64_t _up(uint64_t n) noexcept nogil:
    return (n + 63) & ~(<uint64_t>63)


# The fork generation, natively (session._fork_gen's twin, bumped by the same kind of hook): a
# Quick made in one generation declines in a forked child, with no call to find out.
cdef uint64_t _fork_gen = 0


def _after_fork_in_child():
    global _fork_gen
    _fork_gen += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


DEF LOCK_WAIT_US = 20000      # a blocked Lock.take looks at signals this often


cdef class Lock:
    """A lock as threading.Lock (acquire, release, locked, a context manager), that the quick
    paths take and give natively, with no call (Quick: the two Python-level calls of a
    threading.Lock's were a good part of a small message's cost): messages.Transport.lock.

    Every taker holds the GIL (Python code, and the quick paths, which run with it), so the
    lock is a flag looked at and set under the GIL: no atomic operation and no semaphore when
    it is free (a PyThread lock's take and give cost some 0.1 us of a ping-pong's 0.6 us
    message).  A thread that finds it held waits, the GIL released, on a PyThread lock used as
    a token that give() posts when there are waiters (a token posted between the waiter's look
    and its wait stays there: no wake-up is lost; one left over only makes a waiter look
    again), and runs signal handlers (KeyboardInterrupt) every 20 ms as it waits.  On a
    free-threaded Python (no GIL: NO_GIL) the token is the lock itself, taken and given."""
    cdef PyThread_type_lock token
    cdef bint held
    cdef int waiters

    def __cinit__(self):
        self.token = PyThread_allocate_lock()
        if self.token == NULL:
            raise MemoryError()
        if not NO_GIL:
            PyThread_acquire_lock(self.token, NOWAIT_LOCK)      # (no token yet)

    def __dealloc__(self):
        if self.token != NULL:
            if not NO_GIL or self.held:   # (freed unlocked, as CPython's own locks)
                PyThread_release_lock(self.token)
            PyThread_free_lock(self.token)

    cdef inline int take(self) except -1:
        if not NO_GIL and not self.held:    # (the GIL makes the look and the set one step)
            self.held = True
            return 0
        return self._wait_take()

    cdef int _wait_take(self) except -1:
        cdef PyLockStatus got
        if NO_GIL:
            if not PyThread_acquire_lock(self.token, NOWAIT_LOCK):
                while True:
                    with nogil:
                        got = PyThread_acquire_lock_timed(self.token, LOCK_WAIT_US, 0)
                    if got == PY_LOCK_ACQUIRED:
                        break
                    PyErr_CheckSignals()
            self.held = True
            return 0
        self.waiters += 1
        try:
            while self.held:
                with nogil:
                    got = PyThread_acquire_lock_timed(self.token, LOCK_WAIT_US, 0)
                if got != PY_LOCK_ACQUIRED:
                    PyErr_CheckSignals()
        finally:
            self.waiters -= 1
        self.held = True
        return 0

    cdef inline void give(self) noexcept:
        self.held = False
        if NO_GIL or self.waiters:
            PyThread_release_lock(self.token)

    def acquire(self, bint blocking=True):
        if not blocking:
            if NO_GIL:
                if not PyThread_acquire_lock(self.token, NOWAIT_LOCK):
                    return False
            elif self.held:
                return False
            self.held = True
            return True
        self.take()
        return True

    def release(self):
        if not self.held:
            raise RuntimeError("release unlocked lock")
        self.give()

    def locked(self):
        return self.held

    def __enter__(self):
        self.take()
        return True

    def __exit__(self, *exc):
        self.release()


cdef class Quick:
    """A transport's quick paths (messages.Transport.quick): they read the transport's state
    (its lock, its tables of posted operations and channels, whether it is closed) through
    the references kept here, with no attribute lookups.

    Each also checks, first, that the communicator is usable (_usable): so a plain
    communicator's send and recv call them before any check of their own (Messages.send,
    Messages.recv), and the general path, which raises the proper error, runs only when they
    decline."""
    cdef object tr
    cdef Lock lock
    cdef dict sends, recvs, incoming, kept, out, inn, headers
    cdef list anyrecvs
    cdef Home home
    cdef int64_t spin_ns, slice_ns
    cdef bint _closed
    cdef object parse, clock
    cdef object comm, group, seg
    cdef const volatile uint32_t *abort
    cdef uint64_t gen

    def __init__(self, tr, dict headers, parse, clock, int64_t slice_ns):
        self.tr = tr
        self.lock = <Lock?>tr.lock
        self.sends, self.recvs, self.incoming = tr.sends, tr.recvs, tr.incoming
        self.kept, self.out, self.inn = tr.kept, tr.out, tr.inn
        self.anyrecvs = tr.any_recvs          # (posted receives from any source: the same list)
        self.home = <Home?>tr.home
        self.spin_ns = tr.spin_ns
        self.headers, self.parse, self.clock = headers, parse, clock
        self.slice_ns = slice_ns
        self._closed = False
        # what _usable reads: the communicator's and the group's closed flags, the group's
        # abort word (its Segment kept, so that the word stays mapped while it is read), the
        # generation made in.  No abort word (a group closed already): never usable here.
        self.comm, self.group, self.gen = tr.comm, tr.group, _fork_gen
        try:
            seg = tr.group._seg
            self.abort = <const volatile uint32_t *><size_t>seg.abort_address()
            self.seg = seg
        except Exception:
            self.abort = NULL

    @property
    def closed(self):
        return self._closed

    @closed.setter
    def closed(self, bint value):
        """(Transport.close.)  Closed, the abort word is let go (the segment may be unmapped
        once the communicator and the group are gone)."""
        self._closed = value
        if value:
            self.abort = NULL
            self.seg = None

    cdef inline bint _usable(self) except -1:
        """What Messages._p2p checks before the general path (it raises what this declines):
        the transport and the communicator open, not a forked child's, the group open and not
        aborted.  The abort word first: no call reads it."""
        return (not self._closed and self.abort != NULL and self.gen == _fork_gen
                and shm_load_seqcst32(self.abort) == 0
                and not self.comm._closed and not self.group._closed)

    def send(self, array, dest, tag):
        """_send, from Python."""
        return self._send(array, dest, tag)

    def recv(self, src, tag, out, deadline):
        """_recv, from Python."""
        return self._recv(src, tag, out, deadline)

    cdef bint _send(self, array, dest, tag) except -1:
        """The blocking send of a small ndarray to dest: True once its record is in the ring
        (one copy, one publication); False, nothing done, when anything else is sent to dest,
        the channel is not made yet, the record does not fit now, or its header is not known
        yet (headers: (dtype, shape, tag) -> header, filled by the general path after it has
        checked the arguments, so a header found means dtype and tag were checked)."""
        cdef cnp.ndarray a
        cdef Ring ring
        cdef uint64_t nbytes
        cdef bytes header
        cdef bint done
        if type(array) is not _NDARRAY or type(dest) is not int or type(tag) is not int \
                or not self._usable():
            return False
        a = <cnp.ndarray>array
        nbytes = <uint64_t>cnp.PyArray_NBYTES(a)
        if nbytes > QUICK_BYTES:
            return False
        if nbytes and not cnp.PyArray_IS_C_CONTIGUOUS(a):
            a = _COPY(a, order="C", copy=True)
        self.lock.take()
        try:
            if self._closed or dest in self.sends:
                return False
            chan = self.out.get(dest)
            if chan is None:
                return False
            ring = <Ring>chan[2]
            if ring.q_dtype is a.descr and ring._same_shape(a.ndim, a.shape) and \
                    ring.q_tag == tag:
                header = ring.q_bytes
            else:
                header = self.headers.get((a.descr, array.shape, tag))
                if header is None:
                    return False
                ring.q_dtype, ring.q_tag, ring.q_bytes = a.descr, tag, header
                ring._memo_shape(a.ndim, a.shape)
            if ring.pbell == NULL and ring.is_attached():
                self.tr._link_receiver(ring, dest)
            done = ring._put(PyBytes_AS_STRING(header), <uint64_t>PyBytes_GET_SIZE(header),
                             <const char *>cnp.PyArray_DATA(a), nbytes, _up(nbytes) - nbytes)
            if done and ring.pbell == NULL and ring.is_attached():
                self.tr._link_receiver(ring, dest)
            return done
        finally:
            self.lock.give()

    cdef object _recv(self, src, tag, out, deadline):
        """The blocking recv from src: the next record from src when nothing else is received
        from it (nor from any source: a receive from ANY_SOURCE posted before this one comes
        first) and the record, all there, has the tag wanted (and fits `out`, when given),
        waiting for it up to one slice (natively); None: nothing done, take the general path.
        (parse: description bytes -> (dtype, shape); clock: time.monotonic, for a deadline.)"""
        cdef Ring ring
        cdef Cond cond
        cdef cnp.ndarray dst
        cdef uint64_t want, t, have, nbytes, meta_len, hdr_len
        cdef uint64_t env[8]
        cdef char meta[MEMO_META]
        cdef bint waited = False, known
        cdef int64_t budget
        cdef int nd, i
        if type(src) is not int or type(tag) is not int or tag < 0 or tag >= 2**63 or (
                out is not None and type(out) is not _NDARRAY) or not self._usable():
            return None
        want = tag
        while True:
            self.lock.take()
            try:
                if self._closed or self.anyrecvs or src in self.recvs or \
                        src in self.incoming or self.kept.get(src):
                    return None
                chan = self.inn.get(src)
                if chan is None:
                    return None
                ring = <Ring>chan[1]
                t = shm_load_relaxed64(ring.tail)
                have = shm_load_acquire64(ring.head) - t
                if have >= GRANULE:
                    ring._copy_out(t, <char *>env, GRANULE)
                    nbytes, meta_len, hdr_len = env[2], env[3], env[4]
                    if env[0] != MAGIC or env[1] != want or have < hdr_len + (
                            0 if env[5] & FLAG_CMA else _up(nbytes)):
                        return None
                    known = False
                    if ring.q_bytes is not None and meta_len <= MEMO_META and \
                            <uint64_t>PyBytes_GET_SIZE(ring.q_bytes) == meta_len:
                        ring._copy_out(t + GRANULE, meta, meta_len)
                        known = memcmp(meta, PyBytes_AS_STRING(ring.q_bytes), meta_len) == 0
                    if not known:
                        b = ring.description(meta_len)
                        dtype, shape = self.parse(b)
                        nd = len(shape)
                        if nd > MEMO_DIMS:
                            return None
                        for i in range(nd):
                            ring.q_dims[i] = shape[i]
                        ring.q_nd = nd
                        ring.q_dtype, ring.q_bytes = dtype, b
                    if out is not None:
                        dst = <cnp.ndarray>out
                        if not (cnp.PyArray_IS_C_CONTIGUOUS(dst) and cnp.PyArray_ISWRITEABLE(dst)
                                and (dst.descr is ring.q_dtype or dst.descr == ring.q_dtype)
                                and ring._same_shape(dst.ndim, dst.shape)):
                            return None
                    else:
                        Py_INCREF(ring.q_dtype)
                        dst = PyArray_Empty(ring.q_nd, ring.q_dims,
                                            <cnp.PyArray_Descr *>ring.q_dtype, 0)
                    if env[5] & FLAG_CMA:
                        if nbytes:
                            err = cma_read(chan[3], env[6], <size_t>cnp.PyArray_DATA(dst),
                                           nbytes)
                            if err:
                                self.tr._cma_failed(src, err)
                        ring.skip_read(hdr_len)
                    else:
                        ring._take(hdr_len, <char *>cnp.PyArray_DATA(dst), nbytes,
                                   _up(nbytes) - nbytes)
                    return dst
            finally:
                self.lock.give()
            if waited:
                return None
            budget = self.slice_ns
            if deadline is not None:
                budget = min(budget, <int64_t>((deadline - self.clock()) * 1e9))
                if budget <= 0:
                    return None
            _cond(&cond, ring, GRANULE)
            with nogil:
                waited = not self.home._wait(&cond, 1, budget, self.spin_ns)


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
