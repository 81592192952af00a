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

- ``control``: the control plane's bodies (NodeStatus every poll; ports, assign, release).
- ``announcement``: the signed mDNS announcement a node joins with.
- ``assignment``: a rank's part in an epoch (Assignment, ServingOptions), sent to every rank.
- ``profiles``: what a node tells of its device (ProfileSummary, ShapeSeconds, LinkProfile).
- ``weight_orders``, ``finetune``, ``balance``: what NodeStatus and the assignments carry of
  weights, fine-tuning jobs and the leader's live balance.
"""
