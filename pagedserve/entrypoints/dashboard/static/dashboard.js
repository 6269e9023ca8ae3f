// pagedserve dashboard: reads the engine-event stream (/v1/events, Server-Sent Events) and draws what the
// scheduler did. No library, no build step. Event format: pagedserve/engine/events.py. Times are the events'
// own (engine wall clock), never the browser's, so a replayed trace draws exactly like live traffic.
"use strict";

const BLOCK_COLORS = ["--free", "--cached", "--inuse", "--shared"];  // index = BlockState
const KEEP_STEPS = 20000;
const KEEP_REQUESTS = 2000;
const THROUGHPUT_WINDOW_S = 1.0;
const IDLE_GAP_S = 1.0;

const S = {
  config: null, blocks: [], steps: [], series: [], reqs: new Map(),
  step: 0, running: 0, waiting: 0, kvUsed: 0, kvTotal: 0, preemptions: 0, hitTokens: 0,
  sampled: [],  // [time, tokens] of recent steps, for tokens/s
  tMin: null, tMax: 0, lastSeq: null, mode: "connecting", ended: false,
};

const $ = (id) => document.getElementById(id);
const css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();

// ------------------------------------------------------------------------------------------ state
function request(id, arrival) {
  let r = S.reqs.get(id);
  if (!r) {
    r = {id, arrival, spans: [], first: null, tokens: [], end: null, reason: null, state: "waiting", since: arrival};
    S.reqs.set(id, r);
  }
  return r;
}

function addSpan(r, t0, t1, kind) {
  const last = r.spans[r.spans.length - 1];
  if (last && last[2] === kind && t0 - last[1] < 0.05) last[1] = Math.max(last[1], t1);
  else r.spans.push([t0, t1, kind]);
}

function setState(r, state, t) {
  if ((r.state === "waiting" || r.state === "preempted") && t > r.since) addSpan(r, r.since, t, r.state);
  r.state = state;
  r.since = t;
}

function token(r, t) {
  if (r.first === null) r.first = t;
  r.tokens.push(t);
}

function seeTime(t) {
  if (S.tMin === null || t < S.tMin) S.tMin = t;
  if (t > S.tMax) S.tMax = t;
}

function applyBlocks(changed) {
  for (const [id, state] of changed || []) S.blocks[id] = state;
}

function finish(list, t) {
  for (const [id, reason] of list) {
    const r = S.reqs.get(id);
    if (!r || r.end !== null) continue;
    setState(r, "finished", t);
    r.end = t;
    r.reason = reason;
  }
}

function apply(ev) {
  if (ev.seq !== undefined) S.lastSeq = ev.seq;
  switch (ev.type) {
    case "hello":
      setMode(ev.mode, ev.mode);
      break;
    case "snapshot":
      S.config = ev.config;
      S.blocks = Array.from(ev.blocks, Number);
      S.kvTotal = S.blocks.length;
      S.running = ev.running;
      S.waiting = ev.waiting;
      for (const [id, status, , , , arrival] of ev.requests || []) {
        const r = request(id, arrival);
        if (r.state !== status && r.end === null) setState(r, status, status === "waiting" ? arrival : ev.t);
      }
      seeTime(ev.t);
      renderConfig();
      break;
    case "step": applyStep(ev); break;
    case "abort":
      finish(ev.finished, ev.t);
      applyBlocks(ev.blocks);
      S.running = ev.running;
      S.waiting = ev.waiting;
      seeTime(ev.t);
      break;
  }
  schedule();
}

function applyStep(ev) {
  const t = ev.t, t1 = ev.t + ev.dur;
  for (const [id, , arrival] of ev.arrived) { request(id, arrival); seeTime(arrival); }
  for (const [id, hit] of ev.admitted) { setState(request(id, t), "running", t); S.hitTokens += hit; }
  let sampled = ev.decode.length;
  for (const [id, n, before, total] of ev.prefill) {
    const r = request(id, t);
    addSpan(r, t, t1, "prefill");
    if (before + n === total) { token(r, t1); sampled++; }
  }
  for (const id of ev.decode) {
    const r = request(id, t);
    addSpan(r, t, t1, "decode");
    token(r, t1);
  }
  for (const [id, , out] of ev.spec || []) {  // accepted speculative drafts: more tokens in the same step
    for (let i = 1; i < out; i++) token(request(id, t), t1);
    sampled += Math.max(out - 1, 0);
  }
  for (const id of ev.preempted) setState(request(id, t), "preempted", t);
  S.preemptions += ev.preempted.length;
  finish(ev.finished, t1);
  applyBlocks(ev.blocks);
  S.step = ev.step + 1;
  S.running = ev.running;
  S.waiting = ev.waiting;
  S.kvUsed = ev.kv.used;
  S.kvTotal = ev.kv.total;
  S.sampled.push([t1, sampled]);
  while (S.sampled.length && S.sampled[0][0] < t1 - THROUGHPUT_WINDOW_S) S.sampled.shift();
  const tps = S.sampled.reduce((a, x) => a + x[1], 0) / THROUGHPUT_WINDOW_S;
  S.steps.push({t, prefill: ev.prefill_tokens, decode: ev.decode_tokens, budget: ev.budget});
  S.series.push({t: t1, running: ev.running, waiting: ev.waiting, kv: ev.kv.used / ev.kv.total, tps});
  if (S.steps.length > KEEP_STEPS) { S.steps.splice(0, S.steps.length - KEEP_STEPS); }
  if (S.series.length > KEEP_STEPS) { S.series.splice(0, S.series.length - KEEP_STEPS); }
  if (S.reqs.size > KEEP_REQUESTS) prune();
  seeTime(t);
  seeTime(t1);
}

function prune() {
  const done = [...S.reqs.values()].filter((r) => r.end !== null).sort((a, b) => a.end - b.end);
  for (const r of done.slice(0, S.reqs.size - KEEP_REQUESTS)) S.reqs.delete(r.id);
}

// ------------------------------------------------------------------------------------------ drawing
let pending = false;
function schedule() {
  if (pending) return;
  pending = true;
  setTimeout(() => { pending = false; render(); }, 100);
}

function canvas2d(id) {
  const c = $(id), dpr = window.devicePixelRatio || 1;
  const w = c.clientWidth, h = c.clientHeight;
  if (c.width !== Math.round(w * dpr)) c.width = Math.round(w * dpr);
  if (c.height !== Math.round(h * dpr)) c.height = Math.round(h * dpr);
  const g = c.getContext("2d");
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  g.clearRect(0, 0, w, h);
  g.font = "11px system-ui, sans-serif";
  return {c, g, w, h};
}

function windowStart() {
  const w = Number($("window").value);
  return w > 0 ? Math.max(S.tMin ?? S.tMax, S.tMax - w) : (S.tMin ?? S.tMax);
}

function render() {
  $("step-count").textContent = S.step;
  $("running-count").textContent = S.running;
  $("waiting-count").textContent = S.waiting;
  $("kv-usage").textContent = S.kvTotal ? (100 * S.kvUsed / S.kvTotal).toFixed(1) + "%" : "0%";
  const last = S.series[S.series.length - 1];
  $("throughput").textContent = last ? last.tps.toFixed(0) : "0";
  $("preemptions").textContent = S.preemptions;
  $("prefix-hits").textContent = S.hitTokens;
  drawSteps();
  drawLanes();
  drawBlocks();
  drawSeries();
}

function drawSteps() {
  const {c, g, w, h} = canvas2d("steps");
  const t0 = windowStart();
  const bar = 3, fit = Math.floor((w - 40) / bar);
  const steps = S.steps.filter((s) => s.t >= t0).slice(-fit);
  c.dataset.steps = steps.length;
  if (!steps.length) return;
  const top = Math.max(...steps.map((s) => Math.max(s.budget, s.prefill + s.decode)));
  const y = (v) => h - 14 - (h - 24) * v / top;
  steps.forEach((s, i) => {
    const x = 40 + i * bar;
    g.fillStyle = css("--decode");
    g.fillRect(x, y(s.decode), bar - 1, y(0) - y(s.decode));
    g.fillStyle = css("--prefill");
    g.fillRect(x, y(s.decode + s.prefill), bar - 1, y(s.decode) - y(s.decode + s.prefill));
  });
  g.strokeStyle = css("--budget");
  g.setLineDash([4, 3]);
  g.beginPath();
  steps.forEach((s, i) => { g.lineTo(40 + i * bar, y(s.budget)); g.lineTo(40 + (i + 1) * bar, y(s.budget)); });
  g.stroke();
  g.setLineDash([]);
  g.fillStyle = css("--muted");
  g.fillText(String(top), 2, y(top) + 10);
  g.fillText("0", 2, y(0));
  g.fillText(`last ${steps.length} steps`, 40, h - 2);
}

function drawLanes() {
  const {c, g, w, h} = canvas2d("lanes");
  const t0 = windowStart(), t1 = Math.max(S.tMax, t0 + 1e-3);
  const reqs = [...S.reqs.values()].filter((r) => r.end === null || r.end >= t0).sort((a, b) => a.arrival - b.arrival);
  const rowH = Math.max(4, Math.min(18, Math.floor((h - 14) / Math.max(reqs.length, 1))));
  const shown = reqs.slice(-Math.floor((h - 14) / rowH));
  c.dataset.lanes = shown.length;
  const left = rowH >= 10 ? 90 : 4;
  const x = (t) => left + (w - left - 4) * (Math.max(t, t0) - t0) / (t1 - t0);
  const colors = {waiting: css("--waiting"), preempted: css("--preempted"), prefill: css("--prefill"),
                  decode: css("--decode")};
  shown.forEach((r, i) => {
    const y = i * rowH, bh = Math.max(rowH - 2, 2);
    if (left > 4) { g.fillStyle = css("--fg"); g.fillText(r.id.slice(0, 14), 2, y + rowH - 4); }
    const spans = [...r.spans];
    if (r.state === "waiting" || r.state === "preempted") spans.push([r.since, t1, r.state]);
    for (const [a, b, kind] of spans) {
      if (b < t0) continue;
      g.fillStyle = colors[kind];
      g.fillRect(x(a), y + 1, Math.max(x(b) - x(a), 1), bh);
    }
    g.fillStyle = css("--fg");
    if (rowH >= 8) for (const t of r.tokens) if (t >= t0) g.fillRect(x(t), y + bh - 2, 1, 3);
    if (r.first !== null && r.first >= t0) {
      const fx = x(r.first);
      g.beginPath(); g.moveTo(fx, y + 1); g.lineTo(fx - 4, y + bh + 1); g.lineTo(fx + 4, y + bh + 1); g.fill();
    }
  });
  g.fillStyle = css("--muted");
  g.fillText(`${shown.length} of ${S.reqs.size} requests, ${(t1 - t0).toFixed(1)} s`, left, h - 2);
}

function drawBlocks() {
  const {c, g, w, h} = canvas2d("block-grid");
  const n = S.blocks.length;
  c.dataset.blocks = n;
  if (!n) return;
  const cell = Math.max(1, Math.min(24, Math.floor(Math.sqrt(w * h / n))));
  const cols = Math.max(1, Math.floor(w / cell));
  const colors = BLOCK_COLORS.map(css);
  const counts = [0, 0, 0, 0];
  for (let i = 0; i < n; i++) {
    const s = S.blocks[i];
    counts[s]++;
    g.fillStyle = colors[s];
    g.fillRect((i % cols) * cell, Math.floor(i / cols) * cell, Math.max(cell - 1, 1), Math.max(cell - 1, 1));
  }
  c.dataset.inUse = counts[2] + counts[3];
  $("block-legend").textContent = `${n} blocks: ${counts[0]} free, ${counts[1]} cached, ${counts[2]} in use, ` +
    `${counts[3]} shared` + (S.config ? ` (${S.config.cache.block_size} tokens each)` : "");
}

function drawSeries() {
  const {g, w, h} = canvas2d("series");
  const t0 = windowStart(), t1 = Math.max(S.tMax, t0 + 1e-3);
  const pts = S.series.filter((p) => p.t >= t0);
  if (!pts.length) return;
  const x = (t) => 4 + (w - 8) * (t - t0) / (t1 - t0);
  const seats = S.config ? S.config.scheduler.max_num_seqs : 1;
  const reqTop = Math.max(1, ...pts.map((p) => Math.max(p.running, p.waiting)));
  const tpsTop = Math.max(1, ...pts.map((p) => p.tps));
  const lines = [["running", css("--decode"), reqTop], ["waiting", css("--waiting"), reqTop],
                 ["kv", css("--kv"), 1], ["tps", css("--tput"), tpsTop]];
  for (const [key, color, top] of lines) {
    g.strokeStyle = color;
    g.beginPath();
    let previous = -Infinity;
    for (const p of pts) {  // idle stretches (no step) are gaps, not slopes
      const y = h - 14 - (h - 24) * p[key] / top;
      if (p.t - previous > IDLE_GAP_S) g.moveTo(x(p.t), y); else g.lineTo(x(p.t), y);
      previous = p.t;
    }
    g.stroke();
  }
  g.fillStyle = css("--muted");
  g.fillText(`requests 0..${reqTop} (max_num_seqs ${seats}), KV 0..100%, tokens/s 0..${tpsTop.toFixed(0)}`, 4, h - 2);
}

function renderConfig() {
  const c = S.config;
  if (!c) return;
  const s = c.scheduler, k = c.cache, m = c.model;
  const rows = [
    ["model", `${m.served_model_name} (${m.architecture}, ${m.dtype}, max_model_len ${m.max_model_len})`],
    ["KV cache", `${k.num_blocks} blocks x ${k.block_size} tokens = ${k.num_blocks * k.block_size} tokens ` +
                 `(${k.kv_cache_dtype}), prefix caching ${k.enable_prefix_caching ? "on" : "off"}`],
    ["--max-num-seqs", s.max_num_seqs],
    ["--max-num-batched-tokens", s.max_num_batched_tokens],
    ["chunked prefill", s.enable_chunked_prefill ? "on" : "off"],
    ["--long-prefill-token-threshold", s.long_prefill_token_threshold || "none"],
    ["scheduling policy", s.policy],
    ["device", `${c.parallel.device}, ${c.parallel.num_threads ?? "all"} threads`],
  ];
  $("config").replaceChildren(...rows.map(([name, value]) => {
    const tr = document.createElement("tr");
    for (const text of [name, value]) { const td = document.createElement("td"); td.textContent = text; tr.append(td); }
    return tr;
  }));
}

function setMode(text, cls) {
  S.mode = text;
  const el = $("mode");
  el.textContent = text;
  el.className = cls || "";
}

// ------------------------------------------------------------------------------------------ stream
// The key lives in this tab only (sessionStorage: gone when the tab closes, never shared with other tabs or written
// to disk as localStorage would be); a #key=... fragment is taken out of the address bar and its history entry.
const KEY_ITEM = "pagedserve-api-key";
const fragment = new URLSearchParams(location.hash.slice(1));
let apiKey = fragment.get("key") || sessionStorage.getItem(KEY_ITEM) || "";
if (fragment.has("key")) {
  sessionStorage.setItem(KEY_ITEM, apiKey);
  history.replaceState(null, "", location.pathname + location.search);
}

async function connect() {
  const url = "/v1/events" + (S.lastSeq !== null ? `?since=${S.lastSeq}` : "");
  let resp;
  try {
    resp = await fetch(url, {headers: apiKey ? {Authorization: `Bearer ${apiKey}`} : {}});
  } catch (err) {
    return retry();
  }
  if (resp.status === 401) {
    setMode("API key needed", "error");
    $("key-form").hidden = false;
    return;
  }
  if (!resp.ok) return retry();
  const reader = resp.body.getReader(), decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    let chunk;
    try { chunk = await reader.read(); } catch (err) { break; }
    if (chunk.done) break;
    buffer += decoder.decode(chunk.value, {stream: true});
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const data = buffer.slice(0, end).split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trimStart()).join("\n");
      buffer = buffer.slice(end + 2);
      if (data) apply(JSON.parse(data));
    }
  }
  if (S.mode === "replay") { setMode("replay (end)", "replay"); return; }
  retry();
}

function retry() {
  setMode("disconnected, retrying", "error");
  setTimeout(connect, 2000);
}

$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  apiKey = $("key-input").value;
  sessionStorage.setItem(KEY_ITEM, apiKey);
  $("key-form").hidden = true;
  connect();
});
$("window").addEventListener("change", schedule);
window.addEventListener("resize", schedule);
connect();
