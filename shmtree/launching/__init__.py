"""The launching layer: starting the processes of a group and making them members.

    launch      run(fn, nprocs): fn on every rank of a new group, in new processes (SPMD);
                the start-method and pickling checks Pool uses too
    pool        Pool: a multiprocessing.pool.Pool whose workers form one shmtree group
    joining     join: the one place communicators are made (Group.join hands it the rank)
    shrink      comm.shrink(): the communicator of the survivors (ShrunkCommunicator)
    heal        pools that heal (Pool(on_failure="shrink" | "respawn")): the pool's Healer,
                its control memory, the workers' side

It may import every layer below it: the communicator (shmtree.communicators.communicator), internode,
p2p, groups, machine, the leaves; and within this layer.  Only the API (shmtree.api,
shmtree's __init__) and the tools above (shmtree.bench) import it.
"""
