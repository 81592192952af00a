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

- ``announcement``: the signed mDNS announcement a node joins with.
- ``assignment``: a rank's part in an epoch (Assignment, ServingOptions), sent to every rank;
  ``finetune_job``: a fine-tuning rank's job, likewise.
- ``profiles``: what a node tells of its device (ProfileSummary, ShapeSeconds, LinkProfile;
  defined in exo_tp.plan.profiles, below the planner that reads them).
- ``balance``: the leader's live balance, as NodeStatus carries it.

The control plane's bodies (exo_tp.node.cluster.control_messages: NodeStatus, Assign, ...),
the weight orders (exo_tp.node.cluster.weight_orders) and the fine-tuning jobs'
(exo_tp.node.cluster.finetune_messages) stay in the node: they carry the weights package's
transfer plans, and the weights package uses this one's client and ids, so a package cycle
would follow (tests/unit/test_layout.py).
"""
