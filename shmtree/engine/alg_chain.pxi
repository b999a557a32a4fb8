# Broadcast and reduce from any root, pipelined along the ring (channel 1 under the ring
# schedule): a chain of P positions that starts (broadcast) or ends (reduce) at the root's
# position q, cut into m chunks that follow each other down the chain, so the time is about
# (m + P - 1) chunk steps and each rank receives and sends the message once: the bandwidth lower
# bound of a rooted collective.  d = this position's distance along the chain:
#
#   broadcast  d = (p - q) mod P:  d = 0 (the root) sends its input (its output already holds
#              it);  0 < d < P-1: recv-copy-send;  d = P-1: recv.
#   reduce     d = (p - q - 1) mod P:  d = 0 sends its input;  0 < d < P-1: predecessor's chunk
#              (op) own input -> on;  d = P-1 (the root): the same -> the output.  The result is
#              the left fold x[q+1] op x[q+2] ... op x[q] in ring order.
#   scan       the reduce's chain with q = P-1 when the ring order is the rank order (msg_scan),
#              every position keeping what it computes: d = 0 sends its input (and copies it to
#              its output); 0 < d < P-1: predecessor's chunk (op) own input -> on and to the
#              output; d = P-1: the same -> the output.  Rank r's result: x[0] op ... op x[r],
#              folded left to right (numpy's accumulate).
#   exscan     the same chain; each position's output is its predecessor's chunk as received
#              (rank 0's the op's identity, written by msg_scan before the call).
#
# Counters: j_up chunks sent, j_down chunks received.

cdef enum:
    CHAIN_STEP = 1


cdef void chain_setup(Eng *e, Chan *c, Call *k) noexcept nogil:
    k.chunk = (c.payload // k.itemsize) * k.itemsize
    k.m = (k.nbytes + k.chunk - 1) // k.chunk


cdef inline int64_t chain_pos(Eng *e, Chan *c, Call *k) noexcept nogil:
    """This position's distance d along the chain (see above)."""
    cdef int64_t P = e.nranks
    cdef int64_t first = k.root if k.coll_kind == CHAIN_BCAST else k.root + 1
    return (((c.ring_pos - first) % P) + P) % P


cdef int chain_ready(Eng *e, Chan *c, Call *k) noexcept nogil:
    cdef int64_t d = chain_pos(e, c, k)
    cdef uint64_t j
    if d == 0:
        return CHAIN_STEP if k.j_up < k.m and can_send(&c.up, c, k.j_up) else 0
    j = k.j_down
    if j >= k.m or not can_recv(&c.cup[0], j):
        return 0
    if d < e.nranks - 1 and not can_send(&c.up, c, j):
        return 0
    return CHAIN_STEP


cdef inline int chain_scan_step(Eng *e, Chan *c, Call *k, uint64_t j, uint64_t lo, uint64_t n,
                                bint last) noexcept nogil:
    """A scan's or exscan's chunk j at a position past the first (see above).  The exscan's
    output is the received chunk, copied out before the slot is let go (its input does not
    overlap its output: msg_scan)."""
    cdef shm_slot_hdr *slot
    if k.coll_kind == CHAIN_SCAN:
        if last:
            return recv_reduce_copy(e, c, k, c.cup, 1, j, k.src + lo, k.dst + lo, n, False,
                                    False)
        return recv_reduce_copy_send(e, c, k, c.cup, 1, j, &c.up, j, k.src + lo, k.dst + lo, n,
                                     False, False)
    if last:
        return recv(e, c, k, c.cup, j, k.dst + lo, n)
    slot = slot_at(&c.cup[0], c, j)
    if n and slot_ok(slot, k, j) and not slot.flags & SHM_FLAG_MISMATCH and not k.mismatch:
        out(e, k.dst + lo, payload(slot), n)
    return recv_reduce_send(e, c, k, c.cup, 1, j, &c.up, j, k.src + lo, n, False, False)


cdef int chain_step(Eng *e, Chan *c, Call *k, int action) noexcept nogil:
    cdef int64_t d = chain_pos(e, c, k)
    cdef bint last = d == e.nranks - 1
    cdef bint bcast = k.coll_kind == CHAIN_BCAST
    cdef uint64_t j = k.j_up if d == 0 else k.j_down
    cdef uint64_t lo = j * k.chunk
    cdef uint64_t n = piece(k, lo)
    cdef int rc
    if d == 0:
        rc = send(e, c, k, &c.up, j, (k.dst if bcast else k.src) + lo, n)
        if rc == RC_DONE and k.coll_kind == CHAIN_SCAN and k.dst != k.src and n:
            out(e, k.dst + lo, k.src + lo, n)
    elif k.coll_kind >= CHAIN_SCAN:
        rc = chain_scan_step(e, c, k, j, lo, n, last)
    elif bcast and last:
        rc = recv(e, c, k, c.cup, j, k.dst + lo, n)
    elif bcast:
        rc = recv_copy_send(e, c, k, c.cup, j, &c.up, j, k.dst + lo, n)
    elif last:
        rc = recv_reduce_copy(e, c, k, c.cup, 1, j, k.src + lo, k.dst + lo, n, False, False)
    else:
        rc = recv_reduce_send(e, c, k, c.cup, 1, j, &c.up, j, k.src + lo, n, False, False)
    if rc != RC_DONE:
        return rc
    if d > 0:
        k.j_down = j + 1
    if not last:
        k.j_up = j + 1
    return RC_DONE


cdef bint chain_done(Eng *e, Chan *c, Call *k) noexcept nogil:
    cdef int64_t d = chain_pos(e, c, k)
    if d == 0:
        return k.j_up >= k.m
    return k.j_down >= k.m and (d == e.nranks - 1 or k.j_up >= k.m)
