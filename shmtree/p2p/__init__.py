"""The p2p layer: point-to-point messages on one machine (docs/design.md, "How messages travel").

    methods     Messages, the mixin of Communicator: send, recv, sendrecv, isend, irecv
    messages    Transport: a communicator's channels, its home page, the posted operations
                and their progress
    waiting     how a Transport waits, checks its peers and fails (a mixin of Transport)
    matching    _Matching: arrived messages to posted receives, the message thread (shared
                with the transport between nodes, shmtree.internode.remote)
    records     what a message is made of: envelope, descriptions, ANY_SOURCE, ANY_TAG,
                Status, the operations; the transports' sizes and times

The native quick paths are shmtree._p2p (Cython).  It may import: the groups layer (session),
the front end's calls and requests (shmtree.frontend.calls, shmtree.frontend.requests), the engine extensions
(shmtree._p2p, _moving), the leaves, and within this layer; never internode, the
communicator, launching or torch.
"""
