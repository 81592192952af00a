"""A request for a fine-tuning job, checked and resolved into a queued job (pure checks and the
model's config: nothing starts here).

OpenAI's "auto" values take mlx-lm's and OpenAI's defaults (3 epochs, batch 4 or fewer, never
fewer than the cluster's nodes); every input that would make the job fail is a 4xx naming its
parameter: unknown or wrong-purpose files, a batch smaller than the nodes or larger than a
file, non-positive epochs or learning rate, an unknown base, a mixture of experts, more LoRA
layers than the model has.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

import aiohttp

from exo_tp.api.core.errors import ApiError
from exo_tp.errors import ExoTpError
from exo_tp.finetune.data import epoch_steps
from exo_tp.finetune.openai_schema import (
    CreateJob,
    FileObject,
    Hyperparameters,
    Job,
    JobHyperparameters,
    JobMethod,
    JobSupervised,
    LoraOptions,
    Progress,
)
from exo_tp.finetune.state import FineTuneState, new_id
from exo_tp.frozen import replace

if TYPE_CHECKING:
    from exo_tp.node.joined import Joined

DEFAULT_EPOCHS = 3
DEFAULT_BATCH = 4


def training_file(state: FineTuneState, file_id: str, param: str) -> FileObject:
    """An uploaded fine-tune file named by a request; 400 otherwise."""
    file = state.files.get(file_id)
    if file is None:
        raise ApiError(
            400, f"Invalid file: '{file_id[:100]}' does not exist", param=param,
            code="invalid_file",
        )  # fmt: skip
    if file.purpose != "fine-tune":
        raise ApiError(400, f"{file_id} is not a fine-tune file", param=param)
    return file


class JoinedSource(Protocol):
    """Whatever knows this node's parts once it joined its cluster (the node's views)."""

    @property
    def joined(self) -> Joined | None: ...


async def new_job(body: CreateJob, state: FineTuneState, views: JoinedSource) -> Job:
    """The queued job ``body`` asks for, OpenAI's "auto" values resolved; a 4xx (or a 503
    while the node has no cluster) for anything that cannot run, before anything starts."""
    train = training_file(state, body.training_file, "training_file")
    valid = (
        training_file(state, body.validation_file, "validation_file")
        if body.validation_file
        else None
    )
    hyper = body.hyperparameters or Hyperparameters()
    if body.method is not None and body.method.supervised is not None:
        hyper = body.method.supervised.hyperparameters or hyper
    joined = views.joined
    if joined is None:
        raise ApiError(503, "the node has not joined a cluster yet", kind="server_error",
                       code="cluster_not_ready", retry_after=5)  # fmt: skip
    members = joined.peers.alive_ids()
    batch = DEFAULT_BATCH if hyper.batch_size == "auto" else hyper.batch_size
    if hyper.batch_size == "auto":
        batch = max(min(DEFAULT_BATCH, train.examples), len(members))
    if batch < 1:
        raise ApiError(400, "Invalid value for 'hyperparameters.batch_size': must be >= 1",
                       param="hyperparameters.batch_size")  # fmt: skip
    if batch < len(members):
        raise ApiError(
            400,
            f"batch_size {batch} is smaller than the cluster's {len(members)} nodes: every "
            "node trains on at least one example per step",
            param="hyperparameters.batch_size",
        )
    for file, param in ((train, "training_file"), (valid, "validation_file")):
        if file is not None and file.examples < batch:
            raise ApiError(
                400,
                f"{file.id} has {file.examples} examples, fewer than the batch size {batch}",
                param=param,
                code="invalid_file",
            )
    epochs = DEFAULT_EPOCHS if hyper.n_epochs == "auto" else hyper.n_epochs
    if epochs < 1:
        raise ApiError(400, "Invalid value for 'hyperparameters.n_epochs': must be >= 1",
                       param="hyperparameters.n_epochs")  # fmt: skip
    iters = hyper.n_iters or epochs * epoch_steps(train.examples, batch)
    multiplier = 1.0 if hyper.learning_rate_multiplier == "auto" else hyper.learning_rate_multiplier
    if multiplier <= 0:
        param = "hyperparameters.learning_rate_multiplier"
        raise ApiError(400, f"Invalid value for '{param}': must be > 0", param=param)
    base, layers = await check_model(views, body.model)
    lora = body.lora or LoraOptions()
    if lora.layers is None:
        lora = replace(lora, layers=min(16, layers))
    elif lora.layers > layers:
        raise ApiError(
            400,
            f"lora.layers {lora.layers} is more than the model's {layers} layers",
            param="lora.layers",
        )
    hp = JobHyperparameters(
        n_epochs=epochs,
        batch_size=batch,
        learning_rate_multiplier=multiplier,
        optimizer=hyper.optimizer or "adam",
    )
    return Job(
        id=new_id("ftjob"),
        created_at=int(time.time()),
        hyperparameters=hp,
        method=JobMethod(supervised=JobSupervised(hyperparameters=hp)),
        model=base,
        seed=body.seed if body.seed is not None else 0,
        status="queued",
        training_file=train.id,
        validation_file=valid.id if valid else None,
        suffix=body.suffix or None,
        user_provided_suffix=body.suffix or None,
        metadata=body.metadata,
        iterations=iters,
        lora=lora,
        progress=Progress(total_steps=iters),
    )


async def check_model(views: JoinedSource, name: str) -> tuple[str, int]:
    """The base model's name and its number of layers; 4xx for one that cannot be
    fine-tuned here."""
    joined = views.joined
    assert joined is not None
    key = joined.models.key_of(name)
    if key is None:
        listed = ", ".join(f"'{n}'" for n, _ in joined.models.listing()) or "none"
        raise ApiError(
            404, f"The model '{name[:200]}' does not exist; this cluster has: {listed}.",
            param="model", code="model_not_found",
        )  # fmt: skip
    try:
        prepared = await joined.models.prepare(key, joined.peers.alive_ids())
    except (ExoTpError, aiohttp.ClientError, TimeoutError) as error:
        raise ApiError(503, f"cannot read the model '{name}': {error}",
                       kind="server_error", code="model_unavailable",
                       retry_after=10) from None  # fmt: skip
    spec = prepared.spec
    if spec.num_experts:
        raise ApiError(
            400,
            f"The model '{name}' ({spec.model_type}) is a mixture of experts: exo-tp "
            "fine-tunes dense models only",
            param="model",
            code="model_not_supported",
        )
    return prepared.name, spec.num_layers
