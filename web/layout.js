// The shard plan as a picture: one row per kind of weight, one bar per row (per pipeline stage
// in hybrid plans), each device's segment placed at the indices it holds and sized by them;
// padding added for an equal-shape collective is hatched in the device's colour.

import { deviceColor } from "./colors.js";
import { h } from "./dom.js";
import { bytes, count, NOT_MEASURED, percent, plural, seconds, span, spanSize } from "./format.js";

const size = spanSize;

// A segment: its place on the bar [offset, offset + width) and what it says.
function segment({ rank, node, offset, width, total, label, tip, kind, data = {}, padding = false }) {
  return h("div", {
    class: `seg${padding ? " padding" : ""}${width === 0 ? " empty" : ""}`,
    style: { left: `${(offset / total) * 100}%`, width: `${(width / total) * 100}%`,
      "--device": deviceColor(node) },
    tabindex: 0,
    "data-tip": tip,
    dataset: { kind, rank, node, ...data },
  }, h("span", { class: "seg-label" }, label));
}

function bar(segments, { caption = null, ruler = null, marks = [], total = 1 } = {}) {
  return h("div", { class: "bar-block" },
    caption ? h("div", { class: "bar-caption" }, caption) : null,
    ruler,
    h("div", { class: "bar" }, ...segments,
      ...marks.map((at) => h("div", { class: "mark", style: { left: `${(at / total) * 100}%` } }))));
}

function row(id, title, subtitle, ...bars) {
  return h("div", { class: "row", dataset: { row: id } },
    h("div", { class: "row-label" }, h("b", {}, title), subtitle ? h("small", {}, subtitle) : null),
    h("div", { class: "row-bars" }, ...bars));
}

// A pipeline's stages each carry a TP plan over their own (local) ranks; the views read one
// plan whose ranks are indexed by global rank. Merge the stages into that shape (idempotent).
export function normalizePlan(response) {
  const stages = response?.stages;
  if (!response || response.plan || !Array.isArray(stages) || !stages.length) return response;
  const last = stages[stages.length - 1].plan;
  const numLayers = stages[0].plan.spec.num_layers;
  const ranks = [];
  const weights = [];
  for (const stage of stages) {
    stage.ranks.forEach((rank, local) => {
      const shard = stage.plan.ranks[local];
      ranks[rank] = { ...shard, rank };
      // a device's share of the model: its share of its stage × the stage's share of layers
      weights[rank] = (shard.weight * size(stage.layers)) / numLayers;
    });
  }
  const plan = { ...last, weights, ranks, vocab_ranks: stages[stages.length - 1].ranks };
  return { ...response, plan };
}

// Pipeline stages when the plan has several; else one group of every rank (pure TP).
function stageGroups(response) {
  const plan = response.plan;
  const stages = response.stages;
  const layers = { start: 0, stop: plan.spec.num_layers };
  if (!Array.isArray(stages) || stages.length <= 1) {
    return [{ index: 0, ranks: plan.ranks.map((r) => r.rank), layers }];
  }
  return stages.map((stage, index) => ({ index, ranks: stage.ranks, layers: stage.layers }));
}

function who(response, rank) {
  return `rank ${rank} · ${response.nodes[rank] ?? "?"}`;
}

function shareRow(response) {
  const { weights } = response.plan;
  const total = weights.reduce((a, b) => a + b, 0) || 1;
  let offset = 0;
  const segments = weights.map((weight, rank) => {
    const node = response.nodes[rank];
    const seg = segment({ rank, node, offset, width: weight, total, kind: "share",
      label: `${node} ${percent(weight / total)}`,
      tip: `${who(response, rank)}\nweight ${weight} → ${percent(weight / total)} of every split`,
      data: { weight } });
    offset += weight;
    return seg;
  });
  return row("share", "Shares", "planned weight per device", bar(segments, { total }));
}

function layersRow(response, groups) {
  const layers = response.plan.spec.num_layers;
  const segments = groups.map((group) => {
    const lanes = group.ranks.map((rank) => h("div", {
      class: "lane", style: { "--device": deviceColor(response.nodes[rank]) },
      dataset: { kind: "layers", rank, node: response.nodes[rank], start: group.layers.start,
        stop: group.layers.stop, count: size(group.layers) },
    }));
    const pure = groups.length === 1;
    const text = pure ? `layers ${span(group.layers)} on all ${group.ranks.length} devices`
      : `stage ${group.index + 1} · layers ${span(group.layers)}`;
    const tip = [pure ? "tensor parallel: every device holds a slice of every layer"
      : `pipeline stage ${group.index + 1}: ${plural(size(group.layers), "layer")}`,
    `layers ${span(group.layers)} (${count(size(group.layers))})`,
    ...group.ranks.map((rank) => who(response, rank))].join("\n");
    return h("div", { class: "seg stage", tabindex: 0, "data-tip": tip,
      style: { left: `${(group.layers.start / layers) * 100}%`,
        width: `${(size(group.layers) / layers) * 100}%` },
      dataset: { kind: "stage", stage: group.index, start: group.layers.start,
        stop: group.layers.stop } },
    h("div", { class: "lanes" }, ...lanes), h("span", { class: "seg-label stage-label" }, text));
  });
  const subtitle = groups.length === 1 ? "pure tensor parallel"
    : `${groups.length} pipeline stages`;
  return row("layers", "Layers", subtitle, bar(segments));
}

function caption(groups, group) {
  return groups.length > 1 ? `stage ${group.index + 1} · ranks ${group.ranks.join(", ")}` : null;
}

function kvRuler(spec) {
  const per = spec.num_heads / spec.num_kv_heads;
  return h("div", { class: "ruler" }, ...Array.from({ length: spec.num_kv_heads }, (_, g) =>
    h("div", { class: "ruler-cell", style: { left: `${(g * per / spec.num_heads) * 100}%`,
      width: `${(per / spec.num_heads) * 100}%` } }, `KV ${g}`)));
}

function kvText(kv) {
  return kv.length ? kv.join(", ") : "none";
}

function queryHeadsRow(response, groups) {
  const { plan } = response;
  const { spec } = plan;
  const per = spec.num_heads / spec.num_kv_heads;
  const marks = Array.from({ length: spec.num_kv_heads - 1 }, (_, g) => (g + 1) * per);
  const bars = groups.map((group) => bar(group.ranks.map((rank) => {
    const { q_heads: q, kv_heads: kv } = plan.ranks[rank].heads;
    const node = response.nodes[rank];
    return segment({
      rank, node, offset: q.start, width: size(q), total: spec.num_heads, kind: "q_heads",
      label: plural(size(q), "head"),
      tip: `${who(response, rank)}\nquery heads ${span(q)} (${plural(size(q), "head")})\n` +
        `KV heads held: ${kvText(kv)} (${plural(kv.length, "slot")})`,
      data: { start: q.start, stop: q.stop, count: size(q), kv: kv.join(",") },
    });
  }), { caption: caption(groups, group), ruler: kvRuler(spec), marks, total: spec.num_heads }));
  const unit = plan.attention_unit === "kv_group"
    ? `split by whole KV groups (${plan.head_unit} q heads each)`
    : "split by query head; KV heads replicated where needed";
  return row("q_heads", "Attention · query heads", `${spec.num_heads} heads in ` +
    `${spec.num_kv_heads} KV groups; ${unit}`, ...bars);
}

function kvHeadsRow(response, groups) {
  const { plan } = response;
  const kvCount = plan.spec.num_kv_heads;
  let replicated = 0;
  const bars = groups.map((group) => {
    const cells = Array.from({ length: kvCount }, (_, kvHead) => {
      const holders = group.ranks.filter((rank) => plan.ranks[rank].heads.kv_heads.includes(kvHead));
      if (holders.length > 1) replicated += 1;
      const tip = `KV head ${kvHead}: ` + (holders.length
        ? `held by ${holders.map((rank) => who(response, rank)).join(", ")}` +
          (holders.length > 1 ? `\nreplicated ×${holders.length} (never split)` : "")
        : "held by no device of this stage");
      return h("div", { class: `kv-cell${holders.length > 1 ? " replicated" : ""}`, tabindex: 0,
        style: { left: `${(kvHead / kvCount) * 100}%`, width: `${100 / kvCount}%` },
        "data-tip": tip, dataset: { kind: "kv_head", kv: kvHead, holders: holders.join(",") } },
      h("div", { class: "lanes" }, ...holders.map((rank) => h("div", {
        class: "lane", style: { "--device": deviceColor(response.nodes[rank]) },
        dataset: { kind: "kv_heads", rank, node: response.nodes[rank], kv: kvHead },
      }))),
      h("span", { class: "seg-label" }, holders.length > 1 ? `KV ${kvHead} ×${holders.length}`
        : `KV ${kvHead}`));
    });
    return bar(cells, { caption: caption(groups, group) });
  });
  const note = replicated ? `${plural(replicated, "KV head")} replicated across devices`
    : "each KV head on one device";
  return row("kv_heads", "Attention · KV heads", `${kvCount} KV heads × ${plan.spec.head_dim}; ` +
    note, ...bars);
}

// Linear-attention layers (Kimi K3's Kimi Delta Attention) split their own heads: each device
// keeps its heads' projections, conv channels and recurrent state.
function linearHeadsRow(response, groups) {
  const { plan } = response;
  const linear = plan.spec.linear_attention;
  if (!linear) return null;
  const total = linear.num_heads;
  const bars = groups.map((group) => bar(group.ranks.map((rank) => {
    const part = plan.ranks[rank].linear_heads ?? { start: 0, stop: 0 };
    return segment({
      rank, node: response.nodes[rank], offset: part.start, width: size(part), total,
      kind: "linear_heads", label: plural(size(part), "head"),
      tip: `${who(response, rank)}\nlinear-attention heads ${span(part)} ` +
        `(${plural(size(part), "head")}: their projections, conv channels and recurrent state)`,
      data: { start: part.start, stop: part.stop, count: size(part) },
    });
  }), { caption: caption(groups, group), total }));
  return row("linear_heads", "Linear attention · heads", `${total} heads × ` +
    `${linear.head_dim} in ${plural(linear.layers.length, "layer")}; units of ` +
    `${plan.linear_head_unit ?? 1}; recurrent state per stream, constant in context`, ...bars);
}

function ffnRows(response, groups) {
  const { plan } = response;
  return Object.entries(plan.spec.ffn_sizes).map(([kind, rows]) => {
    const bars = groups.map((group) => bar(group.ranks.map((rank) => {
      const part = plan.ranks[rank].ffn[kind] ?? { start: 0, stop: 0 };
      const node = response.nodes[rank];
      return segment({
        rank, node, offset: part.start, width: size(part), total: rows, kind: `ffn:${kind}`,
        label: plural(size(part), "row"),
        tip: `${who(response, rank)}\n${kind} rows ${span(part)} (${count(size(part))} rows = ` +
          `${count(size(part) / plan.ffn_unit)} × ${plan.ffn_unit}-row units)`,
        data: { start: part.start, stop: part.stop, count: size(part) },
      });
    }), { caption: caption(groups, group), total: rows }));
    return row(`ffn:${kind}`, ffnTitle(kind), `${count(rows)} rows in units of ` +
      `${plan.ffn_unit} (gate/up columns, down inputs)${expertNote(plan.spec, kind)}`, ...bars);
  });
}

// MoE kinds say what the rows are of: every routed expert is split alike (the experts stay
// stacked), and a decoded token reads only its top-k experts' rows.
const FFN_TITLES = { ffn: "FFN", expert_ffn: "MoE · routed experts",
  shared_expert_ffn: "MoE · shared experts" };

function ffnTitle(kind) {
  return FFN_TITLES[kind] ?? `FFN · ${kind}`;
}

function expertNote(spec, kind) {
  if (kind !== "expert_ffn" || !spec.num_experts) return "";
  return `; each of ${spec.num_experts} experts split alike (top ${spec.experts_per_token} ` +
    `read per token)`;
}

// Vocab shards as laid out in the logits all-gather: every shard padded to the largest.
function vocabRow(response) {
  const { plan } = response;
  const gather = plan.collectives.find((c) => c.name === "logits");
  // in a pipeline the LM head (and its gather) lives on the last stage
  const holders = plan.vocab_ranks ? plan.vocab_ranks.map((r) => plan.ranks[r]) : plan.ranks;
  const ranks = holders.filter((r) => size(r.vocab) > 0 || gather);
  const slot = gather ? gather.padded : null;
  const total = slot ? slot * ranks.length : plan.spec.vocab_size;
  const segments = ranks.flatMap((shard, index) => {
    const { rank, vocab } = shard;
    const node = response.nodes[rank];
    const offset = slot ? index * slot : vocab.start;
    const pad = slot ? slot - size(vocab) : 0;
    const tip = `${who(response, rank)}\nvocab rows ${span(vocab)} (${count(size(vocab))} rows)` +
      (slot ? `\npadded by ${count(pad)} to ${count(slot)} for the logits all-gather` : "");
    const data = { start: vocab.start, stop: vocab.stop, count: size(vocab), padding: pad };
    const parts = [segment({ rank, node, offset, width: size(vocab), total, kind: "vocab",
      label: `${count(size(vocab))} rows`, tip, data })];
    if (pad > 0) {
      parts.push(segment({ rank, node, offset: offset + size(vocab), width: pad, total,
        kind: "vocab_padding", label: `+${count(pad)} pad`, tip, data, padding: true }));
    }
    return parts;
  });
  const marks = slot ? ranks.slice(1).map((_, i) => (i + 1) * slot) : [];
  const padTotal = slot ? total - plan.spec.vocab_size : 0;
  const subtitle = slot
    ? `${count(plan.spec.vocab_size)} rows; the logits gather sends ${ranks.length} × ` +
      `${count(slot)} (${count(padTotal)} padding, ${percent(padTotal / total)})`
    : `${count(plan.spec.vocab_size)} rows`;
  const where = plan.vocab_ranks ? " (LM head on the last stage)" : "";
  return row("vocab", "Vocabulary", subtitle + where, bar(segments, { marks, total }));
}

function collectivesList(plan) {
  return h("ul", { class: "collectives" }, ...plan.collectives.map((c) => {
    const where = c.per_layer ? `${c.per_layer}× per layer` : "once per forward";
    const padding = c.sizes.reduce((sum, n) => sum + (c.padded - n), 0);
    return h("li", { dataset: { collective: c.name } },
      h("code", {}, c.name), ` ${c.op} · ${where} · ${count(c.padded)} values per rank`,
      padding ? h("span", { class: "pad-note" }, ` · padding ${c.sizes.map((n) => count(c.padded - n))
        .join(" / ")}`) : null);
  }));
}

function legend(response) {
  return h("div", { class: "legend" },
    ...response.nodes.map((node, rank) => h("span", { class: "legend-item",
      style: { "--device": deviceColor(node) } }, h("span", { class: "swatch" }),
    `${node} (rank ${rank})`)),
    h("span", { class: "legend-item padding-key" }, h("span", { class: "swatch hatched" }),
      "padding (sent, not computed)"));
}

export function specLine(spec) {
  const ffn = Object.entries(spec.ffn_sizes).map(([k, v]) => `${k} ${count(v)}`).join(", ");
  const quant = spec.quantization
    ? `${spec.quantization.bits}-bit, group ${spec.quantization.group_size}` : "unquantized";
  return `${spec.model_type} · ${spec.num_layers} layers · hidden ${count(spec.hidden_size)} · ` +
    `${spec.num_heads} q / ${spec.num_kv_heads} KV heads × ${spec.head_dim} · FFN ${ffn} · ` +
    `vocab ${count(spec.vocab_size)} · ${quant}`;
}

// A vision checkpoint's tower: whole beside the first stage's first rank (exo_tp.plan.vision),
// its image features entering that stage's embedding all-reduce.
function towerLine(response) {
  const towerBytes = response.plan.spec.vision_bytes;
  if (!towerBytes) return null;
  const rank = response.stages?.length ? response.stages[0].ranks[0] : 0;
  const node = response.nodes?.[rank] ?? `rank ${rank}`;
  return h("div", { class: "spec tower", dataset: { tower: rank } },
    `vision tower: whole on ${node} (rank ${rank}), ${bytes(towerBytes)}; ` +
    "its image features join the first stage's embedding all-reduce");
}

export function predictedView(response) {
  const predicted = response.predicted;
  if (!predicted || !(predicted.tokens_per_second > 0)) {
    return h("div", { class: "predicted-none", dataset: { predicted: "" } },
      `predicted tokens/s: ${NOT_MEASURED}`);
  }
  return h("div", { class: "predicted-value", dataset: { predicted: predicted.tokens_per_second },
    "data-tip": `the plan's cost model: ${seconds(predicted.decode_seconds_per_token)} per ` +
      "decoded token" },
  h("b", {}, predicted.tokens_per_second.toFixed(1)), " tok/s predicted");
}

export function renderLayout(container, response) {
  response = normalizePlan(response);
  if (!response.plan) {
    container.replaceChildren(h("div", { class: "empty" },
      `No plan yet: the cluster is ${response.state || "forming"}.`));
    return;
  }
  const groups = stageGroups(response);
  container.replaceChildren(
    h("div", { class: "spec" }, specLine(response.plan.spec)),
    ...[towerLine(response)].filter(Boolean),
    // tensor-parallel, pipeline stages only (no tensor-parallel table) or whole on one node
    ...(response.mode ? [h("div", { class: "spec mode", title: response.mode_reason || "" },
      `${response.mode}: ${response.mode_reason}`)] : []),
    legend(response),
    h("div", { class: "rows" },
      shareRow(response),
      layersRow(response, groups),
      queryHeadsRow(response, groups),
      kvHeadsRow(response, groups),
      linearHeadsRow(response, groups),
      ...ffnRows(response, groups),
      vocabRow(response)),
    h("details", { class: "comm" }, h("summary", {}, "Collectives per token"),
      collectivesList(response.plan)));
}
