"""What crosses a process or node boundary, and the one way signed node-to-node HTTP is done.

- ``ids``: the ids every link uses, one NewType per concept (NodeId, Epoch, RequestId, ...).
- ``errors``: WireError, the one refusal body; PeerRefused, the exception behind it.
- ``http``: SignedClient (``call(peer, path, body, Reply)``, ``stream``) and ``signed_app``
  (typed routes behind the signature check): control, weights and whatever comes next.
"""
