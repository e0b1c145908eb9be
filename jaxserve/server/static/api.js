// The server's API as the page uses it: the API key (kept in sessionStorage, sent as a Bearer
// header on every /v1 call) and fetch helpers that turn error bodies into Error messages.
"use strict";

const Api = (() => {
  const KEY = "jaxserve.apiKey";
  let onAuthNeeded = () => {};

  function key() { return sessionStorage.getItem(KEY) || ""; }
  function setKey(value) {
    if (value) sessionStorage.setItem(KEY, value); else sessionStorage.removeItem(KEY);
  }
  function headers(extra) {
    const h = Object.assign({}, extra || {});
    if (key()) h.Authorization = "Bearer " + key();
    return h;
  }

  class ApiError extends Error {
    constructor(status, message) { super(message); this.status = status; }
  }

  // `sent`: the key the request carried; a refusal of an older key (a request still in flight
  // when the user typed a new one) does not ask again.
  async function check(response, sent) {
    if (response.ok) return response;
    let message = response.status + " " + response.statusText;
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) message = body.error.message;
    } catch (_) { /* not JSON: keep the status line */ }
    if (response.status === 401 && sent === key()) onAuthNeeded(message);
    throw new ApiError(response.status, message);
  }

  async function getJson(path, signal) {
    const sent = key();
    const r = await fetch(path, { headers: headers(), signal, cache: "no-store" });
    return (await check(r, sent)).json();
  }

  // POSTs `body` and calls onEvent(obj) for each server-sent event until [DONE].
  async function stream(path, body, onEvent, signal) {
    const sent = key();
    const r = await check(await fetch(path, {
      method: "POST", signal, body: JSON.stringify(body),
      headers: headers({ "Content-Type": "application/json" }),
    }), sent);
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") return;
          const obj = JSON.parse(data);
          if (obj.error) throw new ApiError(500, obj.error.message || "stream error");
          onEvent(obj);
        }
      }
    }
  }

  // The served model's name: requests must name it (fetched once, again after a failure).
  let model = null;
  async function modelInfo() {
    if (model === null) model = (await getJson("/v1/models")).data[0];
    return model;
  }

  // Everything a request's `model` may name: the base model first, then the LoRA adapters
  // (they have a `parent`); fetched each time, since adapters come and go.
  async function models() { return (await getJson("/v1/models")).data; }

  return { key, setKey, getJson, stream, modelInfo, models, ApiError,
           set onAuthNeeded(fn) { onAuthNeeded = fn; } };
})();
