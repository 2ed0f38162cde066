// A tiny bar chart (inline SVG): acceptance rate of each draft position, percentages underneath.

const NS = "http://www.w3.org/2000/svg";

function el(name, attrs) {
  const e = document.createElementNS(NS, name);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
  return e;
}

// rates: fraction of the steps that drafted position i whose draft i was accepted (0..1).
export function acceptanceChart(rates) {
  rates = rates.map((r) => (Number.isFinite(r) ? Math.max(0, Math.min(1, r)) : 0));
  const bw = 20, gap = 4, h = 30, label = 11;
  const w = Math.max(rates.length, 1) * (bw + gap) - gap;
  const svg = el("svg", { width: w, height: h + label, viewBox: `0 0 ${w} ${h + label}`, class: "chart",
    role: "img" });
  const title = el("title", {});
  title.textContent = "Acceptance per draft position: " +
    rates.map((r, i) => `${i + 1}: ${Math.round(r * 100)}%`).join(", ");
  svg.appendChild(title);
  rates.forEach((r, i) => {
    const x = i * (bw + gap);
    const bh = r * h;
    svg.appendChild(el("rect", { x, y: 0, width: bw, height: h, class: "bar-bg", rx: 2 }));
    svg.appendChild(el("rect", { x, y: h - bh, width: bw, height: bh, class: "bar", rx: 2 }));
    const t = el("text", { x: x + bw / 2, y: h + label - 1, class: "bar-label", "text-anchor": "middle" });
    t.textContent = String(Math.round(r * 100));  // percent; the position is the bar's place
    svg.appendChild(t);
  });
  return svg;
}
