# The engine's C types, included first by _engine.pyx: the segment layout (layout.h), the
# synchronisation primitives (shm_sync.h), and the state every primitive, the waiting code and the
# algorithms work on (Conn, Chan, Call, Eng) plus the algorithm interface (Alg).
#
# Vocabulary: chunk (a piece of the message of at most `payload` bytes), slot (a place in a ring),
# step (a counter value: the k-th chunk a ring has carried since the group began), edge (child ->
# parent), up (towards the root, being reduced), down (from the root, the result), item (the ring
# schedule's unit: one chunk of one block at one step of the schedule).

cdef extern from "sched.h" nogil:
    int sched_yield()

cdef extern from "_csrc/shm_sync.h" nogil:
    uint64_t shm_load_acquire64(const uint64_t *p)
    uint64_t shm_load_relaxed64(const uint64_t *p)
    void shm_store_release64(uint64_t *p, uint64_t v)
    uint32_t shm_load_acquire32(const uint32_t *p)
    void shm_store_seqcst32(uint32_t *p, uint32_t v)
    uint32_t shm_load_seqcst32(const uint32_t *p)
    uint32_t shm_fetch_add32(uint32_t *p, uint32_t v)
    int shm_cas32(uint32_t *p, uint32_t expected, uint32_t desired)
    void shm_fence()
    void shm_cpu_relax()
    int64_t shm_now_ns()
    int shm_futex_wait(uint32_t *addr, uint32_t expected, int64_t timeout_ns)
    void shm_futex_wake_all(uint32_t *addr)
    void shm_copy_nt(void *dst, const void *src, size_t n)
    void shm_store_fence()

# the segment layout: one definition, in layout.h (see there for the offsets)
cdef extern from "_csrc/layout.h" nogil:
    enum:
        SHM_LINE
        SHM_PAGE
        SHM_MAX_DIMS
        SHM_FLAG_MISMATCH
        SHM_NOTE_MAX
    uint64_t SHM_XSRC_OFFERED
    ctypedef struct shm_desc_head:
        uint64_t seq
        uint64_t nbytes
        uint64_t shape
        uint16_t kind
        uint8_t op
        uint8_t dtype
        uint32_t ndim
    ctypedef struct shm_desc:
        shm_desc_head head
        int64_t dims[SHM_MAX_DIMS]
    ctypedef struct shm_slot_hdr:
        shm_desc_head desc
        uint64_t chunk
        uint32_t flags
        uint64_t ready
        uint64_t freed
    ctypedef struct shm_seg_hdr:
        uint64_t magic
        uint32_t version
        uint32_t nranks
        uint64_t total
        uint8_t nonce[16]
        uint8_t digest[16]
        uint32_t abort_reason
        int32_t abort_rank
        uint32_t claim
    ctypedef struct shm_rank_block:
        uint32_t bell
        uint32_t sleepers
        uint32_t joined
        uint32_t pid
        double ctime
        uint64_t done
        uint32_t state
        uint64_t call
        uint64_t place[2][4]
        uint64_t direct
        uint64_t xsrc[2]
        shm_desc desc[2]
        uint32_t note_len
        char note[500]
        uint64_t probe


# progress() results (also what every primitive, algorithm step and wait returns: RC_DONE is
# 'go on')
cdef enum:
    RC_DONE = 0
    RC_STALLED = 1
    RC_ABORTED = 2
    RC_MISMATCH = 3
    RC_CORRUPT = 4
    RC_NEED_OUT = 5         # a broadcast's data follows and this rank has no output yet
                            # (engine/bcast.pxi: bcast_handover, bcast_need_out)
    RC_ALONE = 6            # (msg_allreduce, inside Engine.call only: one rank, the call
                            # whole without a round: Engine.alone)


cdef struct Conn:
    # One ring end this rank uses: a ring it consumes (recv) or produces (send).  A ring is a
    # page-aligned region of the segment holding a head counter (written only by the producer),
    # one tail counter per consumer (each written only by its consumer), every counter on its own
    # 128-byte line, then nslots slots of a 64-byte slot header followed by the chunk payload.
    # Counters only grow; step k lives in slot k mod nslots.
    char *ring            # NULL: no such ring
    uint64_t hdr          # bytes before slot 0 (the counter lines, rounded to a page)
    uint64_t base         # send: the head, recv: this rank's tail, when the call began
    int tail              # recv: this rank's tail in the ring
    int ntails            # send: how many consumers (tails) the ring has
    int peer              # recv: the producer (woken when a slot frees)
    int *peers            # send: the consumers (woken when an item is published)


cdef struct Chan:
    int ring              # 1: the ring schedule (parent = successor, the one child = predecessor)
    int pair              # 1: channel 0 of a group of two (its round is one exchange,
                          # alg_inline.pxi)
    int ring_pos          # this rank's position on the ring
    int parent            # -1 at the root
    int index             # this rank's index among the parent's children (its tail there)
    int nchild
    int *children
    uint64_t nslots, stride, payload
    Conn up               # send: the ring towards the parent (ring NULL at the root)
    Conn down             # send: this rank's results, read by its children (NULL at a leaf)
    Conn pdown            # recv: the parent's result ring (NULL at the root)
    Conn *cup             # recv: the children's up rings [nchild]


cdef struct Call:
    int ch
    const char *src
    char *dst
    uint64_t nbytes, chunk, m     # payload bytes, bytes per chunk, chunks (tree) / items (ring)
    uint64_t block, nc            # ring: bytes per block, chunks per block
    int itemsize
    reduce_fn fn
    uint64_t j_up, j_down         # progress counters (their meaning is the algorithm's)
    shm_desc_head desc            # this rank's descriptor, stamped on every slot of the call
    int check_desc                # compare descriptors (the channel-0 round)
    int mismatch
    const void **srcs             # scratch: the operands of one fused reduction (nchild + 1)
    int coll_kind                 # chain algorithms: CHAIN_BCAST, CHAIN_REDUCE, CHAIN_SCAN or
                                  # CHAIN_EXSCAN
    int root                      # rooted collectives: the root's ring position
    int rank_order                # an allreduce of two ranks folded x_0 op x_1 (Engine.call's
                                  # RANK_ORDER: deterministic=True; alg_ring.pxi)
    const uint64_t *offs          # block algorithms: [lo, hi) of each ring position's block


cdef enum:
    CHAIN_BCAST = 1
    CHAIN_REDUCE = 2
    CHAIN_SCAN = 3                # (a reduce's chain from rank 0 in rank order, every position
    CHAIN_EXSCAN = 4              # keeping its prefix: alg_chain.pxi, msg_scan)


cdef struct Direct:
    # The single-copy collectives (alg_direct.pxi): the fold order of the group's schedule (set
    # once), and this call's pointers into every rank's shared input and output.
    int mode              # the collective (DIRECT_ALLREDUCE, DIRECT_BROADCAST, DIRECT_ALLGATHER)
    int ring              # 1: the ring schedule's order (order, pos), 0: the tree's (post, kids)
    int *order            # ring: the ranks in ring order [P]
    int pos               # ring: this rank's position
    int root              # tree: its root
    int *post             # tree: its inner nodes, children before their parent [npost]
    int npost
    int *kid_start        # tree: the children of v are kids[kid_start[v] .. kid_start[v + 1]]
    int *kids
    char *scratch         # tree: one piece per rank (its partial result)
    char *tmp             # reduce: one piece
    const void **srcs     # the operands of one fold [P]
    const char **ins      # every rank's input [P] (this call)
    char **outs           # every rank's output [P]
    int pairwise          # fold two operands at a time (float16 and bfloat16 under the ring)
    uint64_t lo, hi, off  # this rank's part of the message (bytes), and how far it is done
    int cur               # alltoall: the source of the piece at off
    int published         # this rank's part is written and said so
    int finished          # every rank's part is


cdef struct Xchg:
    # The exchange (alg_exchange.pxi): every rank's outbox of nslots slots (no counters: each
    # slot's ready / freed words), and the call's blocks.  B[p*P + q]: bytes rank p sends rank q
    # (the same matrix on every rank); blocks are packed in rank order in src (by destination)
    # and dst (by source).
    char **box            # every rank's outbox [P] (NULL: a group of one)
    uint64_t nslots, stride, payload
    uint64_t epoch        # tickets of the next exchange start here (the same on every rank)
    uint64_t base         # the call's: item j of any rank's sequence has ticket base + j + 1
    uint64_t m            # the call's: the most items any rank sends (the epoch's advance)
    uint64_t *last        # [nslots] the ticket this rank last put into each of its slots
    const uint64_t *B     # the call's byte matrix [P*P]
    uint64_t *to_at       # [P] where the block for rank q starts in this rank's src
    uint64_t *from_at     # [P] where rank p's block for this rank starts in p's src
    uint64_t *dst_at      # [P + 1] where the block from rank p starts in this rank's dst
    uint64_t *first       # [P] index, in rank p's item sequence, of its first item for us
    uint64_t *got         # [P] items taken from rank p so far
    uint64_t *need        # [P] items to take from rank p
    uint64_t nsend, sent  # items this rank sends, and has sent
    int round, in_round   # the next item to send: destination me + round, its index there
    int own_done          # this rank's own block copied
    uint64_t own_off      # how much of it (a piece at a time, when nothing else is ready)
    int src_next          # the source looked at first by the next ready() (round robin)


cdef struct Cma:
    # The single copy of private buffers (alg_cma.pxi): each receiver reads what it gets
    # straight out of its senders' buffers, with process_vm_readv.
    int state             # CMA_UNKNOWN (not probed yet), CMA_YES, CMA_NO, CMA_OFF (switched off)
    uint64_t token        # this rank's probe word (its address is the rank block's `probe`)
    int *pids             # [P] every rank's process (the probe's, the reads')
    uint64_t *src         # [P] the call's: where each rank's source lies in its process
    int mode              # the collective (DIRECT_ALLGATHER or DIRECT_ALLTOALL)
    uint64_t chunk        # bytes read at a time (CMA_CHUNK)
    int s                 # the source read now: the s-th before this rank (s = 1 .. P - 1; P:
    uint64_t off          # every one read), and how many bytes of its block are
    int own_done          # this rank's own block copied (alltoall)
    int published         # this rank has read all it gets, and said so (`direct`)
    int finished          # every rank that reads this rank's buffer has said so
    int err               # the errno of a failed read (0: none), its source, and since when
    int err_rank
    int64_t err_since
    uint64_t n_calls, n_bytes     # calls run so, and bytes read


cdef struct Eng:
    # What the nogil code of one rank sees: the segment, the waiting policy and counters, the
    # channels, and the call in progress.
    char *base
    int rank, nranks
    uint32_t *abort_word
    int64_t spin_ns, yield_ns, sleep_ns
    int64_t slice_end             # monotonic ns at which the running slice ends (0: the clock
    int64_t slice_ns              # was not read yet: a call that finishes at once never reads it)
    bint nt                       # the call in progress writes its output with streaming stores
    uint64_t n_yields, n_sleeps, n_timeouts
    int64_t busy_until            # until then, a wait skips its yield phase: a yield found this
                                  # CPU taken by another thread lately (wait.pxi, BUSY_YIELD_NS)
    int64_t idle_since            # when the call in progress last made no progress (0: it did,
                                  # or it began): kept across its time slices (wait.pxi)
    uint64_t n_sent               # payload bytes this rank has published into rings
    Chan chans[3]                 # latency, bandwidth, and (when the bandwidth channel is a
                                  # tree) a ring around it for the other collectives
    Call call
    Direct dir
    Xchg x
    Cma cma


# An algorithm runs one channel of a call in steps.  ready() says which step can run now without
# blocking (0: none), step() runs it; the waiting code calls ready() once more before sleeping.
ctypedef void (*alg_setup_fn)(Eng *e, Chan *c, Call *k) noexcept nogil
ctypedef int (*alg_ready_fn)(Eng *e, Chan *c, Call *k) noexcept nogil
ctypedef int (*alg_step_fn)(Eng *e, Chan *c, Call *k, int action) noexcept nogil
ctypedef bint (*alg_done_fn)(Eng *e, Chan *c, Call *k) noexcept nogil

cdef struct Alg:
    alg_setup_fn setup            # after the call state is reset: chunking, item count m, checks
    alg_ready_fn ready
    alg_step_fn step
    alg_done_fn done


cdef inline shm_rank_block *rank_block(char *base, int r) noexcept nogil:
    return <shm_rank_block *>(base + sizeof(shm_seg_hdr) + <uint64_t>r * sizeof(shm_rank_block))


cdef struct Bcast:
    # A broadcast's call (engine/bcast.pxi): its first round, and the data that may follow it in
    # the same call.  root -1: the call in progress is no broadcast.
    int root, root_pos    # the root's rank and ring position
    int pending           # the round runs; its result says whether data follows
    int need              # the data follows and waits for this rank's output (RC_NEED_OUT)
    int ran               # the data came in this call
    uint64_t given        # the bytes of what this rank passed (its claim)
    char *dst             # this rank's output for the data (NULL: none yet)
    Py_ssize_t room       # the data room of the next first round (next_room: every rank agrees)
    Py_ssize_t used_room  # the room of the round in progress
