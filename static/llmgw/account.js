/* The account page's usage chart, from the data the page embeds (json_script). */
"use strict";

(function () {
  const source = document.getElementById("lg-usage-data");
  const target = document.getElementById("lg-usage-chart");
  if (!source || !target || !window.LlmgwCharts) return;
  const data = JSON.parse(source.textContent);
  window.LlmgwCharts.bars(target, { values: data.tokens, labels: data.labels, title: "Tokens per day", every: 7 });
})();
