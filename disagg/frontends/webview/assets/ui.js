// disagg web view: polls /ui/api/state every second and redraws. No libraries:
// the cluster picture and the charts are plain SVG. Every text from the server
// goes in through textContent, never as markup.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const POLL_MS = 1000;

function h(tag, props, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (v === undefined || v === null) continue;
    if (k === "class") e.className = v;
    else if (k === "style") Object.assign(e.style, v); // CSSOM: the CSP forbids inline style=""
    else e.setAttribute(k, v);
  }
  for (const kid of kids.flat(Infinity)) {
    if (kid === null || kid === undefined) continue;
    e.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return e;
}

function s(tag, attrs, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

const fmtS = (v) => (v === null || v === undefined ? "–" : v < 1 ? `${(v * 1000).toFixed(v < 0.01 ? 1 : 0)} ms` : `${v.toFixed(2)} s`);
function fmtB(v) {
  if (v === null || v === undefined) return "–";
  const u = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (v >= 1000 && i < u.length - 1) { v /= 1000; i++; }
  return `${v.toFixed(v < 10 && i ? 1 : 0)} ${u[i]}`;
}
const fmtPct = (v) => (v === null || v === undefined ? "–" : `${Math.round(v * 100)}%`);
const clip = (t, n) => (t && t.length > n ? t.slice(0, n - 1) + "…" : t || "");

function percentile(values, q) {
  if (!values.length) return null;
  const o = [...values].sort((a, b) => a - b);
  return o[Math.min(o.length - 1, Math.floor(q * o.length))];
}

// ---- the cluster picture ----------------------------------------------------

function topology(state) {
  const box = document.getElementById("topology");
  const W = Math.max(280, Math.min(1000, box.clientWidth - 24));
  const narrow = W < 560; // phones: prefill agents above, decode agents below
  const nodeH = 62, gap = 12;
  const byName = Object.fromEntries(state.agents.map((a) => [a.name, a]));
  const svg = s("svg", { role: "img", "aria-label": "prefill and decode agents and their links" });
  let y = 4;
  for (const model of state.models) {
    const mine = state.agents.filter((a) => a.model === model);
    const pre = mine.filter((a) => a.role === "prefill"), dec = mine.filter((a) => a.role === "decode");
    svg.append(s("text", { x: 4, y: y + 14, class: "pipe" }, model));
    y += 24;
    let P, D, nodeW, bottom;
    if (narrow) {
      const row = (list, ry) => {
        const w = (W - 8 - gap * (list.length - 1)) / Math.max(list.length, 1);
        return list.map((a, i) => ({ a, x: 4 + i * (w + gap), y: ry, w }));
      };
      P = row(pre, y);
      D = row(dec, y + nodeH + 56);
      bottom = y + 2 * nodeH + 56;
    } else {
      nodeW = Math.min(260, (W - 90) / 2);
      const rows = Math.max(pre.length, dec.length, 1), height = rows * (nodeH + gap);
      const col = (list, x) => list.map((a, i) => ({
        a, x, w: nodeW, y: y + (height - list.length * (nodeH + gap)) / 2 + i * (nodeH + gap),
      }));
      P = col(pre, 4);
      D = col(dec, W - nodeW - 4);
      bottom = y + height - gap;
    }
    for (const l of state.links.filter((l) => l.model === model)) {
      const p = P.find((n) => n.a.name === l.prefill), d = D.find((n) => n.a.name === l.decode);
      if (!p || !d) continue;
      const up = byName[l.prefill]?.up && byName[l.decode]?.up;
      const cls = `link${l.requests && up ? " active" : ""}`;
      // "link": timed on the wire; else K/V bytes over the transfer windows (mostly waiting for compute)
      const kind = l.rate_kind === "link" ? "link" : "K/V bytes / transfer time";
      const label = l.requests ? `${kind} ${fmtB(l.bytes_per_s)}/s · ${l.requests} req` : "no K/V yet";
      if (narrow) {
        const x1 = p.x + p.w / 2, y1 = p.y + nodeH, x2 = d.x + d.w / 2, y2 = d.y, my = (y1 + y2) / 2;
        svg.append(s("path", { d: `M${x1},${y1} C${x1},${my} ${x2},${my} ${x2},${y2}`, class: cls }));
        svg.append(s("text", { x: (x1 + x2) / 2 + 8, y: my + 4, class: "rate" }, label));
      } else {
        const x1 = p.x + p.w, y1 = p.y + nodeH / 2, x2 = d.x, y2 = d.y + nodeH / 2, mx = (x1 + x2) / 2;
        svg.append(s("path", { d: `M${x1},${y1} C${mx},${y1} ${mx},${y2} ${x2},${y2}`, class: cls }));
        svg.append(s("text", { x: mx, y: (y1 + y2) / 2 - 5, "text-anchor": "middle", class: "rate" }, label));
      }
    }
    for (const n of [...P, ...D]) svg.append(node(n, n.w, nodeH));
    y = bottom + 14;
  }
  svg.setAttribute("viewBox", `0 0 ${W} ${y}`);
  box.replaceChildren(svg);
}

function node({ a, x, y }, w, hgt) {
  const g = s("g", { "data-node": a.name, class: a.up ? "up" : "down" });
  g.append(s("rect", { x, y, width: w, height: hgt, rx: 8, class: `node${a.up ? "" : " down"}` }));
  const chars = Math.floor((w - 16) / 7.6), sub = Math.floor((w - 16) / 6.2);
  g.append(s("text", { x: x + 10, y: y + 19 }, clip(`${a.up ? "●" : "✕"} ${a.name}`, chars)));
  const what = [a.role, a.embedding_only && "embeddings only", a.device, a.model_dir].filter(Boolean).join(" · ");
  g.append(s("text", { x: x + 10, y: y + 36, class: "sub" }, clip(what, sub)));
  const line3 = a.up
    ? `${a.in_flight ?? 0} in flight · ${a.tokens_per_s ?? 0} tok/s${a.role === "decode" ? ` · batch ${a.batch ?? 0}` : ""}`
    : clip(a.error || a.last_error || "down", sub);
  g.append(s("text", { x: x + 10, y: y + 52, class: "sub" }, clip(line3, sub)));
  return g;
}

// ---- agent cards -------------------------------------------------------------

function agentCard(a) {
  const rows = [
    ["role", a.role], ["model", a.model], ["address", a.address], ["device", a.device && `${a.backend || ""} ${a.device}`],
    ["weights", a.weights], ["queue", a.queued ?? a.in_flight], ["batch rows", a.batch !== undefined && a.batch !== null ? `${a.batch} / ${a.max_batch}` : null],
    ["tokens/s", a.live_rate !== undefined ? `${a.live_rate.toFixed(1)} (decoding now)` : a.tokens_per_s],
    ["memory", a.rss_bytes ? fmtB(a.rss_bytes) : null],
    ["prefix hits", a.prefix_hit_rate !== undefined && a.prefix_hit_rate !== null ? fmtPct(a.prefix_hit_rate) : null],
    ["prefix reused", a.prefix_memory_tokens ?? null],
    ["prefix on disk", a.prefix_disk ? `${a.prefix_disk.hits} hits, ${a.prefix_disk.cached_tokens} tokens, ${fmtB(a.prefix_disk.bytes)} / ${fmtB(a.prefix_disk.max_bytes)}` : null],
    ["requests", a.requests !== undefined && a.requests !== null ? `${a.requests}, ${a.errors ?? 0} failed, ${a.cancelled ?? 0} cancelled` : null],
    ["uptime", a.uptime_s ? fmtS(a.uptime_s) : null],
  ].filter(([, v]) => v !== null && v !== undefined && v !== "");
  return h("div", { class: `card agent${a.up ? "" : " down"}`, "data-agent": a.name, "data-up": String(a.up) },
    h("div", { class: "head" }, h("span", { class: "name" }, a.name), h("span", { class: `badge ${a.up ? "up" : "down"}` }, a.up ? "up" : "down")),
    h("dl", {}, rows.map(([k, v]) => [h("dt", {}, k), h("dd", {}, String(v))])),
    a.up ? null : h("div", { class: "err" }, a.error || "down"),
    a.last_error ? h("div", { class: "err", title: "the agent's last error" }, a.last_error) : null);
}

// ---- requests ------------------------------------------------------------------
// Every bar on one time axis: the last `win.span` seconds, ending now (gateway clock).
// A request's phases sit where they happened (the decode agent's timeline, `at` on
// its clock), so a 2 s and a 16 s request have bars of different lengths.

const SPANS = [60, 120, 300, 900, 1800, 3600];

function windowFor(state) {
  const oldest = Math.min(state.now, ...state.requests.slice(0, 40).map((r) => r.started));
  const span = SPANS.find((w) => state.now - oldest <= w * 0.95) || SPANS[SPANS.length - 1];
  return { end: state.now, span, start: state.now - span };
}

function timeAxis(win) {
  const ticks = [];
  for (const f of [0, 0.25, 0.5, 0.75, 1]) {
    const ago = win.span * (1 - f);
    const label = ago === 0 ? "now" : ago >= 60 ? `−${(ago / 60).toFixed(ago % 60 ? 1 : 0)} min` : `−${ago.toFixed(0)} s`;
    ticks.push(h("span", { class: "tick", style: { left: `${(f * 100).toFixed(2)}%` } }, label));
  }
  return h("div", { class: "req axisrow" },
    h("div", {}), h("div", { class: "muted" }, `time axis: last ${win.span >= 60 ? `${win.span / 60} min` : `${win.span} s`}`),
    h("div", { class: "timeaxis", "data-span": String(win.span) }, ticks), h("div", {}));
}

function segments(r, win) {
  const t = r.timeline;
  const outcome = r.state === "running" ? "running" : r.outcome || r.state;
  const bar = h("div", { class: `bar ${outcome}`, "data-timeline": t ? "yes" : "no" });
  const pct = (abs) => Math.max(0, Math.min(100, ((abs - win.start) / win.span) * 100));
  const place = (cls, a, b, title) => {
    if (a === null || a === undefined || b === null || b === undefined) return null;
    const left = pct(a), right = pct(Math.max(b, a));
    const e = h("i", { class: cls, style: { left: `${left.toFixed(3)}%`, width: `${Math.max(right - left, 0.25).toFixed(3)}%` }, title });
    bar.append(e);
    return e;
  };
  const end = r.state === "running" ? win.end : r.started + (r.elapsed || 0);
  // the whole request, gateway's view: its extent is what the axis compares
  const span = place("span", r.started, end, `${outcome} · ${fmtS(end - r.started)}`);
  if (span) span.dataset.width = String(end - r.started);
  if (t && t.at) {
    const at = (k) => (t[k] === null || t[k] === undefined ? null : t.at + t[k]);
    const first = at("first_token");
    const ps = at("prefill_start") ?? first;
    place("queue", t.at, ps, `queued ${fmtS(ps - t.at)}`);
    place("prefill", at("prefill_start"), at("prefill_end"), `prefill ${fmtS((t.prefill_end ?? 0) - (t.prefill_start ?? 0))}`);
    place("kv", at("kv_first"), at("kv_last"), `K/V layers arriving ${fmtS((t.kv_last ?? 0) - (t.kv_first ?? 0))}`);
    place("decode", first, t.done !== undefined && t.done !== null ? at("done") : end, "decode");
    if (first !== null) bar.append(h("i", { class: "tok", style: { left: `${pct(first).toFixed(3)}%` }, title: "first token" }));
  } else if (r.state === "running") {
    place("run", r.started, end, "running");
  }
  if (outcome !== "running" && r.state !== "refused") {
    bar.append(h("i", { class: `end ${outcome}`, style: { left: `${pct(end).toFixed(3)}%` }, title: outcome }));
  }
  return bar;
}

// How a request ended, in the APIs' words; refused: answered 4xx before it ran.
const OUTCOME_LABEL = { stop: "stop", length: "length", tool_calls: "tool calls", cancelled: "cancelled", error: "failed", refused: "refused" };

function liveRate(r) {
  // a running request's decode rate: tokens after the first over the time since it
  if (r.state !== "running" || !r.first_token || r.tokens < 2) return null;
  const dt = r.elapsed - r.first_token;
  return dt > 0 ? (r.tokens - 1) / dt : null;
}

function requestRow(r, win) {
  const where = r.tokens ? "decoding" : "prefilling";
  const outcome = r.state === "running" ? where : r.outcome || r.state;
  const label = OUTCOME_LABEL[outcome] || outcome;
  const servers = [r.prefill_server, r.decode_server].filter(Boolean).join(" → ");
  const rate = liveRate(r);
  const nums = r.state === "refused"
    ? [h("div", {}, r.error), h("div", { class: "muted" }, "not run")]
    : r.state === "running"
      ? [h("div", {}, fmtS(r.elapsed)), h("div", { class: "muted" }, `${r.tokens} tok${rate ? ` · ${rate.toFixed(1)} tok/s` : ""}`)]
      : [h("div", {}, `ttft ${fmtS(r.ttft)}`), h("div", { class: "muted" }, `${r.tokens} tok · ${fmtS(r.elapsed)}`)];
  const why = r.state === "refused" ? r.why : r.error || r.why;
  return h("div", { class: "req", "data-req": String(r.id), "data-state": r.state, "data-outcome": outcome },
    h("div", { class: "id" }, `#${r.id}`),
    h("div", { class: "what" },
      h("div", { class: "prompt", title: r.prompt }, r.prompt || "(empty)"),
      h("div", { class: "meta" }, h("span", { class: `m ${outcome}` }, label), [r.method, r.model, servers].filter(Boolean).join(" · "))),
    segments(r, win),
    h("div", { class: "nums" }, nums),
    why ? h("div", { class: `why${r.error ? " failed" : ""}` }, `${r.state === "refused" ? "refused" : r.error ? "failed" : "why"}: ${why}`) : null);
}

// ---- charts ----------------------------------------------------------------------

const CW = 420, CH = 160, PAD = { l: 46, r: 8, t: 8, b: 20 };

function axes(svg, ymax, fmt, xlabel) {
  const x0 = PAD.l, y0 = CH - PAD.b;
  svg.append(s("line", { x1: x0, y1: PAD.t, x2: x0, y2: y0, class: "axis" }));
  svg.append(s("line", { x1: x0, y1: y0, x2: CW - PAD.r, y2: y0, class: "axis" }));
  for (const f of [0, 0.5, 1]) {
    const y = y0 - f * (y0 - PAD.t);
    svg.append(s("text", { x: x0 - 4, y: y + 3, "text-anchor": "end" }, fmt(ymax * f)));
  }
  svg.append(s("text", { x: CW - PAD.r, y: CH - 4, "text-anchor": "end" }, xlabel));
}

function latencyChart(id, done, key, win) {
  // each request a dot where it ended (wall clock), with rolling p50/p95/p99
  const box = document.getElementById(id);
  const end = (r) => r.started + (r.elapsed || 0);
  const pts = done.filter((r) => typeof r[key] === "number" && end(r) >= win.start).sort((a, b) => end(a) - end(b));
  const svg = s("svg", { viewBox: `0 0 ${CW} ${CH}`, role: "img" });
  const vals = pts.map((r) => r[key]);
  const ymax = Math.max(percentile(vals, 0.99) || 0, 1e-3) * 1.15;
  axes(svg, ymax, fmtS, pts.length ? `${pts.length} requests · last ${win.span / 60} min` : "no data yet");
  const X = (r) => PAD.l + ((end(r) - win.start) / win.span) * (CW - PAD.l - PAD.r);
  const Y = (v) => CH - PAD.b - (Math.min(v, ymax) / ymax) * (CH - PAD.b - PAD.t);
  pts.forEach((r) => svg.append(s("circle", { cx: X(r), cy: Y(r[key]), r: 2.2, class: "dot" })));
  for (const [q, cls] of [[0.5, "p50"], [0.95, "p95"], [0.99, "p99"]]) {
    const d = pts.map((r, i) => `${i ? "L" : "M"}${X(r).toFixed(1)},${Y(percentile(vals.slice(Math.max(0, i - 19), i + 1), q)).toFixed(1)}`).join("");
    if (d) svg.append(s("path", { d, class: cls }));
  }
  const note = h("div", { class: "note" },
    h("b", { class: "k50" }, "p50 "), fmtS(percentile(vals, 0.5)), "  ",
    h("b", { class: "k95" }, "p95 "), fmtS(percentile(vals, 0.95)), "  ",
    h("b", { class: "k99" }, "p99 "), fmtS(percentile(vals, 0.99)));
  box.replaceChildren(svg, note);
}

// Queue depth and memory: sampled at each poll while the page is open.
const HISTORY = [];

function remember(state) {
  const running = state.requests.filter((r) => r.state === "running");
  const queued = state.agents.reduce((n, a) => n + (a.queued ?? 0), 0);
  const rss = state.agents.filter((a) => a.up).reduce((n, a) => n + (a.rss_bytes || 0), 0);
  HISTORY.push({ t: state.now, waiting: running.filter((r) => !r.tokens).length + queued, running: running.length, rss });
  while (HISTORY.length && HISTORY[0].t < state.now - 3600) HISTORY.shift();
}

function seriesChart(id, key, fmt, win, what) {
  const box = document.getElementById(id);
  const pts = HISTORY.filter((p) => p.t >= win.start);
  const ymax = Math.max(...pts.map((p) => p[key]), key === "rss" ? 1e6 : 1) * 1.15;
  const svg = s("svg", { viewBox: `0 0 ${CW} ${CH}`, role: "img" });
  axes(svg, ymax, fmt, pts.length > 1 ? `last ${win.span / 60} min (since this page opened)` : "collecting…");
  const X = (p) => PAD.l + ((p.t - win.start) / win.span) * (CW - PAD.l - PAD.r);
  const Y = (v) => CH - PAD.b - (v / ymax) * (CH - PAD.b - PAD.t);
  const d = pts.map((p, i) => `${i ? "L" : "M"}${X(p).toFixed(1)},${Y(p[key]).toFixed(1)}`).join("");
  if (d) svg.append(s("path", { d, class: "p50" }));
  const last = pts.length ? pts[pts.length - 1][key] : null;
  box.replaceChildren(svg, h("div", { class: "note" }, `${what} now ${last === null ? "–" : fmt(last)}`));
}

function tpsChart(done, now) {
  const box = document.getElementById("c-tps");
  const B = 5, N = 60; // 5-second buckets, the last 5 minutes
  const sums = new Array(N).fill(0);
  for (const r of done) {
    const end = r.started + r.elapsed, i = N - 1 - Math.floor((now - end) / B);
    if (i >= 0 && i < N) sums[i] += r.tokens || 0;
  }
  const rates = sums.map((v) => v / B);
  const ymax = Math.max(...rates, 1) * 1.15;
  const svg = s("svg", { viewBox: `0 0 ${CW} ${CH}`, role: "img" });
  axes(svg, ymax, (v) => v.toFixed(v < 10 ? 1 : 0), "last 5 min");
  const bw = (CW - PAD.l - PAD.r) / N;
  rates.forEach((v, i) => {
    const hgt = (v / ymax) * (CH - PAD.b - PAD.t);
    if (v > 0) svg.append(s("rect", { x: PAD.l + i * bw + 0.5, y: CH - PAD.b - hgt, width: bw - 1, height: hgt, class: "tps" }));
  });
  box.replaceChildren(svg, h("div", { class: "note" }, `now ${rates[N - 1].toFixed(1)} tok/s`));
}

function kvChart(done) {
  const box = document.getElementById("c-kv");
  const pts = done.filter((r) => r.kv_bytes).sort((a, b) => a.started - b.started).slice(-60);
  const ymax = Math.max(...pts.map((r) => r.kv_bytes), 1) * 1.15;
  const svg = s("svg", { viewBox: `0 0 ${CW} ${CH}`, role: "img" });
  axes(svg, ymax, fmtB, pts.length ? `last ${pts.length} disaggregated requests` : "no K/V transfers yet");
  const bw = (CW - PAD.l - PAD.r) / Math.max(pts.length, 1);
  pts.forEach((r, i) => {
    const hgt = (r.kv_bytes / ymax) * (CH - PAD.b - PAD.t);
    svg.append(s("rect", { x: PAD.l + i * bw + 0.5, y: CH - PAD.b - hgt, width: Math.max(bw - 1, 1), height: hgt, class: "bars" }));
  });
  const vals = pts.map((r) => r.kv_bytes);
  box.replaceChildren(svg, h("div", { class: "note" }, `median ${fmtB(percentile(vals, 0.5))} · max ${fmtB(Math.max(0, ...vals))}`));
}

// ---- the loop ----------------------------------------------------------------------

function render(state) {
  const up = state.agents.filter((a) => a.up).length;
  const live = state.requests.filter((r) => r.state === "running");
  const running = live.length;
  const done = state.requests.filter((r) => r.state === "done");
  const fallbacks = done.filter((r) => r.method === "local-fallback").length;
  const hits = done.filter((r) => r.cached_tokens > 0).length;
  const rate = live.map(liveRate).filter((v) => v !== null).reduce((a, b) => a + b, 0);
  for (const a of state.agents) {
    // the agent's own tokens/s counts finished requests: while it decodes, say the live rate
    const mine = live.filter((r) => r.decode_server === a.name).map(liveRate).filter((v) => v !== null);
    if (a.role === "decode" && mine.length) a.live_rate = mine.reduce((x, y) => x + y, 0);
  }
  remember(state);
  const win = windowFor(state);
  const item = (k, v) => h("span", {}, `${k} `, h("b", {}, String(v)));
  document.getElementById("summary").replaceChildren(
    item("models", state.models.join(", ")),
    item("agents up", `${up}/${state.agents.length}`),
    item("in flight", running),
    item("decoding", `${rate.toFixed(1)} tok/s`),
    item("done", done.length),
    item("fallbacks", fallbacks),
    item("prompts reusing a cached prefix", done.length ? fmtPct(hits / done.length) : "–"));
  topology(state);
  document.getElementById("agents").replaceChildren(...state.agents.map(agentCard));
  const list = document.getElementById("requests");
  const rows = state.requests.slice(0, 40).map((r) => requestRow(r, win));
  list.replaceChildren(...(rows.length ? [timeAxis(win), ...rows] : [h("p", { class: "muted" }, "No requests yet.")]));
  const measured = state.requests.filter((r) => r.state === "done" || r.outcome === "cancelled");
  latencyChart("c-ttft", measured, "ttft", win);
  latencyChart("c-tpot", measured, "tpot", win);
  seriesChart("c-queue", "waiting", (v) => v.toFixed(v < 10 && v % 1 ? 1 : 0), win, "waiting for a first token");
  seriesChart("c-mem", "rss", fmtB, win, "agents' resident memory");
  tpsChart(done, state.now);
  kvChart(done);
}

async function poll() {
  const live = document.getElementById("live");
  try {
    const resp = await fetch("/ui/api/state", { credentials: "same-origin", cache: "no-store" });
    if (resp.status === 401) { location.reload(); return; } // signed out: the server shows the key form
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    render(await resp.json());
    live.className = "live ok";
    live.textContent = `live · ${new Date().toLocaleTimeString()}`;
  } catch (e) {
    live.className = "live bad";
    live.textContent = `gateway not answering (${e.message})`;
  }
  setTimeout(poll, POLL_MS);
}

poll();
