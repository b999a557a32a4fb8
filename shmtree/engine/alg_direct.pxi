# Single copy (shared arrays, docs/design.md "Shared arrays"): every rank's input and output lie
# in the group's shared allocations, which every rank has mapped - the same allocations on every
# rank, each rank at an offset of its own - agreed through the rank blocks' `place`, written
# before the channel-0 round and compared after it, so that the round is also the barrier that
# makes every input ready.  No ring moves data; each rank then does its part straight between
# the arrays, and says so (its rank block's `direct`, seq + 1), and waits until every rank has:
# nobody returns while another may still read its input or write its output.  Nothing in the
# middle waits: the parts are disjoint.  The abort word is read before every piece: once the
# group is aborted (a peer timed out, was interrupted, or the group was closed), no rank writes
# more than the piece in hand into outputs whose owners have left the call.
#
# allreduce: each rank reduces one part of the message straight from every rank's input, in the
#   order the private path's schedule uses for those elements (the same bits), a piece at a time
#   while it is in cache, and copies each piece into every rank's output: X read and X written
#   per rank, one copy's traffic.  The orders (as the private paths fold, docs/algorithms.md):
#   ring schedule: block b (ceil(n/P) items at ring position b) is the left fold over the inputs
#     of ring positions b, b+1, ..., b+P-1 (float16 and bfloat16 rounded after every step, as
#     each hop does); this rank, at position b, folds straight into its own output.
#   pipelined tree: every inner node folds its own input, then its children's partial results,
#     left to right, in one fused pass; this rank computes part `rank` of the root's result
#     (into scratch, a piece per rank) and copies it into every output, its own included.
# broadcast: each rank, the root too, copies a share of the root's output (which holds the data)
#   into every other rank's output: the work of P-1 copies spread over P cores.
# reduce_scatter: every rank folds its own block (ring position p: the inputs of positions p+1,
#   ..., p, the blocks algorithm's order) straight into its output (which may be private).
# reduce: every rank folds a 1/P share of the elements in the chain's order towards the root
#   (position q: the inputs of positions q+1, ..., q), a piece at a time in a buffer (the root's
#   output may be its input, the last operand), into the root's output, which lies in the
#   inputs' allocation (so every rank has it mapped).
# alltoall (the exchange's blocks, Xchg): every rank copies the block each rank has for it
#   straight from that rank's input into its own output (which may be private): the receiver
#   pulls, X read and X written per rank, no copy through an outbox.
# allgather: every rank copies its own block (in its output, or from its input when the caller
#   gave it apart: then into its own output too) into every other rank's output, a piece at a
#   time while it is in cache (pushing beat pulling each block: 2 MiB at P=2 152 us against
#   257).

cdef enum:
    DIRECT_ALLREDUCE = 0      # the modes: _engine.pyx's COLL_* codes (it checks)
    DIRECT_BROADCAST = 1
    DIRECT_REDUCE = 2
    DIRECT_REDUCE_SCATTER = 3
    DIRECT_ALLGATHER = 4
    DIRECT_ALLTOALL = 5
    DIRECT_PIECE = 32768      # bytes reduced and copied out at a time (L1/L2-resident)
    DIRECT_COPY = 65536       # bytes copied at a time (broadcast, allgather): read once, written
                              # P - 1 times while in cache
    DIRECT_WORK = 1
    DIRECT_PUBLISH = 2
    DIRECT_FINISH = 3


cdef void direct_setup(Eng *e, Chan *c, Call *k) noexcept nogil:
    cdef Direct *d = &e.dir
    cdef uint64_t share = (k.nbytes // k.itemsize + e.nranks - 1) // e.nranks * k.itemsize
    cdef uint64_t part = d.pos if d.ring else e.rank
    d.published = 0
    d.finished = 0
    k.chunk = DIRECT_PIECE // k.itemsize * k.itemsize       # (reductions: whole items)
    if k.chunk == 0:
        k.chunk = k.itemsize
    if d.mode == DIRECT_ALLREDUCE:
        d.lo = part * share if part * share < k.nbytes else k.nbytes
        d.hi = d.lo + share if d.lo + share < k.nbytes else k.nbytes
    elif d.mode == DIRECT_BROADCAST:          # a share of the bytes per rank, the root's too
        k.chunk = DIRECT_COPY
        share = (k.nbytes + e.nranks - 1) // e.nranks
        share = (share + 63) // 64 * 64
        d.lo = <uint64_t>e.rank * share if <uint64_t>e.rank * share < k.nbytes else k.nbytes
        d.hi = d.lo + share if d.lo + share < k.nbytes else k.nbytes
    elif d.mode == DIRECT_ALLGATHER:          # this rank's own block
        k.chunk = DIRECT_COPY
        d.lo = k.offs[2 * d.pos]
        d.hi = k.offs[2 * d.pos + 1]
    elif d.mode == DIRECT_REDUCE_SCATTER:     # this rank's own block
        d.lo = k.offs[2 * d.pos]
        d.hi = k.offs[2 * d.pos + 1]
    elif d.mode == DIRECT_ALLTOALL:           # this rank's whole output, source by source
        k.chunk = DIRECT_COPY
        d.lo = 0
        d.hi = e.x.dst_at[e.nranks]
        d.cur = 0
    else:                                     # reduce: a share of the items per rank
        d.lo = <uint64_t>e.rank * share if <uint64_t>e.rank * share < k.nbytes else k.nbytes
        d.hi = d.lo + share if d.lo + share < k.nbytes else k.nbytes
    d.off = d.lo


cdef inline bint direct_all_through(Eng *e, uint64_t target) noexcept nogil:
    cdef int r
    for r in range(e.nranks):
        if shm_load_acquire64(&rank_block(e.base, r).direct) < target:
            return False
    return True


cdef int direct_ready(Eng *e, Chan *c, Call *k) noexcept nogil:
    cdef Direct *d = &e.dir
    if d.off < d.hi:
        return DIRECT_WORK
    if not d.published:
        return DIRECT_PUBLISH
    if not d.finished and direct_all_through(e, k.desc.seq + 1):
        return DIRECT_FINISH
    return 0


cdef inline void direct_fold(Eng *e, Call *k, Direct *d, uint64_t off, uint64_t n, int start,
                             char *target) noexcept nogil:
    """Elements [off, off + n) of the inputs of ring positions start, start + 1, ... (mod P),
    folded left to right into target (pairwise, rounding at every step, where the hops do)."""
    cdef int P = e.nranks, j
    cdef Py_ssize_t items = n // k.itemsize
    for j in range(P):
        d.srcs[j] = d.ins[d.order[(start + j) % P]] + off
    if d.pairwise and P > 2:
        k.fn(target, d.srcs, 2, items)
        for j in range(2, P):
            d.srcs[1] = d.srcs[j]
            d.srcs[0] = target
            k.fn(target, d.srcs, 2, items)
    else:
        k.fn(target, d.srcs, P, items)


cdef inline void direct_ring_piece(Eng *e, Call *k, Direct *d, uint64_t off,
                                   uint64_t n) noexcept nogil:
    cdef char *target = d.outs[e.rank] + off
    cdef int j
    direct_fold(e, k, d, off, n, d.pos, target)
    for j in range(e.nranks):
        if j != e.rank:
            out(e, d.outs[j] + off, target, n)


cdef inline void direct_tree_piece(Eng *e, Call *k, Direct *d, uint64_t off,
                                   uint64_t n) noexcept nogil:
    cdef int i, v, ch, m, j
    cdef Py_ssize_t items = n // k.itemsize
    cdef const char *result = d.ins[d.root] + off
    for i in range(d.npost):
        v = d.post[i]
        d.srcs[0] = d.ins[v] + off
        m = 1
        for j in range(d.kid_start[v], d.kid_start[v + 1]):
            ch = d.kids[j]
            if d.kid_start[ch + 1] > d.kid_start[ch]:
                d.srcs[m] = d.scratch + <uint64_t>ch * DIRECT_PIECE     # an inner node's partial
            else:
                d.srcs[m] = d.ins[ch] + off                             # a leaf's own input
            m += 1
        k.fn(d.scratch + <uint64_t>v * DIRECT_PIECE, d.srcs, m, items)
    if d.npost:
        result = d.scratch + <uint64_t>d.root * DIRECT_PIECE      # the root's: the result
    for j in range(e.nranks):
        out(e, d.outs[j] + off, result, n)


cdef int direct_step(Eng *e, Chan *c, Call *k, int action) noexcept nogil:
    cdef Direct *d = &e.dir
    cdef const char *src
    cdef uint64_t n
    cdef int r, root
    if action == DIRECT_WORK:
        if aborted(e):                # (a piece at a time: no rank goes on writing into the
            return RC_ABORTED         # outputs of peers that have given up the call)
        n = d.hi - d.off if d.hi - d.off < k.chunk else k.chunk
        if d.mode == DIRECT_BROADCAST:
            root = d.order[k.root]
            for r in range(e.nranks):
                if r != root:
                    memcpy(d.outs[r] + d.off, d.outs[root] + d.off, n)
        elif d.mode == DIRECT_ALLGATHER:          # from the input when it is not out[rank]
            src = d.outs[e.rank] + d.off if k.src == NULL else k.src + (d.off - d.lo)
            for r in range(e.nranks):
                if r != e.rank or k.src != NULL:
                    memcpy(d.outs[r] + d.off, src, n)
        elif d.mode == DIRECT_ALLTOALL:           # from the input of the source of this piece
            while e.x.dst_at[d.cur + 1] <= d.off:
                d.cur += 1
            if e.x.dst_at[d.cur + 1] - d.off < n:
                n = e.x.dst_at[d.cur + 1] - d.off
            memcpy(k.dst + d.off, d.ins[d.cur] + e.x.from_at[d.cur] + (d.off - e.x.dst_at[d.cur]),
                   n)
        elif d.mode == DIRECT_REDUCE_SCATTER:     # block p: x[p+1] op ... op x[p]
            direct_fold(e, k, d, d.off, n, d.pos + 1, k.dst + (d.off - d.lo))
        elif d.mode == DIRECT_REDUCE:             # towards root q: x[q+1] op ... op x[q]
            direct_fold(e, k, d, d.off, n, k.root + 1, d.tmp)     # (the root's out may be its
            memcpy(d.outs[d.order[k.root]] + d.off, d.tmp, n)    # input: the last operand)
        elif d.ring:
            direct_ring_piece(e, k, d, d.off, n)
        else:
            direct_tree_piece(e, k, d, d.off, n)
        d.off += n
    elif action == DIRECT_PUBLISH:
        if e.nt:
            shm_store_fence()             # the streaming stores are out before the word
        shm_store_release64(&rank_block(e.base, e.rank).direct, k.desc.seq + 1)
        shm_fence()                       # pairs with a sleeper's fence (prims.pxi, Waking)
        for r in range(e.nranks):
            if r != e.rank:
                wake(e, r)
        d.published = 1
    else:
        d.finished = 1
    return RC_DONE


cdef bint direct_done(Eng *e, Chan *c, Call *k) noexcept nogil:
    return e.dir.finished
