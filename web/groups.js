// Every group the cluster serves (/v1/cluster's `groups`, issue #59): the main model, the other
// models resident beside it and the replicas, each over its nodes, with its load, pinning, idle
// time and keep-alive (the leader's, which every node's status carries).

import { deviceColor } from "./colors.js";
import { h } from "./dom.js";
import { duration, plural } from "./format.js";

// each node once, in the order of its first rank
const nodesOf = (ranks) => [...new Set(ranks)];

function nameCell(group) {
  return h("td", { dataset: { field: "model" }, title: group.key },
    group.model, group.replica > 0 ? h("span", { class: "muted" }, ` replica ${group.replica}`) : "");
}

function nodesCell(group) {
  const nodes = nodesOf(group.ranks);
  const names = nodes.map((node, i) => [i ? ", " : "", h("span", { class: "name",
    dataset: { node }, style: { "--device": deviceColor(node) } }, node)]);
  return h("td", { dataset: { field: "nodes" } }, names,
    h("span", { class: "muted" }, ` · ${plural(group.ranks.length, "rank")}`));
}

function loadText(group) {
  const { in_flight: running, waiting, idle_seconds: idle } = group;
  if (running || waiting) return `${running} running` + (waiting ? `, ${waiting} waiting` : "");
  return typeof idle === "number" ? `idle ${duration(idle)}` : "idle";
}

function expiresText(group) {
  if (typeof group.expires_in !== "number") return "stays loaded";
  return group.expires_in > 0 ? `unloads in ${duration(group.expires_in)}` : "unloads now";
}

function row(group) {
  return h("tr", { dataset: { group: group.group, model: group.model, key: group.key,
    replica: group.replica, state: group.state, pinned: group.pinned,
    nodes: nodesOf(group.ranks).join(","), ranks: group.ranks.length } },
    nameCell(group),
    h("td", {}, h("span", { class: "state", dataset: { state: group.state, field: "state" } },
      group.state)),
    nodesCell(group),
    h("td", { dataset: { field: "pinned" } }, group.pinned ? "pinned" : "on demand"),
    h("td", { dataset: { field: "load" } }, loadText(group)),
    h("td", { dataset: { field: "expires" } }, expiresText(group)));
}

// `view`: /v1/cluster's answer
export function renderGroups(container, note, view) {
  const list = view.groups || [];
  const models = new Set(list.map((g) => g.key)).size;
  note.textContent = list.length === 0 ? ""
    : `${plural(models, "model")} in ${plural(list.length, "group")}`;
  if (list.length === 0) {
    container.replaceChildren(h("div", { class: "muted" }, "no model loaded"));
    return;
  }
  const head = ["model", "state", "nodes", "pinned", "load", "keep-alive"];
  container.replaceChildren(h("table", {},
    h("thead", {}, h("tr", {}, ...head.map((c) => h("th", {}, c)))),
    h("tbody", {}, ...list.map(row))));
}
