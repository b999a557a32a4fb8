# Primitives: ring access, waking, the output copy, readiness checks, and the chunk primitives
# over the SPSC rings (after NCCL's primitives.h: an algorithm is a few named primitives; the
# flow control - slot checks, counters, fences, wake-ups - lives here).
#
# Memory ordering: heads and tails are published with release stores and observed with acquire
# loads (shm_sync.h), so a consumer that sees head > step sees the slot's payload and header, and
# a producer that sees a tail past a slot may overwrite it.  Each counter is written by one rank
# only.
#
# Waking: each rank owns a bell (a futex word) and a sleepers flag.  A waiter raises its flag,
# reads the bell, re-checks its conditions, then sleeps on the bell (wait.pxi); whoever publishes
# something issues a full fence after its release stores, then checks the flag of every rank that
# may wait for it and rings its bell.  The fence pair makes a lost wake-up impossible.

# ---- ring access ----

cdef inline uint64_t ring_hdr_bytes(int ntails) noexcept nogil:
    cdef uint64_t b = <uint64_t>SHM_LINE * (1 + ntails)
    return (b + SHM_PAGE - 1) // SHM_PAGE * SHM_PAGE


cdef inline uint64_t *ring_head(char *ring) noexcept nogil:
    return <uint64_t *>ring


cdef inline uint64_t *ring_tail(char *ring, int i) noexcept nogil:
    return <uint64_t *>(ring + SHM_LINE * (1 + i))


cdef inline shm_slot_hdr *slot_at(Conn *r, Chan *c, uint64_t j) noexcept nogil:
    """The slot of the call's item j in ring r (step r.base + j)."""
    return <shm_slot_hdr *>(r.ring + r.hdr + ((r.base + j) % c.nslots) * c.stride)


cdef inline char *payload(shm_slot_hdr *slot) noexcept nogil:
    return <char *>slot + sizeof(shm_slot_hdr)


# ---- waking and the output ----

cdef inline void wake(Eng *e, int r) noexcept nogil:
    """Ring rank r's bell if it is (about to be) asleep; callers have fenced."""
    cdef shm_rank_block *b = rank_block(e.base, r)
    if shm_load_seqcst32(&b.sleepers):
        shm_fetch_add32(&b.bell, 1)
        shm_futex_wake_all(&b.bell)


cdef inline void out(Eng *e, char *dst, const char *src, uint64_t n) noexcept nogil:
    """Copy result bytes into the caller's output: streaming stores for large messages
    (nt_bytes and up), whose output will not be read back from cache soon.  (progress() issues
    the store fence when the call ends.)"""
    if e.nt:
        shm_copy_nt(dst, src, n)
    else:
        memcpy(dst, src, n)


# ---- readiness: can a primitive run now without blocking? ----

cdef inline bint can_recv(Conn *r, uint64_t j) noexcept nogil:
    """Has item j arrived in ring r (its producer's head is past it)?"""
    return shm_load_acquire64(ring_head(r.ring)) > r.base + j


cdef inline bint can_send(Conn *r, Chan *c, uint64_t j) noexcept nogil:
    """Is there a free slot for item j in ring r (every consumer's tail within nslots)?"""
    cdef int i
    for i in range(r.ntails):
        if r.base + j - shm_load_acquire64(ring_tail(r.ring, i)) >= c.nslots:
            return False
    return True


cdef inline bint can_recv_all(Conn *rs, int n, uint64_t j) noexcept nogil:
    cdef int i
    for i in range(n):
        if not can_recv(&rs[i], j):
            return False
    return True


# ---- slot headers ----

cdef inline void stamp(shm_slot_hdr *slot, Call *k, uint64_t j) noexcept nogil:
    slot.desc = k.desc
    slot.chunk = j
    slot.flags = SHM_FLAG_MISMATCH if k.mismatch else 0


cdef inline bint slot_ok(const shm_slot_hdr *slot, Call *k, uint64_t j) noexcept nogil:
    """Does a received slot belong to this call and item?  (Only the seq when the descriptors
    are being compared: a different descriptor is a mismatch, not corruption.)"""
    return slot.chunk == j and slot.desc.seq == k.desc.seq


cdef inline uint64_t piece(Call *k, uint64_t lo) noexcept nogil:
    """Bytes of the chunk that starts at byte lo of the message (0 past its end)."""
    if lo >= k.nbytes:
        return 0
    return k.nbytes - lo if k.nbytes - lo < k.chunk else k.chunk


# ---- the chunk primitives ----
#
# One generic operation (NCCL's genericOp): receive item rj from each ring of `ins` (checked:
# it must carry this call's seq and index rj), combine it with the own input `src` (may be NULL)
# into the slot of item sj of ring `dst_ring` (or straight into `dst` when dst_ring is NULL), copy
# the result from that slot to the output `dst` too when copy_out, then release the consumed
# slots (tails) and publish the new one (head), fence, and wake whoever may wait on either.
# n == 0 (nothing of the message in this item, or a mismatch) still stamps and publishes: the
# item carries the descriptor and flags.  The named primitives below fix the shape.
#
# Operand order is part of the result's bits (the kernels reduce srcs[0] op srcs[1] op ...):
# own_first puts src before the received items (the tree), else after them (the ring).
# check: compare each received slot's descriptor with ours (the channel-0 round); a slot flagged
# FLAG_MISMATCH (someone below saw a difference) always sets the call's mismatch, after which no
# data moves and every slot carries the flag on.

cdef inline void reduce_copy_out(Eng *e, Call *k, char *target, char *dst, const void **sv,
                                 int nsrc, uint64_t n) noexcept nogil:
    """A final result reduced into the slot and copied to the output piece by piece, each
    piece while it is still in the nearest cache (not one pass over the slot and another over
    the copy).  Moves the operand pointers in sv (scratch of this step)."""
    cdef uint64_t off = 0, piece
    cdef uint64_t step = REDUCE_PIECE // k.itemsize * k.itemsize
    cdef int i
    if step == 0:
        step = k.itemsize
    while off < n:
        piece = n - off if n - off < step else step
        k.fn(target + off, sv, nsrc, piece // k.itemsize)
        out(e, dst + off, target + off, piece)
        for i in range(nsrc):
            sv[i] = <const char *>sv[i] + piece
        off += piece


cdef inline int generic_op(Eng *e, Chan *c, Call *k, Conn *ins, int nin, uint64_t rj,
                           Conn *dst_ring, uint64_t sj, const char *src, char *dst,
                           uint64_t n, bint own_first, bint check,
                           bint copy_out) noexcept nogil:
    cdef const void **sv = k.srcs
    cdef int i, nsrc = 0
    cdef shm_slot_hdr *slot
    cdef shm_slot_hdr *mine = NULL
    cdef char *target
    cdef bint dup
    if own_first and (src != NULL or nin == 0):
        sv[nsrc] = src
        nsrc += 1
    for i in range(nin):
        slot = slot_at(&ins[i], c, rj)
        if not slot_ok(slot, k, rj):
            return RC_CORRUPT
        if slot.flags & SHM_FLAG_MISMATCH or (
                check and memcmp(&slot.desc, &k.desc, sizeof(shm_desc_head)) != 0):
            k.mismatch = 1
        sv[nsrc] = payload(slot)
        nsrc += 1
    if not own_first and src != NULL:
        sv[nsrc] = src
        nsrc += 1
    if dst_ring != NULL:
        mine = slot_at(dst_ring, c, sj)
        target = payload(mine)
    else:
        target = dst
    if n and not k.mismatch and target != NULL:      # (target: NULL only when n is 0)
        if nsrc == 1:
            if target == <char *>sv[0]:
                pass                                  # in place (own input is the output)
            elif dst_ring == NULL and nin:
                out(e, target, <const char *>sv[0], n)     # received result -> the output
            else:
                memcpy(target, sv[0], n)
        elif copy_out and target != dst:
            reduce_copy_out(e, k, target, dst, sv, nsrc, n)
        else:
            k.fn(target, sv, nsrc, n // k.itemsize)
        if copy_out and (nsrc == 1 or target == dst):
            out(e, dst, target, n)                    # keep our own copy of a final result
    if mine != NULL:
        stamp(mine, k, sj)
        if not k.mismatch:
            e.n_sent += n
    for i in range(nin):                              # the received slots are consumed
        shm_store_release64(ring_tail(ins[i].ring, ins[i].tail), ins[i].base + rj + 1)
    if dst_ring != NULL:
        shm_store_release64(ring_head(dst_ring.ring), dst_ring.base + sj + 1)
    shm_fence()                       # pairs with a sleeper's fence between its flag and its bell
    for i in range(nin):
        wake(e, ins[i].peer)
    if dst_ring != NULL:
        # the consumers of the new item may be the producers just woken (the tree root's result
        # ring, a ring of two ranks): wake each rank once
        dup = dst_ring.ntails == nin
        i = 0
        while dup and i < nin:
            dup = dst_ring.peers[i] == ins[i].peer
            i += 1
        if not dup:
            for i in range(dst_ring.ntails):
                wake(e, dst_ring.peers[i])
    return RC_DONE


cdef inline int send(Eng *e, Chan *c, Call *k, Conn *to, uint64_t sj, const char *src,
                     uint64_t n) noexcept nogil:
    """Own input -> item sj of ring `to`."""
    return generic_op(e, c, k, NULL, 0, 0, to, sj, src, NULL, n, True, False, False)


cdef inline int recv(Eng *e, Chan *c, Call *k, Conn *frm, uint64_t rj, char *dst,
                     uint64_t n) noexcept nogil:
    """Item rj of ring `frm` -> the output."""
    return generic_op(e, c, k, frm, 1, rj, NULL, 0, NULL, dst, n, True, False, False)


cdef inline int recv_reduce_send(Eng *e, Chan *c, Call *k, Conn *ins, int nin, uint64_t rj,
                                 Conn *to, uint64_t sj, const char *src, uint64_t n,
                                 bint own_first, bint check) noexcept nogil:
    """Items rj of rings `ins` (op) own input -> item sj of ring `to`."""
    return generic_op(e, c, k, ins, nin, rj, to, sj, src, NULL, n, own_first, check, False)


cdef inline int recv_reduce_copy(Eng *e, Chan *c, Call *k, Conn *ins, int nin, uint64_t rj,
                                 const char *src, char *dst, uint64_t n, bint own_first,
                                 bint check) noexcept nogil:
    """Items rj of rings `ins` (op) own input -> the output."""
    return generic_op(e, c, k, ins, nin, rj, NULL, 0, src, dst, n, own_first, check, False)


cdef inline int recv_reduce_copy_send(Eng *e, Chan *c, Call *k, Conn *ins, int nin,
                                      uint64_t rj, Conn *to, uint64_t sj, const char *src,
                                      char *dst, uint64_t n, bint own_first,
                                      bint check) noexcept nogil:
    """Items rj of rings `ins` (op) own input -> item sj of ring `to` and the output (a result
    completed here)."""
    return generic_op(e, c, k, ins, nin, rj, to, sj, src, dst, n, own_first, check, True)


cdef inline int recv_copy_send(Eng *e, Chan *c, Call *k, Conn *frm, uint64_t rj, Conn *to,
                               uint64_t sj, char *dst, uint64_t n) noexcept nogil:
    """Item rj of ring `frm` -> item sj of ring `to` and the output (a final result passed on;
    the output is copied from our own slot, hot in cache)."""
    return generic_op(e, c, k, frm, 1, rj, to, sj, NULL, dst, n, True, False, True)


cdef inline int local_copy(Call *k, const char *src, char *dst, uint64_t n) noexcept nogil:
    """Own input -> the output (a group of one)."""
    if n and src != dst:
        memcpy(dst, src, n)
    return RC_DONE
