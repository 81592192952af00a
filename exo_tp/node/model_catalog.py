"""What the model picker lists: every model the cluster can serve (offered by a member, or on
this node's disk: prepared, in the Hugging Face cache, or a folder), whether it fits the
members' memory and, with measured devices, the planner's predicted tokens/s; plus downloads."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from exo_tp.errors import ExoTpError
from exo_tp.frozen import Frozen
from exo_tp.models.catalog import LocalModel, local_models
from exo_tp.models.hub import DownloadProgress
from exo_tp.node.joined import Joined
from exo_tp.node.leader.placement import planner_cluster
from exo_tp.plan import load_spec
from exo_tp.plan.cluster import MEMORY_HEADROOM
from exo_tp.plan.search import choose_plan
from exo_tp.wire.profiles import ProfileSummary

log = logging.getLogger(__name__)

CACHE_SECONDS = 30.0  # a model's fit and prediction, per member set, before they are redone


class CatalogEntry(Frozen):
    name: str  # what a request's "model" (or the picker's Load) takes
    source: str  # "cluster" (a member offers it), "prepared", "hub cache", "folder"
    size: int  # weight bytes (0: not known here)
    format: str
    fits: bool | None  # None: not known (no config here)
    predicted_tokens_per_s: float | None  # None: devices not measured, or it does not fit
    loaded: bool


class CatalogView(Frozen):
    models: tuple[CatalogEntry, ...]
    downloads: tuple[DownloadProgress, ...]


class ModelCatalog:
    def __init__(self, models_dirs: tuple[Path, ...] = ()) -> None:
        self.models_dirs = models_dirs
        self._fits: dict[tuple[str, tuple[str, ...]], tuple[float, bool | None, float | None]] = {}

    def view(
        self,
        joined: Joined,
        serving: frozenset[str],
        own_profile: ProfileSummary | None,
        downloads: tuple[DownloadProgress, ...],
    ) -> CatalogView:
        models = joined.models
        offers = models.offers()
        entries: list[CatalogEntry] = []
        seen: set[str] = set()
        local = {str(m.folder.resolve()): m for m in local_models(self.models_dirs)}
        for name, key in models.listing():
            folder = models.weights.folder(key)
            described = local.get(str(folder.resolve())) if folder else None
            size = max((o.total_bytes for _, o in offers.get(key, [])), default=0)
            entries.append(
                self._entry(
                    joined, name, "cluster", folder, described, size, own_profile, key in serving
                )
            )
            seen.add(name)
            if folder is not None:
                seen.add(str(folder.resolve()))
        for model in local.values():
            if model.name in seen or str(model.folder.resolve()) in seen:
                continue
            entries.append(
                self._entry(
                    joined,
                    model.name,
                    model.source,
                    model.folder,
                    model,
                    model.size,
                    own_profile,
                    False,
                )
            )
        return CatalogView(models=tuple(entries), downloads=downloads)

    def _entry(
        self,
        joined: Joined,
        name: str,
        source: str,
        folder: Path | None,
        described: LocalModel | None,
        size: int,
        own_profile: ProfileSummary | None,
        loaded: bool,
    ) -> CatalogEntry:
        fits, predicted = (
            (None, None) if folder is None else self._fit(joined, folder, size, own_profile)
        )
        return CatalogEntry(
            name=name,
            source=source,
            size=described.size if described else size,
            format=described.format if described else "?",
            fits=fits,
            predicted_tokens_per_s=predicted,
            loaded=loaded,
        )

    def _fit(
        self, joined: Joined, folder: Path, size: int, own_profile: ProfileSummary | None
    ) -> tuple[bool | None, float | None]:
        peers = joined.peers
        eligible = [a for n in peers.alive_ids() if (a := peers.get(n)) is not None]
        cache_key = (str(folder), tuple(sorted(a.node_id for a in eligible)))
        cached = self._fits.get(cache_key)
        if cached is not None and time.monotonic() - cached[0] < CACHE_SECONDS:
            return cached[1], cached[2]
        fits: bool | None
        predicted: float | None = None
        try:
            spec = load_spec(folder)
            members = joined.leader.members_for(spec, eligible, own_profile)
            if members.measured:
                choice = choose_plan(spec, planner_cluster(spec, members))
                fits, predicted = True, choice.best.prediction.tokens_per_second
            else:
                memory = sum(a.memory_available for a in eligible) * MEMORY_HEADROOM
                fits = size <= memory if memory else None
        except ExoTpError as error:  # PlanError: no plan fits the members' memory
            log.debug("%s: %s", folder, error)
            fits = False
        except (OSError, ValueError) as error:
            log.debug("%s: %s", folder, error)
            fits = None
        self._fits[cache_key] = (time.monotonic(), fits, predicted)
        return fits, predicted
