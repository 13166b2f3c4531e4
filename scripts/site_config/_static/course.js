// make site: the stepper's recorded frames (scripts/course_site.py, frames_html).
// Each .stepper-frames holds its frames as JSON: what was clicked, the status text, the
// requests' table and the figures (plotly JSON); previous / next show one at a time.
"use strict";

function showFrame(box, frames, i) {
  const f = frames[i];
  box.dataset.frame = String(i);
  box.querySelector(".sf-count").textContent = `frame ${i + 1} of ${frames.length}`;
  box.querySelector(".sf-click").textContent = f.click;
  box.querySelector(".sf-status").textContent = f.status;
  box.querySelector(".sf-requests").innerHTML = f.requests;  // made by the build, not typed
  box.querySelector(".sf-prev").disabled = i === 0;
  box.querySelector(".sf-next").disabled = i === frames.length - 1;
  const figs = box.querySelector(".sf-figs");
  const names = f.figures.map(([name]) => name);
  for (const el of Array.from(figs.children)) {
    if (!names.includes(el.dataset.name)) { Plotly.purge(el); el.remove(); }
  }
  for (const [name, fig] of f.figures) {
    let el = figs.querySelector(`[data-name="${name}"]`);
    if (!el) {
      el = document.createElement("div");
      el.dataset.name = name;
      el.className = "sf-fig";
    }
    figs.appendChild(el);  // (again: in this frame's order)
    Plotly.react(el, fig.data, fig.layout, {responsive: true, displaylogo: false});
  }
}

document.addEventListener("DOMContentLoaded", () => {
  for (const box of document.querySelectorAll(".stepper-frames")) {
    const frames = JSON.parse(box.querySelector(".sf-data").textContent);
    let i = 0;
    box.querySelector(".sf-prev").addEventListener("click", () => showFrame(box, frames, i = Math.max(0, i - 1)));
    box.querySelector(".sf-next").addEventListener("click", () => showFrame(box, frames, i = Math.min(frames.length - 1, i + 1)));
    showFrame(box, frames, 0);
  }
});
