# Broadcast's call (Engine.call with BROADCAST): its first round, and the hand-over from that
# round to the data in the same call.  The round's layout and the functions that build and read
# it are _moving.pyx's (bcast_fill, bcast_read, next_room: claims | the root's description |
# data room); what the engine reads of it here is BC_CLAIM and BC_META.
#
# The round is a bitwise or of every rank's contribution (its claim, a digest of what it
# passed; the root's description and, when it fits the room, the data).  When every claim
# agrees, the description is short and the data is larger than both the room and the inline
# limit, the data follows in the same call (bcast_handover): the chain from the root on the
# ring channel, or the single copy when every rank's output lies in one shared allocation.
# Every other case ends with the round, and the caller reads it (take_result): the data came
# inline, or the Python layer goes on (collectives.py: a long description, a mismatch said in
# words, data that takes a round of its own).


cdef int ring_pos(Engine self, int r) noexcept:
    """Rank r's position in the ring order."""
    cdef int q
    for q in range(self.e.nranks):
        if self.e.dir.order[q] == r:
            return q
    return 0


cdef int msg_broadcast(Engine self, array, out, int root, int kind, uint64_t tag) except -2:
    """broadcast: this rank passed an ndarray (the root: C-contiguous and aligned), or None with
    an ndarray out= that is, and out= is None or fits what it passed as is (_moving.fits).
    tag BC_DATA_ONLY: the data alone (out: every rank's output as uint8, the root's holding
    the data; after a round of the Python layer's)."""
    cdef int me = self.e.rank, P = self.e.nranks, rc
    cdef bint is_root = me == root
    cdef cnp.ndarray c, res, f
    cdef uint64_t n
    cdef int64_t dims[1]
    if not 0 <= root < P:
        return -1
    if tag == BC_DATA_ONLY:
        return bcast_data_only(self, out, root, kind)
    claim = array
    if array is None:
        if is_root:
            return -1
        claim = out                   # (None too: this rank claims nothing, the root says all)
    if claim is not None and (type(claim) is not np.ndarray or (
            out is not None and (type(out) is not np.ndarray or not fits(out, claim)))):
        return -1
    n = 0
    if claim is not None:
        c = <cnp.ndarray>claim
        n = cnp.PyArray_NBYTES(c)
    first = bcast_fill(claim, is_root, me, P, self.bc.room)
    if first is None:
        return -1
    f = <cnp.ndarray>first
    result = out
    if claim is not None and n > self.sel_limit[COLL_BROADCAST]:     # (the data may follow in
        # this call: the output is given before the round, the root's holding its data)
        if result is None:
            result = np.empty((<object>c).shape, c.dtype)
        res = <cnp.ndarray>result
        if is_root and cnp.PyArray_DATA(res) != cnp.PyArray_DATA(c):
            memmove(cnp.PyArray_DATA(res), cnp.PyArray_DATA(c), n)
    rc = self.may_begin()
    if rc != RC_DONE:
        return rc
    dims[0] = cnp.PyArray_SIZE(f)
    self.begin_call(f, f, <const char *>cnp.PyArray_DATA(f), <char *>cnp.PyArray_DATA(f),
                    dims[0], 1, OP_BOR, DT_U1, kind, 1, dims, COLL_ALLREDUCE, ALG_INLINE)
    self.bc.pending = 1
    self.bc.root = root
    self.bc.root_pos = ring_pos(self, root)
    self.bc.used_room = self.bc.room
    self.bc.dst = NULL
    self.bc.given = n
    self.bc_out = out
    if claim is not None and n > self.sel_limit[COLL_BROADCAST]:
        self.bc_result = result
        self.bc.dst = <char *>cnp.PyArray_DATA(res)
        self._place(self.cur_seq, self.bc.dst, self.bc.dst, n, True)
    return RC_DONE


cdef int bcast_data_only(Engine self, out, int root, int kind) except -2:
    """The data of a broadcast whose round the Python layer ran: out, every rank's output as
    uint8 (the root's holding the data); the descriptor (kind, (nbytes,), bytes, bitwise or).
    Selection: inline, a bitwise or in which only the root has bits (the others' outputs are
    zeroed first), or the chain from the root (the single copy when shared)."""
    cdef cnp.ndarray o
    cdef int64_t dims[1]
    cdef int rc, alg
    if type(out) is not np.ndarray:
        return -1
    o = <cnp.ndarray>out
    if (cnp.PyArray_TYPE(o) != cnp.NPY_UINT8 or not cnp.PyArray_IS_C_CONTIGUOUS(o)
            or not cnp.PyArray_ISWRITEABLE(o)):
        return -1
    dims[0] = cnp.PyArray_NBYTES(o)
    alg = ALG_INLINE if self.e.nranks == 1 else select(self, COLL_BROADCAST, dims[0])
    self.result = out
    rc = self.may_begin()
    if rc != RC_DONE:
        return rc
    if alg != ALG_RING:
        if self.e.rank != root:
            memset(cnp.PyArray_DATA(o), 0, dims[0])
        self.begin_call(o, o, <const char *>cnp.PyArray_DATA(o), <char *>cnp.PyArray_DATA(o),
                        dims[0], 1, OP_BOR, DT_U1, kind, 1, dims, COLL_ALLREDUCE,
                        select(self, COLL_ALLREDUCE, dims[0]))
        return RC_DONE
    self.e.call.root = ring_pos(self, root)
    self.e.call.coll_kind = CHAIN_BCAST
    self.begin_call(None, o, NULL, <char *>cnp.PyArray_DATA(o), dims[0], 1, OP_BOR, DT_U1,
                    kind, 1, dims, COLL_BROADCAST, ALG_RING)
    return RC_DONE


cdef object bcast_ended(Engine self):
    """A broadcast's call has ended (DONE): its result - the output, when the data came (in the
    round, or after it in the same call), else (what bcast_read says, the round, its room) for
    the Python layer to go on - and the room of the next first round (every rank read the same
    round, so every rank agrees on it)."""
    cdef int P = self.e.nranks
    first = self.src_ref
    room = self.bc.used_room
    self.bc.room = next_room(first, P, self.sel_limit[COLL_BROADCAST])
    if self.bc.ran or (P == 1 and self.bc_result is not None):
        return self.bc_result             # (one rank: its output holds the data already)
    got = bcast_read(first, self.bc_out, P, room)
    if type(got) is not tuple:
        return got
    return got, first, room


cdef int bcast_need_out(Engine self) except -1:
    """The data follows and this rank passed neither an array nor out=: its output, of the
    root's dtype and shape (from the round), is made now; the data then runs on."""
    got = bcast_read(self.src_ref, None, self.e.nranks, self.bc.used_room)
    result = np.empty(got[2], got[1])
    self.bc_result = result
    self.bc.need = 0
    self.dst_p = <char *>cnp.PyArray_DATA(<cnp.ndarray>result)
    self._start_phase(self._ring_channel(), ALG_RING, NULL, self.dst_p, self.msg_nbytes)
    return 0
