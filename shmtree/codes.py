"""The words members of a group exchange through the segment: call kinds (in a call's
descriptor), abort reasons (the header's abort word), member states (each rank block's state
word), and how each is said in an error message.

Plain constants and text helpers: every other module of the library may import this one, and it
imports nothing of shmtree's.
"""

# call kinds in the descriptor; a rooted collective adds KIND_ROOT_STEP * root (the descriptor's
# kind is 16 bits: roots up to 4095), so ranks that disagree on the root disagree on the kind
KIND_ALLREDUCE = 1
KIND_BARRIER = 2
KIND_BROADCAST = 3
KIND_REDUCE = 4
KIND_ALLGATHER = 5
KIND_REDUCE_SCATTER = 6
KIND_ALLGATHER_LENGTHS = 7     # allgather(axis=0)'s first round: every rank's length
KIND_ALLTOALL = 8
KIND_GATHER = 9
KIND_SCATTER = 10
KIND_SCAN = 11
KIND_EXSCAN = 12
KIND_COUNTS = 13               # a round of counts before a call whose blocks differ in size
                               # (alltoall(counts=), gather(axis=0)): its "root step" is the
                               # kind of the call it precedes (KIND_COUNTS + KIND_ROOT_STEP *
                               # KIND_ALLTOALL), so the rounds of different calls differ
KIND_SCAN_BACK = 14            # scan / exscan's second exchange (the prefixes going back)
KIND_DETERMINISTIC = 15        # reproducible sums (repro.py): deterministic=True calls and
                               # Accumulator allreduces; its "root step" says which (DET_*)
KIND_ROOT_STEP = 16
# the calls of KIND_DETERMINISTIC: kind = KIND_DETERMINISTIC + KIND_ROOT_STEP * DET_*, a
# reduce's root added to DET_REDUCE (roots below DET_ROOTS; a larger root takes the last
# code and says itself in the rounds' shapes)
DET_ALLREDUCE, DET_REDUCE_SCATTER, DET_SCAN, DET_EXSCAN, DET_ACCUMULATE = range(5)
DET_REDUCE = 8
DET_ROOTS = 4095 - DET_REDUCE        # (roots from DET_ROOTS on share the code 4095)
DET_NAMES = {DET_ALLREDUCE: "allreduce", DET_REDUCE_SCATTER: "reduce_scatter", DET_SCAN: "scan",
             DET_EXSCAN: "exscan"}
KIND_NAMES = {KIND_ALLREDUCE: "allreduce", KIND_BARRIER: "barrier", KIND_BROADCAST: "broadcast",
              KIND_REDUCE: "reduce", KIND_ALLGATHER: "allgather",
              KIND_REDUCE_SCATTER: "reduce_scatter", KIND_ALLGATHER_LENGTHS: "allgather",
              KIND_ALLTOALL: "alltoall", KIND_GATHER: "gather", KIND_SCATTER: "scatter",
              KIND_SCAN: "scan", KIND_EXSCAN: "exscan", KIND_COUNTS: "counts",
              KIND_SCAN_BACK: "scan"}
ROOTED = (KIND_BROADCAST, KIND_REDUCE, KIND_GATHER, KIND_SCATTER)
KIND_NAMES.update({KIND_DETERMINISTIC + KIND_ROOT_STEP * d: f"deterministic {name}"
                   for d, name in DET_NAMES.items()})
KIND_NAMES[KIND_DETERMINISTIC + KIND_ROOT_STEP * DET_ACCUMULATE] = "Accumulator allreduce"


def det_kind(det, root=0) -> int:
    """The descriptor kind of a reproducible call (DET_*; a deterministic reduce's root)."""
    if det == DET_REDUCE:
        det += min(root, DET_ROOTS)
    return KIND_DETERMINISTIC + KIND_ROOT_STEP * det


def kind_name(kind) -> str:
    """'allreduce', 'broadcast(root=2)', 'alltoall(counts)': a descriptor's kind for people."""
    base, root = kind % KIND_ROOT_STEP, kind // KIND_ROOT_STEP
    if base == KIND_DETERMINISTIC:
        if root >= DET_REDUCE:
            return f"deterministic reduce(root={root - DET_REDUCE})" if root < 4095 else \
                "deterministic reduce"
        return KIND_NAMES.get(kind, "reproducible collective")
    if base == KIND_COUNTS and root:
        return f"{KIND_NAMES.get(root, 'collective')}(counts)"
    name = KIND_NAMES.get(base, "collective")
    return f"{name}(root={root})" if base in ROOTED else name

# abort reasons (the header's abort word); the ones marked (note) are explained in the words of
# the rank that aborted, kept in its rank block
ABORT_DIED = 1         # rank = the member found dead
ABORT_TIMEOUT = 2      # rank = the member whose timeout ran out (note)
ABORT_FAILED = 3       # rank = the member that raised or was interrupted (note)
ABORT_CLOSED = 4       # the group was closed by its creator
ABORT_CORRUPT = 5      # rank = the member that found a corrupted ring
ABORT_MEMBERSHIP = 6   # a process tried to join a full group (e.g. a replaced Pool worker)
ABORT_STALL = 7        # rank = a Pool member that waited on idle members (note)
ABORT_LEFT = 8         # rank = a member that waited on one that left the group for good (note)
ABORT_TASK = 9         # rank = a Pool member whose task raised while others waited for it (note)
ABORT_INIT = 10        # rank = a Pool member whose initializer raised (note)
ABORT_REVOKED = 11     # rank = the member that called comm.revoke() (groups/survive.py)
NOTED = (ABORT_TIMEOUT, ABORT_FAILED, ABORT_STALL, ABORT_LEFT, ABORT_TASK, ABORT_INIT)

# what a member is doing (its rank block's state word): a Pool worker is idle between tasks;
# a member that closed its communicator (returned from run's fn) has left for good
ST_NONE, ST_BUSY, ST_IDLE, ST_LEFT = 0, 1, 2, 3
STATE_NAMES = {ST_NONE: "not joined yet", ST_BUSY: "busy outside the collective",
               ST_IDLE: "idle, no task", ST_LEFT: "left the group"}


WORDS_BYTES = 256          # what one rank says of a mismatch every rank saw, in UTF-8 bytes


def grouped(said, ranks=None):
    """[(ranks, text)]: the ranks (all, or those given) that said the same text, grouped in
    order of first appearance (said: a text per rank)."""
    groups = {}
    for r in (range(len(said)) if ranks is None else ranks):
        groups.setdefault(said[r], []).append(r)
    return [(rs, text) for text, rs in groups.items()]


def ranks_text(ranks):
    """'rank 2' or 'ranks 0,1,3'."""
    ranks = list(ranks)
    return f"rank{'s' if len(ranks) != 1 else ''} {','.join(map(str, ranks))}"


def states_text(absent):
    """'rank 1: idle, no task; rank 3: left the group' for (rank, state) pairs."""
    return "; ".join(f"rank {r}: {STATE_NAMES.get(st, st)}" for r, st in absent)
