"""The internode layer: communicators across nodes, over MPI (docs/design.md, "Across nodes").

    nodes       Spanning: the communicator across nodes (the node's communicator and MPI
                between the leaders), its executors, one per collective
    agreement   how Spanning runs a call: guarded, after every rank's row is compared
    pipelines   the data steps across nodes: segments, lanes, exchanges
    inter       Link: the leaders' MPI step on a thread of its own
    remote      messages between nodes (Remote, SpanningMessages)
    relay       inter=: the launcher relays its workers' messages between nodes
    mailbox     inter=: the mailbox between a node's leader and its launcher; Proxy, the
                launcher's side
    proxylink   inter=: ProxyLink, the leader's side
    multinode   forming them: from_mpi, NodeGroup (Group(size, inter=)), spanning_member

mpi4py is imported lazily, where MPI is used.  It may import: the front end (shmtree.frontend.front,
calls, collectives), the p2p layer, the groups and machine layers, the engine, the leaves,
and within this layer; never shmtree.communicators.communicator or subcomm, launching or torch.
"""
