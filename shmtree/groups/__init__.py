"""The groups layer: a group of ranks, its shared memory, and this process's membership.

    transport   the group's segment (one memfd), laid out per tree edge: header, rank
                blocks, rings
    group       Group: its plan, its segment, admitting a member (Group.join), liveness of
                the members, aborting and saying why
    token       the rendezvous token (Group.rendezvous_token / from_token): plain data,
                parsed and checked, never unpickled
    subgroup    sub_plan and SubGroup: the plan and the group of a sub-communicator
    session     this process's membership: shmtree.current(), the fork generation
    shared      the memory of shared arrays (comm.empty / comm.zeros): SharedArrays
    survive     revoke, agree, failed_ranks, shrink: the Survive mixin of every communicator,
                the survive region's agreement (issue 38)
    sentinel    a thread per member process asleep on its peers' pidfds: a death aborts the
                group at once

It makes no communicator: Group.join hands the admitted rank to the function that
shmtree.launching.joining registers.  It may import: the machine layer, the engine
(shmtree._engine, _moving), the leaves (shmtree.codes, errors, ops), and within this layer;
never the front end, p2p, internode, launching or torch.
"""
