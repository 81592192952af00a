// The model picker: every model the cluster can serve (prepared, hub cache, folders, hub ids
// being downloaded), whether it fits the cluster's memory and the planner's predicted speed.
// "Load" does what a request naming the model does; a typed hub id is downloaded first, with
// its progress shown from the catalog's downloads.

import { getJson, postJson } from "./api.js";
import { h } from "./dom.js";
import { bytes } from "./format.js";

export class ModelPicker {
  constructor({ table, form, input, note }) {
    Object.assign(this, { table, form, input, note });
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      const name = input.value.trim();
      if (name) this.load(name);
    });
  }

  async load(name) {
    this.note.textContent = `asking the cluster to load ${name}…`;
    this.note.dataset.level = "info";
    try {
      const answer = await postJson("/v1/models/load", { model: name });
      this.note.textContent = `${answer.model}: ${answer.state}`;
    } catch (error) {
      this.note.textContent = error.message;
      this.note.dataset.level = "error";
    }
    await this.refresh();
  }

  async refresh() {
    let catalog;
    try {
      catalog = await getJson("/v1/models/catalog");
    } catch (error) {
      this.table.replaceChildren(h("div", { class: "muted" }, error.message));
      return;
    }
    const rows = catalog.models.map((m) => h("tr", { dataset: { model: m.name } },
      h("td", { class: "name" }, m.name, m.loaded ? h("span", { class: "tag" }, "serving") : ""),
      h("td", {}, m.source),
      h("td", {}, m.size ? bytes(m.size) : "?"),
      h("td", {}, m.format),
      h("td", { dataset: { field: "fits" } }, m.fits === null ? "?" : m.fits ? "fits" : "too big"),
      h("td", { dataset: { field: "speed" } },
        m.predicted_tokens_per_s ? `${m.predicted_tokens_per_s.toFixed(1)} tok/s` : "–"),
      h("td", {}, m.loaded ? "" : h("button", {
        type: "button", disabled: m.fits === false, onclick: () => this.load(m.name) }, "Load"))));
    const downloads = catalog.downloads.map((d) => h("div", {
      class: "download", dataset: { model: d.model, state: d.state } },
      h("span", {}, `${d.model}: ${d.state}`),
      h("progress", { max: d.total || 1, value: d.done }),
      h("span", {}, `${bytes(d.done)} of ${bytes(d.total)}`),
      d.error ? h("span", { class: "error" }, d.error) : ""));
    this.table.replaceChildren(
      h("table", {}, h("thead", {}, h("tr", {}, ...["model", "source", "size", "format",
        "memory", "predicted", ""].map((c) => h("th", {}, c)))), h("tbody", {}, ...rows)),
      ...downloads);
  }
}
