"""A node's settings (from `exo-tp run`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from exo_tp.api.core.defaults import GenerationDefaults
from exo_tp.api.server_limits import Limits
from exo_tp.security.access import ApiAccess
from exo_tp.wire.assignment import DType, ServingOptions
from exo_tp.wire.ids import NodeId

# The MLX backend asked for (exo_tp.node.leader.backend_choice chooses one per epoch).
Requested = Literal["auto", "ring", "jaccl"]


@dataclass(frozen=True)
class NodeConfig:
    node_id: NodeId
    models: tuple[str, ...] = ()  # the --model names this node has the files of
    host: str = "127.0.0.1"
    api_port: int = 8000
    control_port: int = 0  # 0: any free port (announced over mDNS)
    cluster: str = "exo-tp"
    secret: str = ""
    weight: float = 0.0  # manual share weight; 0: use the measured profile
    dtype: DType = "float32"
    settle: float = 1.5
    # Where the cluster's size is known (`--local-nodes N`), it forms once all are in, without
    # the settle (which waits for more nodes to be discovered); 0: unknown.
    members: int = 0
    bind: str = ""  # address the HTTP servers listen on (default: ``host``)
    backend: Requested = "auto"
    rdma: dict[str, str] = field(default_factory=dict)  # peer node id -> RDMA device
    backends: tuple[str, ...] = ("ring",)  # backends MLX can start on this node
    stages: tuple[int, ...] = ()  # leader: force pipeline stages (ranks per stage)
    serving: ServingOptions = ServingOptions()
    max_queue: int = 64  # requests waiting beyond the batch before 429s
    stall_timeout: float = 30.0  # a rank making no progress this long fails its epoch
    adapter_path: str | None = None  # an mlx-lm LoRA adapter applied to every shard
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)  # API defaults
    access: ApiAccess = field(default_factory=ApiAccess)  # public API key and CORS origins
    rebalance: bool = True  # leader: re-plan shares when the measured rank speeds drift
    rebalance_threshold: float = 0.10  # the slowest rank's cost over a balanced split
    api_limits: Limits = Limits()  # the public API listener's connection caps and timeouts
    cluster_limits: Limits = Limits()  # the cluster listener's (control, weights, forwards)
    # False: with one model listed, a request naming another is served by it (mlx_lm.server)
    strict_model_names: bool = False
    models_dirs: tuple[Path, ...] = ()  # folders of model folders the picker lists too
    # Seconds a model loaded on demand stays loaded once idle (None: for ever); the --model
    # ones are pinned (exo_tp.node.leader.keep_alive).
    keep_alive: float | None = None
    max_models: int = 3  # models resident at once (exo_tp.node.leader.resident)
    replicas: int = 1  # groups of the main model over disjoint sets of nodes (0: the planner's)
    max_memory: int | None = None  # bytes this node lends to models (None: what is available)

    @property
    def listen_host(self) -> str:
        return self.bind or self.host
