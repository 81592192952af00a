// The node's own HTTP API: JSON views and the OpenAI-style streaming chat endpoint.
// Every failure becomes an ApiError whose message is what the page shows. Every call carries
// the API key kept in this browser; a 401 asks the user for one, then the call is retried.

import { authHeaders, keyRejected, storedKey } from "./key.js";

export class ApiError extends Error {
  constructor(message, { status = 0, code = null, type = null } = {}) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.code = code;
    this.type = type;
  }
}

async function errorFromResponse(response) {
  const text = await response.text();
  try {
    const error = JSON.parse(text).error;
    if (error && error.message) {
      return new ApiError(error.message, { status: response.status, code: error.code, type: error.type });
    }
  } catch {
    // not JSON: fall through to the raw text
  }
  return new ApiError(`HTTP ${response.status} ${response.statusText}: ${text.slice(0, 200)}`,
    { status: response.status });
}

const VIEW_TIMEOUT_MS = 5000;

// makeInit() gives fetch's options afresh for each try (a timeout starts with its try).
async function request(path, makeInit) {
  for (;;) {
    const key = storedKey();
    const init = makeInit();
    let response;
    try {
      response = await fetch(path, {
        cache: "no-store", ...init, headers: { ...init.headers, ...authHeaders(key) } });
    } catch (error) {
      if (error.name === "AbortError") throw error;
      const why = error.name === "TimeoutError" ? `no answer within ${VIEW_TIMEOUT_MS / 1000} s`
        : error.message;
      throw new ApiError(`cannot reach this node (${why})`);
    }
    if (response.status === 401) {
      const error = await errorFromResponse(response);
      if (await keyRejected(key, error.message)) continue;
      throw error;
    }
    if (!response.ok) throw await errorFromResponse(response);
    return response;
  }
}

// A hung node must not hang the page: views give up after a few seconds.
export async function getJson(path) {
  return (await request(path, () => ({ signal: AbortSignal.timeout(VIEW_TIMEOUT_MS) }))).json();
}

// Server-sent events of a streamed chat completion: yields each parsed JSON payload until
// [DONE]; an error event (a failure after the stream started) is thrown as an ApiError.
export async function* streamChat(body, signal) {
  const response = await request("/v1/chat/completions", () => ({
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    signal,
  }));
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let boundary;
    while ((boundary = /\r?\n\r?\n/.exec(buffer))) {
      const event = buffer.slice(0, boundary.index);
      buffer = buffer.slice(boundary.index + boundary[0].length);
      const data = event.split(/\r?\n/).filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trimStart()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      const payload = JSON.parse(data);
      if (payload.error) {
        throw new ApiError(payload.error.message || "generation failed",
          { status: response.status, code: payload.error.code, type: payload.error.type });
      }
      yield payload;
    }
  }
  throw new ApiError("the stream ended before the answer was complete");
}

// A JSON POST (loading a model, starting a download); errors as ApiError like the views.
export async function postJson(path, body) {
  return (await request(path, () => ({
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
    signal: AbortSignal.timeout(VIEW_TIMEOUT_MS),
  }))).json();
}
