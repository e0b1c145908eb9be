// Small time-series charts drawn on <canvas> (no library): a line over the last `capacity`
// points, the y axis from 0 to the larger of `minMax` and the data's maximum.
"use strict";

class Series {
  constructor(canvas, { color = "#2458c6", capacity = 240, minMax = 1, unit = "" } = {}) {
    this.canvas = canvas; this.color = color; this.capacity = capacity;
    this.minMax = minMax; this.unit = unit; this.points = [];
  }

  push(value) {
    this.points.push(Number.isFinite(value) ? value : null);
    if (this.points.length > this.capacity) this.points.shift();
  }

  last() {
    for (let i = this.points.length - 1; i >= 0; i--) if (this.points[i] !== null) return this.points[i];
    return null;
  }

  draw() {
    const c = this.canvas, dpr = window.devicePixelRatio || 1;
    const w = c.clientWidth || c.width, h = c.clientHeight || c.height;
    if (c.width !== Math.round(w * dpr)) { c.width = Math.round(w * dpr); c.height = Math.round(h * dpr); }
    const g = c.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, h);
    const values = this.points.filter((v) => v !== null);
    const top = Math.max(this.minMax, ...values) * 1.1;
    const pad = { l: 4, r: 4, t: 14, b: 4 };
    const x = (i) => pad.l + (w - pad.l - pad.r) * (i / Math.max(1, this.capacity - 1));
    const y = (v) => h - pad.b - (h - pad.t - pad.b) * (v / top);
    g.strokeStyle = "#e2e4e8"; g.lineWidth = 1;
    for (const f of [0.5, 1]) { g.beginPath(); g.moveTo(pad.l, y(top / 1.1 * f)); g.lineTo(w - pad.r, y(top / 1.1 * f)); g.stroke(); }
    g.fillStyle = "#5c6370"; g.font = "10px system-ui, sans-serif";
    g.fillText(formatNumber(top / 1.1) + this.unit, pad.l + 2, 10);
    const offset = this.capacity - this.points.length;
    g.strokeStyle = this.color; g.lineWidth = 1.6; g.beginPath();
    let pen = false;
    this.points.forEach((v, i) => {
      if (v === null) { pen = false; return; }
      if (pen) g.lineTo(x(i + offset), y(v)); else g.moveTo(x(i + offset), y(v));
      pen = true;
    });
    g.stroke();
  }
}

function formatNumber(v) {
  if (v === null || v === undefined || !Number.isFinite(v)) return "–";
  if (Math.abs(v) >= 1000) return (v / 1000).toFixed(1) + "k";
  if (Math.abs(v) >= 100) return v.toFixed(0);
  if (Math.abs(v) >= 10) return v.toFixed(1);
  return v.toFixed(2);
}
