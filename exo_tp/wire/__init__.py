"""What crosses a process or node boundary, and the one way signed node-to-node HTTP is done.
Nothing here imports the domain packages (they import it).

- ``ids``: the ids every link uses, one NewType per concept (NodeId, Epoch, Rank, RequestId,
  BatchUid, ModelKey, ModelIdentity).
- ``errors``: WireError, the one refusal body; PeerRefused, the exception behind it.
- ``http``: SignedClient (``call(peer, path, body, Reply)``, ``read``, ``stream``) and
  ``signed_app`` (typed routes behind the signature check): control, weights, what comes next.
- ``runtime``: every link of an epoch's processes (source and conductor, rank and supervisor,
  conductor and ranks, pipeline hops), one discriminated union per link.
- ``weights``: the weight transport's request bodies and its reports (progress, bytes served).

Two sets stay beside their domain because they carry its data: the control bodies
(exo_tp.node.control, exo_tp.node.weight_messages: assignments and transfer plans, whose boxes
are the weights package's) and the mDNS announcement (exo_tp.node.announcement).
"""
