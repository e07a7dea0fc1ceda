// The GPU lease dashboard: reads REST API v1 every few seconds and draws the pool.
// No framework, no build step. Text goes in through textContent only (never innerHTML).
//
// Identity: with hub OAuth (data-auth="hub") the browser's login cookie, plus the
// page's XSRF token in X-XSRFToken; otherwise a token the user types, kept in
// sessionStorage and sent as "Authorization: token ...".
"use strict";

(function () {
  const REFRESH_MS = 5000;
  const TOKEN_KEY = "gpu-lease-token";
  const page = document.body.dataset;
  const api = page.baseUrl + "api/v1/";
  const hub = page.auth === "hub";
  const $ = (id) => document.getElementById(id);
  let admin = false; // from GET quotas/me
  let timer = null;

  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  function headers() {
    const h = { Accept: "application/json" };
    if (hub) {
      h["X-XSRFToken"] = page.xsrf;
    } else {
      const token = sessionStorage.getItem(TOKEN_KEY);
      if (token) h.Authorization = "token " + token;
    }
    return h;
  }

  async function get(path) {
    let r;
    try {
      r = await fetch(api + path, { headers: headers(), credentials: "same-origin", cache: "no-store" });
    } catch (e) {
      throw new ApiError(0, "The broker cannot be reached; retrying.");
    }
    if (!r.ok) {
      let message = "HTTP " + r.status;
      try {
        const body = await r.json();
        if (body.message) message = body.message;
      } catch (e) { /* not JSON */ }
      throw new ApiError(r.status, message);
    }
    return r.json();
  }

  // -- small builders ----------------------------------------------------------
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v !== null && v !== undefined) node.setAttribute(k, v);
    }
    for (const c of children) {
      if (c === null || c === undefined) continue;
      node.append(c instanceof Node ? c : String(c));
    }
    return node;
  }

  function pct(f) {
    return (Math.round(f * 10000) / 100).toString() + "%";
  }

  function ago(seconds) {
    if (seconds === null || seconds === undefined || !isFinite(seconds)) return "–";
    let s = Math.max(0, Math.floor(seconds));
    if (s < 60) return s + " s";
    if (s < 3600) return Math.floor(s / 60) + " min " + (s % 60) + " s";
    if (s < 86400) return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
    return Math.floor(s / 86400) + " d " + Math.floor((s % 86400) / 3600) + " h";
  }

  function window_(seconds) {
    if (seconds === null || seconds === undefined) return "–";
    for (const [unit, size] of [["d", 86400], ["h", 3600], ["min", 60]]) {
      if (seconds % size === 0) return seconds / size + " " + unit;
    }
    return seconds + " s";
  }

  function dash(v) {
    return v === null || v === undefined ? "–" : String(v);
  }

  function table(caption, header, rows, numeric) {
    const num = new Set(numeric || []);
    const thead = el("thead", {}, el("tr", {}, ...header.map((h, i) =>
      el("th", { scope: "col", class: num.has(i) ? "num" : null }, h))));
    const tbody = el("tbody", {}, ...rows.map((row) =>
      el("tr", {}, ...row.map((cell, i) => el("td", { class: num.has(i) ? "num" : null }, cell)))));
    return el("div", { class: "table-wrap" },
      el("table", {}, el("caption", { class: "hint" }, caption), thead, tbody));
  }

  function bar(fraction, label) {
    const value = Math.round(Math.min(1, Math.max(0, fraction)) * 100);
    const fill = el("span");
    fill.style.width = value + "%"; // CSSOM, allowed by the page's CSP
    return el("div", {
      class: "bar" + (value >= 100 ? " full" : ""), role: "meter", "aria-label": label,
      "aria-valuemin": "0", "aria-valuemax": "100", "aria-valuenow": String(value),
      "aria-valuetext": pct(fraction) + " allocated",
    }, fill);
  }

  function now() {
    return Date.now() / 1000;
  }

  // -- sections -----------------------------------------------------------------
  function gpuName(g) {
    const local = !g.node || g.node === "local" || g.node === "localhost";
    return "GPU " + g.index + " · " + (g.name || "GPU") + (local ? "" : " · node " + g.node);
  }

  function drawGpus(gpus) {
    const box = $("gpus");
    if (!gpus.length) {
      box.replaceChildren(el("p", { class: "empty" }, "No GPUs in the pool."));
      return;
    }
    box.replaceChildren(el("div", { class: "gpus" }, ...gpus.map((g) => {
      const name = gpuName(g);
      const n = g.leases;
      return el("article", { class: "gpu", "aria-label": name },
        el("h3", {}, name),
        bar(g.allocated_fraction, name + " allocation"),
        el("p", {}, el("strong", {}, pct(g.allocated_fraction)), " allocated · " +
          g.allocated_mb + " / " + g.memory_mb + " MiB · " + n + (n === 1 ? " lease" : " leases")));
    })));
  }

  function drawLeases(leases, gpus) {
    const box = $("leases");
    const names = new Map(gpus.map((g) => [g.uuid, "GPU " + g.index]));
    if (!leases.length) {
      box.replaceChildren(el("p", { class: "empty" }, admin ? "No active leases." : "You hold no GPU lease."));
      return;
    }
    const t = now();
    const rows = leases.map((x) => [
      x.user,
      el("code", { title: x.kernel_id }, x.kernel_id.slice(0, 8)),
      names.get(x.gpu.uuid) || x.gpu.uuid.slice(0, 12),
      pct(x.fraction),
      x.memory_limit_mb + " MiB",
      x.execution_state === "busy" ? "busy" : (x.last_activity ? ago(t - x.last_activity) : "–"),
      ago(t - x.created_at),
    ]);
    box.replaceChildren(table(admin ? "Every active lease" : "Your active leases",
      ["User", "Kernel", "GPU", "Fraction", "Memory cap", "Idle", "Age"], rows, [3, 4]));
  }

  function drawQueue(queue) {
    const box = $("queue");
    if (!queue.length) {
      box.replaceChildren(el("p", { class: "empty" }, admin ? "Nobody is waiting." : "You are not waiting for a GPU."));
      return;
    }
    const rows = queue.map((q) => [String(q.position), q.user,
      el("code", { title: q.kernel_id }, q.kernel_id.slice(0, 8)), pct(q.fraction),
      dash(q.group), ago(q.waiting_s)]);
    box.replaceChildren(table(admin ? "Waiting requests in order" : "Your place in the queue",
      ["Position", "User", "Kernel", "Fraction", "Group", "Waiting"], rows, [0, 3]));
  }

  const QUOTA_HEADER = ["Max fraction", "Max leases", "Max lease fraction", "Budget (fraction-hours)", "Budget window", "Priority"];

  function quotaCells(q) {
    return [dash(q.max_fraction), dash(q.max_leases), dash(q.max_lease_fraction),
      dash(q.budget_fraction_hours), window_(q.budget_window), dash(q.priority)];
  }

  function drawMyQuota(me) {
    const cells = quotaCells(me.effective || {});
    const list = el("dl", {}, ...QUOTA_HEADER.flatMap((h, i) => [el("dt", {}, h), el("dd", {}, cells[i])]));
    $("quota").replaceChildren(
      el("p", {}, "Holding now: " + pct(me.held_fraction || 0) + " of a GPU in " + me.leases +
        (me.leases === 1 ? " lease." : " leases.")),
      list,
      el("p", { class: "hint" }, "–: no limit."));
  }

  function drawQuotas(book) {
    const rows = [["default", "–", ...quotaCells(book.default || {})]];
    for (const [level, key] of [["group", "groups"], ["user", "users"]]) {
      for (const [name, q] of Object.entries(book[key] || {})) rows.push([level, name, ...quotaCells(q)]);
    }
    $("quotas").replaceChildren(table("Default, group and user quotas (–: unlimited at the default level, inherited elsewhere)",
      ["Level", "Name", ...QUOTA_HEADER], rows));
  }

  // -- the loop -------------------------------------------------------------------
  async function refresh() {
    try {
      const me = await get("quotas/me"); // who am I: user, groups, admin
      admin = me.admin === true;
      const [gpus, leases, queue, book] = await Promise.all([
        get("gpus").then((b) => b.gpus),
        get(admin ? "leases?all=1" : "leases").then((b) => b.leases),
        get("queue").then((b) => b.queue),
        admin ? get("quotas") : Promise.resolve(null),
      ]);
      $("who").textContent = "Signed in as " + me.user + (admin ? " (admin)" : "");
      drawGpus(gpus);
      drawLeases(leases, gpus);
      drawQueue(queue);
      drawMyQuota(me);
      $("quotas-section").hidden = !admin;
      if (book) drawQuotas(book);
      $("content").hidden = false;
      $("login").hidden = true;
      $("status").textContent = "Updated " + new Date().toLocaleTimeString();
    } catch (e) {
      if (e.status === 401) {
        stop();
        if (hub) {
          $("status").textContent = "Your login has expired: reload the page to sign in again.";
        } else {
          sessionStorage.removeItem(TOKEN_KEY);
          showLogin(e.message);
        }
        return;
      }
      $("status").textContent = "Not updated: " + e.message;
    }
  }

  function start() {
    stop();
    refresh();
    timer = setInterval(refresh, REFRESH_MS);
  }

  function stop() {
    if (timer !== null) clearInterval(timer);
    timer = null;
  }

  function showLogin(message) {
    $("content").hidden = true;
    $("login").hidden = false;
    $("logout").hidden = true;
    $("who").textContent = "";
    $("login-error").textContent = message || "";
    $("token").focus();
  }

  function init() {
    if (hub) {
      $("who").textContent = "Signed in as " + page.user;
      start();
      return;
    }
    $("login-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const token = $("token").value.trim();
      if (!token) return;
      sessionStorage.setItem(TOKEN_KEY, token);
      $("token").value = "";
      $("login-error").textContent = "";
      $("logout").hidden = false;
      start();
    });
    $("logout").addEventListener("click", () => {
      stop();
      sessionStorage.removeItem(TOKEN_KEY);
      showLogin("");
    });
    if (sessionStorage.getItem(TOKEN_KEY)) {
      $("logout").hidden = false;
      start();
    } else {
      showLogin("");
    }
  }

  init();
})();
