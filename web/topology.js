// The cluster as a graph (nodes, measured links, the leader) and one card per node.

import { deviceColor } from "./colors.js";
import { h, s } from "./dom.js";
import { bytes, flops, NOT_MEASURED, percent, rate, seconds } from "./format.js";

const WIDTH = 900;

// A link's ends may name nodes or ranks; both resolve to node ids.
function linkEnds(link, ranks) {
  const id = (end) => (typeof end === "number" ? ranks[end] : end);
  return [id(link.a), id(link.b)];
}

function findLink(links, ranks, a, b) {
  return links.find((link) => {
    const [x, y] = linkEnds(link, ranks);
    return (x === a && y === b) || (x === b && y === a);
  });
}

function linkText(link) {
  const parts = [];
  if (link.all_sum_latency) parts.push(seconds(link.all_sum_latency));
  if (link.all_sum_bandwidth) parts.push(rate(link.all_sum_bandwidth));
  return parts.join(" · ");
}

// Where a link's figures come from (exo_tp.wire.profiles.LinkSource).
const SOURCES = {
  bench: "measured by exo-tp bench --peers (an all_sum)",
  probe: "probed when the node joined (round trips: an estimate)",
  epoch: "timed by this epoch's ranks",
};

function linkSource(link) {
  const how = SOURCES[link.source] || "measured";
  return link.measured_at ? `${how}, ${link.measured_at}` : how;
}

// The epoch's own timings first; the links measured between members (what the leader planned
// with) for every other pair.
export function clusterLinks(cluster) {
  return [...(cluster.links || []), ...(cluster.measured_links || [])];
}

function linkTip(a, b, link) {
  if (!link) return `${a} ↔ ${b}\nlink ${NOT_MEASURED}: planned as the default link`;
  return [
    `${a} ↔ ${b}: ${link.up === false ? "DOWN" : "up"}`,
    linkSource(link),
    // a ring of more than two ranks times its all_sum as a whole, not per pair
    link.group_size > 2 ? `all_sum over the ring of ${link.group_size} ranks:` : null,
    `all_sum latency (4 KB): ${seconds(link.all_sum_latency)}`,
    `all_sum bandwidth (8 MB): ${rate(link.all_sum_bandwidth)}`,
    `send/recv latency: ${seconds(link.send_recv_latency)}`,
    link.error ? `error: ${link.error}` : null,
  ].filter(Boolean).join("\n");
}

// Nodes on an ellipse, stretched to fill the drawing between the leader mark above the top
// node and the names under the bottom ones.
function geometry(count) {
  const height = count <= 3 ? 240 : 300;
  const cx = WIDTH / 2;
  if (count <= 2) {
    const y = height / 2;
    return { height, at: count === 1 ? [[cx, y]] : [[cx - 220, y], [cx + 220, y]] };
  }
  const rx = Math.min(380, 150 + 40 * count);
  const angles = Array.from({ length: count }, (_, i) => -Math.PI / 2 + (2 * Math.PI * i) / count);
  const sines = angles.map(Math.sin);
  const [low, high] = [Math.min(...sines), Math.max(...sines)];
  const [top, bottom] = [56, height - 62];
  return { height, at: angles.map((angle, i) => [cx + rx * Math.cos(angle),
    top + ((sines[i] - low) / (high - low)) * (bottom - top)]) };
}

// With many nodes a label on every edge is unreadable: label the ring (rank neighbours, the
// links the ring backend uses) and leave the rest to the hover text.
function labelled(count, ranks, a, b) {
  if (count <= 3) return true;
  const i = ranks.indexOf(a);
  const j = ranks.indexOf(b);
  return i >= 0 && j >= 0 && (Math.abs(i - j) === 1 || Math.abs(i - j) === ranks.length - 1);
}

export function renderGraph(svg, cluster) {
  const nodes = cluster.nodes;
  const links = clusterLinks(cluster);
  const ranks = cluster.ranks || [];
  const { height, at: points } = geometry(nodes.length);
  const at = new Map(points.map((p, i) => [nodes[i].node_id, p]));
  svg.setAttribute("viewBox", `0 0 ${WIDTH} ${height}`);
  const edges = [];
  const labels = [];
  nodes.forEach((a, i) => nodes.slice(i + 1).forEach((b) => {
    const [x1, y1] = at.get(a.node_id);
    const [x2, y2] = at.get(b.node_id);
    const link = findLink(links, ranks, a.node_id, b.node_id);
    const down = link?.up === false || !a.alive || !b.alive;
    const kind = !link ? "unmeasured" : down ? "down" : "measured";
    const tip = linkTip(a.node_id, b.node_id, link);
    edges.push(s("line", { x1, y1, x2, y2, class: `edge ${kind}`, "data-tip": tip,
      dataset: { link: `${a.node_id}|${b.node_id}` } }));
    const text = !link ? "" : down ? "down"
      : labelled(nodes.length, ranks, a.node_id, b.node_id) ? linkText(link) : "";
    if (text) {
      labels.push(s("text", { x: (x1 + x2) / 2, y: (y1 + y2) / 2 - 6, class: "edge-label",
        "text-anchor": "middle", "data-tip": tip }, text));
    }
  }));
  const glyphs = nodes.map((node) => {
    const [x, y] = at.get(node.node_id);
    const rank = ranks.indexOf(node.node_id);
    const here = node.node_id === cluster.node_id;
    return s("g", { class: `glyph${node.alive ? "" : " down"}`, "data-tip": nodeTip(node, rank) },
      here ? s("circle", { cx: x, cy: y, r: 36, class: "here-ring" }) : null,
      s("circle", { cx: x, cy: y, r: 29, fill: node.alive ? deviceColor(node.node_id) : "#3a4150",
        class: "disc" }),
      s("text", { x, y: y + 5, "text-anchor": "middle", class: "disc-label" },
        rank >= 0 ? `r${rank}` : "–"),
      s("text", { x, y: y + 50, "text-anchor": "middle", class: "glyph-name" }, node.node_id),
      node.leader ? s("text", { x, y: y - 38, "text-anchor": "middle", class: "crown" }, "★ leader")
        : null);
  });
  svg.replaceChildren(...edges, ...labels, ...glyphs);
}

function nodeTip(node, rank) {
  return [`${node.node_id} (${node.host})`, rank >= 0 ? `rank ${rank}` : "no rank in this epoch",
    node.alive ? "alive" : "not answering", `worker: ${node.worker_state || "none"}`].join("\n");
}

// Live readings (status polls) first, else what the node announced from its profile.
function memoryOf(node) {
  const live = node.memory;
  if (live && live.total > 0) return { total: live.total, used: live.used };
  const total = node.memory_total || node.profile?.memory_total || 0;
  const available = node.memory_available || node.profile?.memory_available || 0;
  return total > 0 ? { total, used: total - available } : null;
}

function memoryView(node) {
  const memory = memoryOf(node);
  if (!memory) return h("span", { class: "muted" }, "not reported");
  const fraction = Math.min(1, Math.max(0, memory.used / memory.total));
  return h("div", { class: "memory", "data-tip": [
    `used ${bytes(memory.used)} of ${bytes(memory.total)} (${percent(fraction)})`,
  ].filter(Boolean).join("\n") },
  h("div", { class: "meter" }, h("div", { class: "meter-fill",
    style: { width: `${fraction * 100}%`, background: deviceColor(node.node_id) } })),
  h("span", { dataset: { field: "memory" } }, `${bytes(memory.used)} / ${bytes(memory.total)}`));
}

function workerView(node) {
  const rss = node.memory?.worker_rss;
  return h("span", { "data-tip": "the worker process holding this node's shard; RSS = its " +
    "resident memory (weights + runtime)" }, node.worker_state || "none",
  rss ? h("span", { class: "muted" }, ` · ${bytes(rss)} RSS`) : null);
}

// What the node holds of the served model: all of it (its files) or the pieces in its shard
// store, and its fetch while one runs (bytes, rate, ETA) or the last one.
function weightsView(node) {
  const w = node.weights;
  if (!w || !w.holds) return h("span", { class: "muted" }, "none of the served model");
  const total = w.total_bytes;
  const fetch = w.fetch;
  const progress = fetch?.progress;
  const tip = [
    w.holds === "files" ? "has the model files: loads its shard from them and serves peers"
      : "holds pieces of the model in its shard store (received from peers)",
    fetch ? `epoch ${fetch.epoch}: share ${bytes(fetch.share_bytes)}, ${bytes(fetch.retained_bytes)} ` +
      `already held, ${bytes(fetch.planned_bytes)} to fetch` : null,
    progress?.failed_sources?.length ? `failed sources: ${progress.failed_sources.join(", ")}` : null,
    progress?.corrupt_pieces ? `${progress.corrupt_pieces} corrupt pieces fetched again` : null,
  ].filter(Boolean).join("\n");
  let text;
  if (w.holds === "files") {
    text = `files · all ${bytes(total)}`;
  } else if (fetch && fetch.state === "fetching" && progress) {
    const eta = progress.eta_s === null ? "ETA ?"
      : `ETA ${progress.eta_s > 0 ? seconds(progress.eta_s) : "0 s"}`;
    text = `fetching ${bytes(progress.bytes_done)} / ${bytes(progress.bytes_total)} · ` +
      `${rate(progress.rate_bytes_s)} · ${eta}`;
  } else {
    const last = fetch ? ` · ${fetch.state} epoch ${fetch.epoch}` +
      (progress ? `: ${bytes(progress.bytes_done)} in ${seconds(fetch.seconds)}` : "") : "";
    text = `store · ${bytes(w.held_bytes)} of ${bytes(total)}${last}`;
  }
  const fraction = total > 0 ? Math.min(1, w.held_bytes / total) : 0;
  return h("div", { class: "memory", "data-tip": tip },
    h("div", { class: "meter" }, h("div", { class: "meter-fill",
      style: { width: `${fraction * 100}%`, background: deviceColor(node.node_id) } })),
    h("span", { dataset: { field: "weights" } }, text));
}

function chipView(profile) {
  if (!profile.chip) return h("span", { class: "muted" }, "not profiled");
  const extra = [profile.cores ? `${profile.cores} cores` : null,
    profile.mlx_device ? `MLX ${profile.mlx_device}${profile.mlx_version ? ` ${profile.mlx_version}` : ""}`
      : null].filter(Boolean).join(" · ");
  return h("span", {}, profile.chip, extra ? h("span", { class: "muted" }, ` · ${extra}`) : null);
}

function scoreView(value, text, tip) {
  return value > 0 ? h("span", { "data-tip": tip }, text) : h("span", { class: "muted" }, NOT_MEASURED);
}

function shareOf(plan, nodeId) {
  const rank = plan?.nodes?.indexOf(nodeId) ?? -1;
  if (rank < 0 || !plan.plan) return null;
  const weights = plan.plan.weights;
  const total = weights.reduce((a, b) => a + b, 0);
  return { rank, fraction: total > 0 ? weights[rank] / total : 0 };
}

// The kernel dtype the plan's model reads its weights in, as the planner names it
// (exo_tp.plan.cost.weight_format): "q4g32" for 4 bits in groups of 32, else "float32".
function weightFormat(plan) {
  const spec = plan?.stages?.[0]?.plan?.spec;
  if (!spec) return null;
  const q = spec.quantization;
  return q ? `q${q.bits}g${q.group_size}` : "float32";
}

// Where the planner's share weight for this node came from.
function weightSource(node, profile, plan, decode) {
  if (node.weight > 0) return `${node.weight} (set by hand)`;
  const format = weightFormat(plan);
  const shapes = (profile.shapes || []).filter((x) => x.dtype === format).length;
  if (shapes > 0) {
    return h("span", { "data-tip": "the model's bytes over the seconds its measured matrix "
      + "shapes take: shares and weight reads priced by shape" },
    `from ${shapes} measured matrix shapes`);
  }
  return h("span", { class: "muted" }, decode > 0 ? "from decode score" : "equal (no score)");
}

function nodeCard(node, cluster, plan) {
  const profile = node.profile || {};
  const decode = node.decode_seconds_per_byte || profile.decode_seconds_per_byte || 0;
  const prefill = node.prefill_flops || profile.prefill_flops || 0;
  const share = shareOf(plan, node.node_id);
  const badges = [
    node.leader ? h("span", { class: "badge leader" }, "leader") : null,
    node.node_id === cluster.node_id ? h("span", { class: "badge here" }, "this page") : null,
    node.alive ? null : h("span", { class: "badge down" }, "not answering"),
  ];
  const row = (label, value) => [h("dt", {}, label), h("dd", {}, value)];
  return h("article", {
    class: `node${node.alive ? "" : " down"}`,
    style: { "--device": deviceColor(node.node_id) },
    dataset: { node: node.node_id, rank: share ? share.rank : "", alive: node.alive,
      leader: node.leader },
  },
  h("header", {},
    h("span", { class: "swatch" }),
    h("span", { class: "node-id" }, node.node_id),
    ...badges),
  h("div", { class: "node-share" },
    share ? `rank ${share.rank} · ${percent(share.fraction)} of the model` : "no rank in this plan"),
  h("dl", {},
    row("chip", chipView(profile)),
    row("memory", memoryView(node)),
    row("worker", workerView(node)),
    row("weights", weightsView(node)),
    row("decode", scoreView(decode, `${rate(1 / decode)} weights`,
      `decode score: ${decode.toExponential(3)} s per byte of weights read`)),
    row("prefill", scoreView(prefill, flops(prefill), "prefill score: matmul throughput")),
    row("weight", weightSource(node, profile, plan, decode)),
    row("host", h("span", { class: "muted" }, node.api_url || node.host))));
}

export function renderNodes(container, cluster, plan) {
  container.replaceChildren(...cluster.nodes.map((node) => nodeCard(node, cluster, plan)));
}

export function topologyNote(cluster) {
  const pairs = new Set(clusterLinks(cluster).map((link) => [link.a, link.b].sort().join("|")));
  const times = (cluster.measured_links || []).map((link) => link.measured_at).filter(Boolean);
  const latest = times.length ? ` (latest ${times.sort().at(-1)})` : "";
  const measured = pairs.size ? `${pairs.size} links measured${latest}` : `links ${NOT_MEASURED}`;
  return `${cluster.nodes.length} nodes · leader ${cluster.leader ?? "none"} · ` +
    `backend ${cluster.backend ?? "—"} · ${measured}${draftNote(cluster.serving)}`;
}

// Speculative decoding with a draft model: where it runs (the conductor's node) and how many
// of its drafts the model kept since the leader started.
function draftNote(serving) {
  if (!serving || !serving.draft_model) return "";
  const where = serving.draft_node ? `on ${serving.draft_node}` : "not loaded";
  const kept = serving.drafted_tokens ? `, ${serving.accepted_tokens}/${serving.drafted_tokens} drafts kept` : "";
  return ` · draft model ${serving.draft_model} ${where}${kept}`;
}
