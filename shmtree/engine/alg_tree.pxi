# Allreduce, pipelined tree (channel 1 unless the ring schedule is chosen): chunk j goes up the
# tree - at each rank the children's chunk j and the own input meet in one fused reduction, sent
# to the parent - and the root's result comes down - each rank passes the parent's result chunk j
# on to its children and into its output.  Up and down steps interleave (down first: it frees the
# slots the root's next result needs); the root's result is final at once.
#
# Counters: j_up chunks reduced and sent up, j_down results received (the root: j_down = j_up).

cdef enum:
    TREE_UP = 1
    TREE_DOWN = 2


cdef void tree_setup(Eng *e, Chan *c, Call *k) noexcept nogil:
    """m chunks of chunk_for() bytes (the call state already says nbytes and itemsize)."""
    k.chunk = chunk_for(c, k.nbytes, k.itemsize)
    k.m = (k.nbytes + k.chunk - 1) // k.chunk


cdef inline uint64_t chunk_for(Chan *c, uint64_t nbytes, uint64_t item) noexcept nogil:
    """Bytes per chunk for a message on a tree channel: the slot payload, or less so that a
    mid-sized message is still cut into PIPE_CHUNKS chunks that overlap in the pipeline (never
    below MIN_CHUNK).  A function of (nbytes, itemsize, payload) alone: every rank cuts the
    message the same way.  (A ring-schedule channel of one rank runs here too: whole slots.)"""
    cdef uint64_t chunk = c.payload // item * item
    cdef uint64_t want = (nbytes + PIPE_CHUNKS - 1) // PIPE_CHUNKS
    if c.ring or want >= chunk:
        return chunk
    if want < MIN_CHUNK:
        want = MIN_CHUNK
    want = (want + 63) // 64 * 64                    # whole cache lines ...
    want = (want + item - 1) // item * item          # ... of whole items
    return want if want < chunk else chunk


cdef inline bint tree_up_ready(Chan *c, Call *k) noexcept nogil:
    if k.j_up >= k.m or not can_recv_all(c.cup, c.nchild, k.j_up):
        return False
    if c.up.ring != NULL:
        return can_send(&c.up, c, k.j_up)
    if c.down.ring != NULL:                       # the root: room in its result ring
        return can_send(&c.down, c, k.j_up)
    return True


cdef inline bint tree_down_ready(Chan *c, Call *k) noexcept nogil:
    if c.parent < 0 or k.j_down >= k.j_up or not can_recv(&c.pdown, k.j_down):
        return False
    return c.down.ring == NULL or can_send(&c.down, c, k.j_down)


cdef int tree_ready(Eng *e, Chan *c, Call *k) noexcept nogil:
    if tree_down_ready(c, k):
        return TREE_DOWN
    if tree_up_ready(c, k):
        return TREE_UP
    return 0


cdef inline int tree_up(Eng *e, Chan *c, Call *k, bint check) noexcept nogil:
    """Chunk j up: children's chunk j (op) own input -> the parent's ring, or at the root the
    result ring and the output."""
    cdef uint64_t j = k.j_up
    cdef uint64_t lo = j * k.chunk
    cdef uint64_t n = piece(k, lo)
    cdef const char *src = k.src + lo if k.src != NULL else NULL
    cdef int rc
    if c.up.ring != NULL:
        if c.nchild:
            rc = recv_reduce_send(e, c, k, c.cup, c.nchild, j, &c.up, j, src, n, True, check)
        else:
            rc = send(e, c, k, &c.up, j, src, n)
    elif c.down.ring != NULL:
        rc = recv_reduce_copy_send(e, c, k, c.cup, c.nchild, j, &c.down, j, src, k.dst + lo, n,
                                   True, check)
    else:
        rc = local_copy(k, src, k.dst + lo, n if not k.mismatch else 0)
    if rc != RC_DONE:
        return rc
    k.j_up = j + 1
    if c.parent < 0:
        k.j_down = j + 1                          # the root's result is final at once
    return RC_DONE


cdef inline int tree_down(Eng *e, Chan *c, Call *k) noexcept nogil:
    """Result chunk j down: the parent's result -> own result ring (for the children) and the
    output."""
    cdef uint64_t j = k.j_down
    cdef uint64_t lo = j * k.chunk
    cdef uint64_t n = piece(k, lo)
    cdef int rc
    if c.down.ring != NULL:
        rc = recv_copy_send(e, c, k, &c.pdown, j, &c.down, j, k.dst + lo, n)
    else:
        rc = recv(e, c, k, &c.pdown, j, k.dst + lo, n)
    if rc == RC_DONE:
        k.j_down = j + 1
    return rc


cdef int tree_step(Eng *e, Chan *c, Call *k, int action) noexcept nogil:
    if action == TREE_DOWN:
        return tree_down(e, c, k)
    return tree_up(e, c, k, False)


cdef bint tree_done(Eng *e, Chan *c, Call *k) noexcept nogil:
    return k.j_down >= k.m and k.j_up >= k.m
