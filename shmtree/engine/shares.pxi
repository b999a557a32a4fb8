# The shared arrays an engine knows (shared.py registers them: Engine.share, unshare), and where
# a call's input and output lie in them (place, direct_agreed: the single copies, alg_direct.pxi).
# Included by _engine.pyx after the Engine class.


cdef share_add(Engine self, uint64_t ident, uint64_t start, uint64_t nbytes, bases, keep):
    """Register a shared allocation: this rank's own stretch of it, and every rank's mapping
    (bases: their addresses, by rank).  keep: what holds the peers' mappings; the engine
    holds it while registered, and a call that may run single-copy on the allocation holds
    it to its end (unshare does not end that).  This rank's own stretch is held by the
    call's own arrays (which lie in it)."""
    cdef int P = self.e.nranks, i
    if len(bases) != P or ident == 0:
        raise ValueError("shmtree: share: one base per rank, and an id")
    if self.nshares == self.share_cap:
        cap = self.share_cap * 2 + 4
        ids = <uint64_t *>realloc(self.share_id, cap * sizeof(uint64_t))
        if ids != NULL:
            self.share_id = ids
        starts = <uint64_t *>realloc(self.share_start, cap * sizeof(uint64_t))
        if starts != NULL:
            self.share_start = starts
        lens = <uint64_t *>realloc(self.share_len, cap * sizeof(uint64_t))
        if lens != NULL:
            self.share_len = lens
        bs = <char **>realloc(self.share_bases, cap * P * sizeof(char *))
        if bs != NULL:
            self.share_bases = bs
        if ids == NULL or starts == NULL or lens == NULL or bs == NULL:
            raise MemoryError()
        self.share_cap = cap
    i = self.nshares
    self.share_id[i] = ident
    self.share_start[i] = start
    self.share_len[i] = nbytes
    for r in range(P):
        self.share_bases[i * P + r] = <char *><uintptr_t>bases[r]
    self.share_keep.append(keep)
    self.nshares = i + 1


cdef share_remove(Engine self, uint64_t ident):
    """Forget an allocation: later calls do not find it.  A call in progress that may use
    it single-copy keeps its mappings (place_keep) until it has ended."""
    cdef int P = self.e.nranks, i, last
    for i in range(self.nshares):
        if self.share_id[i] == ident:
            last = self.nshares - 1
            self.share_id[i] = self.share_id[last]
            self.share_start[i] = self.share_start[last]
            self.share_len[i] = self.share_len[last]
            memcpy(&self.share_bases[i * P], &self.share_bases[last * P], P * sizeof(char *))
            self.share_keep[i] = self.share_keep[last]
            del self.share_keep[last]
            self.nshares = last
            return


cdef int share_find(Engine self, const char *p, uint64_t n, uint64_t *off) noexcept:
    """The index of the registered allocation that holds [p, p + n) (off: where), or -1."""
    cdef int i
    cdef uint64_t a = <uint64_t><uintptr_t>p
    for i in range(self.nshares):
        if self.share_start[i] <= a and a + n <= self.share_start[i] + self.share_len[i]:
            off[0] = a - self.share_start[i]
            return i
    return -1


cdef void place(Engine self, uint64_t seq, const char *src_p, char *dst_p, uint64_t nbytes,
                bint eligible) noexcept:
    """Say where this call's input and output lie (the rank block's place: allocation and
    offset of each; zeros when the call cannot run single-copy here: not eligible, not both
    in registered allocations, or partly overlapping), and keep every rank's mapping of
    both allocations (the offsets are added once every rank has said its own), held
    (place_keep) until the call has ended."""
    cdef uint64_t *place = self.seg.block(self.e.rank).place[seq & 1]
    cdef uint64_t soff = 0, doff = 0
    cdef int si = -1, di = -1, r, P = self.e.nranks
    cdef Direct *d = &self.e.dir
    cdef uintptr_t align = self.msg_itemsize if self.msg_itemsize < 8 else 8
    if (<uintptr_t>src_p | <uintptr_t>dst_p) % align:
        eligible = False          # (the kernels take items at their alignment; moves
                                  # are bytes)
    if eligible and self.nshares and src_p != NULL and dst_p != NULL and P > 1 and nbytes:
        si = share_find(self, src_p, nbytes, &soff)
        if si >= 0:
            di = share_find(self, dst_p, nbytes, &doff)
    if di >= 0 and (self.share_id[si] != self.share_id[di] or soff == doff
                    or soff + nbytes <= doff or doff + nbytes <= soff):
        place[0] = self.share_id[si]
        place[1] = soff
        place[2] = self.share_id[di]
        place[3] = doff
        for r in range(P):
            d.ins[r] = self.share_bases[si * P + r]
            d.outs[r] = self.share_bases[di * P + r]
        self.place_keep = self.share_keep[si]       # (no allocation: cannot fail)
        self.place_keep_out = self.share_keep[di]
    else:
        memset(place, 0, 4 * sizeof(uint64_t))
        self.place_keep = self.place_keep_out = None


cdef bint direct_agreed(Engine self) noexcept nogil:
    """After the channel-0 round (every rank has written its place): did every rank say
    that its input lies in one and the same allocation, and its output in one and the same
    (each at an offset of its own)?  The same answer on every rank; if so, aim the single
    copy's pointers at every rank's input and output."""
    cdef int par = self.cur_seq & 1
    cdef const uint64_t *mine = self.seg.block(self.e.rank).place[par]
    cdef const uint64_t *theirs
    cdef int r
    cdef Direct *d = &self.e.dir
    if mine[0] == 0:
        return False
    for r in range(self.e.nranks):
        theirs = self.seg.block(r).place[par]
        if theirs[0] != mine[0] or theirs[2] != mine[2]:
            return False
    for r in range(self.e.nranks):
        theirs = self.seg.block(r).place[par]
        d.ins[r] += theirs[1]
        d.outs[r] += theirs[3]
    return True



# ---- the single copy of private buffers (alg_cma.pxi): the offer and the agreement ----

cdef bint cma_big(Engine self, const uint64_t *B) noexcept nogil:
    """Is the exchange of byte matrix B large enough for the single copy by cross-memory attach:
    its bytes in all (the whole matrix, own blocks included) at least cma_total and its largest
    block at least cma_bytes?  (The same answer on every rank: B is.)"""
    cdef int P = self.e.nranks, p, q
    cdef uint64_t most = 0, n, whole = 0
    for p in range(P):
        for q in range(P):
            n = B[p * P + q]
            whole += n
            if p != q and n > most:
                most = n
    return most >= self.cma_bytes and whole >= self.cma_total


cdef void cma_offer(Engine self, uint64_t seq, const char *at, bint big) noexcept nogil:
    """This rank's word for call seq (xsrc): it offers the single copy (its probe said yes, and
    big) and its source lies at `at` in its memory, or it does not (0).  Every call writes its
    word (a stale one is never read)."""
    self.seg.block(self.e.rank).xsrc[seq & 1] = (
        SHM_XSRC_OFFERED | <uint64_t><uintptr_t>at if big and self.e.cma.state == CMA_YES
        else 0)


cdef void cma_place(Engine self, uint64_t seq, int coll, int alg, const char *src_p,
                    char *dst_p) noexcept:
    """begin_call's offer (cma_offer) of the single copy by cross-memory attach: a large
    allgather - its bytes in all (every rank's output: P x its result) at least cma_total and
    its largest block at least cma_bytes - or a large exchange (cma_big).  The source: the
    allgather's own block (its input, or in place its row of the output), the exchange's
    input.  Other calls write no word, and their first phase reads none (scatter's and
    alltoall(counts=)'s calls offer after their own first round: msg_scatter, xv_handover)."""
    cdef int P = self.e.nranks, q
    cdef uint64_t most = 0, n, whole = 0
    cdef const uint64_t *o
    cdef const char *at = src_p
    if alg == ALG_INLINE or (coll != COLL_ALLGATHER and coll != COLL_ALLTOALL):
        return                            # (no word: only these calls read it, when their
                                          # first phase ends: Engine._run_call)
    if self.e.cma.state != CMA_YES:
        cma_offer(self, seq, NULL, False)
        return
    if coll == COLL_ALLTOALL:
        cma_offer(self, seq, at, cma_big(self, self.e.x.B))
        return
    o = self.e.call.offs
    for q in range(P):
        n = o[2 * q + 1] - o[2 * q]
        whole += n * P
        if n > most:
            most = n
    if at == NULL:                        # (in place: the own block in the output)
        at = dst_p + o[2 * self.e.dir.pos]
    cma_offer(self, seq, at, most >= self.cma_bytes and whole >= self.cma_total)


cdef bint cma_agreed(Engine self) noexcept nogil:
    """After the channel-0 round (every rank has written its xsrc): did every rank offer the
    single copy?  The same answer on every rank; if so, note where every rank's source lies."""
    cdef int par = self.cur_seq & 1, r
    cdef uint64_t v
    cdef Cma *m = &self.e.cma
    if not self.seg.block(self.e.rank).xsrc[par] & SHM_XSRC_OFFERED:
        return False
    for r in range(self.e.nranks):
        v = self.seg.block(r).xsrc[par]
        if not v & SHM_XSRC_OFFERED:
            return False
        m.src[r] = v & ~SHM_XSRC_OFFERED
    m.mode = DIRECT_ALLGATHER if self.coll == COLL_ALLGATHER else DIRECT_ALLTOALL
    return True
