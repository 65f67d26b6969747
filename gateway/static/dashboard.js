// The swarmroute dashboard: renders each DashboardState frame from /dashboard/events (gateway/dashboard_feed.py).
// Plain DOM, no framework, no build step. Every text comes in through textContent: messages quote what nodes said.
"use strict";

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "class") node.className = value;
    else if (key === "style") node.setAttribute("style", value);
    else node.setAttribute(key, value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function bytes(n) {
  if (!n) return "–";
  if (n >= 1e9) return (n / 1e9).toFixed(2) + " GB";
  if (n >= 1e6) return (n / 1e6).toFixed(1) + " MB";
  return (n / 1e3).toFixed(0) + " kB";
}

function ms(v, digits = 2) { return v === null || v === undefined ? "–" : v.toFixed(digits); }

function duration(s) {
  if (s === null || s === undefined) return "ETA unknown";
  if (s < 60) return `ETA ${Math.ceil(s)} s`;
  return `ETA ${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
}

function range(layers) { return `[${layers[0]}, ${layers[1]})`; }

function layerClass(layer) {
  if (layer.serving.length && layer.standby.length) return "standby";
  if (layer.serving.length) return "serving";
  if (layer.fetching.length) return "fetching";
  return "missing";
}

function layerTitle(i, layer) {
  const parts = [`layer ${i}`];
  parts.push(`serving: ${layer.serving.join(", ") || "none"}`);
  if (layer.standby.length) parts.push(`standby: ${layer.standby.join(", ")}`);
  if (layer.fetching.length) parts.push(`fetching: ${layer.fetching.join(", ")}`);
  return parts.join("\n");
}

function renderModel(model, nodes) {
  const served = model.layers.filter((l) => l.serving.length).length;
  const badge = model.complete
    ? el("span", { class: "badge complete" }, "complete: a route can form")
    : el("span", { class: "badge incomplete" },
      "incomplete: " + (model.missing.length ? `layers ${model.missing.join(", ")} not served` : "no chain of ranges"));
  const bar = el("div", { class: "bar", role: "img",
    "aria-label": `${served} of ${model.n_layers} layers served` },
  model.layers.map((layer, i) => el("div", { class: `layer ${layerClass(layer)}`, title: layerTitle(i, layer) },
    layer.serving.length + layer.standby.length || "")));
  const mine = nodes.filter((n) => n.model === model.name || n.model === model.id);
  const rows = mine.map((n) => {
    const left = (100 * n.layers[0]) / model.n_layers;
    const width = (100 * (Math.min(n.layers[1], model.n_layers) - n.layers[0])) / model.n_layers;
    const label = n.state === "fetching" && n.fetch
      ? `${n.node_id} fetching ${Math.round(100 * n.fetch.fraction)}%` : `${n.node_id} ${n.state}`;
    return el("div", { class: "range" },
      el("span", { class: n.state, style: `left:${left}%;width:${width}%`, title: `${n.node_id} ${range(n.layers)}` },
        label));
  });
  return el("div", { class: "model", "data-model": model.id },
    el("h3", {}, model.name, badge,
      el("span", { class: "muted" }, [...model.aliases, model.id.slice(0, 12)].join(" · ")),
      el("span", { class: "muted" }, `${served}/${model.n_layers} layers served`)),
    bar, el("div", { class: "ranges" }, rows));
}

function fetchCell(fetch) {
  if (!fetch) return "";
  const pct = Math.round(100 * fetch.fraction);
  return el("span", { class: "fetch" },
    el("span", { class: "progress" }, el("i", { style: `width:${pct}%` })),
    `${fetch.phase} ${pct}% · ${bytes(fetch.bytes_downloaded)} of ${bytes(fetch.bytes_needed)} · `
    + `${bytes(fetch.rate_bps)}/s · ${duration(fetch.eta_s)}`,
    fetch.message ? el("div", { class: "muted" }, fetch.message) : null);
}

function renderNodes(nodes) {
  const body = document.querySelector("#nodes tbody");
  body.replaceChildren(...nodes.map((n) => el("tr", { "data-node": n.node_id },
    el("td", {}, n.node_id, el("div", { class: "muted" }, n.endpoint || "(no endpoint yet)")),
    el("td", {}, el("span", { class: `state ${n.state}` }, n.state)),
    el("td", {}, range(n.layers), n.head ? " head" : "", n.tail ? " tail" : ""),
    el("td", { class: "num" }, n.threads || "–"),
    el("td", { class: "num" }, bytes(n.rss_bytes)),
    el("td", { class: "num" }, bytes(n.kv_bytes)),
    el("td", { class: "num" }, `${n.active_sessions}/${n.max_sessions}`),
    el("td", { class: "num" }, n.compute_ms_per_layer === null ? "–" : `${ms(n.compute_ms_per_layer, 3)} ms`),
    el("td", {}, fetchCell(n.fetch)),
    el("td", { class: "num" }, `${n.heartbeat_age_s.toFixed(1)} s ago`))));
}

function link(rtt, arrow) { return rtt === null || rtt === undefined ? arrow : `${arrow} ${ms(rtt)} ms ${arrow}`; }

function renderRoute(route) {
  const parts = [];
  route.forEach((hop, i) => {
    parts.push(el("span", { class: `hop ${hop.health}` },
      `${hop.node_id} ${range(hop.layers)} ${ms(hop.compute_ms)} ms`));
    if (i < route.length - 1) parts.push(el("span", { class: "link" }, link(hop.link_rtt_ms, "→")));
  });
  // the tail's tokens go back to the head: the ring's last link
  const back = route.length > 1 ? route[route.length - 1].link_rtt_ms : null;
  if (back !== null && back !== undefined) parts.push(el("span", { class: "link" }, `↩ ${ms(back)} ms`));
  return parts;
}

function renderSessions(sessions) {
  const body = document.querySelector("#sessions tbody");
  if (!sessions.length) {
    body.replaceChildren(el("tr", {}, el("td", { colspan: "8", class: "muted" }, "No session in the last 30 s.")));
    return;
  }
  body.replaceChildren(...sessions.map((s) => {
    const spec = s.speculation_acceptance === null ? "–"
      : `${Math.round(100 * s.speculation_acceptance)}% accepted (${s.speculation_windows} windows)`;
    const notes = [s.failure, s.repair].filter(Boolean).map((t) => el("div", { class: "muted" }, t));
    const prefill = s.phase === "prefill" ? ` (prefill ${s.prefill_done}/${s.prefill_total})` : "";
    return el("tr", { "data-session": s.session_id },
      el("td", {}, s.session_id.slice(0, 8), el("div", { class: "muted" }, s.model)),
      el("td", {}, el("span", { class: `phase ${s.phase}` }, s.phase + prefill)),
      el("td", {}, renderRoute(s.route), notes),
      el("td", { class: "num" }, s.generated_tokens),
      el("td", { class: "num" }, s.tokens_per_s.toFixed(1)),
      el("td", { class: "num" }, ms(s.link_ms)),
      el("td", {}, spec),
      el("td", {}, s.health));
  }));
}

function renderLinks(links) {
  const box = document.getElementById("links");
  if (!links.nodes.length) {
    box.replaceChildren(el("p", { class: "muted" },
      "No link measured yet: nodes measure the nodes they route to and from."));
    return;
  }
  const head = el("tr", {}, el("th", {}, "from \\ to"), links.nodes.map((n) => el("th", {}, n)));
  const rows = links.nodes.map((from, i) => el("tr", {}, el("th", {}, from),
    links.rtt_ms[i].map((v, j) => el("td", { class: "num" }, i === j ? "·" : ms(v, 3)))));
  box.replaceChildren(el("table", {}, el("thead", {}, head), el("tbody", {}, rows)));
}

function renderEvents(events) {
  const list = document.getElementById("events");
  if (!events.length) {
    list.replaceChildren(el("li", { class: "muted" }, "Nothing has happened yet."));
    return;
  }
  list.replaceChildren(...events.map((e) => el("li", { class: e.kind },
    el("time", {}, new Date(e.at * 1000).toLocaleTimeString()), e.text)));
}

function render(state) {
  const models = document.getElementById("models");
  if (state.models.length) models.replaceChildren(...state.models.map((m) => renderModel(m, state.nodes)));
  else models.replaceChildren(el("p", { class: "muted" }, "No node serves a model."));
  renderNodes(state.nodes);
  renderSessions(state.sessions);
  renderLinks(state.links);
  renderEvents(state.events);
  document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
}

function connect() {
  const status = document.getElementById("status");
  const source = new EventSource("/dashboard/events");
  source.onopen = () => { status.className = "status live"; status.textContent = "live"; };
  source.onmessage = (msg) => render(JSON.parse(msg.data));
  source.onerror = () => { status.className = "status down"; status.textContent = "disconnected: retrying"; };
}

connect();
