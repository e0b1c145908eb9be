// The engine view: polls /v1/engine/state a few times a second and draws the batch slots, the
// KV block map (one cell per block), the waiting queue, summary counters and time series.
"use strict";

const Engine = (() => {
  const $ = (id) => document.getElementById(id);
  // Polling period: 250 ms, or ?poll_ms=N (50..5000) for a closer (or lighter) look.
  const asked = Number(new URLSearchParams(location.search).get("poll_ms"));
  const POLL_MS = asked >= 50 && asked <= 5000 ? asked : 250;
  const COLORS = { null: "#9aa0a6", free: "#eceef1", evictable: "#b9e3c6", cachedEdge: "#1e8e3e" };
  let prev = null, timer = null, hoverBlock = -1, lastSnap = null;
  const charts = {};

  // A colour per request, from a palette of distinct hues in order of first sight (so requests
  // running together differ); the same id keeps its colour in the table and on the map.
  const PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
                   "#ff9da7", "#9c755f", "#3b8bc2", "#d37295", "#8cd17d"];
  const colorIndex = new Map();
  function colorOf(id) {
    if (!colorIndex.has(id)) {
      colorIndex.set(id, colorIndex.size % PALETTE.length);
      if (colorIndex.size > 4096) colorIndex.delete(colorIndex.keys().next().value);
    }
    return PALETTE[colorIndex.get(id)];
  }

  // "chatcmpl-3f2a…9e-1" style ids shortened to their start and the choice suffix.
  function shortId(id) {
    const m = /^(.*?)(-\d+)?$/.exec(id);
    const head = m[1], tail = m[2] || "";
    return head.length > 14 ? head.slice(0, 12) + "…" + tail : id;
  }

  function kindOf(b, i) {
    if (i < b.first_usable) return "null";
    const ref = b.ref_counts[i], cached = b.cached[i] === 1;
    if (ref === 0) return cached ? "evictable" : "free";
    if (ref > 1) return "shared";
    return cached ? "cached" : "used";
  }

  function layout(canvas, n) {
    const w = canvas.clientWidth || 400;
    const cell = n <= 256 ? 18 : n <= 1024 ? 12 : n <= 4096 ? 7 : 4;
    const gap = cell >= 7 ? 2 : 1;
    const cols = Math.max(1, Math.floor((w + gap) / (cell + gap)));
    return { cell, gap, cols, rows: Math.ceil(n / cols), w };
  }

  function drawBlocks(snap) {
    const b = snap.blocks, canvas = $("block-map"), dpr = window.devicePixelRatio || 1;
    const L = layout(canvas, b.num_blocks);
    const h = L.rows * (L.cell + L.gap);
    canvas.style.height = h + "px";
    canvas.width = Math.round(L.w * dpr); canvas.height = Math.round(h * dpr);
    const g = canvas.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.font = `${Math.max(8, L.cell - 7)}px system-ui, sans-serif`;
    g.textAlign = "center"; g.textBaseline = "middle";
    // Per kind, plus cached_in_use: cached blocks someone holds (whatever their refcount).
    const counts = { free: 0, evictable: 0, used: 0, cached: 0, shared: 0, null: 0, cached_in_use: 0 };
    for (let i = 0; i < b.num_blocks; i++) {
      const kind = kindOf(b, i);
      counts[kind]++;
      if (b.cached[i] === 1 && b.ref_counts[i] > 0) counts.cached_in_use++;
      const x = (i % L.cols) * (L.cell + L.gap), y = Math.floor(i / L.cols) * (L.cell + L.gap);
      const owner = b.owner[i] >= 0 ? b.owners[b.owner[i]] : null;
      g.fillStyle = owner ? colorOf(owner) : COLORS[kind];
      g.fillRect(x, y, L.cell, L.cell);
      if (b.cached[i] === 1 && L.cell >= 7) {  // a cached block: a green corner
        g.fillStyle = COLORS.cachedEdge;
        g.beginPath(); g.moveTo(x + L.cell, y); g.lineTo(x + L.cell, y + L.cell / 2.2); g.lineTo(x + L.cell - L.cell / 2.2, y); g.fill();
      }
      if (kind === "shared") {
        g.strokeStyle = "#1b1d21"; g.lineWidth = 1.5; g.strokeRect(x + 0.75, y + 0.75, L.cell - 1.5, L.cell - 1.5);
        if (L.cell >= 12) { g.fillStyle = "#ffffff"; g.fillText(String(b.ref_counts[i]), x + L.cell / 2, y + L.cell / 2 + 1); }
      }
      if (i === hoverBlock) { g.strokeStyle = "#000"; g.lineWidth = 2; g.strokeRect(x + 1, y + 1, L.cell - 2, L.cell - 2); }
    }
    canvas.dataset.counts = JSON.stringify(counts);
    canvas.setAttribute("aria-label", `KV block map: ${counts.used + counts.cached + counts.shared} of ` +
      `${b.num_blocks - counts.null} blocks in use, ${counts.shared} shared, ${counts.evictable} cached and free`);
    $("block-info").textContent = `${b.num_blocks} blocks × ${b.block_size} tokens`;
    drawLegend(counts);
    return L;
  }

  function drawLegend(counts) {
    const items = [["free", COLORS.free, "free"], ["evictable", COLORS.evictable, "cached prefix, free (evictable)"],
      ["used", `linear-gradient(90deg, ${PALETTE[0]}, ${PALETTE[1]})`, "in use (colour = request)"],
      ["cached", `linear-gradient(225deg, #1e8e3e 30%, ${PALETTE[0]} 30%)`, "in use, cached prefix"],
      ["shared", "#555", "shared (refcount shown)"], ["null", COLORS.null, "null block"]];
    $("block-legend").replaceChildren(...items.map(([key, color, label]) => {
      const li = document.createElement("li");
      li.dataset.kind = key;
      li.innerHTML = `<span class="swatch" style="background:${color}"></span>`;
      li.append(`${label}: `);
      const n = document.createElement("strong"); n.textContent = counts[key]; li.append(n);
      return li;
    }));
  }

  function drawSlots(snap) {
    const rows = snap.slots.map((s) => {
      const tr = document.createElement("tr");
      tr.dataset.requestId = s.request_id;
      const cells = [s.slot === null ? "–" : s.slot, s.request_id, s.phase, s.prompt_tokens, s.output_tokens, s.computed_tokens, s.blocks];
      cells.forEach((v, k) => {
        const td = document.createElement("td");
        if (k === 1) {
          td.innerHTML = `<span class="swatch" style="background:${colorOf(s.request_id)}"></span>`;
          td.className = "rid"; td.title = s.request_id; v = shortId(s.request_id);
        }
        if (k === 2) td.className = "phase-" + s.phase;
        td.append(String(v));
        tr.appendChild(td);
      });
      return tr;
    });
    const max = snap.config.max_num_seqs;
    if (!rows.length) {
      const tr = document.createElement("tr");
      tr.innerHTML = `<td class="empty" colspan="7">idle: ${max} slots free</td>`;
      rows.push(tr);
    }
    $("slots").tBodies[0].replaceChildren(...rows);
    $("waiting").replaceChildren(...snap.waiting.map((w) => {
      const li = document.createElement("li");
      li.textContent = `${shortId(w.request_id)} (${w.prompt_tokens + w.output_tokens} tokens)`;
      li.title = w.request_id;
      if (w.preempted) { li.className = "preempted"; li.append(" — preempted"); }
      return li;
    }));
    if (!snap.waiting.length) $("waiting").innerHTML = '<li class="muted" style="list-style:none">empty</li>';
  }

  function card(id, label, value, flash) {
    let el = document.getElementById("card-" + id);
    if (!el) {
      el = document.createElement("div");
      el.className = "card"; el.id = "card-" + id;
      el.innerHTML = '<div class="value"></div><div class="label"></div>';
      $("summary").appendChild(el);
    }
    el.querySelector(".value").textContent = value;
    el.querySelector(".label").textContent = label;
    if (flash) { el.classList.remove("flash"); void el.offsetWidth; el.classList.add("flash"); }
  }

  function drawSummary(snap) {
    const g = snap.gauges, c = snap.counters;
    const used = g.kv_blocks_total ? 100 * g.kv_blocks_in_use / g.kv_blocks_total : 0;
    const hitRate = c.prefix_cache_queries_tokens ? 100 * c.prefix_cache_hits_tokens / c.prefix_cache_queries_tokens : 0;
    card("running", `running (of ${snap.config.max_num_seqs} slots)`, g.running);
    card("waiting", "waiting", g.waiting);
    card("kv", "KV blocks in use", `${used.toFixed(1)}%`);
    card("cached", "cached prefix blocks", g.prefix_cache_blocks);
    card("hits", "prefix-cache hit rate (all time)", `${hitRate.toFixed(1)}%`);
    card("preemptions", "preemptions", c.num_preemptions, prev && c.num_preemptions > prev.counters.num_preemptions);
    card("cow", "copy-on-write copies", c.cow_copies, prev && c.cow_copies > prev.counters.cow_copies);
    card("steps", "engine steps", c.num_steps);
  }

  function pushSeries(snap) {
    const g = snap.gauges;
    charts.kv.push(g.kv_blocks_total ? 100 * g.kv_blocks_in_use / g.kv_blocks_total : 0);
    if (prev) {
      const dt = snap.monotonic - prev.monotonic;
      const c = snap.counters, p = prev.counters, s = snap.server, ps = prev.server;
      if (dt > 0) {
        charts.throughput.push((c.decode_tokens + c.prefill_tokens - p.decode_tokens - p.prefill_tokens) / dt);
        const n = s.ttft_count - ps.ttft_count;
        charts.ttft.push(n > 0 ? 1000 * (s.ttft_sum_s - ps.ttft_sum_s) / n : charts.ttft.last());
        const q = c.prefix_cache_queries_tokens - p.prefix_cache_queries_tokens;
        charts.hits.push(q > 0 ? 100 * (c.prefix_cache_hits_tokens - p.prefix_cache_hits_tokens) / q : charts.hits.last());
      }
    }
    for (const [name, chart] of Object.entries(charts)) {
      chart.draw();
      $("val-" + name).textContent = chart.last() === null ? "" : formatNumber(chart.last());
    }
  }

  function render(snap) {
    if (prev && snap.monotonic === prev.monotonic) return;  // the engine thread has not rebuilt it yet
    lastSnap = snap;
    drawSummary(snap);
    drawSlots(snap);
    drawBlocks(snap);
    pushSeries(snap);
    prev = snap;
    $("engine-status").textContent = `updated ${new Date(snap.time * 1000).toLocaleTimeString()} · ` +
      `snapshot age ${(snap.age_s * 1000).toFixed(0)} ms · ${snap.server.in_flight} requests in flight`;
    $("view-engine").dataset.updates = String(Number($("view-engine").dataset.updates || 0) + 1);
  }

  async function poll() {
    try {
      render(await Api.getJson("/v1/engine/state"));
    } catch (e) {
      $("engine-status").textContent = "state unavailable: " + e.message;
    }
    timer = setTimeout(poll, POLL_MS);
  }

  function onHover(ev) {
    if (!lastSnap) return;
    const canvas = $("block-map"), b = lastSnap.blocks, L = layout(canvas, b.num_blocks);
    const r = canvas.getBoundingClientRect();
    const col = Math.floor((ev.clientX - r.left) / (L.cell + L.gap)), row = Math.floor((ev.clientY - r.top) / (L.cell + L.gap));
    const i = row * L.cols + col;
    if (col >= L.cols || i < 0 || i >= b.num_blocks) { $("block-tip").textContent = "\u00a0"; hoverBlock = -1; return; }
    hoverBlock = i;
    const owner = b.owner[i] >= 0 ? ` · held by ${b.owners[b.owner[i]]}` : "";
    $("block-tip").textContent = `block ${i}: ${kindOf(b, i)} · refcount ${b.ref_counts[i]}${b.cached[i] ? " · cached" : ""}${owner}`;
    drawBlocks(lastSnap);
  }

  function init() {
    charts.throughput = new Series($("chart-throughput"), { color: "#2458c6", minMax: 10 });
    charts.ttft = new Series($("chart-ttft"), { color: "#b35c00", minMax: 10 });
    charts.kv = new Series($("chart-kv"), { color: "#8e24aa", minMax: 10 });
    charts.hits = new Series($("chart-hits"), { color: "#1e8e3e", minMax: 10 });
    $("block-map").addEventListener("mousemove", onHover);
    poll();
  }

  return { init };
})();
