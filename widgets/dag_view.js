// piper_nb DagView: draws the Designer's graphviz SVG and reports clicks.
//
// Model traits (see piper_nb/ui/widgets.py): `svg` (graphviz output whose node <g>
// elements carry the DAG node id as their `id`), `selected` (the selected node id, set
// here on click and by Python), `message` (shown instead of the picture when set) and
// `zoom` (1 fits the width; larger values scroll). Nothing else is kept in JS.

function nodeId(g) {
  // graphviz writes <g id="F[PP=0,MB=0]" class="node"><title>n3</title>...
  if (g.id) return g.id;
  const title = g.querySelector("title");
  return title ? title.textContent : "";
}

function render({ model, el }) {
  el.classList.add("pn-dag");
  const bar = document.createElement("div");
  bar.className = "pn-dag-bar";
  const zoomOut = document.createElement("button");
  const zoomIn = document.createElement("button");
  const fit = document.createElement("button");
  zoomOut.textContent = "\u2212";
  zoomIn.textContent = "+";
  fit.textContent = "fit";
  for (const b of [zoomOut, zoomIn, fit]) b.className = "pn-dag-zoom";
  const note = document.createElement("span");
  note.className = "pn-dag-note";
  bar.append(zoomOut, zoomIn, fit, note);
  const canvas = document.createElement("div");
  canvas.className = "pn-dag-canvas";
  el.append(bar, canvas);

  function mark() {
    const selected = model.get("selected");
    for (const g of canvas.querySelectorAll("g.node")) {
      g.classList.toggle("pn-selected", selected !== "" && nodeId(g) === selected);
    }
    note.textContent = selected ? `selected: ${selected}` : "click a node for its details";
  }

  function scale() {
    const svg = canvas.querySelector("svg");
    if (!svg) return;
    const zoom = model.get("zoom");
    svg.style.maxWidth = zoom <= 1 ? "100%" : "none";
    svg.style.width = zoom <= 1 ? "" : `${Math.round(zoom * 100)}%`;
    svg.style.height = "auto";
  }

  function draw() {
    const message = model.get("message");
    if (message) {
      canvas.innerHTML = "";
      const p = document.createElement("p");
      p.className = "pn-dag-message";
      p.textContent = message;
      canvas.append(p);
      return;
    }
    canvas.innerHTML = model.get("svg");
    scale();
    mark();
  }

  function onClick(event) {
    const g = event.target.closest("g.node");
    if (!g || !canvas.contains(g)) return;
    event.preventDefault();
    model.set("selected", nodeId(g));
    model.save_changes();
  }

  function setZoom(value) {
    model.set("zoom", Math.min(Math.max(value, 1), 8));
    model.save_changes();
  }

  const onIn = () => setZoom(model.get("zoom") * 1.5);
  const onOut = () => setZoom(model.get("zoom") / 1.5);
  const onFit = () => setZoom(1);
  canvas.addEventListener("click", onClick);
  zoomIn.addEventListener("click", onIn);
  zoomOut.addEventListener("click", onOut);
  fit.addEventListener("click", onFit);
  model.on("change:svg", draw);
  model.on("change:message", draw);
  model.on("change:selected", mark);
  model.on("change:zoom", scale);
  draw();

  return () => {
    canvas.removeEventListener("click", onClick);
    model.off("change:svg", draw);
    model.off("change:message", draw);
    model.off("change:selected", mark);
    model.off("change:zoom", scale);
  };
}

export default { render };
