# Broadcast's call (Engine.call with BROADCAST), all of it in this file: its first round's
# layout (one definition, below) and the functions that build and read it in one C pass each
# (bcast_fill, bcast_read, next_room: in Python its handful of small numpy operations cost
# several times the round itself), the call (msg_broadcast), and the named hand-over from the
# first round to the data in the same call (bcast_handover).
#
# The round is a bitwise or of every rank's contribution (its claim, a digest of what it
# passed; the root's description and, when it fits the room, the data).  When every claim
# agrees, the description is short and the data is larger than both the room and the inline
# limit, the data follows in the same call (bcast_handover): the chain from the root on the
# ring channel, or the single copy when every rank's output lies in one shared allocation.
# Every other case ends with the round, and the caller reads it (take_result): the data came
# inline, or the Python layer goes on (collectives.py: a long description, a mismatch said in
# words, data that takes a round of its own).


# ---- the first round's layout: one definition ----
#
# The byte layout of broadcast's first round (collectives.py; the engine's quick_broadcast
# reads the claims and the description's first bytes too), built and read here in one C pass
# each, because in Python its handful of small numpy operations cost several times the round
# itself.  (allgather's inline round, the output with zeros outside each rank's row, is built in
# the engine: Engine.quick_allgather.)
#
# It travels as a bitwise-or of bytes (op bor on uint8) in which each rank writes only its own
# part and zeros elsewhere, so the or of all contributions is every part, exactly, for any dtype.
#
# Broadcast's first round (bcast_fill / bcast_read): F = 8P + META + room bytes, where room (the
# data room) is what the group's previous broadcast needed (next_room), so that a loop of
# broadcasts of one size sends each in one round of about its own size:
#   [0, 8P)            rank r's claim at 8r: 8 bytes naming the (dtype, shape) it passed, the low
#                      bit set; zero when it passed None
#   [8P, 8P + META)    the root's description of its array:
#                        +0 u8 1 (present)     +1 u8 long: the description follows in its own round
#                        +2 u8 ndim            +3 u8 length of dtype.str
#                        +4 u32 length of the pickled (dtype, shape) when long
#                        +8 u64 the array's nbytes
#                        +16 dtype.str (at most 16 bytes)   +32 at most 8 int64 dims
#                      long when the dtype has fields or a subarray, its str names another
#                      dtype (ml_dtypes' bfloat16 is '<V2'), or its str or ndim do not fit
#   [8P + META, F)     the root's data, when it fits the room (and the description is not long)
# A claim is FNV-1a (64-bit) over the dtype's key (dtype.str for plain dtypes; its pickle for
# structured ones), then ndim and every dim; every rank checks every claim against the root's.

cdef enum:
    CLAIM = 8
    META = 96
    MAX_STR = 16
    MAX_INLINE_DIMS = 8

CLAIM_BYTES = CLAIM
META_BYTES = META

cdef dict _KEYS = {}                  # dtype -> (key bytes, inline: plain with a short str)
cdef dict _DTYPES = {}                # dtype.str bytes -> dtype


cdef object _last_dt = None              # (the last dtype asked: a loop of broadcasts asks one)
cdef tuple _last_key = None


cdef tuple _key(dt):
    global _last_dt, _last_key
    if dt is _last_dt:
        return _last_key
    got = _KEYS.get(dt)
    if got is None:
        if len(_KEYS) > 1024:
            _KEYS.clear()
        # (a dtype whose str names another one - ml_dtypes' bfloat16 is '<V2' - travels
        # pickled, as structured ones do)
        plain = dt.fields is None and dt.subdtype is None and _named_by_str(dt)
        if plain:
            s = dt.str.encode()
            got = (s, len(s) <= MAX_STR)
        else:
            got = (pickle.dumps(dt, protocol=4), False)
        _KEYS[dt] = got
    _last_dt, _last_key = dt, got
    return got


cdef uint64_t _fnv(const uint8_t *p, Py_ssize_t n, uint64_t h) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        h = (h ^ p[i]) * 1099511628211ULL
    return h


cdef uint64_t _claim_c(bytes key, int ndim, const int64_t *dims):
    return _claim_raw(<const uint8_t *>PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key), ndim,
                      dims)


cdef uint64_t _claim_raw(const uint8_t *key, Py_ssize_t n, int ndim,
                         const int64_t *dims) noexcept nogil:
    cdef uint64_t h = _fnv(key, n, 1469598103934665603ULL)
    cdef int i
    h = (h ^ <uint64_t>ndim) * 1099511628211ULL
    for i in range(ndim):
        h = (h ^ <uint64_t>dims[i]) * 1099511628211ULL
    return h | 1


def claim(dtype, shape) -> int:
    """The 8-byte claim (as an int, low bit set) naming (dtype, shape)."""
    dt = np.dtype(dtype)
    cdef int64_t dims[64]
    cdef int i, nd = len(shape)
    if nd > 64:
        raise ValueError("shmtree: at most 64 dimensions")
    for i in range(nd):
        dims[i] = shape[i]
    return _claim_c(_key(dt)[0], nd, dims)


def round_bytes(int P, Py_ssize_t room):
    """F: the size of broadcast's first round for P ranks with `room` bytes of data room."""
    return CLAIM * P + META + room


cpdef object bcast_fill(object a, bint is_root, int rank, int P, Py_ssize_t room,
                        object reuse=None):
    """This rank's contribution to broadcast's first round: a uint8 array of F bytes (`reuse`
    zeroed, when it is one of that size: the engine's, from its previous round; else a new
    one).  a: None, or an ndarray of a dtype without Python objects (on the root:
    C-contiguous and aligned); None when a is not so (the call is declined: the Python layer
    makes it so or says why not)."""
    cdef cnp.ndarray arr
    if a is not None:
        if not isinstance(a, np.ndarray):
            return None
        arr = <cnp.ndarray>a
        if (cnp.PyDataType_FLAGS(<cnp.dtype>cnp.PyArray_DESCR(arr)) & 1   # (Python objects)
                or (is_root and not (cnp.PyArray_IS_C_CONTIGUOUS(arr)
                                     and cnp.PyArray_ISALIGNED(arr)))):
            return None
    cdef cnp.npy_intp n = CLAIM * P + META + room
    cdef cnp.ndarray buf
    if reuse is not None and cnp.PyArray_NBYTES(<cnp.ndarray>reuse) == n:
        buf = <cnp.ndarray>reuse
        memset(cnp.PyArray_DATA(buf), 0, n)
    else:
        buf = cnp.PyArray_ZEROS(1, &n, cnp.NPY_UINT8, 0)
    cdef uint8_t *p = <uint8_t *>cnp.PyArray_DATA(buf)
    cdef uint8_t *m = p + CLAIM * P
    cdef int nd, i
    cdef uint64_t c, nbytes
    cdef bytes key, blob
    if a is None:
        return buf
    nd = cnp.PyArray_NDIM(arr)
    key, short = _key(arr.dtype)
    c = _claim_c(key, nd, <const int64_t *>cnp.PyArray_DIMS(arr))
    memcpy(p + CLAIM * rank, &c, CLAIM)
    if not is_root:
        return buf
    nbytes = cnp.PyArray_NBYTES(arr)
    m[0] = 1
    memcpy(m + 8, &nbytes, 8)
    if not short or nd > MAX_INLINE_DIMS:
        blob = pickle.dumps((arr.dtype, tuple(a.shape)), protocol=4)
        m[1] = 1
        (<uint32_t *>(m + 4))[0] = <uint32_t>len(blob)
        return buf
    m[2] = nd
    m[3] = PyBytes_GET_SIZE(key)
    memcpy(m + 16, PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key))
    for i in range(nd):
        (<int64_t *>(m + 32))[i] = cnp.PyArray_DIMS(arr)[i]
    if nbytes <= <uint64_t>room and nbytes:
        memcpy(m + META, cnp.PyArray_DATA(arr), nbytes)
    return buf


cpdef Py_ssize_t next_room(cnp.ndarray buf, int P, Py_ssize_t cap) except -1:
    """The data room of the group's next first round: the size of the broadcast this round
    began (which every rank read from it), in whole 64-byte lines, at least 64; 64 when it
    was larger than cap (its data could not have come inline anyway).  So repeated broadcasts
    of one size take one round, and every rank agrees on the room."""
    cdef uint64_t nbytes
    memcpy(&nbytes, <uint8_t *>cnp.PyArray_DATA(buf) + CLAIM * P + 8, 8)
    nbytes = (nbytes + 63) // 64 * 64
    if nbytes < 64 or nbytes > <uint64_t>cap:
        nbytes = 64
    return <Py_ssize_t>nbytes


def long_meta(a):
    """The root's pickled (dtype, shape), for the round that follows a long description."""
    return pickle.dumps((a.dtype, tuple(a.shape)), protocol=4)


def wrong_claims(cnp.ndarray buf, int P, uint64_t want):
    """The ranks whose claim in the first round is neither zero nor `want`."""
    cdef const uint64_t *c = <const uint64_t *>cnp.PyArray_DATA(buf)
    cdef int r
    return [r for r in range(P) if c[r] != 0 and c[r] != want]


cpdef object bcast_read(cnp.ndarray buf, object out, int P, Py_ssize_t room):
    """Read broadcast's first round (every rank's contributions or-ed together).  Returns the
    result array when the data came inline and `out` is None or a C-contiguous, aligned,
    writable array of the root's dtype and shape (then `out` itself).  Otherwise a tuple:
    ("long", length) - the description follows in a round of that many bytes;
    ("mismatch", dtype, shape, ranks) - those ranks passed another dtype or shape;
    ("inline", dtype, shape) - the data is in the round (at CLAIM * P + META), `out` needs care;
    ("data", dtype, shape) - the data follows."""
    cdef uint8_t *p = <uint8_t *>cnp.PyArray_DATA(buf)
    cdef uint8_t *m = p + CLAIM * P
    cdef uint64_t nbytes
    cdef int nd = m[2], slen = m[3]
    cdef cnp.ndarray res
    if m[0] != 1:
        raise RuntimeError("shmtree: broadcast: the root's description is missing from the "
                           "first round")
    if m[1]:
        return ("long", (<uint32_t *>(m + 4))[0])
    memcpy(&nbytes, m + 8, 8)
    cdef const int64_t *dims = <const int64_t *>(m + 32)
    cdef uint64_t want = _claim_raw(m + 16, slen, nd, dims)
    cdef const uint64_t *claims = <const uint64_t *>p
    cdef bint agreed = True
    cdef int r
    for r in range(P):
        agreed = agreed and (claims[r] == 0 or claims[r] == want)
    res = None
    if (agreed and nbytes <= <uint64_t>room and type(out) is _NDARRAY
            and cnp.PyArray_NDIM(<cnp.ndarray>out) == nd
            and memcmp(cnp.PyArray_DIMS(<cnp.ndarray>out), dims, nd * sizeof(int64_t)) == 0
            and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>out)
            and cnp.PyArray_ISALIGNED(<cnp.ndarray>out)
            and cnp.PyArray_ISWRITEABLE(<cnp.ndarray>out)):
        key, short = _key((<cnp.ndarray>out).dtype)        # (the common case: out given; no
        if (short and PyBytes_GET_SIZE(key) == slen         # dtype or shape objects built)
                and memcmp(PyBytes_AS_STRING(key), m + 16, slen) == 0):
            res = <cnp.ndarray>out
    if res is None:
        key = (<char *>(m + 16))[:slen]
        dt = _DTYPES.get(key)
        if dt is None:
            if len(_DTYPES) > 1024:
                _DTYPES.clear()
            dt = _DTYPES[key] = np.dtype(key.decode())
        shape = tuple([dims[i] for i in range(nd)])
        if not agreed:
            return ("mismatch", dt, shape, wrong_claims(buf, P, want))
        if nbytes > <uint64_t>room:
            return ("data", dt, shape)
        if out is None:
            res = np.empty(shape, dt)
        elif (type(out) is _NDARRAY and (<cnp.ndarray>out).dtype == dt and out.shape == shape
              and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>out)
              and cnp.PyArray_ISALIGNED(<cnp.ndarray>out)
              and cnp.PyArray_ISWRITEABLE(<cnp.ndarray>out)):
            res = <cnp.ndarray>out
        else:
            return ("inline", dt, shape)
    if nbytes:
        memcpy(cnp.PyArray_DATA(res), m + META, nbytes)
    return res


cpdef bint fits(object out, object a) except -1:
    """Is `out` an ndarray that can take `a`'s values in place: a's dtype and shape,
    C-contiguous, aligned and writable (the common out=, checked without building objects)?"""
    if not isinstance(out, np.ndarray):
        return False
    cdef cnp.ndarray o = <cnp.ndarray>out
    cdef cnp.ndarray x = <cnp.ndarray>a
    cdef int nd = cnp.PyArray_NDIM(o)
    return (nd == cnp.PyArray_NDIM(x)
            and memcmp(cnp.PyArray_DIMS(o), cnp.PyArray_DIMS(x), nd * sizeof(cnp.npy_intp)) == 0
            and cnp.PyArray_IS_C_CONTIGUOUS(o) and cnp.PyArray_ISALIGNED(o)
            and cnp.PyArray_ISWRITEABLE(o)
            and cnp.PyArray_EquivTypes(<cnp.dtype>cnp.PyArray_DESCR(o),
                                       <cnp.dtype>cnp.PyArray_DESCR(x)))


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
    if claim is not None and (type(claim) is not _NDARRAY or (
            out is not None and (type(out) is not _NDARRAY or not fits(out, claim)))):
        return -1
    n = 0
    if claim is not None:
        c = <cnp.ndarray>claim
        n = cnp.PyArray_NBYTES(c)
    first = bcast_fill(claim, is_root, me, P, self.bc.room, self.bc_buf)
    if first is None:
        return -1
    self.bc_buf = first                   # (the next round's, once this call and what follows
                                          # it in the Python layer are over: calls of a rank
                                          # run one after the other)
    f = <cnp.ndarray>first
    result = out
    if claim is not None and n > self.sel_limit[COLL_BROADCAST]:     # (the data may follow in
        # this call: the output is given before the round, the root's holding its data)
        if result is None:
            result = np.empty((<object>c).shape, c.dtype)
        res = <cnp.ndarray>result
        if is_root and cnp.PyArray_DATA(res) != cnp.PyArray_DATA(c):
            memmove(cnp.PyArray_DATA(res), cnp.PyArray_DATA(c), n)
    if out is None and claim is not None and n <= <uint64_t>self.bc.room:
        out = empty_like(c, -1)           # (the data comes in the round: its output, made
                                          # here in C, which bcast_read checks and fills)
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
        place(self, self.cur_seq, self.bc.dst, self.bc.dst, n, True)
    return RC_DONE


cdef int bcast_data_only(Engine self, out, int root, int kind) except -2:
    """The data of a broadcast whose round the Python layer ran: out, every rank's output as
    uint8 (the root's holding the data); the descriptor (kind, (nbytes,), bytes, bitwise or).
    Selection: inline, a bitwise or in which only the root has bits (the others' outputs are
    zeroed first), or the chain from the root (the single copy when shared)."""
    cdef cnp.ndarray o
    cdef int64_t dims[1]
    cdef int rc, alg
    if type(out) is not _NDARRAY:
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


cdef int bcast_handover(Engine self) noexcept nogil:
    """After a broadcast's first round: when its result says the data follows (every claim
    agrees with the root's, the description is not long, and the data is larger than both
    the round's room and the inline limit), run it in the same call on the ring channel:
    the chain from the root, or the single copy when every rank's output lies in one shared
    allocation (the round was the agreement).  Every rank reads the same round, so every
    rank decides alike.  RC_NEED_OUT when this rank has no output yet (bcast_need_out)."""
    cdef int P = self.e.nranks, r, ch
    cdef const uint8_t *p = <const uint8_t *>self.dst_p
    cdef const uint64_t *claims = <const uint64_t *>p
    cdef const uint8_t *m = p + CLAIM * P
    cdef uint64_t want, n, head = CLAIM * P + META
    self.bc.pending = 0
    ch = self._ring_channel()
    if ch < 0 or self.msg_nbytes < head:
        return RC_DONE
    want = claims[self.bc.root]
    if want == 0 or m[0] != 1 or m[1] != 0:
        return RC_DONE
    for r in range(P):
        if claims[r] != 0 and claims[r] != want:
            return RC_DONE                # (a mismatch: the caller says it)
    memcpy(&n, m + 8, 8)
    if n <= self.msg_nbytes - head or n <= self.sel_limit[COLL_BROADCAST]:
        return RC_DONE                    # (the data came inline, or takes a round of its
    self.bc.ran = 1                       # own: the caller's)
    self.phase = 1
    self.direct = direct_agreed(self)   # (zero places where an output is missing)
    self.coll = COLL_BROADCAST
    self.msg_nbytes = n
    self.src_p = NULL
    self.e.call.root = self.bc.root_pos
    self.e.call.coll_kind = CHAIN_BCAST
    self.e.dir.mode = COLL_BROADCAST
    self.e.dir.pairwise = 0
    self.e.nt = not self.direct and self.nt_bytes > 0 and n >= self.nt_bytes
    if self.bc.dst == NULL:
        self.bc.need = 1
        return RC_NEED_OUT
    self.dst_p = self.bc.dst
    self._start_phase(1 if self.direct else ch, ALG_DIRECT if self.direct else ALG_RING,
                      NULL, self.dst_p, n)
    return drive(&self.e, self._alg())


cdef int bcast_need_out(Engine self, dst) except -1:
    """The data follows and this rank passed neither an array nor out=: its output `dst` (made
    by the caller from the round's description), which the data then runs into."""
    cdef cnp.ndarray o = dst
    cdef uint64_t want = self.msg_nbytes
    if not self.busy or not self.bc.need:
        raise RuntimeError("shmtree: give_output: no broadcast waits for its output")
    if self.sc_mode:                      # (a scatter's: this rank's block)
        want = self.sc_Bp[self.sc_root * self.e.nranks + self.e.rank]
    if (not cnp.PyArray_IS_C_CONTIGUOUS(o) or not cnp.PyArray_ISWRITEABLE(o)
            or <uint64_t>cnp.PyArray_NBYTES(o) != want):
        raise ValueError("shmtree: give_output: the output must be C-contiguous, writable, of "
                         "the data's size")
    self.bc_result = dst
    if self.sc_mode:
        self.sc_out = dst
    self.bc.need = 0
    self.result = None
    self.dst_p = <char *>cnp.PyArray_DATA(o)
    self._start_phase(self._ring_channel(), ALG_CMA if self.cma else ALG_RING, NULL, self.dst_p,
                      self.msg_nbytes)            # (a scatter's may read by cross-memory attach)
    return 0
