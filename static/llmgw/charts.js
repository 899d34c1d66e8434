/* llmgw charts: small line and bar charts drawn as inline SVG.
 *
 * Written here rather than vendored: the dashboard must work with no network access (no CDN)
 * and needs two chart kinds, which fit in this file. Every text goes in through textContent,
 * never innerHTML, because model names and labels come from users.
 */
"use strict";

(function (global) {
  const SVG = "http://www.w3.org/2000/svg";
  const PALETTE = ["#2f7ebc", "#e07b24", "#3a9d5d", "#c23b4e", "#7b5ea7", "#a0772d", "#d160a6", "#6b7a8f"];
  const H = 170;
  // Drawn at the container's own width, so text stays its real size on a phone and a laptop.
  let W = 480;
  function fit(container) {
    W = Math.max(280, Math.round(container.clientWidth || 480));
  }
  const PAD = { left: 44, right: 8, top: 10, bottom: 22 };

  function el(name, attrs, parent) {
    const node = document.createElementNS(SVG, name);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
    if (parent) parent.appendChild(node);
    return node;
  }

  function niceMax(value) {
    if (!(value > 0)) return 1;
    const power = Math.pow(10, Math.floor(Math.log10(value)));
    for (const step of [1, 2, 2.5, 5, 10]) {
      if (value <= step * power) return step * power;
    }
    return 10 * power;
  }

  function formatNumber(value) {
    if (value >= 1e6) return (value / 1e6).toFixed(value >= 1e7 ? 0 : 1) + "M";
    if (value >= 1e3) return (value / 1e3).toFixed(value >= 1e4 ? 0 : 1) + "k";
    if (value >= 10 || value === 0) return String(Math.round(value));
    return value.toFixed(value >= 1 ? 1 : 2);
  }

  function color(i) {
    return PALETTE[i % PALETTE.length];
  }

  function frame(svg, max, xLabels) {
    const plotH = H - PAD.top - PAD.bottom;
    for (let i = 0; i <= 2; i++) {
      const y = PAD.top + plotH - (plotH * i) / 2;
      el("line", { x1: PAD.left, x2: W - PAD.right, y1: y, y2: y, class: "lg-grid" }, svg);
      const label = el("text", { x: PAD.left - 6, y: y + 4, class: "lg-axis", "text-anchor": "end" }, svg);
      label.textContent = formatNumber((max * i) / 2);
    }
    xLabels.forEach(([fraction, text]) => {
      const x = PAD.left + (W - PAD.left - PAD.right) * fraction;
      const anchor = fraction === 0 ? "start" : fraction === 1 ? "end" : "middle";
      const label = el("text", { x: x, y: H - 6, class: "lg-axis", "text-anchor": anchor }, svg);
      label.textContent = text;
    });
  }

  function legend(container, series) {
    const list = document.createElement("ul");
    list.className = "lg-legend";
    series.forEach((s, i) => {
      const item = document.createElement("li");
      const swatch = document.createElement("span");
      swatch.className = s.dashed ? "lg-swatch lg-swatch-dashed" : "lg-swatch";
      swatch.style.borderColor = swatch.style.background = color(s.color ?? i);
      if (s.dashed) swatch.style.background = "none";
      item.appendChild(swatch);
      item.appendChild(document.createTextNode(s.name));
      list.appendChild(item);
    });
    container.appendChild(list);
  }

  function empty(container, text) {
    const note = document.createElement("p");
    note.className = "lg-empty";
    note.textContent = text;
    container.appendChild(note);
  }

  /* Lines over equally spaced points; a null value leaves a gap.
   * spec: {series: [{name, values, color?, dashed?}], xLabels: [[fraction, text]], emptyText}
   * (color: a palette index, so related series can share one) */
  function lines(container, spec) {
    fit(container);
    container.replaceChildren();
    const all = spec.series.flatMap((s) => s.values.filter((v) => v !== null));
    if (!all.length || all.every((v) => v === 0 && spec.hideZero)) {
      empty(container, spec.emptyText || "no data in this window");
      return;
    }
    const max = niceMax(Math.max(...all));
    const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, class: "lg-chart", role: "img" });
    el("title", {}, svg).textContent = spec.title || "";
    frame(svg, max, spec.xLabels || []);
    const plotW = W - PAD.left - PAD.right;
    const plotH = H - PAD.top - PAD.bottom;
    spec.series.forEach((series, i) => {
      const stroke = color(series.color ?? i);
      const n = series.values.length;
      const step = n > 1 ? plotW / (n - 1) : 0;
      let points = [];
      const flush = () => {
        if (points.length === 1) {
          const [x, y] = points[0].split(",");
          el("circle", { cx: x, cy: y, r: 2, fill: stroke }, svg);
        } else if (points.length > 1) {
          const attrs = { points: points.join(" "), stroke: stroke, class: "lg-line" };
          if (series.dashed) attrs["stroke-dasharray"] = "5 3";
          el("polyline", attrs, svg);
        }
        points = [];
      };
      series.values.forEach((value, j) => {
        if (value === null || value === undefined) return flush();
        const x = PAD.left + step * j;
        const y = PAD.top + plotH - (plotH * value) / max;
        points.push(`${x.toFixed(1)},${y.toFixed(1)}`);
      });
      flush();
    });
    container.appendChild(svg);
    legend(container, spec.series);
  }

  /* Vertical bars, one per label. spec: {values, labels, title, every} */
  function bars(container, spec) {
    fit(container);
    container.replaceChildren();
    const max = niceMax(Math.max(0, ...spec.values));
    const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, class: "lg-chart", role: "img" });
    el("title", {}, svg).textContent = spec.title || "";
    const n = spec.values.length;
    const every = spec.every || Math.ceil(n / 6);
    const xLabels = [];
    spec.labels.forEach((label, i) => {
      // The last bar is always labelled; a regular label too close before it is dropped.
      const last = i === n - 1;
      if ((i % every === 0 && n - 1 - i >= every / 2) || last) xLabels.push([n > 1 ? i / (n - 1) : 0, label]);
    });
    frame(svg, max, xLabels);
    const plotW = W - PAD.left - PAD.right;
    const plotH = H - PAD.top - PAD.bottom;
    const slot = plotW / Math.max(1, n);
    spec.values.forEach((value, i) => {
      const h = (plotH * value) / max;
      const bar = el(
        "rect",
        { x: PAD.left + slot * i + slot * 0.15, y: PAD.top + plotH - h, width: slot * 0.7, height: h, fill: color(0) },
        svg,
      );
      el("title", {}, bar).textContent = `${spec.labels[i]}: ${formatNumber(value)}`;
    });
    container.appendChild(svg);
  }

  global.LlmgwCharts = { lines: lines, bars: bars, color: color, formatNumber: formatNumber };
})(window);
