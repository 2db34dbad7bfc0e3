// The console's script: refreshes the figures every 2 s, draws the latency chart, shows a
// payload on demand, and asks before a purge.
"use strict";
(() => {
  let samples = [];
  const keep = 300; // the server keeps ten minutes at one sample every 2 s
  const canvas = document.getElementById("latency");
  document.querySelectorAll("form[method=post]").forEach((form) => {
    form.addEventListener("submit", (e) => {
      const confirmText = e.submitter && e.submitter.dataset.confirm;
      if (confirmText && !window.confirm(confirmText)) e.preventDefault();
    });
  });
  document.querySelectorAll("details[data-event]").forEach((details) => {
    details.addEventListener("toggle", async () => {
      const pre = details.querySelector("pre");
      if (!details.open || pre.dataset.loaded) return;
      const response = await fetch("/api/events/" + details.dataset.event);
      const body = await response.json();
      pre.textContent = response.ok ? JSON.stringify(body.payload, null, 2) : body.error;
      pre.dataset.loaded = "1";
    });
  });

  function set(id, text) {
    const el = document.getElementById(id);
    if (el) el.textContent = text;
  }
  function age(ms) {
    if (ms === null || ms === undefined) return "-";
    const s = ms / 1000;
    return s < 1 ? ms + "ms" : s < 120 ? s.toFixed(1) + "s" : (s / 60).toFixed(1) + "m";
  }
  function draw() {
    if (!canvas) return;
    const g = canvas.getContext("2d");
    const w = canvas.width, h = canvas.height, pad = 28;
    g.clearRect(0, 0, w, h);
    const values = samples.flatMap((s) => [s.p50_ms, s.p99_ms]).filter((v) => v !== null);
    const top = Math.max(1, ...values) * 1.1;
    g.strokeStyle = "#dde1e6"; g.fillStyle = "#5b6570"; g.font = "11px sans-serif";
    for (let i = 0; i <= 4; i++) {
      const y = pad / 2 + (h - pad) * i / 4;
      g.beginPath(); g.moveTo(pad, y); g.lineTo(w, y); g.stroke();
      g.fillText((top * (4 - i) / 4).toFixed(top < 10 ? 1 : 0), 0, y + 4);
    }
    for (const [key, color] of [["p50_ms", "#1a73e8"], ["p99_ms", "#d93025"]]) {
      g.strokeStyle = color; g.beginPath();
      samples.forEach((s, i) => {
        if (s[key] === null) return;
        const first = i === 0 || samples[i - 1][key] === null;
        const x = pad + (w - pad) * (keep - samples.length + i) / (keep - 1);
        const y = pad / 2 + (h - pad) * (1 - s[key] / top);
        first ? g.moveTo(x, y) : g.lineTo(x, y);
      });
      g.stroke();
    }
  }
  async function refresh() {
    try {
      const response = await fetch("/api/summary");
      if (!response.ok) return;
      const s = await response.json();
      set("pending", s.stats.pending); set("held_by_key", s.stats.held_by_key); set("delayed", s.stats.delayed); set("in_flight", s.stats.in_flight);
      set("dead_letters", s.stats.dead_letters); set("oldest_pending", age(s.stats.oldest_pending_age_ms));
      set("paused", s.pauses.length ? s.pauses.map((p) => p.topic || "every topic").join(", ") : "none");
      if (s.relay) {
        set("breaker", s.relay.breaker_open ? "OPEN: destination down, probing" : "closed");
        set("limit", `${s.relay.delivery_limit} (${s.relay.deliveries_in_flight} in flight)`);
        samples = s.history;
        const last = samples[samples.length - 1];
        set("rate", last ? Math.round(last.rate) : "-");
        draw();
      }
      const list = document.getElementById("warnings");
      if (list) {
        list.replaceChildren(...s.warnings.map((w) => { const li = document.createElement("li"); li.className = "warn"; li.textContent = w; return li; }));
      }
    } catch (_) { /* the next refresh tries again */ }
  }
  refresh();
  setInterval(refresh, 2000);
})();
