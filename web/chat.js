// The chat panel: streams an answer token by token and shows the generation speed live; shows
// the tool calls an answer makes and, when asked, each token's log-probability on hover; takes
// images for a model that reads them (attach.js), kept in the history sent with later turns.

import { ApiError, streamChat } from "./api.js";
import { Attachments, takesImages, thumbnails, userContent } from "./attach.js";
import { h } from "./dom.js";
import { count, percent, seconds } from "./format.js";

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
    this.models = [];
    const { form, input, model, clear } = elements;
    this.attachments = new Attachments({ button: elements.attach, file: elements.file,
      strip: elements.attachments, note: elements.note, input });
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
    model.addEventListener("input", () => {
      this.modelEdited = true;
      this.attachments.setVision(takesImages(this.models, model.value.trim()));
    });
    clear.addEventListener("click", () => this.clear());
  }

  // The served model fills the model field until the user edits it.
  setModel(name) {
    if (name && !this.modelEdited && this.el.model.value !== name) this.el.model.value = name;
    this.attachments.setVision(takesImages(this.models, this.el.model.value.trim()));
  }

  // /v1/models' entries: whether the chat's model takes images.
  setModels(models) {
    this.models = models;
    this.attachments.setVision(takesImages(models, this.el.model.value.trim()));
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
    if (this.el.logprobs.checked) {
      body.logprobs = true;
      body.top_logprobs = TOP_LOGPROBS;
    }
    const tools = this.el.tools.value.trim();
    if (tools) {
      try {
        body.tools = JSON.parse(tools);
      } catch (error) {
        throw new ApiError(`the tools are not valid JSON: ${error.message}`);
      }
    }
    return body;
  }

  bubble(role, text, images = []) {
    this.el.messages.querySelector(".empty")?.remove();
    const content = h("div", { class: "content" }, text);
    const calls = h("div", { class: "tool-calls" });
    const shown = images.length ? h("div", { class: "images" }, thumbnails(images)) : null;
    const element = h("div", { class: `message ${role}`, dataset: { role } }, shown, content,
      calls);
    this.el.messages.append(element);
    return { element, content, calls };
  }

  stats(parts, tps) {
    this.el.stats.dataset.tps = tps ?? "";
    this.el.stats.replaceChildren(...parts.filter(Boolean).map((part) =>
      h("span", { class: part.endsWith("tok/s") ? "tps" : null }, part)));
  }

  // The turn to send (the history, then the typed text and attached images) and its request;
  // null when there is nothing to send or the settings are wrong (the error is shown).
  async compose() {
    if (this.composing) return null; // a second Enter while an image is still being read
    this.composing = true;
    try {
      await this.attachments.ready(); // a pasted or picked image still being read goes too
    } finally {
      this.composing = false;
    }
    const text = this.el.input.value.trim();
    const images = this.attachments.urls;
    if (!text && images.length === 0) return null;
    this.showError(null);
    const messages = [...this.history, { role: "user", content: userContent(text, images) }];
    try {
      return { text, images, messages, body: this.body(messages) };
    } catch (error) {
      this.showError(error);
      return null;
    }
  }

  async send() {
    const composed = await this.compose();
    if (!composed) return;
    const { text, images, messages, body } = composed;
    this.el.input.value = "";
    this.attachments.take();
    this.bubble("user", text, images);
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
    const calls = new ToolCalls(answer.calls);
    const scores = new TokenScores(answer.content);
    this.stats(["waiting for the first token…"]);
    try {
      for await (const chunk of streamChat(body, this.controller.signal)) {
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          if (choice.finish_reason) finish = choice.finish_reason;
          scores.add(choice.logprobs?.content);
          const called = calls.add(choice.delta?.tool_calls);
          if (called) scores.drop(); // those tokens spelled the tool call
          const delta = choice.delta?.content;
          if (!delta && !called) continue;
          const now = performance.now();
          firstAt ??= now;
          tokens += 1;
          if (delta) {
            reply += delta;
            scores.text(delta);
          }
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
      this.history = [...messages, calls.message(reply)];
    } catch (error) {
      if (error.name === "AbortError") {
        answer.element.dataset.state = "stopped";
        this.history = [...messages, calls.message(reply)];
        this.stats([`stopped after ${count(tokens)} tokens`]);
      } else {
        answer.element.dataset.state = "error";
        if (!reply) {
          answer.content.textContent = "(no answer)";
          this.el.input.value ||= text; // nothing came back: let the user retry as is
          this.attachments.restore(images);
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

const TOP_LOGPROBS = 5;

// One span per streamed piece of text; with log-probabilities, its tokens' scores and the
// likeliest alternatives show on hover (the page's shared tooltip reads data-tip).
class TokenScores {
  constructor(content) {
    this.content = content;
    this.pending = [];
  }

  add(entries) {
    if (entries) this.pending.push(...entries);
  }

  drop() {
    this.pending = [];
  }

  text(piece) {
    const scored = this.pending;
    this.pending = [];
    if (scored.length === 0) {
      this.content.append(piece);
      return;
    }
    const tip = scored.map((entry) => {
      const alternatives = (entry.top_logprobs || []).map((alt) =>
        `  ${JSON.stringify(alt.token)}  ${alt.logprob.toFixed(3)}`);
      return [`${JSON.stringify(entry.token)}  logprob ${entry.logprob.toFixed(3)} ` +
        `(p ${percent(Math.exp(entry.logprob))})`, ...alternatives].join("\n");
    }).join("\n\n");
    this.content.append(h("span", { class: "token", tabindex: 0, "data-tip": tip,
      dataset: { logprob: scored[0].logprob.toFixed(4) } }, piece));
  }
}

// Tool calls as they stream in (by index: name and id first, arguments in pieces), each shown
// as a call card; the assistant turn keeps them for the next request.
class ToolCalls {
  constructor(element) {
    this.element = element;
    this.calls = [];
  }

  add(deltas) {
    if (!deltas || deltas.length === 0) return false;
    for (const delta of deltas) {
      const index = delta.index ?? this.calls.length;
      const call = this.calls[index] ??= { id: "", type: "function",
        function: { name: "", arguments: "" } };
      if (delta.id) call.id = delta.id;
      if (delta.function?.name) call.function.name += delta.function.name;
      if (delta.function?.arguments) call.function.arguments += delta.function.arguments;
    }
    this.render();
    return true;
  }

  render() {
    this.element.replaceChildren(...this.calls.map((call) => {
      let args = call.function.arguments;
      try {
        args = JSON.stringify(JSON.parse(args), null, 2);
      } catch {
        // still streaming (or not JSON): show it as it came
      }
      return h("div", { class: "tool-call", dataset: { name: call.function.name, id: call.id } },
        h("div", { class: "tool-name" }, "tool call ", h("b", {}, call.function.name)),
        h("pre", { class: "tool-args" }, args));
    }));
  }

  message(content) {
    const message = { role: "assistant", content };
    if (this.calls.length) message.tool_calls = this.calls;
    return message;
  }
}
