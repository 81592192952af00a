"""Weights move between peers: a node holding the model files serves them, every other node
fetches exactly its shard, and a re-plan moves only the difference (see
docs/weights.md).

Pure (no MLX, no I/O; frozen pydantic models):

- ``manifest``: ModelManifest, TensorEntry (file, offset, dtype, shape, split axis, digest
  blocks), the data every node shares about a model.
- ``layout`` / ``describe``: where a tensor sits in the architecture table and where any plan
  may cut it (the manifest's block cuts).
- ``boxes``: ``rank_boxes(manifest, plan, rank)``, exactly what ``load_shard`` reads for one
  rank of a PipelinePlan; Boxes (index ranges per tensor) and their set algebra.
- ``transfer``: ``plan_transfer`` (per node: retained boxes, fetches with sources by cost and
  fallbacks), ``choose_rank_order`` (the order that moves the fewest bytes), Holding.

With I/O:

- ``build``: ``manifest_for(folder)``, computed once by a node that has the files, cached.
- ``store``: ShardStore, a sparse mirror of the model folder that ``load_shard`` reads as is.
- ``server``: WeightServer, aiohttp routes (manifest, holdings, file, read), signed.
- ``client``: ``fetch_manifest``, ``fetch_holding``, ``fetch_transfer`` (digest checks,
  refetch, fallback, TransferProgress callback).
- ``key``: ``folder_key(folder)`` / ``manifest_key(manifest)``, the cheap fingerprint (config
  and safetensors headers) that names a model on every node.

In a node (exo_tp.node.member.weights: its folders, stores, routes and fetches; exo_tp.node.
cluster_model: the leader's choice of model, holdings, rank order and transfer plan):

1. Every node mounts ``NodeWeights.app()`` (the WeightServer's routes plus ``/manifest-of``) at
   ``MOUNT`` on its control server and offers its folders and stores in its status, by key.
2. The leader prepares the model (config and tokenizer, from a holder if it has no files); when
   some node of the plan lacks the files, every holder computes the manifest once, the leader
   gathers Holdings (``fetch_holding``), picks ``choose_rank_order`` and ``plan_transfer``, and
   sends each node its NodeTransfer in a WeightOrder with its assignment.
3. A node whose NodeTransfer says ``load_from == "store"`` fetches the manifest, opens its
   ShardStore, serves it, ``fetch_transfer``s its share with progress, ``store.require``s it,
   and starts its worker with ``model_dir = store.folder`` (``load_shard`` is unchanged).
"""
