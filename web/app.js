// Wires the page: polls the node's /v1/cluster and /v1/plan, redraws what changed, runs chat.

import { getJson } from "./api.js";
import { renderBalance } from "./balance.js";
import { Chat } from "./chat.js";
import { claimColors } from "./colors.js";
import { h, installTooltip } from "./dom.js";
import { renderGroups } from "./groups.js";
import { installKeyDialog } from "./key.js";
import { refreshFinetune } from "./finetune.js";
import { ModelPicker } from "./models.js";
import { normalizePlan, predictedView, renderLayout } from "./layout.js";
import { renderGraph, renderNodes, topologyNote } from "./topology.js";

const POLL_MS = 2000;
const $ = (id) => document.getElementById(id);

const chat = new Chat({
  form: $("chat-form"), input: $("chat-input"), model: $("chat-model"),
  maxTokens: $("chat-max-tokens"), temperature: $("chat-temperature"), send: $("chat-send"),
  logprobs: $("chat-logprobs"), tools: $("chat-tools"), attach: $("chat-attach"),
  file: $("chat-file"), attachments: $("chat-attachments"), note: $("chat-note"),
  clear: $("chat-clear"), messages: $("messages"), stats: $("chat-stats"), error: $("chat-error"),
});

const picker = new ModelPicker({
  table: $("models"), form: $("model-form"), input: $("model-input"), note: $("model-note"),
});

let shownPlan = null; // the plan response drawn now (JSON), to redraw only on change
let shownEpoch = null;

function banner(problems) {
  const element = $("banner");
  element.hidden = problems.length === 0;
  element.className = `banner ${problems.some((p) => p.level === "error") ? "error" : "warning"}`;
  element.replaceChildren(...problems.map((p) => h("div", { dataset: { level: p.level } }, p.text)));
}

function header(cluster) {
  $("summary").replaceChildren(
    h("span", {}, "cluster ", h("b", {}, cluster.cluster)),
    h("span", {}, "page from ", h("b", {}, cluster.node_id)),
    h("span", {}, "epoch ", h("b", { dataset: { field: "epoch" } }, cluster.epoch)));
  const state = $("state");
  state.dataset.state = cluster.state;
  state.textContent = cluster.state;
  state.title = cluster.state_reason || "";
}

function drawPlan(plan) {
  const key = JSON.stringify(plan);
  if (key === shownPlan) return;
  if (shownEpoch !== null && plan.epoch !== shownEpoch) {
    const time = new Date().toLocaleTimeString();
    $("layout-note").textContent = `re-planned at ${time}: epoch ${shownEpoch} → ${plan.epoch}`;
    $("layout-panel").classList.remove("flash");
    void $("layout-panel").offsetWidth; // restart the highlight animation
    $("layout-panel").classList.add("flash");
  } else if (plan.epoch !== null) {
    $("layout-note").textContent = `epoch ${plan.epoch} · ${plan.model}`;
  }
  if (plan.mode) $("layout-note").title = `${plan.mode}: ${plan.mode_reason}`;
  shownPlan = key;
  shownEpoch = plan.epoch;
  document.body.dataset.planEpoch = plan.epoch ?? "";
  $("predicted").replaceChildren(plan.plan ? predictedView(plan) : "");
  renderLayout($("layout"), plan);
}

async function poll() {
  const [cluster, plan, models] = await Promise.allSettled([getJson("/v1/cluster"),
    getJson("/v1/plan").then(normalizePlan), getJson("/v1/models")]);
  const problems = [];
  for (const [path, result] of [["/v1/cluster", cluster], ["/v1/plan", plan]]) {
    if (result.status === "rejected") {
      problems.push({ level: "error", text: `${path}: ${result.reason.message}` });
    }
  }
  document.body.classList.toggle("stale", problems.length > 0);
  if (cluster.status === "fulfilled") {
    const view = cluster.value;
    claimColors(view.nodes.map((n) => n.node_id));
    header(view);
    if (view.state === "failed") {
      problems.push({ level: "error", text: `cluster failed: ${view.state_reason || "no reason given"}` });
    } else if (view.state !== "ready") {
      problems.push({ level: "warning", text: `cluster ${view.state}` +
        (view.state_reason ? `: ${view.state_reason}` : "") + " — chat waits until it is ready" });
    }
    renderGraph($("topology-graph"), view);
    renderNodes($("nodes"), view, plan.status === "fulfilled" ? plan.value : null);
    $("topology-note").textContent = topologyNote(view);
    renderBalance($("balance"), $("balance-note"), view.balance);
    renderGroups($("groups"), $("groups-note"), view);
  }
  // the chat offers images for a model that takes them (a failed poll keeps what it knew)
  if (models.status === "fulfilled") chat.setModels(models.value.data);
  if (plan.status === "fulfilled") {
    chat.setModel(plan.value.model);
    drawPlan(plan.value);
  }
  banner(problems);
  await picker.refresh();
  try {
    await refreshFinetune($("finetune-panel"), $("finetune"));
  } catch {
    // the panel keeps its last drawing; the banner reports a node that stopped answering
  }
}

async function loop() {
  try {
    await poll();
  } finally {
    setTimeout(loop, POLL_MS);
  }
}

installTooltip($("tooltip"));
installKeyDialog();
loop();
