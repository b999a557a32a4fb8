# Allreduce, the ring schedule (reduce-scatter, then allgather, around tree.ring).  In the
# channel's terms the successor is the 'parent' that consumes this rank's up ring, and the
# predecessor the single 'child' whose up ring it consumes.
#
# The message is cut into P blocks of nc chunks.  Chunk column c of every block goes round the
# ring on its own: position p sends 2(P-1) items for it, step s = 0 .. 2P-3, to its successor:
#   s = 0            block p, own input;
#   1 <= s < P-1     block p-s: predecessor's item (c, s-1) (op) own input   (reduce-scatter);
#   s = P-1          block p+1: the same, now complete: also written to the output;
#   s >= P           block p+1-(s-P+1): predecessor's item (c, s-1), copied to the output too;
# then receives the predecessor's item (c, 2P-3) into the output only.  Item t = c*(2P-2) + s
# depends on the predecessor's item t-1 alone, so the ring never needs more than two slots
# however large the blocks (ordering items block by block would need a whole block of slots).
# Each block is completed at exactly one rank, so every rank gets the same bits (the received
# partial result is the first operand, the own input the second, at every rank; in a call of
# two ranks with rank_order, rank 0 puts its own first, so that every block is x_0 op x_1:
# deterministic=True, frontend/repro.py).
#
# Counters: j_up items sent (t), j_down items of the predecessor consumed.

cdef enum:
    RING_SEND = 1
    RING_LAST = 2


cdef void ring_setup(Eng *e, Chan *c, Call *k) noexcept nogil:
    """P blocks of whole items; every block travels as nc chunks; 2(P-1) items sent per column
    (and as many received)."""
    cdef uint64_t nitems = k.nbytes // k.itemsize
    k.chunk = (c.payload // k.itemsize) * k.itemsize
    k.block = (nitems + e.nranks - 1) // e.nranks * k.itemsize
    k.nc = (k.block + k.chunk - 1) // k.chunk if k.block else 1
    k.m = 2 * (e.nranks - 1) * k.nc


cdef inline void ring_piece(Eng *e, Chan *c, Call *k, uint64_t col, int64_t s,
                            uint64_t *lo, uint64_t *n) noexcept nogil:
    """Byte range of chunk column col of the block this position handles at step s
    (s = 2P-2, one past its last send, is the block of the final receive)."""
    cdef int64_t P = e.nranks
    cdef int64_t b
    cdef uint64_t bhi, clo
    if s < P - 1:
        b = c.ring_pos - s
    else:
        b = c.ring_pos + 1 - (s - (P - 1))
    b = ((b % P) + P) % P
    bhi = (<uint64_t>b + 1) * k.block
    if bhi > k.nbytes:
        bhi = k.nbytes
    clo = <uint64_t>b * k.block + col * k.chunk
    lo[0] = clo
    n[0] = 0
    if clo < bhi:
        n[0] = bhi - clo
        if n[0] > k.chunk:
            n[0] = k.chunk


cdef inline bint ring_last_next(Eng *e, Call *k) noexcept nogil:
    """Is the next action the final receive of a column (not a send)?"""
    cdef uint64_t steps = 2 * (e.nranks - 1)
    return k.j_up > 0 and k.j_up % steps == 0 and k.j_down < k.j_up


cdef int ring_ready(Eng *e, Chan *c, Call *k) noexcept nogil:
    cdef uint64_t t = k.j_up
    if ring_last_next(e, k):
        return RING_LAST if can_recv(&c.cup[0], k.j_down) else 0
    if t >= k.m or not can_send(&c.up, c, t):
        return 0
    if t % (2 * (e.nranks - 1)) and not can_recv(&c.cup[0], t - 1):
        return 0
    return RING_SEND


cdef inline int ring_send(Eng *e, Chan *c, Call *k) noexcept nogil:
    cdef uint64_t t = k.j_up
    cdef uint64_t P = e.nranks
    cdef uint64_t s = t % (2 * (P - 1))
    cdef uint64_t lo, n
    cdef int rc
    ring_piece(e, c, k, t // (2 * (P - 1)), s, &lo, &n)
    if s == 0:
        rc = send(e, c, k, &c.up, t, k.src + lo, n)
    elif s < P - 1:
        rc = recv_reduce_send(e, c, k, c.cup, 1, t - 1, &c.up, t, k.src + lo, n, False, False)
    elif s == P - 1:                  # (rank_order, two ranks: rank 0 folds its own first)
        rc = recv_reduce_copy_send(e, c, k, c.cup, 1, t - 1, &c.up, t, k.src + lo, k.dst + lo, n,
                                   k.rank_order and e.rank == 0, False)
    else:
        rc = recv_copy_send(e, c, k, c.cup, t - 1, &c.up, t, k.dst + lo, n)
    if rc != RC_DONE:
        return rc
    if s >= 1:
        k.j_down = t
    k.j_up = t + 1
    return RC_DONE


cdef inline int ring_last(Eng *e, Chan *c, Call *k) noexcept nogil:
    """The predecessor's last item of a column (its final allgather step): output only."""
    cdef uint64_t u = k.j_down
    cdef uint64_t lo, n
    ring_piece(e, c, k, u // (2 * (e.nranks - 1)), 2 * (e.nranks - 1), &lo, &n)
    cdef int rc = recv(e, c, k, c.cup, u, k.dst + lo, n)
    if rc == RC_DONE:
        k.j_down = u + 1
    return rc


cdef int ring_step(Eng *e, Chan *c, Call *k, int action) noexcept nogil:
    if action == RING_LAST:
        return ring_last(e, c, k)
    return ring_send(e, c, k)


cdef bint ring_done(Eng *e, Chan *c, Call *k) noexcept nogil:
    return k.j_up >= k.m and k.j_down >= k.m
