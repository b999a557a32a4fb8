/* The byte layout of a group's shared segment (one memfd), as C structs.
 *
 * One definition: the engine (_engine.pyx and the shmtree/engine/ .pxi files, through
 * `cdef extern`) uses these types, and exports the sizes transport.py needs (HEADER_BYTES,
 * RANK_BLOCK_BYTES, SLOT_HDR_BYTES, LINE_BYTES, PAGE_BYTES).  Every padding byte is explicit:
 * the compiler inserts none (every field sits at a multiple of its own size), and the static
 * assertions below pin the offsets that other processes (and tests/test_security.py, which pokes
 * the header at 0, 8, 12, 16 and 48) rely on.  Changing any of it is a VERSION change.
 *
 *     0                header (4096): magic, version, nranks, size, nonce, plan digest |
 *                      abort word (own line) | rank claims (own line)
 *     4096             rank blocks, 1024 bytes each: bell + sleepers (own line) | join record,
 *                      calls completed, member state, call in progress | two call descriptors
 *                      (by call seq parity) | abort note | probe word's address
 *     then rings       (offsets computed by transport.py): head line | one tail line per
 *                      consumer, rounded up to a page | S slots of (slot header + payload)
 */
#ifndef SHMTREE_LAYOUT_H
#define SHMTREE_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#define SHM_LINE 128            /* every shared counter on its own line (two 64-byte lines:
                                   the adjacent-line prefetcher pairs them) */
#define SHM_PAGE 4096
#define SHM_MAX_DIMS 12         /* dims kept in a descriptor for messages (the shape digest
                                   covers all) */
#define SHM_FLAG_MISMATCH 1u    /* slot flag: a descriptor differed below (the result is void) */

/* The part of a call descriptor that ranks compare (and that every slot of the call echoes). */
typedef struct shm_desc_head {
    uint64_t seq;               /*  0 */
    uint64_t nbytes;            /*  8 */
    uint64_t shape;             /* 16 FNV-1a digest of all the dims and ndim */
    uint16_t kind;              /* 24 */
    uint8_t op;                 /* 26 */
    uint8_t dtype;              /* 27 */
    uint32_t ndim;              /* 28 */
} shm_desc_head;                /* 32: compared between ranks */

/* A call descriptor (in the rank block, two of them by call seq parity). */
typedef struct shm_desc {
    shm_desc_head head;         /*   0 */
    int64_t dims[SHM_MAX_DIMS]; /*  32 the first SHM_MAX_DIMS dims (for messages) */
} shm_desc;                     /* 128 */

/* The header of every ring slot, followed by the chunk payload.  The rings' flow control is
 * their head and tail counters; the exchange's outboxes (alg_exchange.pxi: slots read by any
 * rank, no counters) use the slot's own two words instead: `ready`, the ticket of the item the
 * slot holds (written by its producer, release, after the payload), and `freed`, the ticket of
 * the item its consumer has taken out (written by that consumer, release, after its copy). */
typedef struct shm_slot_hdr {
    shm_desc_head desc;         /*  0 the producer's call descriptor (its compared part) */
    uint64_t chunk;             /* 32 chunk (tree) or item (ring) index within the call */
    uint32_t flags;             /* 40 SHM_FLAG_* */
    uint32_t pad;               /* 44 */
    uint64_t ready;             /* 48 exchange: ticket of the item held (producer) */
    uint64_t freed;             /* 56 exchange: ticket of the item taken out (its consumer) */
} shm_slot_hdr;                 /* 64 */

/* The segment header (first page). */
typedef struct shm_seg_hdr {
    uint64_t magic;             /*   0 "SMTREE01" little endian */
    uint32_t version;           /*   8 */
    uint32_t nranks;            /*  12 */
    uint64_t total;             /*  16 segment bytes */
    uint8_t nonce[16];          /*  24 per-group random */
    uint8_t pad0[8];            /*  40 */
    uint8_t digest[16];         /*  48 digest of the group's plan (trees, geometry): join
                                       checks it */
    uint8_t pad1[64];           /*  64 */
    uint32_t abort_reason;      /* 128 own line: 0 while the group is healthy */
    int32_t abort_rank;         /* 132 */
    uint8_t pad2[120];          /* 136 */
    uint32_t claim;             /* 256 own line: next rank to hand out (Pool workers) */
    uint8_t pad3[SHM_PAGE - 260];
} shm_seg_hdr;                  /* 4096 */

/* One rank's block (after the header, rank r at SHM_PAGE + r * sizeof(shm_rank_block)). */
typedef struct shm_rank_block {
    uint32_t bell;              /*    0 futex word */
    uint32_t sleepers;          /*    4 raised while the rank is (about to be) asleep */
    uint8_t pad0[120];          /*    8 */
    uint32_t joined;            /*  128 0 free, 1 being claimed, 2 joined (pid and ctime valid) */
    uint32_t pid;               /*  132 */
    double ctime;               /*  136 process create time (psutil) */
    uint64_t done;              /*  144 seq + 1 of the last call this rank has completed (its
                                        part of it is all published; a mismatch counts) */
    uint32_t state;             /*  152 what the member is doing (ST_*, the Python layer's) */
    uint32_t pad1;              /*  156 */
    uint64_t call;              /*  160 seq + 1 of the call this rank is in, 0 between calls */
    uint64_t place[2][4];       /*  168 where this rank's message lies, by call seq parity:
                                        shared allocation and byte offset of the input, then of
                                        the output (ids 0: private memory); written before the
                                        call's first round, read by every rank after it */
    uint64_t direct;            /*  232 seq + 1 of the last single-copy call whose part this
                                        rank has written (into every rank's output) */
    uint64_t xsrc[2];           /*  240 single copy of private buffers (cross-memory attach,
                                        alg_cma.pxi), by call seq parity: SHM_XSRC_OFFERED | the
                                        address, in this rank's process, of what its peers read
                                        (0: this rank does not offer it for this call); written
                                        before the call's first round, read after it */
    shm_desc desc[2];           /*  256 call descriptors by call seq parity */
    uint32_t note_len;          /*  512 why this rank aborted the group (its own words) */
    char note[500];             /*  516 */
    uint64_t probe;             /* 1016 the address, in this rank's process, of its probe word
                                        (alg_cma.pxi: a peer reads it once with
                                        process_vm_readv to learn whether it may); 0: none */
} shm_rank_block;               /* 1024 */

#define SHM_XSRC_OFFERED (1ull << 63)   /* (user-space addresses lie below 2^63) */

#define SHM_NOTE_MAX ((uint32_t)sizeof(((shm_rank_block *)0)->note))

#define SHM_ASSERT_AT(T, f, off) _Static_assert(offsetof(T, f) == (off), #T "." #f " moved")
SHM_ASSERT_AT(shm_desc_head, nbytes, 8);
SHM_ASSERT_AT(shm_desc_head, shape, 16);
SHM_ASSERT_AT(shm_desc_head, kind, 24);
SHM_ASSERT_AT(shm_desc_head, op, 26);
SHM_ASSERT_AT(shm_desc_head, dtype, 27);
SHM_ASSERT_AT(shm_desc_head, ndim, 28);
_Static_assert(sizeof(shm_desc_head) == 32, "descriptor head is 32 bytes");
SHM_ASSERT_AT(shm_desc, dims, 32);
_Static_assert(sizeof(shm_desc) == 128, "descriptor is 128 bytes");
SHM_ASSERT_AT(shm_slot_hdr, chunk, 32);
SHM_ASSERT_AT(shm_slot_hdr, flags, 40);
SHM_ASSERT_AT(shm_slot_hdr, ready, 48);
SHM_ASSERT_AT(shm_slot_hdr, freed, 56);
_Static_assert(sizeof(shm_slot_hdr) == 64, "slot header is 64 bytes");
SHM_ASSERT_AT(shm_seg_hdr, version, 8);
SHM_ASSERT_AT(shm_seg_hdr, nranks, 12);
SHM_ASSERT_AT(shm_seg_hdr, total, 16);
SHM_ASSERT_AT(shm_seg_hdr, nonce, 24);
SHM_ASSERT_AT(shm_seg_hdr, digest, 48);
SHM_ASSERT_AT(shm_seg_hdr, abort_reason, 128);
SHM_ASSERT_AT(shm_seg_hdr, abort_rank, 132);
SHM_ASSERT_AT(shm_seg_hdr, claim, 256);
_Static_assert(sizeof(shm_seg_hdr) == SHM_PAGE, "header is one page");
SHM_ASSERT_AT(shm_rank_block, joined, 128);
SHM_ASSERT_AT(shm_rank_block, pid, 132);
SHM_ASSERT_AT(shm_rank_block, ctime, 136);
SHM_ASSERT_AT(shm_rank_block, done, 144);
SHM_ASSERT_AT(shm_rank_block, state, 152);
SHM_ASSERT_AT(shm_rank_block, call, 160);
SHM_ASSERT_AT(shm_rank_block, place, 168);
SHM_ASSERT_AT(shm_rank_block, direct, 232);
SHM_ASSERT_AT(shm_rank_block, xsrc, 240);
SHM_ASSERT_AT(shm_rank_block, probe, 1016);
SHM_ASSERT_AT(shm_rank_block, desc, 256);
SHM_ASSERT_AT(shm_rank_block, note_len, 512);
SHM_ASSERT_AT(shm_rank_block, note, 516);
_Static_assert(sizeof(shm_rank_block) == 1024, "rank block is 1024 bytes");
#undef SHM_ASSERT_AT

#endif
