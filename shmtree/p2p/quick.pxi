# (included by shmtree/_p2p.pyx) The blocking calls' quick paths in C: Quick.send and Quick.recv
# (p2p/messages.py, Transport.quick), and Lock, the transport's lock.

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
