"""A shard store holding only a rank's boxes builds that rank's shard bit-equal to the folder.

The reference is load_shard reading the original model folder (the loader every node uses
today); the store side never sees the folder's weight files.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from arch_configs import tiny_config
from mlx.utils import tree_flatten
from safetensors import safe_open
from tiny_models import write_tiny_model

from exo_tp.errors import ExoTpError
from exo_tp.node.member.weight_folders import STORE_INFO, StoreInfo
from exo_tp.node.member.weights import NodeWeights
from exo_tp.plan import load_spec, plan_tensor_parallel
from exo_tp.plan.pipeline import PipelinePlan, single_stage
from exo_tp.shard.apply import load_shard
from exo_tp.weights.boxes import Boxes, rank_boxes
from exo_tp.weights.build import manifest_for
from exo_tp.weights.manifest import ModelManifest
from exo_tp.weights.pieces import read_piece
from exo_tp.weights.store import ShardStore, store_root


@pytest.fixture(scope="session")
def manifest_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.getbasetemp() / "manifests"


def fill(store: ShardStore, folder: Path, boxes: Boxes) -> None:
    """What the transport does, without the network: pieces read from the folder."""
    manifest = store.manifest
    for extra in manifest.extra_files:
        assert store.write_file(extra.name, (folder / extra.name).read_bytes())
    for name, a, b in boxes.pieces():
        entry = manifest.tensor(name)
        assert store.write_piece(name, a, b, read_piece(folder / entry.file, entry, a, b)) == []


def load(folder: Path, plan: PipelinePlan, rank: int) -> object:
    index, local = plan.locate(rank)
    stage = plan.stages[index]
    return load_shard(
        folder,
        stage.tp,
        local,
        mx.distributed.init(),
        None,
        stage.layers,
        index == 0,
        index == len(plan.stages) - 1,
    )


def assert_same_parameters(ours: object, reference: object) -> None:
    a, b = dict(tree_flatten(ours.parameters())), dict(tree_flatten(reference.parameters()))
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        same = np.array_equal(np.array(a[name].view(mx.uint8)), np.array(b[name].view(mx.uint8)))
        assert same, name


def disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in folder.glob("*.safetensors"))


def check_store_loads(
    tmp_path: Path, folder: Path, manifest: ModelManifest, plan: PipelinePlan, ranks: list[int]
) -> None:
    for rank in ranks:
        boxes = rank_boxes(manifest, plan, rank)
        store = ShardStore(tmp_path / f"store{rank}", manifest)
        with pytest.raises(ExoTpError, match="lacks"):
            store.require(boxes)
        fill(store, folder, boxes)
        store.require(boxes)
        share = boxes.nbytes(manifest)
        # only the share is on disk (the rest are holes), a page per touched run at most
        assert disk_bytes(store.folder) < share + 4096 * 8 * len(manifest.tensors)
        ours, reference = load(store.folder, plan, rank), load(folder, plan, rank)
        assert_same_parameters(ours, reference)
        if rank == 0:  # rank 0's forward in a group of one: its own partial logits
            ids = mx.array([[1, 17, 42, 310, 5]])
            assert np.array_equal(np.array(ours(ids)), np.array(reference(ids)))
        store.close()


def test_store_of_each_rank_loads_bit_equal(
    tmp_path: Path, default_models: dict[str, Path], manifest_cache: Path
) -> None:
    folder = default_models["smollm2-135m-q4"]
    manifest = manifest_for(folder, manifest_cache)
    plan = single_stage(plan_tensor_parallel(load_spec(folder), [5, 3, 2]))
    check_store_loads(tmp_path, folder, manifest, plan, [0, 1, 2])


def test_checkpoint_sanitize_transforms_moves_whole_and_loads(
    tmp_path: Path, default_models: dict[str, Path], manifest_cache: Path
) -> None:
    """A mixtral checkpoint in Hugging Face layout (one tensor per expert, stacked by
    sanitize()): the expert tensors are moved whole, and the shard is still exact."""
    folder = write_tiny_model(
        tmp_path / "mixtral", tiny_config("mixtral"), default_models["smollm2-135m"]
    )
    weights = mx.load(str(folder / "model.safetensors"))
    hf = {}
    for name, value in weights.items():
        if ".switch_mlp." not in name:
            hf[name] = value
            continue
        prefix, _, rest = name.partition(".switch_mlp.")
        proj = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}[rest.split(".")[0]]
        for e in range(value.shape[0]):
            hf[f"{prefix}.experts.{e}.{proj}.weight"] = value[e]
    mx.save_safetensors(str(folder / "model.safetensors"), hf)
    manifest = manifest_for(folder, manifest_cache)
    experts = [t for t in manifest.tensors if ".experts." in t.name]
    assert experts and not any(t.sliceable for t in experts)
    plan = single_stage(plan_tensor_parallel(load_spec(folder), [5, 3, 2]))
    check_store_loads(tmp_path, folder, manifest, plan, [0, 2])


def test_store_refuses_corrupt_pieces_and_survives_restart(
    tmp_path: Path, default_models: dict[str, Path], manifest_cache: Path
) -> None:
    folder = default_models["smollm2-135m-q4"]
    manifest = manifest_for(folder, manifest_cache)
    name = "model.layers.3.mlp.down_proj.scales"  # a column slab: strided runs
    entry = manifest.tensor(name)
    a, b = entry.cuts[2], entry.cuts[5]
    data = bytearray(read_piece(folder / entry.file, entry, a, b))
    # independent reference: the safetensors package's own slicing
    with safe_open(str(folder / entry.file), framework="np") as f:
        assert bytes(data) == np.ascontiguousarray(f.get_slice(name)[:, a:b]).tobytes()

    store = ShardStore(tmp_path / "store", manifest)
    data[len(data) // 3] ^= 1
    assert store.write_piece(name, a, b, bytes(data)) != []
    assert not store.held.ranges
    data[len(data) // 3] ^= 1
    assert store.write_piece(name, a, b, bytes(data)) == []
    with pytest.raises(ValueError, match="not whole digest blocks"):  # 64-row blocks
        store.write_piece("model.embed_tokens.scales", 0, 63, bytes(63 * 18 * 2))
    store.close()

    again = ShardStore(tmp_path / "store", manifest)  # a restart: the journal is kept
    assert again.held == Boxes(ranges={name: ((a, b),)})
    assert b"".join(again.read_piece(name, a, b)) == bytes(data)
    with open(again.folder / entry.file, "r+b") as f:  # the disk rots one byte
        f.seek(entry.offset + entry.length * entry.run_unit + a * entry.run_unit)  # row 1
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    lost = again.verify()
    assert lost.ranges and not again.held.covers(lost)
    again.close()
    assert ShardStore(tmp_path / "store", manifest).held == again.held
    shutil.rmtree(tmp_path / "store")


def test_local_nodes_keep_their_own_stores(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    default_models: dict[str, Path],
    manifest_cache: Path,
) -> None:
    """Nodes of one machine start in any order over the stores earlier runs left: each takes
    the shared store or its own named one, never another node's. (A third node once took the
    second's, and the second then had no store for the model: its epoch failed with "the
    shard store ... is in use by another process".)"""
    monkeypatch.setenv("EXO_TP_HOME", str(tmp_path))
    manifest = manifest_for(default_models["smollm2-135m-q4"], manifest_cache)
    shared = store_root(manifest.identity)
    for root in (shared, shared.with_name(f"{shared.name}-local-1")):
        ShardStore(root, manifest).close()
        (root / STORE_INFO).write_text(StoreInfo(name="q4", manifest=manifest).model_dump_json())
    nodes = {name: NodeWeights(name, "secret") for name in ("local-0", "local-2", "local-1")}
    try:
        held = {
            name: [store.folder.name for _, store in node.stores.values()]
            for name, node in nodes.items()
        }
        assert held == {
            "local-0": [shared.name],
            "local-2": [],  # it makes its own when an epoch needs the model
            "local-1": [f"{shared.name}-local-1"],
        }
    finally:
        for node in nodes.values():
            asyncio.run(node.close())
