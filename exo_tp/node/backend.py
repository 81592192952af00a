"""The public API's view of a node (`exo_tp.api.backend.Backend`): the one place where the
node's states and failures become HTTP errors (`ApiError`)."""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo_tp.api.core.defaults import GenerationDefaults
from exo_tp.api.core.errors import FORWARD_PREFIX, ApiError, not_ready
from exo_tp.api.model_list import ModelObject
from exo_tp.api.proxy import Upstream
from exo_tp.frozen import Frozen
from exo_tp.models.catalog import local_models
from exo_tp.models.hub import HubError, HubRef, hub_ref
from exo_tp.node.api_errors import api_error, model_loading, too_large
from exo_tp.node.cluster.views import ClusterView, HealthView, PlanView
from exo_tp.node.finetune.jobs import FineTuning
from exo_tp.node.finetune.records import FT_PREFIX
from exo_tp.node.leader.cluster_model import Prepared
from exo_tp.node.leader.dispatch import (
    Dispatcher,
    DispatchError,
)
from exo_tp.node.leader.model_requests import ModelRequests
from exo_tp.node.leader.resident import TooLarge, first_load
from exo_tp.node.member.hub_downloads import HubDownloads
from exo_tp.node.model_catalog import CatalogView, ModelCatalog
from exo_tp.node.status_views import StatusViews
from exo_tp.security.signing import control_headers
from exo_tp.vision.families import NoImages, vision_config
from exo_tp.wire.runtime import Delta, Done, GenerateRequest

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from exo_tp.node.leader.formation import Leader
    from exo_tp.vision.prompt import ImagePrompter


class LoadAnswer(Frozen):
    model: str
    state: Literal["loaded", "loading", "downloading", "unloaded"]


class NodeBackend:
    def __init__(
        self,
        views: StatusViews,
        dispatcher: Dispatcher,
        requests: ModelRequests,
        defaults: GenerationDefaults,
        downloads: HubDownloads,
        catalog: ModelCatalog,
        fine_tuning: FineTuning,
    ):
        self._views, self._dispatcher, self._requests = views, dispatcher, requests
        self.fine_tuning = fine_tuning
        self._downloads, self._catalog = downloads, catalog
        self.node_id = views.config.node_id
        self.started = views.started
        self.defaults = defaults
        # The model a request named (`for_model`: a copy bound to it); None: the main group's
        self._key: str | None = None

    # ---- the model served ------------------------------------------------------------------

    def for_model(self, name: str) -> NodeBackend:
        """This backend bound to the model ``name`` (its tokenizer, context and groups), once
        it is resident: `ApiError` until then (exo_tp.node.leader.resident)."""
        bound = copy.copy(self)
        bound._key = self.require_model(name)
        return bound

    def _current(self) -> Prepared | None:
        joined = self._views.joined
        if joined is None:
            return None
        if self._key is not None and (prepared := joined.models.prepared(self._key)) is not None:
            return prepared
        return joined.models.current

    def _group(self, tokens: Sequence[int] | None = None) -> Dispatcher:
        """The request source of a group serving the bound model (the main group's model
        where none is bound): for a request's ``tokens``, the router's pick among its
        replicas; without, its first group."""
        joined = self._views.joined
        key = self._key or self._views.serving_key()
        if key is None or joined is None:
            return self._dispatcher
        groups = joined.groups
        leader = groups.first(key) if tokens is None else groups.route(key, tokens)
        return leader.dispatcher if leader is not None else self._dispatcher

    def _prepared(self) -> Prepared:
        """The model this node serves requests for (as leader): the bound one, else the one
        it prepared last."""
        current = self._current()
        if current is None:
            raise not_ready("no model loaded yet")
        return current

    @property
    def model(self) -> str:
        """The served model's name (``ft:...`` when a fine-tuning job's adapter is on)."""
        current = self._current()
        if current is None:
            return ""
        job_id = self._views.serving_adapter()
        if current.key != self._views.serving_key():
            job_id = None  # another resident model's group: no fine-tuning adapter on it
        job = self.fine_tuning.state.jobs.get(job_id) if job_id else None
        return job.fine_tuned_model if job and job.fine_tuned_model else current.name

    @property
    def tokenizer(self) -> TokenizerWrapper:
        return self._prepared().tokenizer

    @property
    def images(self) -> ImagePrompter | NoImages | None:
        return self._prepared().images

    @property
    def context_length(self) -> int:
        """The model's context, or less where the epoch's KV memory holds fewer tokens."""
        context = self._prepared().spec.context_length
        kv_tokens = self._group().kv_tokens
        return context if kv_tokens is None else min(context, kv_tokens)

    @property
    def vocab_size(self) -> int:
        return self._prepared().spec.vocab_size

    def models_view(self) -> list[ModelObject]:
        """/v1/models: every model a member has the files of (one at a time is served)."""
        joined = self._views.joined
        if joined is None:
            return []
        loaded, adapter = self._views.loaded_keys(), self._views.serving_adapter()
        serving = self._views.serving_key()
        cards = [
            ModelObject.of(
                name,
                int(self.started),
                key in loaded and (key != serving or adapter is None),
                vision=self._takes_images(key),
            )
            for name, key in joined.models.listing()
        ]
        # base models with a fine-tuned adapter: this node's jobs', and the leader's (which
        # runs the jobs and serves their models) from its status
        leader = joined.peers.status(joined.peers.leader_id())
        models = {m.name: m for m in (leader.fine_tuned if leader else ())}
        models.update({m.name: m for m in self._views.finetune_fine_tuned()})
        for model in models.values():
            on = adapter is not None and model.name.endswith(":" + adapter)
            cards.append(ModelObject.of(model.name, model.created, on, parent=model.base))
        return cards

    def _takes_images(self, key: str) -> bool:
        """Whether the model runs images here: its config, where this node has its files."""
        current = self._current()
        if current is not None and current.key == key:
            return current.images is not None and not isinstance(current.images, NoImages)
        folder = self._views.joined.models.weights.local_dir(key) if self._views.joined else None
        return folder is not None and vision_config(folder) is not None

    def require_model(self, name: str) -> str:
        """The key of the model a request for ``name`` runs on (on the leader): 404 if no
        member has it; 503 while it loads (asking the leader to load it, beside the models
        resident or in place of the least recently used); 400 if it cannot fit."""
        joined = self._views.joined
        assert joined is not None
        if (busy := self.fine_tuning.busy_error()) is not None:
            raise busy
        if name.startswith(FT_PREFIX):
            return self._require_fine_tuned(name)
        key = joined.models.key_of(name)
        listing = joined.models.listing()
        if key is None and (folder := self._on_disk(name)) is not None:
            joined.groups.background(self._offer_then_load(name, folder))
            raise model_loading(name)
        ref = hub_ref(name) if key is None else None
        if ref is not None:  # a hub model no member has: this node (the leader) fetches it
            raise self._downloading(ref)
        if key is None and not self._views.config.strict_model_names and len(listing) == 1:
            key = listing[0][1]  # one model: it serves any name, as mlx_lm.server does
        if key is None:
            listed = ", ".join(f"'{n}'" for n, _ in listing) or "none yet"
            raise ApiError(
                404,
                f"The model '{name}' does not exist; this cluster serves: {listed}.",
                param="model",
                code="model_not_found",
            )
        if key == self._views.serving_key() and self._views.serving_adapter() is not None:
            self._requests.load(key, name)  # the base without the job's adapter
            raise model_loading(name)
        groups = joined.groups.groups_of(key)
        if not groups:
            wanted = joined.groups.want(key, name)
            if isinstance(wanted, TooLarge):
                raise too_large(name, wanted)
            raise model_loading(name)
        if all(first_load(group) for group in groups):  # as the request that asked was told
            raise model_loading(name)
        return key

    def _on_disk(self, name: str) -> Path | None:
        """The folder of ``name`` in this node's --models-dir folders, if it is there (only
        those: a prepared or cached model a request names is served as before, by the one
        model listed or a 404, unless the picker loads it)."""
        models = local_models(self._catalog.models_dirs)
        local = {m.name: m for m in models if m.source == "folder"}
        return local[name].folder if name in local else None

    async def _offer_then_load(self, name: str, folder: Path) -> None:
        """Offer a model folder of this node's disk to the cluster, then load it beside the
        models resident (exo_tp.node.leader.resident)."""
        try:
            key = await asyncio.to_thread(self._views.weights.add_folder, name, folder)
            await self._load_offered(name, key)
        except Exception:  # a bug: the request's retry meets it again, the log says what
            log.exception("loading %s from its folder failed", name)

    async def _load_offered(self, name: str, key: str) -> None:
        """Load ``key``, a folder this node just offered (a --models-dir model, a download),
        beside the models resident once its offer is out."""
        joined = self._views.joined
        assert joined is not None
        weights = self._views.weights
        for _ in range(50):  # offered from this node's next status on (a poll: about 1 s)
            if joined.models.key_of(name) is not None:
                break
            await asyncio.sleep(0.1)
        if not joined.groups.groups_of(key):
            wanted = joined.groups.want(key, name, weights.folders[key].weight_bytes)
            if isinstance(wanted, TooLarge):
                log.warning("%s", too_large(name, wanted).message)

    def _require_fine_tuned(self, name: str) -> str:
        """A request for ``ft:<base>:<suffix>:<job>``: the base with that job's adapter."""
        joined = self._views.joined
        assert joined is not None
        job = self.fine_tuning.adapter_of(name)
        key = joined.models.key_of(job.model) if job else None
        if job is None or key is None:
            raise ApiError(
                404,
                f"The model '{name[:200]}' does not exist (no succeeded fine-tuning job "
                "made it, or its base is gone).",
                param="model",
                code="model_not_found",
            )
        if key != self._views.serving_key() or self._views.serving_adapter() != job.id:
            self._requests.load(key, name, job.id)
            raise ApiError(
                503,
                f"loading the model '{name}' (its base with the adapter on every shard); "
                "retry shortly",
                kind="server_error",
                code="model_loading",
                retry_after=10,
            )
        return key

    def _downloading(self, ref: HubRef) -> ApiError:
        """503 while ``ref`` downloads (then it is loaded beside the models resident), or the
        download's own 4xx/5xx."""
        name, joined = str(ref), self._views.joined
        assert joined is not None
        try:
            progress = self._downloads.want(
                ref, lambda key: joined.groups.background(self._load_offered(name, key))
            )
        except HubError as error:
            return ApiError(error.status, str(error), param="model", code="model_unavailable")
        got = f" ({progress.done / 1e6:.1f} of {progress.total / 1e6:.1f} MB)" if progress else ""
        return ApiError(
            503,
            f"downloading the model '{name}'{got}; it is loaded when done; retry shortly",
            kind="server_error",
            code="model_downloading",
            retry_after=10,
        )

    def model_catalog(self) -> CatalogView:
        joined = self._views.joined
        if joined is None:
            raise not_ready("the node has not joined a cluster yet")
        downloads = list(self._downloads.views())
        for node_id in joined.peers.alive_ids():
            status = joined.peers.status(node_id)
            if node_id != self.node_id and status is not None:
                downloads += status.downloads  # the leader's, where a page asks another node
        return self._catalog.view(
            joined, self._views.loaded_keys(), self._views.profile, tuple(downloads)
        )

    async def load_model(self, name: str) -> LoadAnswer:
        """What a request naming ``name`` does (the picker's Load), answered without a 503."""
        joined = self._views.joined
        if joined is None:
            raise not_ready("the node has not joined a cluster yet")
        if joined.models.key_of(name) is None and hub_ref(name) is None:
            local = {m.name: m for m in local_models(self._catalog.models_dirs)}
            if name in local:  # on this node's disk: offer it, then load it beside the others
                joined.groups.background(self._offer_then_load(name, local[name].folder))
                return LoadAnswer(model=name, state="loading")
        try:
            self.require_model(name)
        except ApiError as error:
            if error.code == "model_loading":
                return LoadAnswer(model=name, state="loading")
            if error.code == "model_downloading":
                return LoadAnswer(model=name, state="downloading")
            raise
        return LoadAnswer(model=name, state="loaded")

    # ---- keep-alive (exo_tp.node.leader.keep_alive; on the leader) -------------------------

    def _leader(self) -> Leader | None:
        joined = self._views.joined
        return joined.leader if joined is not None and joined.leads() else None

    def _leaders(self) -> list[Leader]:
        """The groups of the bound model (the main one where none is bound), on the leader."""
        leader = self._leader()
        joined = self._views.joined
        if leader is None or joined is None:
            return []
        return joined.groups.groups_of(self._key) if self._key is not None else [leader]

    def keep_alive(self, seconds: float) -> None:
        for leader in self._leaders():
            leader.keep_alive(seconds)

    def resident(self, name: str) -> tuple[int | None, float | None]:
        joined = self._views.joined
        key = joined.models.key_of(name) if joined else None
        if joined is None or key is None:
            return None, None
        if not joined.leads():  # the leader's status says when; the context is the leader's
            status = joined.peers.status(joined.peers.leader_id())
            views = [g for g in status.groups if g.key == key] if status else []
            return None, views[0].expires_in if views else None
        prepared, leader = joined.models.prepared(key), joined.groups.first(key)
        if prepared is None or leader is None:
            return None, None
        kv_tokens = leader.dispatcher.kv_tokens
        context = prepared.spec.context_length
        expires = leader.keep_alive_view(key).expires_in
        return (context if kv_tokens is None else min(context, kv_tokens)), expires

    async def unload_model(self, name: str) -> LoadAnswer:
        """Let the served model go now if it is ``name`` (or the one any name stands for)."""
        leader = self._leader()
        if leader is None:
            raise not_ready("the node has not joined a cluster yet")
        joined = self._views.joined
        assert joined is not None
        key, listing = joined.models.key_of(name), joined.models.listing()
        if key is None and not self._views.config.strict_model_names and len(listing) == 1:
            key = listing[0][1]  # one model: any name means it, as for a request
        if key is None:
            message = f"The model '{name[:200]}' does not exist."
            raise ApiError(404, message, param="model", code="model_not_found")
        reason = f"the model was unloaded (a client asked for '{name[:200]}')"
        await joined.groups.unload(key, reason)
        return LoadAnswer(model=name, state="unloaded")

    # ---- where requests run ----------------------------------------------------------------

    def leader_id(self) -> str | None:
        return self._views.leader_id()

    def generation_upstream(self) -> Upstream | None:
        if self._views.leads():
            return None
        joined = self._views.joined
        leader = joined.peers.get(joined.peers.leader_id()) if joined else None
        if leader is None:
            raise ApiError(
                503, "cluster not ready: no leader", kind="server_error", code="cluster_not_ready"
            )
        # over the leader's cluster listener: a flood of its public API cannot block it
        return Upstream(leader.node_id, leader.control_url + FORWARD_PREFIX)

    def forward_headers(self, path: str, body: bytes) -> dict[str, str]:
        return control_headers(self._views.config.secret, path, body)

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[Delta | Done, None]:
        if (busy := self.fine_tuning.busy_error()) is not None:
            raise busy
        events = self._group(request.tokens).generate(request)
        try:
            async for event in events:
                yield event
        except DispatchError as error:
            raise api_error(error) from None
        finally:
            await events.aclose()

    # ---- views -----------------------------------------------------------------------------

    def serving_state(self) -> str:
        return self._views.serving_state()

    def health(self) -> HealthView:
        return self._views.health()

    def cluster_view(self) -> ClusterView:
        return self._views.cluster()

    async def plan_view(self) -> PlanView:
        return await self._views.plan()
