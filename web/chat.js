// The chat panel: streams an answer token by token and shows the generation speed live.

import { ApiError, streamChat } from "./api.js";
import { h } from "./dom.js";
import { count, seconds } from "./format.js";

// Decode speed: tokens after the first over the time since the first (prefill excluded).
function decodeRate(tokens, firstAt, now) {
  return tokens > 1 && now > firstAt ? (tokens - 1) / ((now - firstAt) / 1000) : null;
}

export class Chat {
  constructor(elements) {
    this.el = elements;
    this.history = [];
    this.controller = null;
    this.modelEdited = false;
    const { form, input, model, clear } = elements;
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      if (this.controller) this.controller.abort();
      else this.send();
    });
    input.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        form.requestSubmit();
      }
    });
    model.addEventListener("input", () => { this.modelEdited = true; });
    clear.addEventListener("click", () => this.clear());
  }

  // The served model fills the model field until the user edits it.
  setModel(name) {
    if (name && !this.modelEdited && this.el.model.value !== name) this.el.model.value = name;
  }

  clear() {
    if (this.controller) this.controller.abort();
    this.history = [];
    this.el.messages.replaceChildren();
    this.el.stats.replaceChildren();
    this.showError(null);
  }

  showError(error) {
    const box = this.el.error;
    if (!error) {
      box.hidden = true;
      box.replaceChildren();
      return;
    }
    const detail = [error.status ? `HTTP ${error.status}` : null, error.code].filter(Boolean);
    box.replaceChildren(h("b", {}, "Error"), detail.length ? ` (${detail.join(", ")})` : "", ": ",
      h("span", { class: "error-message" }, error.message));
    box.hidden = false;
  }

  body(messages) {
    const body = { model: this.el.model.value.trim(), messages };
    const number = (input) => (input.value.trim() === "" ? null : Number(input.value));
    const maxTokens = number(this.el.maxTokens);
    const temperature = number(this.el.temperature);
    if (maxTokens !== null) body.max_tokens = maxTokens;
    if (temperature !== null) body.temperature = temperature;
    return body;
  }

  bubble(role, text) {
    this.el.messages.querySelector(".empty")?.remove();
    const content = h("div", { class: "content" }, text);
    const element = h("div", { class: `message ${role}`, dataset: { role } }, content);
    this.el.messages.append(element);
    return { element, content };
  }

  stats(parts, tps) {
    this.el.stats.dataset.tps = tps ?? "";
    this.el.stats.replaceChildren(...parts.filter(Boolean).map((part) =>
      h("span", { class: part.endsWith("tok/s") ? "tps" : null }, part)));
  }

  async send() {
    const text = this.el.input.value.trim();
    if (!text) return;
    this.showError(null);
    this.el.input.value = "";
    const messages = [...this.history, { role: "user", content: text }];
    this.bubble("user", text);
    const answer = this.bubble("assistant", "");
    answer.element.dataset.state = "waiting";
    this.controller = new AbortController();
    this.el.send.textContent = "Stop";
    this.el.send.classList.add("stop");
    const started = performance.now();
    let firstAt = null;
    let tokens = 0;
    let usage = null;
    let finish = null;
    let reply = "";
    this.stats(["waiting for the first token…"]);
    try {
      for await (const chunk of streamChat(this.body(messages), this.controller.signal)) {
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          if (choice.finish_reason) finish = choice.finish_reason;
          const delta = choice.delta?.content;
          if (!delta) continue;
          const now = performance.now();
          firstAt ??= now;
          tokens += 1;
          reply += delta;
          answer.content.textContent = reply;
          answer.element.dataset.state = "streaming";
          const tps = decodeRate(tokens, firstAt, now);
          this.stats([`${count(tokens)} tokens`, tps ? `${tps.toFixed(1)} tok/s` : "… tok/s",
            `first token ${seconds((firstAt - started) / 1000)}`], tps);
          this.el.messages.scrollTop = this.el.messages.scrollHeight;
        }
      }
      const end = performance.now();
      const generated = usage?.completion_tokens ?? tokens;
      const tps = firstAt === null ? null : decodeRate(generated, firstAt, end);
      this.stats([`${count(generated)} tokens`, tps ? `${tps.toFixed(1)} tok/s` : null,
        firstAt === null ? null : `first token ${seconds((firstAt - started) / 1000)}`,
        usage ? `prompt ${count(usage.prompt_tokens)}` : null, finish ? `finish: ${finish}` : null],
      tps);
      answer.element.dataset.state = "done";
      this.history = [...messages, { role: "assistant", content: reply }];
    } catch (error) {
      if (error.name === "AbortError") {
        answer.element.dataset.state = "stopped";
        this.history = [...messages, { role: "assistant", content: reply }];
        this.stats([`stopped after ${count(tokens)} tokens`]);
      } else {
        answer.element.dataset.state = "error";
        if (!reply) {
          answer.content.textContent = "(no answer)";
          this.el.input.value ||= text; // nothing came back: let the user retry as is
        }
        this.stats([]);
        this.showError(error instanceof ApiError ? error : new ApiError(String(error)));
      }
    } finally {
      this.controller = null;
      this.el.send.textContent = "Send";
      this.el.send.classList.remove("stop");
    }
  }
}
