"""Asking a peer for the manifest of its model folder, by key: the peer computes it the first
time (hashing every file), so a slow answer is "ask again later" (ManifestPending), not a
failure; the manifest is accepted only if signed with the cluster secret and of that key."""

from __future__ import annotations

import aiohttp

from exo_tp.frozen import Frozen
from exo_tp.weights.key import manifest_key
from exo_tp.weights.manifest import ModelManifest
from exo_tp.weights.server import MOUNT
from exo_tp.weights.transfer import TransferError
from exo_tp.wire.announcement import Announcement
from exo_tp.wire.errors import PeerRefused, UnsignedReply
from exo_tp.wire.http import SignedClient


def weights_url(member: Announcement) -> str:
    """Where a member serves its weights (and their manifests) to its peers."""
    return member.control_url + MOUNT


class ManifestPending(TransferError):
    """The holder is still computing the manifest (the first time for that folder)."""


class ManifestOf(Frozen):
    """Body of /weights/manifest-of: the manifest of this node's folder with that key."""

    key: str


async def manifest_of(
    session: aiohttp.ClientSession, weights_url: str, secret: str, key: str
) -> ModelManifest:
    """A peer's manifest of its folder with ``key`` (the peer computes it the first time);
    accepted only if signed with the cluster secret and of that key."""
    client = SignedClient(secret, session)
    try:
        manifest = await client.call(
            weights_url, "/manifest-of", ManifestOf(key=key), ModelManifest, signed_reply=True
        )
    except PeerRefused as refused:
        error = ManifestPending if refused.status == 503 else TransferError
        raise error(f"{weights_url}: {refused.error}") from None
    except UnsignedReply:
        raise TransferError(f"{weights_url}: the manifest is not signed with the secret") from None
    if manifest_key(manifest) != key:
        raise TransferError(f"{weights_url} sent the manifest of another model")
    return manifest
