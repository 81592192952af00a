"""Weights move between peers: a node holding the model files serves them, every other node
fetches exactly its shard, and a re-plan moves only the difference (README: "Weights move
between peers").

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

Wiring into a node:

1. Every node: ``server = WeightServer(node_id, secret)`` and
   ``control_app.add_subapp(MOUNT, server.app())``. A node with the model folder:
   ``server.serve(ServedModel(manifest_for(folder), folder=folder))``.
2. The leader collects ``Holding``s (``fetch_holding`` or ``ServedModel.holding``), picks
   ``order, plan = choose_rank_order(manifest, nodes, plan_for, holdings)`` (``plan_for`` maps
   a node order to the plan with each node's share) and ``plan_transfer(manifest, plan, order,
   holdings)``; each node's Assignment carries its NodeTransfer and the manifest identity.
3. A node whose NodeTransfer says ``load_from == "store"``: ``fetch_manifest`` from a peer (once),
   ``store = ShardStore(store_root(identity), manifest)``, serve it
   (``ServedModel(manifest, store=store)``), ``await fetch_transfer(...)`` with a progress
   callback, ``store.require(transfer.share)``, then start the worker with
   ``model_dir = store.folder`` (``load_shard`` is unchanged).
"""
