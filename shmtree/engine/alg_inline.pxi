# The channel-0 round that starts every call (the latency path): one chunk up and down the
# latency tree that carries this rank's call descriptor - every parent compares its children's
# with its own, a difference flags the round (MISMATCH for all) - and the data itself when the
# message fits (nbytes <= small_bytes; else nbytes 0 here and the data goes on channel 1).
# The tree algorithm's steps, with descriptor checking on the way up.

cdef void inline_setup(Eng *e, Chan *c, Call *k) noexcept nogil:
    k.chunk = (c.payload // k.itemsize) * k.itemsize
    k.m = 1
    k.check_desc = 1


cdef int inline_step(Eng *e, Chan *c, Call *k, int action) noexcept nogil:
    if action == TREE_DOWN:
        return tree_down(e, c, k)
    return tree_up(e, c, k, True)
