"""What a node announces over mDNS (zeroconf TXT record), signed with the cluster secret."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import Field, ValidationError

from exo_tp.plan.spec import Frozen
from exo_tp.security.signing import sign, verify
from exo_tp.wire.ids import NodeId

SERVICE_TYPE = "_exo-tp._tcp.local."


class Announcement(Frozen):
    node_id: NodeId = Field(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9_-]+$")
    version: str
    cluster: str
    host: str  # address peers use for the API, control and ring sockets
    api_port: int = Field(gt=0, lt=65536)
    control_port: int = Field(gt=0, lt=65536)
    memory_total: int = 0
    memory_available: int = 0
    decode_seconds_per_byte: float = 0.0  # the profile's decode score (0: unknown)
    prefill_flops: float = 0.0
    layer_overhead_seconds: float = 0.0  # the profile's per-layer overhead (0: unknown)
    weight: float = 0.0  # a manual share weight overriding the decode score (0: none)
    started: float = 0.0  # unix time the node started: a restarted node is a new member

    def _canonical(self) -> bytes:
        items = sorted(self.model_dump(mode="json").items())
        return "&".join(f"{k}={v}" for k, v in items).encode()

    def to_txt(self, secret: str) -> dict[str, str]:
        txt = {k: str(v) for k, v in self.model_dump(mode="json").items()}
        txt["sig"] = sign(secret, self._canonical())
        return txt

    @classmethod
    def from_txt(
        cls, txt: Mapping[bytes, bytes | None] | Mapping[str, str | None], secret: str
    ) -> tuple[Announcement | None, str]:
        """The announcement if its signature checks out, else (None, why)."""
        fields = {
            (k.decode() if isinstance(k, bytes) else k): (
                v.decode() if isinstance(v, bytes) else (v or "")
            )
            for k, v in txt.items()
        }
        signature = fields.pop("sig", "")
        try:
            announcement = cls.model_validate(fields)
        except ValidationError as error:
            return None, f"malformed announcement ({error.error_count()} bad fields)"
        if not verify(secret, announcement._canonical(), signature):
            return None, "bad signature (another cluster secret, or altered)"
        return announcement, ""

    @property
    def api_url(self) -> str:
        return f"http://{self.host}:{self.api_port}"

    @property
    def control_url(self) -> str:
        return f"http://{self.host}:{self.control_port}"
