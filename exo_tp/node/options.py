"""One node's `exo-tp run` settings, as parsed: what the CLI hands a node it starts itself
(`--local-nodes`, benches, tests) instead of a command line to parse again. Secrets are not
in it: they reach the node through its environment."""

from __future__ import annotations

from pydantic import Field

from exo_tp.api.core.defaults import GenerationDefaults
from exo_tp.frozen import Frozen
from exo_tp.node.cluster.config import Requested
from exo_tp.wire.assignment import DType, ServingOptions

# The child that runs one node from these options (`python -m exo_tp.cli.node_child`) finds
# them (JSON) in this environment variable.
NODE_OPTIONS_ENV = "EXO_TP_NODE_OPTIONS"


class ConnectionOptions(Frozen):
    """The connection-limit flags as given (`exo_tp.cli.connection_args.add_connection_args`);
    the caps left None follow the open-files limit of the node's own process, so the node
    resolves them (`exo_tp.cli.connection_args.connection_limits`)."""

    header_timeout: float
    body_timeout: float
    keepalive_timeout: float
    max_connections: int | None
    max_connections_per_address: int
    max_header_size: int
    cluster_max_connections: int | None
    cluster_max_connections_per_address: int


class NodeLab(Frozen):
    """The node's emulated slow device (`exo_tp.lab.factor`): its work factor, or a file
    holding it (re-read while serving), and the cores its rank is pinned to."""

    work_factor: float | None = None
    work_factor_file: str | None = None
    cpus: tuple[int, ...] | None = None


class NodeOptions(Frozen):
    """Defaults live in one place, `exo-tp run`'s flags (`exo_tp.cli.run.node_options`)."""

    models: tuple[str, ...]
    host: str | None  # None: this machine's first non-loopback address
    bind: str | None
    api_port: int
    control_port: int
    node_id: str | None  # None: hostname and a random suffix
    cluster: str
    secret_file: str | None
    allowed_origins: str | None
    weight: float
    profile: str | None
    no_bench: bool
    dtype: DType
    backend: Requested
    rdma: tuple[str, ...]  # PEER=DEVICE
    stages: tuple[int, ...]
    adapter_path: str | None
    serving: ServingOptions
    max_queue: int
    stall_timeout: float
    defaults: GenerationDefaults
    connections: ConnectionOptions
    strict_model_names: bool
    rebalance: bool  # --rebalance, auto resolved where the flags were parsed
    rebalance_threshold: float
    lab: NodeLab | None  # None: the lab is off (nothing wrapped, no rank pinned)
    models_dirs: tuple[str, ...]  # folders of model folders the web UI's picker lists too
    keep_alive: float | None = None  # --keep-alive in seconds (None: for ever)
    max_models: int = Field(default=3, ge=1)  # --max-models: models resident at once
    replicas: int = Field(default=1, ge=0)  # --replicas: groups of the main model (0: auto)
    max_memory: int | None = None  # --max-memory: bytes this node lends to models
    # The cluster's size where it is known (`--local-nodes N`); 0: unknown (discovery).
    members: int = 0
