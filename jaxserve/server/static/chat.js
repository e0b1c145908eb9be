// The playground: a conversation streamed from /v1/chat/completions with the sampling
// settings of the side panel, and per-message TTFT, tokens/s and token counts.
"use strict";

const Chat = (() => {
  const $ = (id) => document.getElementById(id);
  const history = [];  // {role, content} of the conversation so far (choice 0 of each reply)
  let controller = null;

  function numberField(id, parse) {
    const raw = $(id).value.trim();
    if (raw === "") return undefined;
    const v = parse(raw);
    if (!Number.isFinite(v)) throw new Error(`${id} must be a number`);
    return v;
  }

  function parseJsonField(id, what) {
    const raw = $(id).value.trim();
    if (!raw) return undefined;
    try { return JSON.parse(raw); } catch (e) { throw new Error(`${what} is not valid JSON: ${e.message}`); }
  }

  // The request body from the settings panel (throws an Error a user can act on).
  function requestBody(messages) {
    const body = { messages, stream: true, stream_options: { include_usage: true } };
    const fields = { temperature: parseFloat, top_p: parseFloat, top_k: (s) => parseInt(s, 10),
                     max_tokens: (s) => parseInt(s, 10), seed: (s) => parseInt(s, 10), n: (s) => parseInt(s, 10) };
    for (const [id, parse] of Object.entries(fields)) {
      const v = numberField(id, parse);
      if (v !== undefined) body[id] = v;
    }
    const stop = $("stop").value.split("\n").filter((s) => s.length > 0);
    if (stop.length) body.stop = stop;
    const format = $("format").value;
    if (format === "json_object") body.response_format = { type: "json_object" };
    if (format === "json_schema") {
      const schema = parseJsonField("schema", "The JSON schema");
      if (!schema) throw new Error("Write a JSON schema, or choose another response format");
      body.response_format = { type: "json_schema", json_schema: { name: "output", schema } };
    }
    const tools = parseJsonField("tools", "The tools list");
    if (tools !== undefined) body.tools = tools;
    return body;
  }

  function addMessage(role, text) {
    const li = document.createElement("li");
    li.className = "msg " + role;
    li.innerHTML = '<div class="role"></div>';
    li.querySelector(".role").textContent = role;
    if (text !== undefined) {
      const p = document.createElement("div");
      p.className = "text"; p.textContent = text; li.appendChild(p);
    }
    $("messages").appendChild(li);
    li.scrollIntoView({ block: "end" });
    return li;
  }

  // One reply: a block per choice, filled as deltas arrive; counts its DOM updates.
  class Reply {
    constructor(n) {
      this.li = addMessage("assistant");
      this.li.dataset.updates = "0";
      this.choices = [];
      for (let i = 0; i < n; i++) {
        const div = document.createElement("div");
        div.className = "choice";
        if (n > 1) div.innerHTML = `<div class="choice-label">choice ${i}</div>`;
        const text = document.createElement("div");
        text.className = "text";
        div.appendChild(text);
        this.li.appendChild(div);
        this.choices.push({ div, text, content: "", calls: [], tokens: 0 });
      }
      this.stats = document.createElement("div");
      this.stats.className = "stats";
      this.li.appendChild(this.stats);
    }

    delta(index, delta) {
      const c = this.choices[index];
      if (!c) return;
      if (delta.content) { c.content += delta.content; c.text.textContent = c.content; }
      for (const call of delta.tool_calls || []) {
        const at = call.index || 0;
        c.calls[at] = c.calls[at] || { name: "", arguments: "" };
        if (call.function && call.function.name) c.calls[at].name += call.function.name;
        if (call.function && call.function.arguments) c.calls[at].arguments += call.function.arguments;
        this.showCalls(c);
      }
      this.li.dataset.updates = String(Number(this.li.dataset.updates) + 1);
      this.li.scrollIntoView({ block: "end" });
    }

    showCalls(c) {
      let pre = c.div.querySelector(".tool-calls");
      if (!pre) { pre = document.createElement("div"); pre.className = "tool-calls"; c.div.appendChild(pre); }
      pre.textContent = c.calls.map((k) => `tool call: ${k.name}(${k.arguments})`).join("\n");
    }
  }

  function statsText(t0, tFirst, tLast, usage) {
    const parts = [];
    if (tFirst !== null) parts.push(`TTFT ${Math.round(tFirst - t0)} ms`);
    const tokens = usage ? usage.completion_tokens : null;
    if (tokens !== null && tokens > 1 && tLast > tFirst) {
      parts.push(`${((tokens - 1) / ((tLast - tFirst) / 1000)).toFixed(1)} tok/s`);
    }
    if (usage) parts.push(`${usage.completion_tokens} tokens (prompt ${usage.prompt_tokens})`);
    return parts.join(" · ");
  }

  async function send(text) {
    let body;
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...history, { role: "user", content: text });
    try { body = requestBody(messages); } catch (e) { addMessage("error", e.message); return; }
    history.push({ role: "user", content: text });
    addMessage("user", text);
    const reply = new Reply(body.n || 1);
    const t0 = performance.now();
    let tFirst = null, tLast = null, usage = null, finish = "";
    controller = new AbortController();
    setBusy(true);
    try {
      body.model = $("model").value || (await Api.modelInfo()).id;
      await Api.stream("/v1/chat/completions", body, (chunk) => {
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          if (tFirst === null) tFirst = performance.now();
          tLast = performance.now();
          reply.delta(choice.index, choice.delta || {});
          if (choice.finish_reason) finish = choice.finish_reason;
        }
        reply.stats.textContent = statsText(t0, tFirst, tLast, usage);
      }, controller.signal);
      reply.stats.textContent = statsText(t0, tFirst, tLast, usage) + (finish ? ` · ${finish}` : "");
      reply.li.dataset.done = "true";
    } catch (e) {
      reply.li.dataset.done = "true";
      const aborted = e.name === "AbortError";
      reply.stats.textContent = aborted ? "stopped" : "";
      if (!aborted) { reply.li.classList.add("error"); reply.stats.textContent = "Error: " + e.message; }
    } finally {
      controller = null;
      setBusy(false);
    }
    const first = reply.choices[0];
    if (first.content || !reply.li.classList.contains("error")) history.push({ role: "assistant", content: first.content });
  }

  function setBusy(busy) { $("send").disabled = busy; $("stop-gen").disabled = !busy; }

  function init() {
    $("composer").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const text = $("prompt").value.trim();
      if (!text || controller) return;
      $("prompt").value = "";
      send(text);
    });
    $("prompt").addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("composer").requestSubmit(); }
    });
    $("stop-gen").addEventListener("click", () => controller && controller.abort());
    $("clear").addEventListener("click", () => { history.length = 0; $("messages").replaceChildren(); });
    $("format").addEventListener("change", () => { $("schema").hidden = $("format").value !== "json_schema"; });
  }

  return { init };
})();
