/* The /admin/ dashboard: polls the staff-only JSON endpoint and redraws.
 *
 * Polling rather than a WebSocket: a plain GET every few seconds works through any proxy or
 * load balancer, needs no sticky sessions, and keeps working when the web process that
 * served the page goes away (the next poll lands on another). The data comes from the
 * database each time, so every web process answers the same. The poll waits for the previous
 * one to finish and pauses while the tab is hidden, so an idle tab costs nothing.
 */
"use strict";

(function () {
  const root = document.getElementById("llmgw-dashboard");
  if (!root) return;
  const url = root.dataset.url;
  const interval = Number(root.dataset.interval || 5000);
  const charts = window.LlmgwCharts;
  const $ = (id) => document.getElementById(id);
  let timer = null;
  let busy = false;
  let last = null;

  function node(tag, attrs, ...children) {
    const element = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "class") element.className = value;
      else element.setAttribute(key, value === true ? "" : String(value));
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      element.appendChild(typeof child === "string" || typeof child === "number" ? document.createTextNode(String(child)) : child);
    }
    return element;
  }

  function gib(mib) {
    const value = mib / 1024;
    return (value >= 10 ? value.toFixed(0) : value.toFixed(1)) + " GiB";
  }

  function age(seconds) {
    if (seconds === null || seconds === undefined) return "never";
    if (seconds < 90) return `${Math.round(seconds)}s ago`;
    if (seconds < 5400) return `${Math.round(seconds / 60)}m ago`;
    return `${Math.round(seconds / 3600)}h ago`;
  }

  function badge(state) {
    return node("span", { class: `lg-badge lg-state-${state}` }, state);
  }

  function renderSummary(data) {
    const s = data.summary;
    $("lg-summary").replaceChildren(
      node("div", { class: "lg-stat" }, node("strong", {}, `${s.nodes_ready}/${s.nodes}`), " nodes ready"),
      node("div", { class: "lg-stat" }, node("strong", {}, `${s.gpus_allocated}/${s.gpus}`), " GPUs allocated"),
      node("div", { class: "lg-stat" }, node("strong", {}, `${s.replicas_ready}/${s.replicas_desired}`), " replicas ready"),
    );
  }

  function renderLease(lease) {
    const box = $("lg-lease");
    if (!lease.held) {
      box.replaceChildren(
        node("span", { class: "lg-badge lg-state-lost" }, "no leader"),
        lease.epoch ? ` last epoch ${lease.epoch}` : " the lease was never claimed",
      );
      return;
    }
    box.replaceChildren(
      node("span", { class: "lg-badge lg-state-ready" }, `epoch ${lease.epoch}`),
      " leader ",
      node("code", {}, lease.holder),
      ` · ${lease.expires_in.toFixed(1)}s left`,
    );
  }

  /* A GPU is given whole to one shard, so the bar shows the allocation (all of the GPU, in
   * colour, or none of it) and, darker inside it, the memory the agent last saw in use. */
  function gpuRow(gpu) {
    const used = gpu.memory_total_mib ? Math.min(100, (100 * gpu.memory_used_mib) / gpu.memory_total_mib) : 0;
    const bar = node("span", {
      class: gpu.allocated_to ? "lg-bar lg-allocated" : "lg-bar",
      title: `${gpu.allocated_to ? "allocated to " + gpu.allocated_to : "free"}; ${gib(gpu.memory_used_mib)} of ${gib(gpu.memory_total_mib)} in use`,
    });
    const usedFill = node("span", { class: "lg-used" });
    usedFill.style.width = `${used.toFixed(1)}%`;
    bar.appendChild(usedFill);
    return node(
      "li",
      { class: "lg-gpu" },
      node("span", { class: "lg-gpu-name" }, `GPU ${gpu.index}`),
      bar,
      node(
        "span",
        { class: "lg-gpu-use" },
        gpu.allocated_to ? node("span", { class: "lg-holder" }, gpu.allocated_to) : node("span", { class: "lg-quiet" }, "free"),
        ` · ${gib(gpu.memory_used_mib)} / ${gib(gpu.memory_total_mib)} used`,
        gpu.model ? node("span", { class: "lg-quiet" }, ` · ${gpu.model}`) : null,
      ),
    );
  }

  function renderNodes(nodes) {
    const box = $("lg-nodes");
    if (!nodes.length) {
      box.replaceChildren(node("p", { class: "lg-empty" }, "No nodes yet. Issue a node token (Nodes → action) and start an agent."));
      return;
    }
    box.replaceChildren(
      ...nodes.map((n) =>
        node(
          "article",
          { class: "lg-node" },
          node(
            "header",
            {},
            node("a", { href: n.url, class: "lg-node-name" }, n.name),
            badge(n.state),
            node("span", { class: "lg-quiet" }, ` heartbeat ${age(n.heartbeat_age_s)}`),
          ),
          n.gpus.length ? node("ul", { class: "lg-gpus" }, n.gpus.map(gpuRow)) : node("p", { class: "lg-quiet" }, "no GPUs reported"),
        ),
      ),
    );
  }

  function modelStatus(m) {
    const parts = [];
    if (!m.enabled) parts.push(node("span", { class: "lg-badge lg-state-cordoned" }, "disabled"));
    if (m.failed) parts.push(node("span", { class: "lg-badge lg-state-lost" }, `${m.failed} failed`));
    if (m.starting) parts.push(node("span", { class: "lg-badge lg-state-new" }, `${m.starting} starting`));
    if (m.draining) parts.push(node("span", { class: "lg-badge lg-state-draining" }, `${m.draining} draining`));
    if (m.demand_waiting && !m.ready) parts.push(node("span", { class: "lg-badge lg-state-new" }, "requests waiting"));
    if (m.placement_note) parts.push(node("span", { class: "lg-pending" }, `pending: ${m.placement_note}`));
    if (!parts.length) {
      parts.push(m.desired ? node("span", { class: "lg-badge lg-state-ready" }, "ready") : node("span", { class: "lg-quiet" }, "scaled to zero"));
    }
    return parts;
  }

  function hitRatio(name) {
    const model = last && last.traffic && last.traffic.models[name];
    const ratio = model ? model.prefix_hit_ratio : null;
    return ratio === null || ratio === undefined ? "–" : `${Math.round(ratio * 100)}%`;
  }

  function renderModels(models) {
    const box = $("lg-models");
    if (!models.length) {
      box.replaceChildren(node("p", { class: "lg-empty" }, "No models in the catalog yet."));
      return;
    }
    const rows = models.map((m) =>
      node(
        "tr",
        {},
        node("th", { scope: "row", class: "lg-name" }, node("a", { href: m.url }, m.name), m.pinned ? node("small", { class: "lg-quiet" }, " pinned") : null),
        node("td", { class: "lg-num" }, `${m.ready} / ${m.desired}`),
        node("td", { class: "lg-num lg-quiet lg-hide-narrow" }, `${m.min_replicas}–${m.max_replicas}`),
        node("td", {}, modelStatus(m)),
        node("td", { class: "lg-num lg-hide-narrow", title: "prompt tokens the engines found in their prefix cache, last hour" }, hitRatio(m.name)),
        node("td", { class: "lg-quiet lg-hide-narrow" }, age(m.last_request_age_s)),
      ),
    );
    box.replaceChildren(
      node(
        "table",
        { class: "lg-table" },
        node(
          "thead",
          {},
          node(
            "tr",
            {},
            node("th", {}, "model"),
            node("th", { class: "lg-num" }, "ready"),
            node("th", { class: "lg-num lg-hide-narrow" }, "min–max"),
            node("th", {}, "status"),
            node("th", { class: "lg-num lg-hide-narrow" }, "cache hits"),
            node("th", { class: "lg-hide-narrow" }, "last request"),
          ),
        ),
        node("tbody", {}, rows),
      ),
    );
  }

  function renderTraffic(traffic) {
    const names = Object.keys(traffic.models);
    const xLabels = [[0, "−60m"], [0.5, "−30m"], [1, "now"]];
    const specs = [
      ["lg-chart-rps", "requests_per_s", "Requests per second"],
      ["lg-chart-tps", "tokens_per_s", "Tokens per second"],
      ["lg-chart-ttft", null, "Time to first token (ms)"],
      ["lg-chart-errors", "errors", "Errors per minute"],
      ["lg-chart-hits", "prefix_hit_ratio_per_minute", "Prefix cache hit ratio"],
    ];
    for (const [id, key, title] of specs) {
      let series;
      if (key) {
        series = names.map((name) => ({ name: name, values: traffic.models[name][key] }));
      } else {
        // One colour per model, as in the other charts; p95 dashed.
        series = names.flatMap((name, i) => [
          { name: `${name} p50`, values: traffic.models[name].ttft_p50_ms, color: i },
          { name: `${name} p95`, values: traffic.models[name].ttft_p95_ms, color: i, dashed: true },
        ]);
      }
      charts.lines($(id), { series: series, xLabels: xLabels, title: title, emptyText: "no requests in the last hour" });
    }
  }

  function renderEvents(events) {
    const box = $("lg-events");
    if (!events.length) {
      box.replaceChildren(node("p", { class: "lg-empty" }, "No events yet."));
      return;
    }
    box.replaceChildren(
      node(
        "ol",
        { class: "lg-events" },
        events.map((e) =>
          node(
            "li",
            {},
            node("time", { datetime: e.at }, new Date(e.at).toLocaleTimeString()),
            node("span", { class: `lg-badge lg-kind-${e.kind}` }, e.kind),
            node("span", { class: "lg-subject" }, e.subject),
            node("span", { class: "lg-message" }, e.message),
          ),
        ),
      ),
    );
  }

  function status(text, kind) {
    const box = $("lg-live");
    box.className = `lg-live lg-live-${kind}`;
    box.textContent = text;
  }

  function render(data) {
    last = data;
    renderSummary(data);
    renderLease(data.lease);
    renderNodes(data.nodes);
    renderModels(data.models);
    renderTraffic(data.traffic);
    renderEvents(data.events);
    root.dataset.loaded = "true";
    status(`live · updated ${new Date(data.generated_at).toLocaleTimeString()}`, "ok");
  }

  async function poll() {
    timer = null;
    busy = true;
    try {
      const response = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" }, cache: "no-store" });
      if (response.status === 401 || response.status === 403) {
        status("signed out: reload the page to sign in again", "error");
        busy = false;
        return; // no point polling without a session
      }
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      render(await response.json());
    } catch (error) {
      status(`cannot reach llmgw (${error.message}); retrying`, "error");
    }
    busy = false;
    if (!document.hidden) timer = setTimeout(poll, interval);
  }

  // Charts are drawn at their container's width: redraw them when it changes.
  let resizing = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizing);
    resizing = setTimeout(() => last && renderTraffic(last.traffic), 150);
  });

  document.addEventListener("visibilitychange", () => {
    if (!document.hidden && timer === null && !busy) poll();
  });
  poll();
})();
