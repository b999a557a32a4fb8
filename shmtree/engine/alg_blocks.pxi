# Reduce-scatter and allgather, the two halves of the ring schedule as collectives of their own
# (channel 1 under the ring schedule).  The message is cut into P blocks, one per ring position
# q, at byte ranges k.offs[2q] .. k.offs[2q+1] of the full message (uneven blocks allowed: the
# np.array_split blocks of reduce_scatter, the ranks' own lengths of allgather(axis=0)); every
# block travels as nc chunk columns (nc from the largest block; a shorter block's extra columns
# are header-only items, so every position takes the same steps).  Column c goes round the ring
# on its own, as in the allreduce's ring schedule: position p sends P-1 items for it, step
# s = 0 .. P-2, to its successor, then receives its predecessor's item (c, P-2):
#
#   reduce-scatter  s = 0: block p-1, own input;  s >= 1: block p-1-s, predecessor's item (c,
#                   s-1) (op) own input;  the final receive: block p, predecessor's item (op) own
#                   input -> the output (this position's block, complete here and only here).
#                   Block q is a left fold x[q+1] op x[q+2] ... op x[q] in ring order.
#   allgather       s = 0: block p, own block (already in the output);  s >= 1: block p-s,
#                   predecessor's item (c, s-1) -> the output and on;  the final receive: block
#                   p+1 -> the output.
#
# Item t = c*(P-1) + s depends on the predecessor's item t-1 alone (two slots suffice).  Each
# rank sends (P-1)/P of the message: the bandwidth lower bound of either half.
#
# Counters: j_up items sent (t), j_down items of the predecessor consumed.

cdef enum:
    BLOCKS_SEND = 1
    BLOCKS_LAST = 2


cdef void blocks_setup(Eng *e, Chan *c, Call *k) noexcept nogil:
    cdef uint64_t q, most = 0
    k.chunk = (c.payload // k.itemsize) * k.itemsize
    for q in range(<uint64_t>e.nranks):
        if k.offs[2 * q + 1] - k.offs[2 * q] > most:
            most = k.offs[2 * q + 1] - k.offs[2 * q]
    k.nc = (most + k.chunk - 1) // k.chunk if most else 1
    k.m = (e.nranks - 1) * k.nc


cdef inline void block_piece(Eng *e, Call *k, int64_t b, uint64_t col, uint64_t *lo,
                             uint64_t *n) noexcept nogil:
    """Byte range of chunk column col of block position b (taken mod P)."""
    cdef int64_t P = e.nranks
    b = ((b % P) + P) % P
    cdef uint64_t blo = k.offs[2 * b], bhi = k.offs[2 * b + 1]
    lo[0] = blo + col * k.chunk
    n[0] = 0
    if lo[0] < bhi:
        n[0] = bhi - lo[0]
        if n[0] > k.chunk:
            n[0] = k.chunk


cdef inline bint blocks_last_next(Eng *e, Call *k) noexcept nogil:
    """Is the next action the final receive of a column (not a send)?"""
    return k.j_up > 0 and k.j_up % (e.nranks - 1) == 0 and k.j_down < k.j_up


cdef int blocks_ready(Eng *e, Chan *c, Call *k) noexcept nogil:
    cdef uint64_t t = k.j_up
    if blocks_last_next(e, k):
        return BLOCKS_LAST if can_recv(&c.cup[0], k.j_down) else 0
    if t >= k.m or not can_send(&c.up, c, t):
        return 0
    if t % (e.nranks - 1) and not can_recv(&c.cup[0], t - 1):
        return 0
    return BLOCKS_SEND


cdef int rs_step(Eng *e, Chan *c, Call *k, int action) noexcept nogil:
    cdef uint64_t t, s, lo, n, steps = e.nranks - 1
    cdef int rc
    cdef int64_t p = c.ring_pos
    if action == BLOCKS_LAST:
        t = k.j_down
        block_piece(e, k, p, t // steps, &lo, &n)
        rc = recv_reduce_copy(e, c, k, c.cup, 1, t, k.src + lo, k.dst + (lo - k.offs[2 * p]),
                              n, False, False)
        if rc == RC_DONE:
            k.j_down = t + 1
        return rc
    t = k.j_up
    s = t % steps
    block_piece(e, k, p - 1 - <int64_t>s, t // steps, &lo, &n)
    if s == 0:
        rc = send(e, c, k, &c.up, t, k.src + lo, n)
    else:
        rc = recv_reduce_send(e, c, k, c.cup, 1, t - 1, &c.up, t, k.src + lo, n, False, False)
    if rc != RC_DONE:
        return rc
    if s >= 1:
        k.j_down = t
    k.j_up = t + 1
    return RC_DONE


cdef int ag_step(Eng *e, Chan *c, Call *k, int action) noexcept nogil:
    cdef uint64_t t, s, lo, n, steps = e.nranks - 1
    cdef int rc
    cdef int64_t p = c.ring_pos
    if action == BLOCKS_LAST:
        t = k.j_down
        block_piece(e, k, p + 1, t // steps, &lo, &n)
        rc = recv(e, c, k, c.cup, t, k.dst + lo, n)
        if rc == RC_DONE:
            k.j_down = t + 1
        return rc
    t = k.j_up
    s = t % steps
    block_piece(e, k, p - <int64_t>s, t // steps, &lo, &n)
    if s == 0:
        rc = send(e, c, k, &c.up, t, k.dst + lo, n)
    else:
        rc = recv_copy_send(e, c, k, c.cup, t - 1, &c.up, t, k.dst + lo, n)
    if rc != RC_DONE:
        return rc
    if s >= 1:
        k.j_down = t
    k.j_up = t + 1
    return RC_DONE


cdef bint blocks_done(Eng *e, Chan *c, Call *k) noexcept nogil:
    return k.j_up >= k.m and k.j_down >= k.m
