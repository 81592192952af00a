// The latest fine-tuning job (OpenAI's fine-tuning API): its state, progress and loss curve.

import { getJson } from "./api.js";
import { h, s } from "./dom.js";

const WIDTH = 320;
const HEIGHT = 90;

// A polyline of (step, loss) points scaled into the box; NaN losses are left out.
function curve(points, lo, hi, last, cls) {
  const good = points.filter(([, loss]) => Number.isFinite(loss));
  if (good.length === 0) return null;
  const x = (step) => (last > 1 ? ((step - 1) / (last - 1)) : 0) * (WIDTH - 8) + 4;
  const y = (loss) => HEIGHT - 4 - (hi > lo ? (loss - lo) / (hi - lo) : 0.5) * (HEIGHT - 8);
  return s("polyline", {
    class: cls,
    fill: "none",
    points: good.map(([step, loss]) => `${x(step).toFixed(1)},${y(loss).toFixed(1)}`).join(" "),
  });
}

export function lossChart(events, total) {
  const metrics = events.filter((e) => e.type === "metrics" && e.data).map((e) => e.data);
  const train = metrics.filter((m) => m.train_loss != null).map((m) => [m.step, m.train_loss]);
  const valid = metrics.filter((m) => m.valid_loss != null).map((m) => [m.step, m.valid_loss]);
  const losses = [...train, ...valid].map(([, loss]) => loss).filter(Number.isFinite);
  if (losses.length === 0) return h("div", { class: "muted" }, "no loss reported yet");
  const lo = Math.min(...losses);
  const hi = Math.max(...losses);
  const last = Math.max(total, ...train.map(([step]) => step));
  return h("div", { class: "loss-chart" },
    s("svg", { viewBox: `0 0 ${WIDTH} ${HEIGHT}`, width: WIDTH, height: HEIGHT, role: "img",
      "aria-label": "training and validation loss" },
      curve(train, lo, hi, last, "train-loss"), curve(valid, lo, hi, last, "valid-loss")),
    h("div", { class: "muted small" },
      train.length ? `training loss ${train[0][1].toFixed(3)} at step ${train[0][0]}, ` +
        `${train[train.length - 1][1].toFixed(3)} at step ${train[train.length - 1][0]} · ` : "",
      "train (solid), validation (dashed)"));
}

// Redraws the panel with the newest job; hidden while the cluster has never fine-tuned.
export async function refreshFinetune(panel, body) {
  const jobs = await getJson("/v1/fine_tuning/jobs?limit=1");
  const job = jobs.data[0];
  panel.hidden = !job;
  if (!job) return;
  const events = await getJson(`/v1/fine_tuning/jobs/${encodeURIComponent(job.id)}/events?limit=100`);
  const progress = job.progress || {};
  body.replaceChildren(
    h("div", { dataset: { field: "job" } },
      h("b", {}, job.id), ` · ${job.model} · `,
      h("span", { dataset: { field: "status" } }, job.status),
      ` · step ${progress.step ?? 0} of ${progress.total_steps ?? job.iterations}`,
      job.nodes && job.nodes.length ? ` · nodes ${job.nodes.join(", ")}` : "",
      job.fine_tuned_model ? h("div", {}, "model ", h("code", {}, job.fine_tuned_model)) : "",
      job.error ? h("div", { class: "error" }, job.error.message) : ""),
    lossChart([...events.data].reverse(), progress.total_steps ?? job.iterations));
}
