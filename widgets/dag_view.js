// piper_nb DagView: draws the Designer's graphviz SVG, pans and zooms it, reports clicks.
//
// Model traits (see piper_nb/ui/widgets.py): `svg` (graphviz output whose node <g>
// elements carry the DAG node id as their `id`), `selected` (the selected node id, set
// here on click and by Python), `message` (shown instead of the picture when set),
// `zoom` (0: open readable, see `readable`; otherwise the scale, 1 = graphviz's own
// size, where labels are 12 px) and `details` (whether the node-details panel beside the
// picture is open; Python lays the panels out from it). Nothing else is kept in JS.
//
// Gestures: drag to pan; ctrl (or cmd) + wheel, or a trackpad pinch, zooms about the
// pointer; double-click zooms in there, shift + double-click out; with the picture
// focused, + and - zoom, 0 goes back to readable and f fits the whole graph.

const LEGIBLE = 0.95;   // the smallest scale the picture opens at: labels of 11.4 px
const LARGEST = 1.25;   // a small graph is enlarged to fill the panel up to this scale
const STEP = 1.25;      // one zoom step (buttons, keys, a wheel notch, a double-click)
const MIN_ZOOM = 0.05;
const MAX_ZOOM = 6;
const DRAG = 4;         // a press that moves further than this (px) pans instead of clicking

function nodeId(g) {
  // graphviz writes <g id="F[PP=0,MB=0]" class="node"><title>n3</title>...
  if (g.id) return g.id;
  const title = g.querySelector("title");
  return title ? title.textContent : "";
}

function points(value) {
  // graphviz sizes the SVG in points ("1415pt"); CSS pixels are 4/3 of a point
  const n = parseFloat(value);
  return value && value.endsWith("pt") ? (n * 4) / 3 : n;
}

function button(text, title) {
  const b = document.createElement("button");
  b.textContent = text;
  b.title = title;
  b.className = "pn-dag-zoom";
  return b;
}

// Plotly's figure widgets size themselves to their element only when JupyterLab sends
// them a resize message, which ipywidgets 8 in JupyterLab 4 does not deliver to a widget
// inside a Tab: drawn first in a hidden tab, they keep plotly's fallback of 700 px
// whatever the panel. One watcher per page gives every figure of a Designer its element's
// width, as the widget relays Python's layout edits (not echoed back to Python), when a
// panel changes size and whenever a figure is drawn again.
function followFigureWidths() {
  if (window.__pnFigureWidths) return;
  window.__pnFigureWidths = true;
  let queued = false;
  const observer = new ResizeObserver(() => later());
  const fit = () => {
    queued = false;
    const Plotly = window.Plotly;   // the widget bundle's own plotly.js sets it
    document.querySelectorAll(".pn-designer .js-plotly-plot").forEach((plot) => {
      if (!plot.pnWatched) {
        plot.pnWatched = true;
        observer.observe(plot);
      }
      if (!Plotly || plot.offsetParent === null || !plot._fullLayout) return;
      const width = Math.floor(plot.getBoundingClientRect().width);
      if (width > 0 && Math.abs(plot._fullLayout.width - width) > 2) {
        Plotly.relayout(plot, { width, _doNotReportToPy: true });
      }
    });
  };
  const later = () => {
    if (!queued) {
      queued = true;
      requestAnimationFrame(fit);
    }
  };
  new MutationObserver(later).observe(document.body, { childList: true, subtree: true });
  later();
}

function render({ model, el }) {
  followFigureWidths();
  el.classList.add("pn-dag");
  const bar = document.createElement("div");
  bar.className = "pn-dag-bar";
  const zoomOut = button("\u2212", "zoom out (-, shift + double-click)");
  const zoomIn = button("+", "zoom in (+, double-click)");
  const readable = button("readable", "open size: labels legible, the panel's width if it fits (0)");
  const fit = button("fit", "the whole graph in the panel (f)");
  const details = button("details", "show or hide the selected node's details");
  details.classList.add("pn-dag-details-toggle");
  const scaleText = document.createElement("span");
  scaleText.className = "pn-dag-scale";
  const note = document.createElement("span");
  note.className = "pn-dag-note";
  const hint = document.createElement("span");
  hint.className = "pn-dag-hint";
  hint.textContent = "drag to pan \u00b7 ctrl + wheel to zoom";
  bar.append(zoomOut, zoomIn, readable, fit, scaleText, note, hint, details);
  const canvas = document.createElement("div");
  canvas.className = "pn-dag-canvas";
  canvas.tabIndex = 0;
  el.append(bar, canvas);
  let size = null;        // the SVG's own size in px, {w, h}
  let shown = 1;          // the scale drawn now

  function mark() {
    const selected = model.get("selected");
    for (const g of canvas.querySelectorAll("g.node")) {
      g.classList.toggle("pn-selected", selected !== "" && nodeId(g) === selected);
    }
    note.textContent = selected ? `selected: ${selected}` : "click a node for its details";
    note.title = note.textContent;
    details.classList.toggle("pn-on", model.get("details"));
  }

  function fitScale() {
    const height = parseFloat(getComputedStyle(canvas).maxHeight) || canvas.clientHeight;
    return Math.min(canvas.clientWidth / size.w, height / size.h);
  }

  function readableScale() {
    return Math.min(Math.max(canvas.clientWidth / size.w, LEGIBLE), LARGEST);
  }

  let pending = null;     // the pointer a zoom step keeps in place, until it is drawn

  function scale() {
    const anchor = pending;
    pending = null;
    const svg = canvas.querySelector("svg");
    if (!svg || !size || canvas.clientWidth === 0) return;
    const zoom = model.get("zoom");
    const next = zoom > 0 ? zoom : readableScale();
    // keep the point under `anchor` (canvas coordinates) where it is
    const ax = anchor ? anchor.x : 0;
    const ay = anchor ? anchor.y : 0;
    const x = (canvas.scrollLeft + ax) / shown;
    const y = (canvas.scrollTop + ay) / shown;
    svg.style.width = `${Math.round(size.w * next)}px`;
    svg.style.height = `${Math.round(size.h * next)}px`;
    shown = next;
    if (anchor) {
      canvas.scrollLeft = x * next - ax;
      canvas.scrollTop = y * next - ay;
    }
    scaleText.textContent = `${Math.round(next * 100)}%` + (zoom > 0 ? "" : " (readable)");
  }

  function draw() {
    const message = model.get("message");
    if (message) {
      canvas.innerHTML = "";
      size = null;
      const p = document.createElement("p");
      p.className = "pn-dag-message";
      p.textContent = message;
      canvas.append(p);
      return;
    }
    canvas.innerHTML = model.get("svg");
    const svg = canvas.querySelector("svg");
    if (svg) {
      size = { w: points(svg.getAttribute("width")), h: points(svg.getAttribute("height")) };
      svg.removeAttribute("width");
      svg.removeAttribute("height");
      svg.style.maxWidth = "none";
      svg.style.display = "block";
    }
    scale();
    mark();
  }

  function setZoom(value, anchor) {
    pending = anchor || null;
    model.set("zoom", value > 0 ? Math.min(Math.max(value, MIN_ZOOM), MAX_ZOOM) : 0);
    model.save_changes();
    scale();   // when the value did not change, no change event drew it
  }

  function centre() {
    return { x: canvas.clientWidth / 2, y: canvas.clientHeight / 2 };
  }

  function at(event) {
    const box = canvas.getBoundingClientRect();
    return { x: event.clientX - box.left, y: event.clientY - box.top };
  }

  // drag to pan; a press that barely moves is a click
  let press = null;
  let dragged = false;
  function onDown(event) {
    if (event.button !== 0) return;
    press = { x: event.clientX, y: event.clientY, left: canvas.scrollLeft, top: canvas.scrollTop };
    dragged = false;
  }
  function onMove(event) {
    if (!press) return;
    const dx = event.clientX - press.x;
    const dy = event.clientY - press.y;
    if (!dragged && Math.hypot(dx, dy) < DRAG) return;
    if (!dragged) {
      dragged = true;
      canvas.classList.add("pn-panning");
    }
    canvas.scrollLeft = press.left - dx;
    canvas.scrollTop = press.top - dy;
    event.preventDefault();
  }
  function onUp() {
    press = null;
    canvas.classList.remove("pn-panning");
  }

  function onClick(event) {
    if (dragged) {
      dragged = false;
      return;
    }
    const g = event.target.closest("g.node");
    if (!g || !canvas.contains(g)) return;
    event.preventDefault();
    model.set("selected", nodeId(g));
    model.set("details", true);
    model.save_changes();
  }

  function onWheel(event) {
    if (!(event.ctrlKey || event.metaKey)) return;   // a plain wheel scrolls as usual
    event.preventDefault();
    setZoom(shown * Math.pow(STEP, -Math.sign(event.deltaY)), at(event));
  }

  function onDouble(event) {
    event.preventDefault();
    setZoom(event.shiftKey ? shown / STEP : shown * STEP, at(event));
  }

  function onKey(event) {
    const keys = {
      "+": () => setZoom(shown * STEP, centre()),
      "=": () => setZoom(shown * STEP, centre()),
      "-": () => setZoom(shown / STEP, centre()),
      "0": () => setZoom(0),
      f: () => setZoom(fitScale()),
    };
    const act = keys[event.key];
    if (!act || event.ctrlKey || event.metaKey || event.altKey || !size) return;
    event.preventDefault();
    event.stopPropagation();   // JupyterLab's command mode must not take the key
    act();
  }

  const onIn = () => setZoom(shown * STEP, centre());
  const onOut = () => setZoom(shown / STEP, centre());
  const onReadable = () => setZoom(0);
  const onFit = () => size && setZoom(fitScale());
  const onDetails = () => {
    model.set("details", !model.get("details"));
    model.save_changes();
  };
  const onResize = () => model.get("zoom") > 0 || scale();
  const resized = new ResizeObserver(onResize);
  resized.observe(canvas);
  canvas.addEventListener("pointerdown", onDown);
  window.addEventListener("pointermove", onMove);
  window.addEventListener("pointerup", onUp);
  canvas.addEventListener("click", onClick);
  canvas.addEventListener("wheel", onWheel, { passive: false });
  canvas.addEventListener("dblclick", onDouble);
  canvas.addEventListener("keydown", onKey);
  zoomIn.addEventListener("click", onIn);
  zoomOut.addEventListener("click", onOut);
  readable.addEventListener("click", onReadable);
  fit.addEventListener("click", onFit);
  details.addEventListener("click", onDetails);
  model.on("change:svg", draw);
  model.on("change:message", draw);
  model.on("change:selected", mark);
  model.on("change:details", mark);
  model.on("change:zoom", scale);
  draw();

  return () => {
    resized.disconnect();
    window.removeEventListener("pointermove", onMove);
    window.removeEventListener("pointerup", onUp);
    model.off("change:svg", draw);
    model.off("change:message", draw);
    model.off("change:selected", mark);
    model.off("change:details", mark);
    model.off("change:zoom", scale);
  };
}

export default { render };
