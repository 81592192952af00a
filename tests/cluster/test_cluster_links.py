"""The plan a running cluster chooses is the plan `exo-tp plan` previews for the same profiles
and links (exo_tp.plan.cluster.cluster_from_profiles is both's cluster model), and the links
decide it: a slow link between two of the members turns the plan away from it.

- two local nodes whose profiles hold a Wi-Fi-like link measured between them (`exo-tp bench
  --peers`): both the preview and the cluster keep to one device; the same profiles without
  the link split the model over both;
- three nodes in network namespaces, one pair's link throttled on the bridge: the nodes probe
  their links as they join, the leader plans with them, and its choice is `exo-tp plan`'s for
  the links the cluster measured, not its choice with every link fast.
"""

from __future__ import annotations

import secrets
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest
from cluster_helpers import CLI, NamespaceLab, can_make_namespaces, local_cluster, wait_ready
from lab_profiles import lab_profile
from node_views import cluster_view, plan_view

from exo_tp.plan.devices import DeviceProfile
from exo_tp.plan.search import Choice
from exo_tp.wire.profiles import LinkProfile

pytestmark = pytest.mark.alone  # under pytest-xdist: it measures the links that decide the plan

MODEL = "smollm2-135m"


def _profile(node_id: str, gb_per_s: float, links: Sequence[LinkProfile] = ()) -> DeviceProfile:
    return lab_profile(gb_per_s, node_id=node_id, links=tuple(links))


def _write(folder: Path, profiles: Sequence[DeviceProfile]) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, profile in enumerate(profiles):
        path = folder / f"device-{i}.json"
        path.write_text(profile.model_dump_json())
        paths.append(path)
    return paths


def _preview(paths: Sequence[Path]) -> tuple[str, ...]:
    """The devices (profile node ids) of `exo-tp plan`'s choice, in device order."""
    args = [arg for p in paths for arg in ("--profile", str(p))]
    done = subprocess.run(
        [*CLI, "plan", "--model", MODEL, *args, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    choice = Choice.model_validate_json(done.stdout.splitlines()[-1])
    ids = [DeviceProfile.model_validate_json(p.read_text()).node_id for p in paths]
    return tuple(ids[d] for d in choice.best.devices)


def test_profile_links_decide_the_cluster_as_they_decide_the_preview(tmp_path: Path) -> None:
    wifi = LinkProfile(
        a="local-0", b="local-1", up=True, all_sum_latency=20e-3, all_sum_bandwidth=5e6
    )
    slow = _write(tmp_path / "wifi", [_profile("local-0", 3.0, [wifi]), _profile("local-1", 3.0)])
    fast = _write(tmp_path / "fast", [_profile("local-0", 3.0), _profile("local-1", 3.0)])
    assert _preview(fast) == ("local-0", "local-1")  # fast links: split over both
    assert _preview(slow) == ("local-0",)  # over Wi-Fi, one device is faster
    extra = ("--profiles", ",".join(map(str, slow)))
    with local_cluster(2, ready=False, extra=extra) as cluster:
        wait_ready(cluster.urls, nodes=1)
        assert plan_view(cluster.urls[1]).nodes == ("local-0",)
        (link,) = [x for x in cluster_view(cluster.urls[0]).measured_links if x.source == "bench"]
        assert {link.a, link.b} == {"local-0", "local-1"}


@pytest.mark.skipif(can_make_namespaces() is not None, reason=str(can_make_namespaces()))
def test_a_slow_link_measured_on_joining_turns_the_plan_away_from_it(tmp_path: Path) -> None:
    """Equal devices at 1 GB/s: over fast links the model splits three ways. With node-1 and
    node-2 throttled to 8 Mbit/s between them, the ring of three would cross that link twice a
    layer, so the cluster, and `exo-tp plan` given the links it measured, split over two."""
    ids = [f"node-{i}" for i in range(3)]
    bare = _write(tmp_path, [_profile(n, 1.0) for n in ids])
    assert len(_preview(bare)) == 3  # every link fast (assumed): three ways
    lab = NamespaceLab()
    lab.up()
    try:
        hosts = [lab.add_host() for _ in ids]
        lab.throttle(hosts[1], hosts[2], "8mbit")
        cluster, secret = f"links-{lab.tag}", secrets.token_hex(16)
        for host, node_id, profile in zip(hosts, ids, bare, strict=True):
            lab.start_node(
                host,
                tmp_path,
                *("--cluster", cluster, "--node-id", node_id, "--profile", str(profile)),
                *("--model", MODEL),
                env={"EXO_TP_SECRET": secret},
            )
        urls = [h.url for h in hosts]
        wait_ready(urls, nodes=2, logs=[h.log for h in hosts if h.log])
        chosen = plan_view(urls[0]).nodes
        measured = cluster_view(urls[0]).measured_links
    finally:
        lab.down()
    pairs = {frozenset((x.a, x.b)): x for x in measured if x.source == "probe"}
    assert len(pairs) == 3, measured  # every pair probed
    slow = pairs[frozenset(ids[1:])]
    fast = pairs[frozenset(ids[:2])]
    assert slow.all_sum_bandwidth and fast.all_sum_bandwidth
    assert slow.all_sum_bandwidth < fast.all_sum_bandwidth / 10, measured
    # the same profiles, with the links the cluster measured: exo-tp plan's choice
    with_links = _write(
        tmp_path / "measured",
        [_profile(n, 1.0, [x for x in measured if x.a == n]) for n in ids],
    )
    assert _preview(with_links) == tuple(sorted(chosen)) and len(chosen) == 2
    assert "node-1" not in chosen or "node-2" not in chosen
