// fdeplb web view: draws the view dict of fdeplb/ui/view_model.py (live: server-sent events from /v1/ui/events;
// player: /v1/ui/view?step=N). No computation of cluster facts here: states, counts, timeline segments, heatmap
// values and replay checks all come from the server. Plain JavaScript, no library.
"use strict";

const SVGNS = "http://www.w3.org/2000/svg";
const $ = (sel, root = document) => root.querySelector(sel);
const $$ = (sel, root = document) => Array.from(root.querySelectorAll(sel));
const ui = { view: null, mode: null, selected: null, lastAuditId: null, rows: [], es: null, step: null };

function el(tag, attrs = {}, text) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVGNS, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) if (v !== undefined && v !== null) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}
const fmtMs = (ms) => ms === null || ms === undefined ? "–" : Math.abs(ms) >= 10000 ? `${(ms / 1000).toFixed(0)} s`
  : Math.abs(ms) >= 1000 ? `${(ms / 1000).toFixed(1)} s` : `${Math.round(ms)} ms`;
const fmtBytes = (b) => b === null || b === undefined ? "–" : b >= 1 << 30 ? `${(b / (1 << 30)).toFixed(2)} GiB`
  : b >= 1 << 20 ? `${(b / (1 << 20)).toFixed(1)} MiB` : b >= 1024 ? `${(b / 1024).toFixed(1)} KiB` : `${b} B`;
const fmtTime = (ms) => { const d = new Date(Number(ms)); return isNaN(d) ? "" :
  d.toISOString().slice(11, 23); };
const short = (id) => id ? String(id).slice(0, 12) : "–";

async function getJSON(url) {
  const r = await fetch(url, { credentials: "same-origin", cache: "no-store" });
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw Object.assign(new Error(body.msg || `HTTP ${r.status}`), { status: r.status });
  return body;
}

// ---- diagrams ------------------------------------------------------------------------------------------------------
async function loadDiagrams() {
  const svgs = await getJSON("/v1/ui/diagrams");
  for (const [machine, svg] of Object.entries(svgs)) {
    const box = $(`#diagram-${machine}`);
    if (box) box.innerHTML = svg;
  }
}

function drawDiagrams(view) {
  for (const [machine, held] of Object.entries(view.current)) {
    for (const g of $$(`g[data-machine="${machine}"][data-state]`)) {
      const n = held[g.dataset.state] || 0;
      if (n > 0) g.setAttribute("aria-current", "true"); else g.removeAttribute("aria-current");
      drawCount(g, machine === "cluster" ? 0 : n);
    }
    const last = view.last[machine];
    for (const e of $$(`g.edge[data-machine="${machine}"]`)) {
      const isLast = last && e.dataset.from === last.from && e.dataset.trigger === last.trigger;
      if (isLast) e.setAttribute("data-last", "true"); else e.removeAttribute("data-last");
    }
  }
  drawSelection();
}

function drawCount(g, n) {
  let badge = $("g.count-badge", g);
  if (!n) { if (badge) badge.remove(); return; }
  if (!badge) {
    const box = g.getBBox();
    badge = el("svg:g", { class: "count-badge" });
    badge.appendChild(el("svg:rect", { class: "count-bg", x: box.x + box.width - 14, y: box.y - 9, rx: 8,
      width: 28, height: 16 }));
    badge.appendChild(el("svg:text", { class: "count", x: box.x + box.width, y: box.y + 3,
      "text-anchor": "middle" }));
    g.appendChild(badge);
  }
  $("text", badge).textContent = String(n);
}

function drawSelection() {
  for (const e of $$("g.edge[data-selected]")) e.removeAttribute("data-selected");
  for (const g of $$("g.selected-end")) g.classList.remove("selected-end");
  const rec = ui.selected;
  if (!rec) return;
  const machine = rec.machine;
  const edge = $$(`g.edge[data-machine="${machine}"]`).find(
    (e) => e.dataset.from === rec.from && e.dataset.trigger === rec.trigger);
  if (edge) edge.setAttribute("data-selected", "true");
  for (const s of [rec.from, rec.to]) {
    const g = $(`g[data-machine="${machine}"][data-state="${s}"]`);
    if (g) g.classList.add("selected-end");
  }
}

// ---- summary -------------------------------------------------------------------------------------------------------
function drawSummary(view) {
  const s = view.summary;
  $("#s-state").textContent = s.state ?? "no records";
  $("#s-state").dataset.state = s.state ?? "none";
  $("#s-cordoned").hidden = !s.cordoned;
  $("#s-round").textContent = s.round ?? "–";
  $("#s-plan").textContent = short(s.plan_id);
  $("#s-plan").title = s.plan_id || "";
  const left = s.deadline_left_ms;
  $("#s-deadline").textContent = left === null || left === undefined ? "none" :
    left >= 0 ? `${fmtMs(left)} left` : `passed ${fmtMs(-left)} ago`;
  const last = view.last.cluster;
  $("#s-last").textContent = last ? `${last.from} → ${last.to} (${last.trigger})` : "–";
  $("#s-reason").textContent = [s.alarm ? `alarm: ${s.alarm}` : "", s.reason || ""].filter(Boolean).join(" · ") || "–";
  $("#cluster-id").textContent = `cluster ${view.cluster}` + (s.lease_holder ? ` · coordinator ${s.lease_holder}` : "")
    + (s.generation !== null && s.generation !== undefined ? ` · generation ${s.generation}` : "");
}

// ---- notices: what an operator must know or do, in the read model's words -------------------------------------------
function drawNotices(view) {
  const box = $("#notices");
  box.textContent = "";
  for (const kind of ["gone", "recreated", "waiting"]) {  // each {title, text}; waiting also {command, also}
    const n = view[kind];
    if (!n) continue;
    const div = el("div", { class: `notice notice-${kind}`, "data-notice": kind, role: kind === "gone" ? "alert" : "status" });
    div.append(el("b", {}, n.title), el("p", {}, n.text));
    if (n.command) div.append(el("code", { id: "commit-command" }, n.command), el("p", { class: "small" }, n.also));
    box.appendChild(div);
  }
  document.body.dataset.gone = String(Boolean(view.gone));
}

// ---- ranks ---------------------------------------------------------------------------------------------------------
function drawLegend(view) {
  const box = $("#legend");
  box.textContent = "";
  const groups = [["rank", "rank state", view.counts.rank], ["weights", "weights (stripe)", view.counts.weights],
    ["membership", "membership (dashed: not active)", view.counts.membership]];
  for (const [machine, label, counts] of groups) {
    const g = el("div", { class: "legend-group" });
    g.appendChild(el("b", {}, label));
    for (const state of view.states[machine]) {
      const n = counts[state] || 0;
      const item = el("span", { class: `legend-item${n ? "" : " zero"}`, "data-legend-machine": machine,
        "data-legend-state": state, "data-count": n });
      item.appendChild(el("i", { class: `sw ${machine}-${state}` }));
      item.appendChild(document.createTextNode(`${state} ${n}`));
      g.appendChild(item);
    }
    box.appendChild(g);
  }
  if (view.mode === "live") {
    const g = el("div", { class: "legend-group" });
    const item = el("span", { class: `legend-item${view.counts.stale ? "" : " zero"}`, "data-legend-state": "stale",
      "data-count": view.counts.stale });
    item.appendChild(el("i", { class: "sw stale" }));
    item.appendChild(document.createTextNode(`stale ${view.counts.stale}`));
    g.appendChild(item);
    box.appendChild(g);
  }
}

function drawRanks(view) {
  const grid = $("#ranks");
  grid.classList.toggle("dense", view.ranks.length > 96);
  grid.classList.toggle("roomy", view.ranks.length <= 16);
  while (grid.children.length > view.ranks.length) grid.lastChild.remove();
  for (const r of view.ranks) {
    let cell = grid.children[r.ep_rank];
    if (!cell) { cell = el("div", { class: "cell", "data-rank": r.ep_rank }, String(r.ep_rank)); grid.appendChild(cell); }
    cell.dataset.state = r.state;
    cell.dataset.weights = r.weights;
    cell.dataset.membership = r.membership;
    cell.dataset.stale = r.stale === null ? "unknown" : String(r.stale);
  }
  $("#rank-total").textContent = `${view.ranks.length} ranks` + (view.counts.stale ? `, ${view.counts.stale} stale` : "");
  drawLegend(view);
}

function rankTip(r) {
  // built from text nodes only: the values come from Redis (a rank's reason is an agent's error text)
  const rows = [["rank", String(r.ep_rank), true], ["state", r.state], ["weights", r.weights],
    ["membership", r.membership]];
  if (ui.mode === "live") {
    rows.push(["heartbeat", r.heartbeat_age_ms === null ? "never" : `${fmtMs(r.heartbeat_age_ms)} ago` +
      (r.heartbeat_ttl_ms ? ` (ttl ${fmtMs(r.heartbeat_ttl_ms)})` : "")]);
    rows.push(["stale", r.stale ? "yes" : "no", Boolean(r.stale)], ["step", r.step ?? "–"],
      ["staged", fmtBytes(r.staged_bytes)], ["routing", r.routing ?? "–"]);
  }
  if (r.reason) rows.push(["reason", r.reason]);
  const out = document.createDocumentFragment();
  rows.forEach(([k, v, bold], i) => {
    if (i) out.appendChild(document.createElement("br"));
    out.appendChild(document.createTextNode(`${k}: `));
    const value = document.createTextNode(String(v));
    if (bold) { const b = document.createElement("b"); b.appendChild(value); out.appendChild(b); }
    else out.appendChild(value);
  });
  return out;
}

function setupTips() {
  const tip = $("#tip");
  document.addEventListener("mouseover", (ev) => {
    const cell = ev.target.closest && ev.target.closest(".cell[data-rank]");
    if (!cell || !ui.view) { tip.hidden = true; return; }
    const r = ui.view.ranks[Number(cell.dataset.rank)];
    if (!r) return;
    tip.replaceChildren(rankTip(r));
    tip.hidden = false;
    const box = cell.getBoundingClientRect();
    tip.style.left = `${Math.min(window.innerWidth - 300, box.right + 8)}px`;
    tip.style.top = `${box.top}px`;
  });
}

// ---- timeline ------------------------------------------------------------------------------------------------------
function drawTimeline(view) {
  const box = $("#timeline");
  box.textContent = "";
  const rounds = view.timeline.rounds;
  if (!rounds.length) { box.appendChild(el("div", { class: "empty" }, "no round yet")); return; }
  const width = Math.max(600, box.clientWidth || 1200);
  const left = 96, right = 16, plotW = width - left - right;
  const n = view.ranks.length;
  const laneH = Math.max(2, Math.min(14, Math.floor(220 / Math.max(1, n))));
  const svg = el("svg:svg", { "data-timeline": "" });
  let y = 4;
  for (const round of rounds.slice().reverse()) {  // the newest first
    const lanes = Object.entries(round.ranks);
    let hi = round.end_ms ?? view.timeline.now_ms;
    for (const [, segs] of lanes) for (const s of segs) hi = Math.max(hi, s.end_ms ?? (round.end_ms === null ? view.timeline.now_ms : s.start_ms));
    const lo = round.start_ms;
    const span = Math.max(1, hi - lo);
    const x = (t) => left + ((t - lo) / span) * plotW;
    const g = el("svg:g", { "data-round": round.round, transform: `translate(0, ${y})` });
    const dur = (round.end_ms ?? view.timeline.now_ms) - round.start_ms;
    g.appendChild(el("svg:text", { x: 0, y: 12, "font-weight": "bold" },
      `round ${round.round} · ${round.outcome} · ${fmtMs(dur)}`));
    let ly = 20;
    g.appendChild(el("svg:text", { x: 0, y: ly + 15, class: "lane-label" }, "cluster"));
    for (const s of round.cluster) {
      const x0 = x(s.start_ms), x1 = x(s.end_ms ?? hi);
      const rect = el("svg:rect", { x: x0, y: ly, width: Math.max(1, x1 - x0), height: 22,
        class: `seg-${s.state}`, "data-segment-state": s.state });
      rect.appendChild(el("svg:title", {}, `${s.state}: ${fmtMs((s.end_ms ?? view.timeline.now_ms) - s.start_ms)}` +
        (s.deadline_ms ? ` (deadline ${fmtMs(s.deadline_ms - s.start_ms)} after entry)` : "")));
      g.appendChild(rect);
      if (x1 - x0 > 60) g.appendChild(el("svg:text", { x: x0 + 4, y: ly + 15, class: "seg-label" }, s.state));
      if (s.deadline_ms && s.deadline_ms <= hi) {
        g.appendChild(el("svg:line", { x1: x(s.deadline_ms), x2: x(s.deadline_ms), y1: ly - 3, y2: ly + 25,
          class: "deadline" }));
      }
    }
    const open = round.cluster.length && round.cluster[round.cluster.length - 1].end_ms === null;
    const lastSeg = round.cluster[round.cluster.length - 1];
    if (open && lastSeg.deadline_ms) {  // the running state's deadline, said in words when it is off the scale
      const t = lastSeg.deadline_ms;
      g.appendChild(el("svg:text", { x: Math.min(width - 150, x(Math.min(t, hi)) + 4), y: ly - 4, class: "lane-label" },
        `deadline in ${fmtMs(t - view.timeline.now_ms)}`));
    }
    for (const m of round.marks) {
      const mx = x(m.ts_ms);
      const tri = el("svg:path", { d: `M${mx - 6},${ly - 8} L${mx + 6},${ly - 8} L${mx},${ly + 2} Z`,
        class: `mark-${m.kind}`, "data-mark": m.kind });
      tri.appendChild(el("svg:title", {}, `${m.kind}: ${m.reason}`));
      g.appendChild(tri);
    }
    ly += 30;
    const ranksTop = ly;
    // every rank lane labelled where the lanes are tall enough, else every k-th (with the rank count)
    const every = laneH >= 9 ? 1 : Math.ceil(9 / laneH);
    g.appendChild(el("svg:text", { x: 0, y: ranksTop + 10, class: "lane-label" }, `ranks (${n})`));
    for (let r = 0; r < n; r += every) {
      g.appendChild(el("svg:text", { x: left - 6, y: ranksTop + r * laneH + Math.min(laneH, 9) - 1,
        class: "rank-label", "text-anchor": "end", "data-lane-rank": r }, every > 1 ? String(r) : `rank ${r}`));
    }
    for (const [rank, segs] of lanes) {
      const ry = ranksTop + Number(rank) * laneH;
      for (const s of segs) {
        const x0 = x(s.start_ms), x1 = x(s.end_ms ?? (round.end_ms === null ? view.timeline.now_ms : hi));
        const rect = el("svg:rect", { x: x0, y: ry, width: Math.max(1, x1 - x0), height: Math.max(1, laneH - 1),
          class: `rseg-${s.state}` });
        if (laneH >= 4) rect.appendChild(el("svg:title", {}, `rank ${rank} ${s.state}: ${fmtMs((s.end_ms ?? hi) - s.start_ms)}`));
        g.appendChild(rect);
      }
    }
    ly = ranksTop + n * laneH + 6;
    // axis
    const axis = el("svg:g", { class: "axis" });
    for (let i = 0; i <= 5; i++) {
      const t = lo + (span * i) / 5;
      axis.appendChild(el("svg:line", { x1: x(t), x2: x(t), y1: 20, y2: ly, stroke: "#eef0f3" }));
      axis.appendChild(el("svg:text", { x: x(t), y: ly + 10, "text-anchor": i === 5 ? "end" : "middle" },
        `+${fmtMs(t - lo)}`));
    }
    g.insertBefore(axis, g.firstChild);
    if (round.end_ms === null) {
      g.appendChild(el("svg:line", { x1: x(view.timeline.now_ms), x2: x(view.timeline.now_ms), y1: 18, y2: ly,
        class: "now" }));
    }
    if (ui.selected && ui.selected.ts_ms >= lo && ui.selected.ts_ms <= hi) {
      g.appendChild(el("svg:line", { x1: x(ui.selected.ts_ms), x2: x(ui.selected.ts_ms), y1: 16, y2: ly,
        class: "moment", "data-moment": ui.selected.id }));
    }
    svg.appendChild(g);
    y += ly + 24;
  }
  svg.setAttribute("viewBox", `0 0 ${width} ${y}`);
  svg.setAttribute("height", y);
  box.appendChild(svg);
}

// ---- plan ----------------------------------------------------------------------------------------------------------
function rdbu(v, lo, hi) {  // GPU load / layer mean on a diverging scale centred on 1 (as rebalance --plot)
  const t = v >= 1 ? Math.min(1, (v - 1) / Math.max(1e-9, hi - 1)) : -Math.min(1, (1 - v) / Math.max(1e-9, 1 - lo));
  const mix = (a, b, f) => Math.round(a + (b - a) * f);
  const white = [247, 247, 247], red = [178, 24, 43], blue = [33, 102, 172];
  const c = t >= 0 ? red : blue, f = Math.abs(t);
  return `rgb(${mix(white[0], c[0], f)},${mix(white[1], c[1], f)},${mix(white[2], c[2], f)})`;
}

function heatmap(values, lo, hi) {
  const L = values.length, G = values[0].length;
  const canvas = el("canvas", { width: G, height: L });
  const ctx = canvas.getContext("2d");
  for (let l = 0; l < L; l++) for (let g = 0; g < G; g++) { ctx.fillStyle = rdbu(values[l][g], lo, hi); ctx.fillRect(g, l, 1, 1); }
  return canvas;
}

function drawPlan(view) {
  const box = $("#plan");
  const p = view.plan;
  const key = p ? `${p.plan_id}` : "";
  if (box.dataset.plan === key) return;
  box.dataset.plan = key;
  box.textContent = "";
  $("#plan-id").textContent = p ? `${p.plan_id} · round ${p.round} · ${p.policy}` : "";
  if (!p) { box.appendChild(el("div", { class: "empty" }, "no plan yet")); return; }
  const figs = el("div", { class: "plan-figs" });
  for (const [label, value] of [["balancedness before", p.balancedness_before.toFixed(4)],
    ["balancedness after", p.balancedness_after.toFixed(4)], ["moved experts", p.moved_experts],
    ["layers × GPUs", `${p.before.length} × ${p.before[0].length}`],
    ...(p.live_ranks ? [["over members", p.live_ranks.join(", ")]] : [])]) {
    const d = el("div"); d.appendChild(el("span", {}, label)); d.appendChild(el("b", {}, String(value))); figs.appendChild(d);
  }
  box.appendChild(figs);
  const maps = el("div", { class: "heatmaps" });
  for (const [label, values] of [["before (old placement)", p.before], ["after (plan)", p.after]]) {
    const f = el("figure");
    const worst = Math.max(...values.map((row) => Math.max(...row)));
    f.appendChild(el("figcaption", {}, `${label} · worst max/mean ${worst.toFixed(3)}`));
    f.appendChild(heatmap(values, p.lo, p.hi));
    maps.appendChild(f);
  }
  box.appendChild(maps);
  const bar = el("div", { class: "colorbar" });
  const c = el("canvas", { width: 100, height: 1 });
  const ctx = c.getContext("2d");
  for (let i = 0; i < 100; i++) { ctx.fillStyle = rdbu(p.lo + ((p.hi - p.lo) * i) / 99, p.lo, p.hi); ctx.fillRect(i, 0, 1, 1); }
  bar.append(`GPU load / layer mean  ${p.lo.toFixed(2)}`, c, `${p.hi.toFixed(2)}  (rows: layers, columns: GPUs)`);
  box.appendChild(bar);
}

// ---- audit ---------------------------------------------------------------------------------------------------------
function filterQuery() {
  const form = $("#filters");
  const q = new URLSearchParams();
  for (const name of ["machine", "rank", "round"]) { const v = form.elements[name].value.trim(); if (v) q.set(name, v); }
  q.set("limit", "500");
  return q.toString();
}

async function loadAudit() {
  try {
    const body = await getJSON(`/v1/ui/audit?${filterQuery()}`);
    $("#audit-error").textContent = "";
    ui.rows = body.rows;
    drawAudit();
  } catch (err) {
    $("#audit-error").textContent = err.message;
  }
}

function drawAudit() {
  const tbody = $("#audit tbody");
  tbody.textContent = "";
  const rows = ui.rows.slice().reverse();  // the newest first
  for (const rec of rows) {
    const tr = el("tr", { "data-audit-id": rec.id, "data-machine-row": rec.machine });
    if (rec.step !== undefined) { tr.dataset.step = rec.step; tr.dataset.check = rec.check; }
    if (ui.selected && ui.selected.id === rec.id) tr.setAttribute("aria-selected", "true");
    if (ui.mode === "player" && rec.step === ui.step) tr.classList.add("at-step");
    const transition = rec.from === rec.to ? `${rec.from} (note)` : `${rec.from} → ${rec.to}`;
    const cells = [short(rec.id) === rec.id ? rec.id : rec.id, fmtTime(rec.ts_ms), rec.machine, rec.key, transition,
      rec.trigger, rec.round ?? "", rec.reason || ""];
    cells.forEach((v, i) => tr.appendChild(el("td", i === 7 ? { class: "reason" } : {}, String(v))));
    if (ui.mode === "player") {
      tr.appendChild(el("td", { class: `player-only check-${rec.check}`, title: rec.reason || "" },
        rec.check === "failed" ? `FAILED: ${rec.reason}` : rec.check));
    }
    tbody.appendChild(tr);
  }
  $("#audit-count").textContent = `${ui.rows.length} records shown` + (ui.mode === "live" ? " (newest first)" : "");
}

function selectRecord(rec) {
  ui.selected = rec;
  for (const tr of $$("#audit tbody tr[aria-selected]")) tr.removeAttribute("aria-selected");
  const tr = $(`#audit tbody tr[data-audit-id="${CSS.escape(rec.id)}"]`);
  if (tr) tr.setAttribute("aria-selected", "true");
  drawSelection();
  if (ui.view) drawTimeline(ui.view);
}

function setupAudit() {
  $("#filters").addEventListener("input", () => { clearTimeout(ui.filterTimer); ui.filterTimer = setTimeout(loadAudit, 200); });
  $("#filters").addEventListener("submit", (ev) => ev.preventDefault());
  $("#audit tbody").addEventListener("click", (ev) => {
    const tr = ev.target.closest("tr[data-audit-id]");
    if (!tr) return;
    const rec = ui.rows.find((r) => r.id === tr.dataset.auditId);
    if (!rec) return;
    if (ui.mode === "player" && rec.step !== undefined && rec.step !== ui.step) {
      goTo(rec.step).then(() => selectRecord(rec));
    } else {
      selectRecord(rec);
    }
  });
}

// ---- render --------------------------------------------------------------------------------------------------------
function render(view) {
  ui.view = view;
  drawNotices(view);
  drawSummary(view);
  drawDiagrams(view);
  drawRanks(view);
  drawTimeline(view);
  drawPlan(view);
  document.body.dataset.clusterState = view.summary.state ?? "none";
  if (view.mode === "player") drawPlayer(view.player);
  if (view.mode === "live" && view.last_audit_id !== ui.lastAuditId) {
    ui.lastAuditId = view.last_audit_id;
    loadAudit();
  }
}

function setMode(mode) {
  ui.mode = mode;
  document.body.dataset.mode = mode;
  $("#mode").textContent = mode === "player" ? "recording player" : "live";
}

function setConn(state, text) {
  const c = $("#conn");
  c.dataset.conn = state;
  c.textContent = text;
  document.body.dataset.redis = state === "redis-down" ? "unavailable" : "ok";
}

// ---- live ----------------------------------------------------------------------------------------------------------
function startLive() {
  const es = new EventSource("/v1/ui/events");
  ui.es = es;
  es.onmessage = (ev) => {
    const data = JSON.parse(ev.data);
    if (data.redis === "unavailable") { setConn("redis-down", `Redis unavailable (${data.error || "no answer"})`); return; }
    if (data.error && !data.summary) { setConn("reconnecting", data.error); return; }
    setConn("live", "live");
    render(data);
  };
  es.onerror = () => { if ($("#conn").dataset.conn !== "redis-down") setConn("reconnecting", "reconnecting…"); };
}

// ---- player --------------------------------------------------------------------------------------------------------
async function goTo(step) {
  const max = Number($("#slider").max);
  step = Math.max(0, Math.min(max, step));
  ui.target = step;  // the step asked for last: answers to earlier requests are dropped
  const seq = (ui.seq = (ui.seq || 0) + 1);
  const view = await getJSON(`/v1/ui/view?step=${step}`);
  if (seq !== ui.seq) return;
  ui.step = view.player.step;
  ui.selected = view.player.record;  // the record at the step is the one highlighted
  $("#slider").value = String(ui.step);
  render(view);
  drawAudit();
}

function drawPlayer(p) {
  $("#player").hidden = false;
  const slider = $("#slider");
  slider.max = String(p.steps);
  $("#prev").disabled = p.step <= 0;
  $("#next").disabled = p.step >= p.steps;
  const rec = p.record;
  $("#step-label").textContent = `record ${p.step} / ${p.steps}` + (rec ? ` · ${rec.key} ${rec.trigger} · ${rec.id}` : " · start of the recording");
  const sum = $("#checks-summary");
  sum.textContent = `${p.file}: ${p.checks.summary}`;
  sum.dataset.ok = String(p.checks.ok);
  const rc = $("#record-check");
  rc.dataset.check = rec ? rec.check : "none";
  rc.textContent = rec ? (rec.check === "failed" ? `this record FAILED the replay: ${rec.reason}` :
    rec.check === "unchecked" ? rec.reason : "this record passed the replay's checks") : "";
  const ticks = $("#fail-ticks");
  ticks.textContent = "";
  for (const s of p.failed_steps) {
    ticks.appendChild(el("i", { style: `left: ${(100 * s) / Math.max(1, p.steps)}%`, title: `record ${s} failed`,
      "data-failed-step": s }));
  }
}

function setupPlayer() {
  $("#slider").addEventListener("input", (ev) => goTo(Number(ev.target.value)));
  const here = () => (ui.target ?? ui.step);
  $("#prev").addEventListener("click", () => goTo(here() - 1));
  $("#next").addEventListener("click", () => goTo(here() + 1));
  document.addEventListener("keydown", (ev) => {
    if (ui.mode !== "player" || ev.target.closest("input, select")) return;
    if (ev.key === "ArrowLeft") goTo((ui.target ?? ui.step) - 1);
    if (ev.key === "ArrowRight") goTo((ui.target ?? ui.step) + 1);
  });
}

// ---- start ---------------------------------------------------------------------------------------------------------
async function main() {
  setupTips();
  setupAudit();
  await loadDiagrams();
  let first;
  try {
    first = await getJSON("/v1/ui/view");
  } catch (err) {
    if (err.status === 503) { setMode("live"); setConn("redis-down", `Redis unavailable (${err.message})`); startLive(); return; }
    setConn("reconnecting", err.message);
    return;
  }
  setMode(first.mode);
  if (first.mode === "player") {
    setupPlayer();
    setConn("player", "recording");
    $("#slider").max = String(first.player.steps);
    ui.step = first.player.step;
    await loadAudit();
    await goTo(first.player.step);
  } else {
    setConn("live", "live");
    render(first);
    startLive();
  }
  window.addEventListener("resize", () => { if (ui.view) drawTimeline(ui.view); });
}

main();
