// The console's own script: drag and drop on "Try a model", and the charts (uPlot). Loaded as
// a file (the Content-Security-Policy runs no inline script); reads its settings from data-*.
"use strict";

const RING = 120; // points a live chart keeps

function dropZone() {
  const zone = document.getElementById("drop");
  if (!zone) return;
  const input = zone.querySelector("input[type=file]");
  const chosen = document.getElementById("chosen");
  const show = () => {
    chosen.textContent = Array.from(input.files).map((f) => f.name).join(", ");
  };
  input.addEventListener("change", show);
  zone.addEventListener("dragover", (event) => {
    event.preventDefault();
    zone.classList.add("over");
  });
  zone.addEventListener("dragleave", () => zone.classList.remove("over"));
  zone.addEventListener("drop", (event) => {
    event.preventDefault();
    zone.classList.remove("over");
    const files = new DataTransfer();
    for (const file of event.dataTransfer.files) {
      if (file.type.startsWith("image/")) files.items.add(file);
    }
    input.files = files.files;
    show();
  });
}

function chart(parent, title, unit, width) {
  const options = {
    title: title,
    width: width,
    height: 180,
    scales: { x: { time: true } },
    series: [{}, { label: unit, stroke: "#0a84ff", fill: "rgba(10,132,255,0.1)", width: 2 }],
    axes: [{}, { size: 60 }],
  };
  return new uPlot(options, [[], []], parent);
}

function push(series, t, value) {
  series[0].push(t);
  series[1].push(value);
  if (series[0].length > RING) {
    series[0].shift();
    series[1].shift();
  }
}

async function throughput() {
  const box = document.getElementById("throughput");
  if (!box || typeof uPlot === "undefined") return;
  const answer = await fetch(box.dataset.url, { credentials: "same-origin" });
  if (!answer.ok) return;
  const past = await answer.json();
  const data = [past.t, past.rate];
  const plot = chart(box, "Items per second", "items/s", box.clientWidth || 800);
  plot.setData(data);
  // Live points from the summary that htmx refreshes every 2 s: no extra request. Each is the
  // job's rate as the API gives it (over the last minute, each chunk run's items spread over
  // the run), not the change in `done` since the last sample: that moves in blocks and chunks,
  // and would draw a steady job as spikes between zeros.
  let open = document.getElementById("summary")?.hasAttribute("hx-get");
  document.body.addEventListener("htmx:afterSwap", (event) => {
    const path = event.detail.pathInfo?.requestPath || "";
    if (!path.endsWith("/summary")) return; // an items page or a filter: not a new sample
    const summary = document.getElementById("summary"); // swapped in whole: find it again
    if (!summary) return;
    if (summary.dataset.rate && summary.hasAttribute("hx-get")) {
      push(data, Date.now() / 1000, Number(summary.dataset.rate));
      plot.setData(data);
    }
    if (open && !summary.hasAttribute("hx-get")) {
      open = false; // it just closed: reload the items once
      document.body.dispatchEvent(new Event("kiln:closed"));
    }
  });
}

const GPU_FIGURES = [
  ["utilization_pct", "Utilisation", "%", 1],
  ["memory_used_bytes", "Memory used", "GiB", 1 / 2 ** 30],
  ["temperature_c", "Temperature", "°C", 1],
  ["power_w", "Power", "W", 1],
];

function gpus() {
  const box = document.getElementById("gpus");
  if (!box || typeof uPlot === "undefined") return;
  const charts = new Map(); // worker → {figure → {plot, data}}
  const every = Number(box.dataset.every || 3) * 1000;
  const poll = async () => {
    const answer = await fetch(box.dataset.url, { credentials: "same-origin" });
    if (answer.ok) draw(await answer.json());
  };
  const draw = (fleet) => {
    for (const worker of fleet.workers) {
      if (!worker.gpu) continue;
      let plots = charts.get(worker.worker);
      if (!plots) {
        plots = new Map();
        const section = document.createElement("section");
        section.className = "gpu";
        section.dataset.worker = worker.worker;
        const heading = document.createElement("h3");
        heading.textContent = worker.worker + (worker.gpu.name ? " · " + worker.gpu.name : "");
        section.appendChild(heading);
        box.appendChild(section);
        plots.section = section;
        charts.set(worker.worker, plots);
      }
      for (const [key, title, unit, scale] of GPU_FIGURES) {
        if (worker.gpu[key] === undefined || worker.gpu[key] === null) continue; // not reported
        let entry = plots.get(key);
        if (!entry) {
          const holder = document.createElement("div");
          holder.className = "gpu-chart";
          holder.dataset.figure = key;
          plots.section.appendChild(holder);
          entry = { data: [[], []], plot: chart(holder, title, unit, 420) };
          plots.set(key, entry);
        }
        push(entry.data, worker.seen_at, worker.gpu[key] * scale);
        entry.plot.setData(entry.data);
      }
    }
  };
  poll();
  setInterval(poll, every);
}

document.addEventListener("DOMContentLoaded", () => {
  dropZone();
  throughput();
  gpus();
});
