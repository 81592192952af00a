"""Nodes and device profiles: what `exo-tp run` measures or loads, announces over mDNS, plans
with, and shows in /v1/cluster (with the links its workers timed when the cluster formed)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from cluster_helpers import local_cluster, loopback_nodes
from helpers import assert_latency_in_seconds, tcp_loopback_reference
from lab_profiles import lab_announcement
from node_views import cluster_view, plan_view

from exo_tp.node.cluster.views import ClusterView
from exo_tp.node.leader.members import node_weights
from exo_tp.plan.devices import DeviceProfile, MatmulScore, read_profile
from exo_tp.plan.spec import ModelSpec, Quantization, load_spec
from exo_tp.profile.shapes import model_shapes
from exo_tp.profile.system import system_info
from exo_tp.wire.announcement import SERVICE_TYPE, Announcement
from exo_tp.wire.profiles import ProfileSummary

pytestmark = pytest.mark.alone  # under pytest-xdist: its nodes measure device profiles

Q4_MODEL = "smollm2-135m-q4"  # weights in format q4g32
SUMMARY_FIELDS = (
    "chip",
    "cores",
    "mlx_version",
    "mlx_device",
    "memory_total",
    "memory_available",
    "backends",
    "decode_seconds_per_byte",
    "prefill_flops",
)


def _meminfo_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal")


def _profile(q4_bytes_per_second: float, headline: float = 3e-10) -> DeviceProfile:
    """This device's identity with chosen scores: the float32 headline, and a 4-bit group-32
    matvec reading ``q4_bytes_per_second``."""
    nbytes = 576 * 1536 // 2 + 2 * 4 * 576 * 1536 // 32
    seconds = nbytes / q4_bytes_per_second
    q4 = MatmulScore(
        kind="matvec",
        dtype="q4g32",
        m=1,
        k=576,
        n=1536,
        seconds=seconds,
        flops=2 * 576 * 1536 / seconds,
        weight_bytes_per_second=q4_bytes_per_second,
        weight_bytes=nbytes,
        working_set_bytes=nbytes * 100,
    )
    return DeviceProfile(
        **system_info().model_dump(),
        memory_bandwidth=1e10,
        decode_seconds_per_byte=headline,
        prefill_flops=4e9,
        kernels=(q4,),
        quick=True,
        measured_at="2026-01-01T00:00:00+00:00",
    )


def _member(node_id: str, weight: float = 0.0, score: float = 0.0) -> Announcement:
    return lab_announcement(node_id, decode_seconds_per_byte=score, weight=weight)


def _spec(quantized: bool) -> ModelSpec:
    """A small Llama, its weights in float32 or in the 4-bit group-32 format."""
    return ModelSpec(
        model_type="llama",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        ffn_sizes={"ffn": 256},
        vocab_size=512,
        tie_word_embeddings=True,
        quantization=Quantization(group_size=32, bits=4) if quantized else None,
    )


def test_node_weights() -> None:
    fast, slow = _profile(1e9).summary(), _profile(0.25e9).summary()
    members = [_member("a"), _member("b"), _member("c", score=1e-9), _member("d")]
    profiles = {"a": fast, "b": slow, "c": None, "d": None}
    q4, f32 = _spec(quantized=True), _spec(quantized=False)
    # a profile gives the speed of the model's weight format; else the announced headline
    # score; else the mean of the others
    assert node_weights(members, profiles, q4) == pytest.approx([1e9, 0.25e9, 1e9, 0.75e9])
    assert node_weights(members[:2], profiles, f32) == pytest.approx([1 / 3e-10] * 2)
    manual = [_member("a", weight=5), _member("b", weight=3)]
    assert node_weights(manual, profiles, q4) == [5, 3]
    # manual weights are relative numbers, speeds are bytes/s: never mixed
    mixed = [_member("a", weight=5), _member("b")]
    assert node_weights(mixed, profiles, q4) == pytest.approx([1e9, 0.25e9])
    assert node_weights([_member("x"), _member("y")], {}, f32) == [1.0, 1.0]


def test_profile_summary_keeps_the_scores() -> None:
    profile = _profile(0.5e9)
    summary = ProfileSummary.model_validate_json(profile.summary().model_dump_json())
    assert summary.decode_score("q4g32") == profile.decode_score("q4g32")
    bf16 = summary.decode_score("bfloat16")
    assert bf16.speed == profile.decode_speed and not bf16.measured  # the headline stands in
    for field in SUMMARY_FIELDS:
        assert getattr(summary, field) == getattr(profile, field)


def _announcements(
    cluster: str, secret: str, count: int, timeout: float = 30
) -> dict[str, dict[bytes, bytes | None]]:
    """The TXT records of ``cluster``'s nodes as any mDNS client on this machine reads them
    (python-zeroconf's own browser, not exo-tp's discovery), by node id."""
    from zeroconf import DNSQuestionType, IPVersion, ServiceBrowser, ServiceInfo, Zeroconf

    names: set[str] = set()

    class Listener:
        def add_service(self, zc: Zeroconf, kind: str, name: str) -> None:
            names.add(name)

        update_service = add_service

        def remove_service(self, zc: Zeroconf, kind: str, name: str) -> None:
            names.discard(name)

    zc = Zeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
    browser = ServiceBrowser(zc, SERVICE_TYPE, Listener())
    found: dict[str, dict[bytes, bytes | None]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(found) < count and time.monotonic() < deadline:
            for name in list(names):
                info = ServiceInfo(SERVICE_TYPE, name)
                # multicast answers: several responders share port 5353 on this host
                if info.request(zc, 2000, question_type=DNSQuestionType.QM) and info.properties:
                    announced, _ = Announcement.from_txt(info.properties, secret)
                    if announced is not None and announced.cluster == cluster:
                        found[announced.node_id] = info.properties
            time.sleep(0.3)
    finally:
        browser.cancel()
        zc.close()
    assert len(found) == count, f"found TXT records of {sorted(found)} only"
    return found


def _wait_links(url: str, count: int, timeout: float = 10) -> ClusterView:
    deadline = time.monotonic() + timeout
    while True:
        view = cluster_view(url)
        if len(view.links) >= count or time.monotonic() > deadline:
            return view
        time.sleep(0.3)


def test_nodes_announce_their_scores_plan_with_them_and_show_measured_links(
    tmp_path: Path, default_models: dict[str, Path]
) -> None:
    """Two nodes on loopback with given profiles: equal float32 headline scores, but node n0
    reads 4-bit weights 3x faster. The TXT carries the scores; the leader plans the 4-bit model
    by the 4-bit scores (0.75 / 0.25, where the headline would give 0.5 / 0.5); /v1/cluster
    shows both profiles and the link the workers timed when their ring formed."""
    profiles = [_profile(1e9), _profile(1e9 / 3)]
    files = []
    for i, profile in enumerate(profiles):
        files.append(tmp_path / f"p{i}.json")
        files[-1].write_text(profile.model_dump_json())
    # --stages 2: both nodes in one tensor-parallel stage whatever the measured link costs (on a
    # slow loopback the planner rightly serves this tiny model from n0 alone)
    node_args = [["--profile", str(f), "--stages", "2"] for f in files]
    with loopback_nodes(node_args, Q4_MODEL, tmp_path) as nodes:
        txt = _announcements(nodes.cluster, nodes.secret, 2)
        view = _wait_links(nodes.urls[1], 1)
        plan = plan_view(nodes.urls[1])
    one_way, rate = tcp_loopback_reference()

    for i, profile in enumerate(profiles):
        record = txt[f"n{i}"]
        assert float(record[b"decode_seconds_per_byte"] or 0) == profile.decode_seconds_per_byte
        assert float(record[b"prefill_flops"] or 0) == profile.prefill_flops
        assert int(record[b"memory_total"] or 0) == _meminfo_total()
        assert 0 < int(record[b"memory_available"] or 0) <= _meminfo_total()
        # a few numbers, not the kernel table (mDNS packets are small)
        assert sum(len(k) + len(v or b"") + 1 for k, v in record.items()) < 600, record

    assert plan.nodes == ("n0", "n1") and plan.plan is not None
    assert plan.plan.weights == pytest.approx([0.75, 0.25])

    for i, profile in enumerate(profiles):
        shown = view.node(f"n{i}")
        assert shown.decode_seconds_per_byte == profile.decode_seconds_per_byte
        summary = shown.profile
        assert summary is not None
        for field in set(SUMMARY_FIELDS) - {"memory_total", "memory_available", "backends"}:
            assert getattr(summary, field) == getattr(profile, field), field
        assert summary.backends == profile.backends
        assert summary.memory_total == _meminfo_total()  # read when the node started
        assert summary.decode_score("q4g32").seconds_per_byte == pytest.approx(
            profile.decode_score("q4g32").seconds_per_byte
        )

    (link,) = view.links
    assert {link.a, link.b} == {"n0", "n1"}
    assert link.up and link.group_size == 2
    assert link.send_recv_latency and link.all_sum_latency and link.all_sum_bandwidth, link
    assert_latency_in_seconds(link.send_recv_latency, one_way)
    assert rate / 100 < link.all_sum_bandwidth < rate * 4, (link, rate)


def test_first_start_measures_one_quick_profile_for_a_local_cluster(
    tmp_path: Path, default_models: dict[str, Path]
) -> None:
    """No cached profile and no weights: `run --local-nodes 2` measures once (not once per
    node), with the served model's matrix shapes, caches it, and both nodes plan with it
    (equal devices: equal shares) and tell the leader those shapes."""
    home, log = tmp_path / "home", tmp_path / "cluster.log"
    with local_cluster(
        2,
        model=str(default_models["smollm2-135m"]),
        bench=True,
        env={"EXO_TP_HOME": str(home)},
        log=log,
        # One TP stage over both: a quick profile measured on a loaded core can make one node
        # alone the faster plan for a 135M model, and the shares over both are the point here.
        extra=("--stages", "2"),
    ) as cluster:
        view = cluster_view(cluster.urls[1])
        plan = plan_view(cluster.urls[1])
    # One file: profile.json, or profile-1-blas-threads.json with OpenBLAS (a thread per rank).
    (path,) = home.glob("profile*.json")
    cached = read_profile(path)
    assert cached.quick and cached.kernels
    assert log.read_text().count("measuring a quick one") == 1, log.read_text()[-3000:]
    assert log.read_text().count("matrix shapes of smollm2-135m") == 1
    # every shape the bench times for the model, in its weight format
    dtype, shapes = model_shapes(load_spec(default_models["smollm2-135m"]))
    assert {(k.dtype, k.k, k.n) for k in cached.shapes} == {(dtype, k, n) for k, n in shapes}
    for node in view.nodes:
        assert node.profile is not None
        assert node.profile.decode_seconds_per_byte == cached.decode_seconds_per_byte
        assert node.profile.chip == cached.chip
        assert node.profile.shapes == cached.shape_seconds
    assert plan.plan is not None and plan.plan.weights == pytest.approx([0.5, 0.5])


def test_manual_weight_measures_nothing(tmp_path: Path, default_models: dict[str, Path]) -> None:
    home = tmp_path / "home"
    home.mkdir()
    model = str(default_models["smollm2-135m"])
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EXO_TP_HOME", str(home))
        with loopback_nodes([["--weight", "2"]], model, tmp_path, ready=False) as nodes:
            deadline = time.monotonic() + 30
            while True:  # the API is up once the node has its profile (or none)
                try:
                    view = cluster_view(nodes.urls[0], timeout=2)
                    break
                except OSError:
                    assert time.monotonic() < deadline, "node never came up"
                    time.sleep(0.3)
    assert list(home.iterdir()) == []  # nothing measured, nothing cached
    (node,) = view.nodes
    assert node.weight == 2 and node.decode_seconds_per_byte == 0
    assert "measuring" not in (tmp_path / "n0.log").read_text()
