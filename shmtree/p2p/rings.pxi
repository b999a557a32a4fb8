# (included by shmtree/_p2p.pyx) A rank's home page (its bell) and the channels' byte rings:
# the lock-free single-producer single-consumer ring of one sender and one receiver.

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
