# The exchange: blocks of any sizes between any pairs of ranks (alltoall and alltoall(counts=);
# gather, scatter and scan's two exchanges are made of it), through every rank's outbox: a region
# of the segment with nslots slots that any rank may read.  Rank p sends its blocks in rounds,
# s = 1 .. P-1, to rank (p + s) mod P, each block cut into items of at most `payload` bytes; its
# item j goes into slot j mod nslots of its own outbox.  Rank q takes the items meant for it
# straight out of the senders' outboxes, from whichever sender has one ready (no sender holds
# up the others).  Each rank writes (P-1)/P of its input into shared memory once and reads what
# it receives once: the least a copy through shared memory can move, with no forwarding.
#
# No counters: a slot carries two words of its own (layout.h): `ready`, the ticket of the item
# it holds (stored with release by the producer after the payload and header), and `freed`, the
# ticket of the item its consumer has copied out (stored with release by that consumer).  Tickets
# are unique for the group's life: item j of any rank's sequence in a call has ticket
# base + j + 1, where base is the same on every rank (every rank advances its epoch by the most
# items any rank sends in the call, which every rank computes from the same matrix B).  A consumer
# waits for ready == its item's ticket (acquire: the payload is then visible); a producer may
# write into a slot once freed == the ticket it last put there (acquire: the consumer's copy is
# done).  Each word has one writer at a time: the producer, or the one consumer of the item.
#
# Waking: as for the rings (prims.pxi): a producer wakes the item's consumer, a consumer wakes
# the producer, after a fence that pairs with the sleeper's.

cdef enum:
    XC_OWN = 1                # copy a piece of this rank's own block
    XC_SEND = 2               # publish the next item
    XC_RECV = 3               # take the next item from rank (action - XC_RECV)


cdef inline uint64_t xitems(uint64_t nbytes, uint64_t chunk) noexcept nogil:
    return (nbytes + chunk - 1) // chunk


cdef inline shm_slot_hdr *xslot(Xchg *x, int r, uint64_t j) noexcept nogil:
    """Slot of item j of rank r's sequence, in r's outbox."""
    return <shm_slot_hdr *>(x.box[r] + (j % x.nslots) * x.stride)


cdef uint64_t xchg_tables(Eng *e, const uint64_t *B) noexcept nogil:
    """The call's tables (Xchg) from the byte matrix B; returns the most items any rank sends
    (the epoch's advance, the same on every rank)."""
    cdef Xchg *x = &e.x
    cdef int P = e.nranks, me = e.rank, p, q, s
    cdef uint64_t chunk = x.payload, acc, most = 0, n
    x.B = B
    acc = 0
    for q in range(P):
        x.to_at[q] = acc
        acc += B[me * P + q]
    acc = 0
    for p in range(P):
        x.dst_at[p] = acc
        acc += B[p * P + me]
        x.from_at[p] = 0
        for q in range(me):
            x.from_at[p] += B[p * P + q]
    x.dst_at[P] = acc
    for p in range(P):
        n = 0                                     # items p sends before its block for us
        x.first[p] = 0
        for s in range(1, P):
            q = (p + s) % P
            if q == me:
                x.first[p] = n
            n += xitems(B[p * P + q], chunk)
        if n > most:
            most = n
        x.need[p] = 0 if p == me else xitems(B[p * P + me], chunk)
        if p == me:
            x.nsend = n
    return most


cdef inline void xchg_skip_empty(Eng *e, Xchg *x) noexcept nogil:
    """Move the send cursor past rounds with nothing (left) to send."""
    cdef int P = e.nranks, q
    while x.round < P:
        q = (e.rank + x.round) % P
        if <uint64_t>x.in_round < xitems(x.B[e.rank * P + q], x.payload):
            return
        x.round += 1
        x.in_round = 0


cdef void xchg_setup(Eng *e, Chan *c, Call *k) noexcept nogil:
    cdef Xchg *x = &e.x
    cdef int p
    k.chunk = x.payload
    x.base = x.epoch
    x.epoch += x.m                    # (xchg_tables' count, the same on every rank)
    x.sent = 0
    x.round = 1
    x.in_round = 0
    xchg_skip_empty(e, x)
    for p in range(e.nranks):
        x.got[p] = 0
    x.own_off = 0
    x.own_done = x.B[e.rank * e.nranks + e.rank] == 0 or (
        k.dst + x.dst_at[e.rank] == k.src + x.to_at[e.rank])      # (in place)
    x.src_next = (e.rank + e.nranks - 1) % e.nranks     # (round 1's sender first)


cdef int xchg_ready(Eng *e, Chan *c, Call *k) noexcept nogil:
    cdef Xchg *x = &e.x
    cdef int P = e.nranks, i, p
    cdef uint64_t j
    if x.sent < x.nsend and shm_load_acquire64(&xslot(x, e.rank, x.sent).freed) \
            == x.last[x.sent % x.nslots]:
        return XC_SEND
    for i in range(P):
        p = (x.src_next + P - i) % P              # (round 1's sender, then round 2's, ...)
        if x.got[p] < x.need[p]:
            j = x.first[p] + x.got[p]
            if shm_load_acquire64(&xslot(x, p, j).ready) == x.base + j + 1:
                return XC_RECV + p
    if not x.own_done:                # (its own block fills the waits: the others' items
        return XC_OWN                 # come first)
    return 0


cdef int xchg_step(Eng *e, Chan *c, Call *k, int action) noexcept nogil:
    cdef Xchg *x = &e.x
    cdef int P = e.nranks, me = e.rank, p, q
    cdef uint64_t j, lo, n, nb, ticket
    cdef shm_slot_hdr *slot
    if action == XC_OWN:              # a piece of the own block (as large as an item)
        nb = x.B[me * P + me]
        n = nb - x.own_off if nb - x.own_off < k.chunk else k.chunk
        memcpy(k.dst + x.dst_at[me] + x.own_off, k.src + x.to_at[me] + x.own_off, n)
        x.own_off += n
        x.own_done = x.own_off == nb
        return RC_DONE
    if action == XC_SEND:
        q = (me + x.round) % P
        nb = x.B[me * P + q]
        lo = <uint64_t>x.in_round * k.chunk
        n = nb - lo if nb - lo < k.chunk else k.chunk
        slot = xslot(x, me, x.sent)
        memcpy(payload(slot), k.src + x.to_at[q] + lo, n)
        stamp(slot, k, x.sent)
        ticket = x.base + x.sent + 1
        x.last[x.sent % x.nslots] = ticket
        shm_store_release64(&slot.ready, ticket)
        e.n_sent += n
        x.sent += 1
        x.in_round += 1
        xchg_skip_empty(e, x)
        shm_fence()                   # pairs with a sleeper's fence between its flag and its bell
        wake(e, q)
        return RC_DONE
    p = action - XC_RECV
    j = x.first[p] + x.got[p]
    slot = xslot(x, p, j)
    if slot.chunk != j or slot.desc.seq != k.desc.seq:
        return RC_CORRUPT
    nb = x.B[p * P + me]
    lo = x.got[p] * k.chunk
    n = nb - lo if nb - lo < k.chunk else k.chunk
    out(e, k.dst + x.dst_at[p] + lo, payload(slot), n)
    shm_store_release64(&slot.freed, x.base + j + 1)
    x.got[p] += 1
    x.src_next = p                    # (the next look starts at this sender again)
    shm_fence()
    wake(e, p)
    return RC_DONE


cdef bint xchg_done(Eng *e, Chan *c, Call *k) noexcept nogil:
    cdef Xchg *x = &e.x
    cdef int p
    if not x.own_done or x.sent < x.nsend:
        return False
    for p in range(e.nranks):
        if x.got[p] < x.need[p]:
            return False
    return True


cdef void xchg_inline_finish(Eng *e, const char *full, char *dst) noexcept nogil:
    """An exchange small enough to travel inline went as one bitwise-or round of every rank's
    whole send buffer (rank p's at the sum of the earlier ranks' row totals of B): take this
    rank's blocks out of it, in source order."""
    cdef Xchg *x = &e.x
    cdef int P = e.nranks, me = e.rank, p, q
    cdef uint64_t row = 0, n
    for p in range(P):
        n = x.B[p * P + me]
        if n:
            memcpy(dst + x.dst_at[p], full + row + x.from_at[p], n)
        for q in range(P):
            row += x.B[p * P + q]


# ---- alltoall(counts=): the counts travel in the call's first round ----
#
# An alltoall whose blocks have sizes of their own (counts=) needs every rank's counts before
# its blocks can move: B[p*P + q] = counts_p[q] x the row's bytes.  They travel in the call's
# first round (the channel-0 round every call starts with: a bitwise or of uint8), each rank
# writing only its own row, with its data beside them when the data fits the round's room:
#   [0, XV_HEAD)                 rank r's row at 8 (P + 2) r, uint64:
#                                  +0 its claim (dtype and dimensions after the first: the low
#                                     bit set, bcast.pxi's _claim_c)
#                                  +8 the rows of its out= plus 1 (0: no out=)
#                                  +16 its counts[P] (rows to each rank)
#   [XV_HEAD, XV_HEAD + P room)  rank r's whole send buffer at XV_HEAD + r room, when every
#                                rank's fits the room (else it is not read)
# Every rank reads the same round, so every rank decides alike (xv_handover, msg.pxi): a claim
# or an out= that disagrees ends the call (the caller says it in words: collectives.py); data
# that fit the room is taken out of the round (one round in all); else the exchange above runs
# on B in the same call.  The room of the next round is what this one needed (xv_next_room):
# a loop of calls of one size sends each in one round of about its own size.

cdef enum:
    RC_XV_ROUND = 16          # (_run_call -> _progress: the round is in, read it with the GIL)
    XV_MIN_ROOM = 64


cdef struct Xv:
    int ready                 # room set (the first call of the group: XV_MIN_ROOM, or none)
    int pending               # the first round of an alltoall(counts=) runs
    uint64_t row              # bytes per row (this rank's: the claims say whether all agree)
    uint64_t room             # the data room of the next round (every rank agrees)
    uint64_t used_room        # the room of the round in progress


cdef inline uint64_t xv_head(int P) noexcept nogil:
    """Bytes of the rows of the counts round (before the data room)."""
    return <uint64_t>8 * P * (P + 2)


cdef inline uint64_t xv_cap(uint64_t payload, uint64_t limit, int P) noexcept nogil:
    """The largest data room a round of P ranks may have: the round fits one chunk of channel 0
    (payload), and its data the inline limit; in whole 64-byte lines (0: none)."""
    cdef uint64_t head = xv_head(P), n
    if head >= payload:
        return 0
    n = payload - head
    if limit < n:
        n = limit
    return n // <uint64_t>P // 64 * 64


cdef inline uint64_t xv_next_room(uint64_t most, uint64_t cap) noexcept nogil:
    """The room of the group's next round, from the most bytes a rank sent in this one: the
    power of two (at least XV_MIN_ROOM) that holds it, or cap if that is less; XV_MIN_ROOM when
    the data was larger than cap (it could not have come inline anyway); 0 when cap is less
    than XV_MIN_ROOM."""
    cdef uint64_t room = XV_MIN_ROOM
    if cap < XV_MIN_ROOM:
        return 0
    if most > cap:
        return XV_MIN_ROOM
    while room < most:
        room <<= 1
    return room if room < cap else cap


cdef bint xv_agreed(const uint64_t *rows, int P) noexcept nogil:
    """Did every rank pass the same claim, and an out= (where one did) of the rows it
    receives?"""
    cdef int r, p
    cdef uint64_t n
    for r in range(P):
        if rows[r * (P + 2)] != rows[0]:
            return False
        if rows[r * (P + 2) + 1]:
            n = 0
            for p in range(P):
                n += rows[p * (P + 2) + 2 + r]
            if rows[r * (P + 2) + 1] != n + 1:
                return False
    return True


cdef uint64_t xv_matrix(const uint64_t *rows, int P, uint64_t row, uint64_t *B) noexcept nogil:
    """B from the round's counts (rows x row bytes); returns the most bytes a rank sends."""
    cdef int p, q
    cdef uint64_t sent, most = 0
    for p in range(P):
        sent = 0
        for q in range(P):
            B[p * P + q] = rows[p * (P + 2) + 2 + q] * row
            sent += B[p * P + q]
        if sent > most:
            most = sent
    return most


cdef void xv_inline_finish(Eng *e, const char *data, uint64_t room, const char *src,
                           char *dst) noexcept nogil:
    """The blocks of a round whose data came inline (every rank's sends at data + p room),
    into this rank's receives in source order; its own block straight from its input."""
    cdef Xchg *x = &e.x
    cdef int P = e.nranks, me = e.rank, p
    cdef uint64_t n
    for p in range(P):
        n = x.B[p * P + me]
        if not n:
            continue
        if p == me:
            memcpy(dst + x.dst_at[me], src + x.to_at[me], n)
        else:
            memcpy(dst + x.dst_at[p], data + <uint64_t>p * room + x.from_at[p], n)
