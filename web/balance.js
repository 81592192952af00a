// The leader's live balance (/v1/cluster's `balance`): each rank's measured compute speed (a
// solo forward of its shard, collectives left out), the share of the shard bytes it holds, the
// share a balanced split would give it (its speed over the sum), the imbalance against the
// re-plan threshold, and the re-plans the live speeds triggered.

import { deviceColor } from "./colors.js";
import { h } from "./dom.js";
import { NOT_MEASURED, percent, rate } from "./format.js";

function stateLine(balance) {
  if (!balance.enabled) return "rebalancing off (--rebalance off): speeds shown, shares kept";
  const imbalance = balance.imbalance === null ? NOT_MEASURED : percent(balance.imbalance);
  const over = balance.over_threshold_seconds === null ? ""
    : ` · over the threshold for ${balance.over_threshold_seconds.toFixed(0)} s`;
  const state = balance.state === "draining"
    ? " · re-planning once the requests in flight finish" : "";
  const skipped = balance.skipped ? ` · last re-plan skipped: ${balance.skipped}` : "";
  return `imbalance ${imbalance} (re-plans over ${percent(balance.threshold)})${over}${state}${skipped}`;
}

function rankRows(balance) {
  const speeds = balance.ranks.map((r) => r.speed_bytes_per_second);
  const measured = speeds.every((s) => typeof s === "number" && s > 0);
  const total = measured ? speeds.reduce((a, b) => a + b, 0) : null;
  return balance.ranks.map((r) => {
    const balanced = total ? r.speed_bytes_per_second / total : null;
    return h("tr", { dataset: { rank: r.rank, node: r.node_id, share: r.share ?? "",
      speed: r.speed_bytes_per_second ?? "", balanced: balanced ?? "" } },
      h("td", {}, `${r.rank}`),
      h("td", { class: "name", style: { "--device": deviceColor(r.node_id) } }, r.node_id),
      h("td", { dataset: { field: "share" } }, r.share === null ? NOT_MEASURED : percent(r.share)),
      h("td", { dataset: { field: "balanced" } }, balanced === null ? "–" : percent(balanced)),
      h("td", { dataset: { field: "speed" },
        title: `latest sample ${rate(r.latest_bytes_per_second)} (${r.samples} samples)` },
        rate(r.speed_bytes_per_second)),
      h("td", {}, r.work_factor ? `×${r.work_factor}` : ""));
  });
}

function history(balance) {
  return balance.rebalances.slice().reverse().map((r) => h("li", {
    dataset: { fromEpoch: r.from_epoch } },
    `${new Date(r.at * 1000).toLocaleTimeString()}: epoch ${r.from_epoch} re-planned at ` +
    `${percent(r.imbalance)} imbalance, after ${r.drained_seconds.toFixed(1)} s draining`));
}

export function renderBalance(container, note, balance) {
  if (!balance) {
    note.textContent = "no leader status yet";
    container.replaceChildren();
    return;
  }
  note.textContent = stateLine(balance);
  const head = ["rank", "node", "share held", "balanced share", "live speed", "lab factor"];
  container.replaceChildren(
    balance.ranks.length === 0 ? h("div", { class: "muted" }, "no ranks serving")
      : h("table", {}, h("thead", {}, h("tr", {}, ...head.map((c) => h("th", {}, c)))),
        h("tbody", {}, ...rankRows(balance))),
    balance.rebalances.length ? h("ul", { class: "rebalances" }, ...history(balance)) : "");
}
