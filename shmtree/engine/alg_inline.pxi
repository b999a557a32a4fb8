# The channel-0 round that starts every call (the latency path): one chunk up and down the
# latency tree that carries this rank's call descriptor - every parent compares its children's
# with its own, a difference flags the round (MISMATCH for all) - and the data itself when the
# message fits (nbytes <= small_bytes; else nbytes 0 here and the data goes on channel 1).
# The tree algorithm's steps, with descriptor checking on the way up.
#
# A group of two ranks (Chan.pair) runs the round as one exchange over the same two rings: each
# rank sends its chunk (descriptor and data) at once, the child on its up ring and the root on
# its result ring, then receives the other's, compares the descriptors and folds the two chunks,
# the root's first, exactly as the root of the tree folds them.  One hop instead of two (up,
# then the result down), and the same bits at both ranks.

cdef enum:
    PAIR_SEND = 1
    PAIR_RECV = 2


cdef void inline_setup(Eng *e, Chan *c, Call *k) noexcept nogil:
    k.chunk = (c.payload // k.itemsize) * k.itemsize
    k.m = 1
    k.check_desc = 1


cdef inline Conn *pair_out(Chan *c) noexcept nogil:
    return &c.up if c.parent >= 0 else &c.down


cdef inline Conn *pair_in(Chan *c) noexcept nogil:
    return &c.pdown if c.parent >= 0 else &c.cup[0]


cdef int inline_ready(Eng *e, Chan *c, Call *k) noexcept nogil:
    if not c.pair:
        return tree_ready(e, c, k)
    if k.j_up == 0:
        return PAIR_SEND if can_send(pair_out(c), c, 0) else 0
    if k.j_down == 0 and can_recv(pair_in(c), 0):
        return PAIR_RECV
    return 0


cdef int inline_step(Eng *e, Chan *c, Call *k, int action) noexcept nogil:
    cdef int rc
    if not c.pair:
        if action == TREE_DOWN:
            return tree_down(e, c, k)
        return tree_up(e, c, k, True)
    if action == PAIR_SEND:
        rc = send(e, c, k, pair_out(c), 0, k.src, piece(k, 0))
        if rc == RC_DONE:
            k.j_up = 1
        return rc
    rc = recv_reduce_copy(e, c, k, pair_in(c), 1, 0, k.src, k.dst, piece(k, 0), c.parent < 0,
                          True)
    if rc == RC_DONE:
        k.j_down = 1
    return rc
