# Single copy of private buffers (docs/algorithms.md, "Single copy"): cross-memory attach.  The
# large allgather and every exchange (alltoall with and without counts, gather, scatter, scan's
# two exchanges: alg_exchange.pxi's byte matrix B) move each byte once: the receiver copies what
# it gets straight out of its senders' buffers with process_vm_readv(2), into its own output.
# No outbox, no ring: X read and X written per rank, as MPI's single copy (Open MPI's smsc/cma,
# coll/xhc's pull from the leader).
#
# The probe (once per group, never per call): every engine publishes, when it starts, the
# address of its probe word (Cma.token, a value derived from the group's nonce and the rank) in
# its rank block.  A rank reads every peer's probe word once, when its first call begins if
# every peer has published its word by then, else after that call's first round (when every
# peer is known to have started: the first call then runs without the single copy); it may read
# them all (the same user, the same pid namespace, no Yama ptrace scope or seccomp filter in the
# way) or it takes no part in the single copy for the group's life.  SHMTREE_CMA=0, read when
# the engine starts, switches it off.
#
# The agreement (per call, in the call's first round as the shared arrays' place): before the
# round, every rank says in its rank block (xsrc, by seq parity) whether it offers this call's
# single copy, and where its source lies in its own memory.  A rank offers when its probe said
# yes and the call qualifies (a large allgather or exchange: its bytes in all cma_total or more,
# its largest block cma_bytes or more; the same answer on every rank).  After the round every
# rank reads every rank's word: all offered, or the call runs the pipelined exchange (the same
# answer everywhere).  The shared arrays' single copy (alg_direct.pxi) comes first, where every
# buffer is shared.
#
# The copy: rank p reads its blocks source by source, s = 1 .. P-1, from the rank s before it
# (alltoall: rank p - s, whose block for p starts at from_at; allgather: ring position pos - s,
# whose own block it reads from that rank's input or, in place, its output), a CMA_CHUNK at a
# time (the abort word is read before each; the drive loop's time slices end between them).
# Round s pairs every reader with a source of its own, so no source serves two readers at once
# where the blocks are alike.  No chunk depends on another (the data sits in the senders'
# buffers when the call's round ends), so nothing is signalled per chunk: when a rank has read
# everything it gets, it says so once (its rank block's `direct`, seq + 1, as the shared single
# copy does) and wakes its peers; it returns once every rank that reads its buffer has said so
# (waiting with the engine's spin, yield, futex sleep: wait.pxi).  A sender never returns, and
# never lets its caller reuse its buffer, while a reader may still be in it.
#
# A failed read (the peer died: ESRCH, or its memory is going: EFAULT) stops the reads: the
# rank waits, and the Python layer's checks between time slices find the dead peer and raise
# on every rank.  Where a read failed otherwise (not ESRCH) and no peer was found dead within
# CMA_GRACE_MS, the rank aborts the group with a note that says which read failed (every rank
# raises it).  A read never writes into another
# process: an aborted group leaves the senders' buffers as they were.

cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void *iov_base
        size_t iov_len
    ssize_t process_vm_readv(int pid, const iovec *local, unsigned long liovcnt,
                             const iovec *remote, unsigned long riovcnt, unsigned long flags)

cdef extern from "<errno.h>" nogil:
    enum:
        ESRCH                     # the process is gone (then only its death is said)
        EIO

cdef extern from "<stdio.h>" nogil:
    int snprintf(char *buf, size_t n, const char *fmt, ...)

cdef extern from "<string.h>" nogil:
    char *strerror(int errnum)

cdef enum:
    CMA_UNKNOWN = 0
    CMA_YES = 1
    CMA_NO = 2
    CMA_OFF = 3
    CMA_CHUNK = 1 << 20           # bytes read per process_vm_readv (measured: 256 KiB .. 4 MiB
                                  # alike; 64 KiB 1.4-2x slower per byte)
    CMA_BYTES = 64 << 10          # a call qualifies when its largest block is this large (one
                                  # read costs a few us: below, the exchange's slots win) ...
    CMA_TOTAL = 16 << 20          # ... and its bytes in all (every rank's output) this many.
                                  # Measured at P = 2 (2 cores, 32 MiB L3): while the data stays
                                  # in cache the exchange's two copies, the sender's and the
                                  # receiver's in parallel through slots hot in cache, beat one
                                  # read per byte by process_vm_readv (which pins each page:
                                  # 10 GB/s against memcpy's 30), 2 MiB alltoall 74 us against
                                  # 104, gather 54 against 146; beyond it, the single copy
                                  # moves less through memory: 16 MiB alltoall 2.0-2.3 ms
                                  # against 2.9
    CMA_OWN = 1
    CMA_READ = 2
    CMA_PUBLISH = 3
    CMA_FINISH = 4
    CMA_FAIL = 5
    CMA_ABORT_FAILED = 3          # codes.ABORT_FAILED (_engine.pyx checks)

DEF CMA_GRACE_MS = 2500           # a failed read with no dead peer found by then: abort (the
                                  # Python layer looks at every member once a second)


cdef inline uint64_t cma_token(Eng *e, int r) noexcept nogil:
    """The value of rank r's probe word: the group's nonce mixed with the rank (a process that
    is not r's, read by mistake, does not hold it there)."""
    cdef uint64_t lo, hi
    cdef shm_seg_hdr *h = <shm_seg_hdr *>e.base
    memcpy(&lo, h.nonce, 8)
    memcpy(&hi, h.nonce + 8, 8)
    return (lo ^ 0x434d41505242454bULL) + (hi | 1) * <uint64_t>(2 * r + 1)


cdef void cma_publish_probe(Eng *e) noexcept nogil:
    """When the engine starts: this rank's probe word and its address, for its peers."""
    e.cma.chunk = CMA_CHUNK
    e.cma.token = cma_token(e, e.rank)
    shm_store_release64(&rank_block(e.base, e.rank).probe, <uint64_t><uintptr_t>&e.cma.token)


cdef inline ssize_t cma_read(int pid, void *local, uint64_t remote, size_t n) noexcept nogil:
    cdef iovec l, r
    l.iov_base = local
    l.iov_len = n
    r.iov_base = <void *><uintptr_t>remote
    r.iov_len = n
    return process_vm_readv(pid, &l, 1, &r, 1, 0)


cdef int cma_probe(Eng *e, bint early) noexcept nogil:
    """Once per group: may this rank read every peer's memory?  CMA_YES (the peers' processes
    noted) or CMA_NO.  After a call's first round every peer has started its engine (published
    its probe word); before the group's first round (early) some may not have: CMA_UNKNOWN
    then, and the probe is made after the round."""
    cdef int r
    cdef uint64_t addr, got
    cdef shm_rank_block *b
    for r in range(e.nranks):
        if r == e.rank:
            continue
        b = rank_block(e.base, r)
        addr = shm_load_acquire64(&b.probe)
        if shm_load_acquire32(&b.joined) != 2 or b.pid == 0 or addr == 0:
            return CMA_UNKNOWN if early else CMA_NO
        got = 0
        if cma_read(<int>b.pid, &got, addr, 8) != 8 or got != cma_token(e, r):
            return CMA_NO
        e.cma.pids[r] = <int>b.pid
    return CMA_YES


cdef inline bint cma_block(Eng *e, Call *k, int s, int *rank, char **local, uint64_t *remote,
                           uint64_t *n) noexcept nogil:
    """The block this rank gets from its s-th source: that rank, where the block goes here,
    where it lies in that rank's process, and its bytes."""
    cdef Cma *m = &e.cma
    cdef Xchg *x = &e.x
    cdef int P = e.nranks, p, q
    if m.mode == DIRECT_ALLTOALL:
        p = (e.rank - s + P) % P
        rank[0] = p
        n[0] = x.B[p * P + e.rank]
        local[0] = k.dst + x.dst_at[p]
        remote[0] = m.src[p] + x.from_at[p]
    else:
        q = (e.dir.pos - s + P) % P
        rank[0] = e.dir.order[q]
        n[0] = k.offs[2 * q + 1] - k.offs[2 * q]
        local[0] = k.dst + k.offs[2 * q]
        remote[0] = m.src[rank[0]]
    return n[0] > 0


cdef inline void cma_skip_empty(Eng *e, Call *k) noexcept nogil:
    """Move past the sources with nothing (left) to read."""
    cdef Cma *m = &e.cma
    cdef int r
    cdef char *local
    cdef uint64_t remote, n
    while m.s < e.nranks:
        if cma_block(e, k, m.s, &r, &local, &remote, &n) and m.off < n:
            return
        m.s += 1
        m.off = 0


cdef void cma_setup(Eng *e, Chan *c, Call *k) noexcept nogil:
    cdef Cma *m = &e.cma
    k.chunk = m.chunk
    m.s = 1
    m.off = 0
    m.published = 0
    m.finished = 0
    m.err = 0
    m.own_done = m.mode != DIRECT_ALLTOALL or e.x.B[e.rank * e.nranks + e.rank] == 0
    m.n_calls += 1
    cma_skip_empty(e, k)


cdef bint cma_readers_through(Eng *e, Call *k) noexcept nogil:
    """Has every rank that reads this rank's buffer said it is through?"""
    cdef int P = e.nranks, me = e.rank, q
    cdef uint64_t target = k.desc.seq + 1
    cdef bint mine = True
    if e.cma.mode != DIRECT_ALLTOALL:
        mine = k.offs[2 * e.dir.pos + 1] > k.offs[2 * e.dir.pos]
    for q in range(P):
        if q == me or (e.cma.mode == DIRECT_ALLTOALL and e.x.B[me * P + q] == 0) or not mine:
            continue
        if shm_load_acquire64(&rank_block(e.base, q).direct) < target:
            return False
    return True


cdef int cma_ready(Eng *e, Chan *c, Call *k) noexcept nogil:
    cdef Cma *m = &e.cma
    if m.err:
        if m.err != ESRCH and shm_now_ns() - m.err_since >= <int64_t>CMA_GRACE_MS * 1000000:
            return CMA_FAIL
        return 0
    if not m.own_done:
        return CMA_OWN
    if m.s < e.nranks:
        return CMA_READ
    if not m.published:
        return CMA_PUBLISH
    if not m.finished and cma_readers_through(e, k):
        return CMA_FINISH
    return 0


cdef int cma_fail(Eng *e) noexcept nogil:
    """A read failed and no peer was found dead meanwhile: abort the group, saying why."""
    cdef Cma *m = &e.cma
    cdef shm_rank_block *me = rank_block(e.base, e.rank)
    cdef char text[400]
    cdef int n = snprintf(text, sizeof(text),
                          "rank %d could not read rank %d's buffer (process_vm_readv: %s); "
                          "set SHMTREE_CMA=0 to move large messages through shared memory",
                          e.rank, m.err_rank, strerror(m.err))
    if n < 0:
        n = 0
    if n > <int>sizeof(text) - 1:
        n = sizeof(text) - 1
    memcpy(me.note, text, n)
    shm_store_seqcst32(&me.note_len, n)
    shmtree_abort_cas(e.abort_word, CMA_ABORT_FAILED, e.rank)
    for n in range(e.nranks):
        shm_fetch_add32(&rank_block(e.base, n).bell, 1)
        shm_futex_wake_all(&rank_block(e.base, n).bell)
    return RC_ABORTED


cdef int cma_step(Eng *e, Chan *c, Call *k, int action) noexcept nogil:
    cdef Cma *m = &e.cma
    cdef Xchg *x = &e.x
    cdef int r, P = e.nranks, me = e.rank
    cdef char *local
    cdef uint64_t remote, n, want
    cdef ssize_t got
    if action == CMA_READ:
        if aborted(e):                # (a chunk at a time: no rank reads on for a call that
            return RC_ABORTED         # its peers have given up)
        cma_block(e, k, m.s, &r, &local, &remote, &n)
        want = n - m.off if n - m.off < m.chunk else m.chunk
        got = cma_read(m.pids[r], local + m.off, remote + m.off, want)
        if got <= 0:
            m.err = errno if got < 0 and errno else EIO     # (EIO: read nothing)
            m.err_rank = r
            m.err_since = shm_now_ns()
            return RC_DONE            # (ready() says nothing more is ready)
        m.off += <uint64_t>got
        m.n_bytes += <uint64_t>got
        cma_skip_empty(e, k)
    elif action == CMA_OWN:
        n = x.B[me * P + me]
        if k.dst + x.dst_at[me] != k.src + x.to_at[me]:
            out(e, k.dst + x.dst_at[me], k.src + x.to_at[me], n)   # (streaming stores for a
        m.own_done = 1                                              # large call: nt_bytes)
    elif action == CMA_PUBLISH:
        shm_store_release64(&rank_block(e.base, me).direct, k.desc.seq + 1)
        shm_fence()                   # pairs with a sleeper's fence (prims.pxi, Waking)
        for r in range(P):
            if r != me:
                wake(e, r)
        m.published = 1
    elif action == CMA_FINISH:
        m.finished = 1
    else:
        return cma_fail(e)
    return RC_DONE


cdef bint cma_done(Eng *e, Chan *c, Call *k) noexcept nogil:
    return e.cma.finished
