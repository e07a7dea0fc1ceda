// The GPU lease dashboard: reads REST API v1 every few seconds and draws the pool.
// No framework, no build step, nothing fetched from elsewhere: the plots are inline SVG
// drawn here. Text goes in through textContent only (never innerHTML).
//
// Identity: with hub OAuth (data-auth="hub") the browser's login cookie, plus the
// page's XSRF token in X-XSRFToken; otherwise a token the user types, kept in
// sessionStorage and sent as "Authorization: token ...".
//
// Admins (hub admins, holders of custom:gpu-lease:admin: instructors) also get a course
// filter (leases, queue and plots of one course), a per-course summary and a revoke
// action on each lease (POST leases/{id}/revoke with a reason the student sees).
"use strict";

(function () {
  const REFRESH_MS = 5000;
  const HISTORY_MS = 60000;
  const TOKEN_KEY = "gpu-lease-token";
  const ALL = "*"; // the course filter's "All courses"; "" is "no course"
  const SVG_NS = "http://www.w3.org/2000/svg";
  const page = document.body.dataset;
  const api = page.baseUrl + "api/v1/";
  const hub = page.auth === "hub";
  const $ = (id) => document.getElementById(id);
  let admin = false; // from GET quotas/me
  let timer = null;
  let course = ALL;
  let range = { since: "24h", step: "15m" };
  let historyAt = 0; // when the plots were last fetched (ms)
  let last = null; // the last data drawn: {gpus, leases, queue, book, usage}
  let revoking = null; // the lease the revoke dialog is about
  let notice = null; // {text, until}: a message kept in the status line for a while
  let asked = 0; // refreshes started, and the newest one drawn: an older answer is dropped
  let drawn = 0;

  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  function headers(json) {
    const h = { Accept: "application/json" };
    if (json) h["Content-Type"] = "application/json";
    if (hub) {
      h["X-XSRFToken"] = page.xsrf;
    } else {
      const token = sessionStorage.getItem(TOKEN_KEY);
      if (token) h.Authorization = "token " + token;
    }
    return h;
  }

  async function send(method, path, body) {
    let r;
    try {
      r = await fetch(api + path, {
        method: method,
        headers: headers(body !== undefined),
        body: body === undefined ? undefined : JSON.stringify(body),
        credentials: "same-origin",
        cache: "no-store",
      });
    } catch (e) {
      throw new ApiError(0, "The broker cannot be reached; retrying.");
    }
    if (!r.ok) {
      let message = "HTTP " + r.status;
      try {
        const answer = await r.json();
        if (answer.message) message = answer.message;
      } catch (e) { /* not JSON */ }
      throw new ApiError(r.status, message);
    }
    return r.status === 204 ? null : r.json();
  }

  const get = (path) => send("GET", path);

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

  function svg(tag, attrs, ...children) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v !== null && v !== undefined) node.setAttribute(k, String(v));
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

  function gpusText(f) {
    return (Math.round(f * 100) / 100).toFixed(2) + " GPU";
  }

  function ago(seconds) {
    if (seconds === null || seconds === undefined || !isFinite(seconds)) return "–";
    let s = Math.max(0, Math.floor(seconds));
    if (s < 60) return s + " s";
    if (s < 3600) return Math.floor(s / 60) + " min " + (s % 60) + " s";
    if (s < 86400) return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
    return Math.floor(s / 86400) + " d " + Math.floor((s % 86400) / 3600) + " h";
  }

  function shortDuration(seconds) {
    const s = Math.round(seconds);
    if (s < 60) return s + " s";
    if (s < 600) return Math.round(s / 6) / 10 + " min";
    if (s < 3600) return Math.round(s / 60) + " min";
    return Math.round(s / 360) / 10 + " h";
  }

  // a time axis' top whose half is a round time too (30 s, 1 min, 2 min, 5 min, ...)
  function niceSeconds(v) {
    const tops = [60, 120, 240, 600, 1200, 2400, 3600, 7200, 14400, 28800, 43200, 86400];
    return tops.find((x) => x >= v) || niceMax(v);
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

  // -- courses -------------------------------------------------------------------
  // A lease (or a waiting request) belongs to its course kernel's group, else to its
  // user's groups (the broker's rule for usage by group), else to "no course" ("").
  function coursesOf(x) {
    if (x.group) return [x.group];
    return x.groups && x.groups.length ? x.groups : [""];
  }

  function inCourse(x) {
    return course === ALL || coursesOf(x).includes(course);
  }

  function courseName(name) {
    return name === "" ? "(no course)" : name;
  }

  function courseCell(x) {
    return coursesOf(x).map(courseName).join(", ");
  }

  function knownCourses(data) {
    const names = new Set();
    for (const x of [...data.leases, ...data.queue]) coursesOf(x).forEach((c) => names.add(c));
    if (data.book) Object.keys(data.book.groups || {}).forEach((c) => names.add(c));
    if (data.usage) Object.keys(data.usage).forEach((c) => names.add(c));
    return [...names].sort((a, b) => (a === "" ? 1 : b === "" ? -1 : a.localeCompare(b)));
  }

  function drawCourseFilter(data) {
    const form = $("view");
    form.hidden = !admin;
    if (!admin) return;
    const select = $("course");
    const wanted = [ALL, ...knownCourses(data)];
    if (course !== ALL && !wanted.includes(course)) wanted.push(course);
    const have = [...select.options].map((o) => o.value);
    if (have.join("\n") !== wanted.join("\n")) {
      select.replaceChildren(...wanted.map((c) =>
        el("option", { value: c }, c === ALL ? "All courses" : courseName(c))));
    }
    select.value = course;
  }

  function drawCourses(data) {
    $("courses-section").hidden = !admin;
    if (!admin) return;
    const rows = [];
    for (const name of knownCourses(data)) {
      const mine = data.leases.filter((x) => coursesOf(x).includes(name));
      // a lease of a student in several courses is split equally, as usage is
      const held = mine.reduce((sum, x) => sum + x.fraction / coursesOf(x).length, 0);
      const waiting = data.queue.filter((q) => coursesOf(q).includes(name)).length;
      const used = data.usage ? data.usage[name] || 0 : null;
      const pick = el("button", { type: "button", class: "link", "data-course": name,
        "aria-pressed": String(course === name) }, courseName(name));
      pick.addEventListener("click", () => setCourse(course === name ? ALL : name));
      rows.push([pick, String(mine.length), gpusText(held), String(waiting),
        used === null ? "–" : (Math.round(used * 100) / 100).toFixed(2)]);
    }
    if (!rows.length) {
      $("courses").replaceChildren(el("p", { class: "empty" }, "No course has used a GPU yet."));
      return;
    }
    $("courses").replaceChildren(table(
      "Per course: a student in several courses counts for each, split equally; pick a course to show only it",
      ["Course", "Leases", "Held now", "Waiting", "Used, last 7 days (fraction-hours)"], rows, [1, 2, 3, 4]));
  }

  function setCourse(name) {
    course = name;
    $("course").value = name;
    // the filter is in the page's URL: a reload, a bookmark or a link keeps it
    const url = new URL(window.location.href);
    if (name === ALL) url.searchParams.delete("course");
    else url.searchParams.set("course", name);
    window.history.replaceState(null, "", url);
    historyAt = 0;
    if (last) draw(last, true);
    refreshHistory();
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

  // Keep a table as it is while the user selects text in it or uses one of its buttons.
  function busy(box) {
    const sel = window.getSelection();
    if (sel && !sel.isCollapsed && sel.anchorNode && box.contains(sel.anchorNode)) return true;
    return box.contains(document.activeElement) && document.activeElement !== box;
  }

  function copyButton(id) {
    const b = el("button", { type: "button", class: "small", "aria-label": "Copy lease id " + id }, "Copy");
    b.addEventListener("click", async () => {
      try {
        await navigator.clipboard.writeText(id);
        b.textContent = "Copied";
      } catch (e) {
        // no clipboard (a plain-http page on another host): select the id instead
        const code = b.previousSibling;
        const r = document.createRange();
        r.selectNodeContents(code);
        const sel = window.getSelection();
        sel.removeAllRanges();
        sel.addRange(r);
        b.textContent = "Press Ctrl+C";
      }
    });
    return b;
  }

  function revokeButton(x) {
    const b = el("button", { type: "button", class: "small danger",
      "aria-label": "Revoke lease " + x.id + " of " + x.user }, "Revoke…");
    b.addEventListener("click", () => openRevoke(x));
    return b;
  }

  // 1st, 2nd, 3rd, 4th, 11th, 21st, ...
  function ordinal(n) {
    const tens = n % 100;
    const suffix = tens >= 10 && tens <= 20 ? "th" : ({ 1: "st", 2: "nd", 3: "rd" }[n % 10] || "th");
    return n + suffix;
  }

  // a parked (or parking, resuming) lease says so, with its place while its resume waits
  const PARK_STATES = ["parking", "parked", "resuming"];
  function idleCell(x, t) {
    if (PARK_STATES.includes(x.state)) {
      const place = x.resume && x.resume.position;
      const text = place ? x.state + ", " + ordinal(place) + " to resume" : x.state;
      return el("span", { class: "parked", title: x.parked_at ? "parked " + ago(t - x.parked_at) + " ago" : "" }, text);
    }
    return x.execution_state === "busy" ? "busy" : (x.last_activity ? ago(t - x.last_activity) : "–");
  }

  function drawLeases(all, gpus, force) {
    const box = $("leases");
    if (!force && busy(box)) return;
    const leases = all.filter(inCourse);
    const names = new Map(gpus.map((g) => [g.uuid, "GPU " + g.index]));
    if (!leases.length) {
      box.replaceChildren(el("p", { class: "empty" },
        admin ? (course === ALL ? "No active leases." : "No active leases in " + courseName(course) + ".")
          : "You hold no GPU lease."));
      return;
    }
    const t = now();
    const rows = leases.map((x) => {
      const row = [
        el("span", { class: "id" }, el("code", { class: "lease-id" }, x.id), copyButton(x.id)),
        x.user,
        courseCell(x),
        el("code", { title: x.kernel_id }, x.kernel_id.slice(0, 8)),
        names.get(x.gpu.uuid) || x.gpu.uuid.slice(0, 12),
        pct(x.fraction),
        x.memory_limit_mb + " MiB",
        idleCell(x, t),
        ago(t - x.created_at),
      ];
      if (admin) row.push(revokeButton(x));
      return row;
    });
    const header = ["Lease id", "User", "Course", "Kernel", "GPU", "Fraction", "Memory cap", "Idle", "Age"];
    if (admin) header.push(el("span", { class: "visually-hidden" }, "Action"));
    const what = admin ? (course === ALL ? "Every active lease" : "Active leases in " + courseName(course))
      : "Your active leases";
    box.replaceChildren(table(what + " (lease ids are what gpu-lease revoke takes)", header, rows, [5, 6]));
  }

  function drawQueue(all) {
    const box = $("queue");
    const queue = all.filter(inCourse);
    if (!queue.length) {
      box.replaceChildren(el("p", { class: "empty" },
        admin ? (course === ALL ? "Nobody is waiting." : "Nobody in " + courseName(course) + " is waiting.")
          : "You are not waiting for a GPU."));
      return;
    }
    const rows = queue.map((q) => [String(q.position), q.user, courseCell(q),
      el("code", { title: q.kernel_id }, q.kernel_id.slice(0, 8)), pct(q.fraction), ago(q.waiting_s)]);
    box.replaceChildren(table(admin ? "Waiting requests in order (positions in the whole queue)" : "Your place in the queue",
      ["Position", "User", "Course", "Kernel", "Fraction", "Waiting"], rows, [0, 4]));
  }

  // the class sessions' timetable: when, its state, what it reserves, uses and lends back
  function clockIn(t, tz) {
    try {
      return new Date(t * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", timeZone: tz });
    } catch (e) {
      return new Date(t * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
    }
  }

  const SESSION_STATES = { planned: "planned", lead: "starts soon (kept for members)", on: "under way", after: "under way (unused share lent back)" };

  function drawSessions(all) {
    const box = $("sessions");
    const list = (all || []).filter((s) => course === ALL || s.course === course);
    if (!list.length) {
      box.replaceChildren(el("p", { class: "empty" }, "No class session in the next two days."));
      return;
    }
    const rows = list.map((s) => [
      s.course,
      (s.source === "by hand" ? "by hand " : (s.label ? s.label + ", " : "")) +
        clockIn(s.start, s.tz) + "–" + clockIn(s.end, s.tz) + " (" + s.tz + ")",
      SESSION_STATES[s.state] || s.state,
      s.share,
      gpusText(s.reserved),
      gpusText(s.used),
      gpusText(s.lent),
    ]);
    box.replaceChildren(table("The timetable: each session reserves a GPU share for its course's members",
      ["Course", "When", "State", "Share", "Reserved", "Used by members", "Lent back"], rows, [4, 5, 6]));
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

  // -- revoke ---------------------------------------------------------------------
  function openRevoke(x) {
    revoking = x;
    $("revoke-what").replaceChildren("Lease ", el("code", {}, x.id), " of " + x.user + " (" +
      pct(x.fraction) + " of a GPU, kernel " + x.kernel_id.slice(0, 8) + ").");
    $("revoke-error").textContent = "";
    $("revoke-reason").value = "";
    countReason();
    $("revoke-confirm").disabled = false;
    $("revoke-dialog").showModal();
    $("revoke-reason").focus();
  }

  // the reason box holds REASON_MAX characters (the broker's limit): say how many are left,
  // and plainly when the box is full, rather than dropping what is typed without a word
  const REASON_MAX = 500;
  function countReason() {
    const n = $("revoke-reason").value.length;
    $("revoke-count").textContent = n >= REASON_MAX
      ? REASON_MAX + " of " + REASON_MAX + " characters: a reason holds no more"
      : n + " of " + REASON_MAX + " characters";
    $("revoke-count").classList.toggle("error", n >= REASON_MAX);
  }

  async function submitRevoke(ev) {
    ev.preventDefault();
    const x = revoking;
    const reason = $("revoke-reason").value.trim();
    if (!x) return;
    if (!reason) {
      $("revoke-error").textContent = "Say why: the student sees this reason.";
      $("revoke-reason").focus();
      return;
    }
    $("revoke-confirm").disabled = true;
    try {
      await send("POST", "leases/" + encodeURIComponent(x.id) + "/revoke", { reason: reason });
    } catch (e) {
      $("revoke-error").textContent = e.message;
      $("revoke-confirm").disabled = false;
      return;
    }
    revoking = null;
    $("revoke-dialog").close();
    notice = { text: "Revoked lease " + x.id + " of " + x.user + ": " + reason, until: Date.now() + 20000 };
    $("status").textContent = notice.text;
    $("leases-h").focus();
    await refresh(true);
  }

  // -- plots ------------------------------------------------------------------------
  const PLOT = { w: 380, h: 200, l: 46, r: 12, t: 12, b: 30 };

  function niceMax(v) {
    if (!(v > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10]) {
      if (m * p >= v - 1e-9) return m * p;
    }
    return 10 * p;
  }

  function timeTicks(t0, t1) {
    const span = t1 - t0;
    const steps = [300, 900, 1800, 3600, 7200, 10800, 14400, 21600, 43200, 86400, 172800];
    const iv = steps.find((s) => span / s <= 6) || 172800;
    const off = new Date(t0 * 1000).getTimezoneOffset() * 60; // local midnight alignment
    const ticks = [];
    for (let t = Math.ceil((t0 + off) / iv) * iv - off; t <= t1; t += iv) ticks.push(t);
    return { ticks, daily: iv >= 86400 };
  }

  function timeLabel(t, daily) {
    const d = new Date(t * 1000);
    if (daily) return d.toLocaleDateString([], { weekday: "short", day: "numeric" });
    return d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
  }

  // A step line (or area down to 0) over buckets [t, t + step): values null are gaps.
  function stepPath(points, key, x, y, step, until, area) {
    let d = "";
    let open = false;
    let startX = 0;
    const close = (endX) => {
      if (open && area) d += "L" + endX.toFixed(1) + "," + y(0).toFixed(1) + "L" + startX.toFixed(1) + "," + y(0).toFixed(1) + "Z";
      open = false;
    };
    let prevEnd = 0;
    for (const p of points) {
      const v = p[key];
      const a = x(p.t);
      const b = x(Math.min(p.t + step, until));
      if (v === null || v === undefined) {
        close(prevEnd);
        continue;
      }
      if (!open) {
        d += "M" + a.toFixed(1) + "," + (area ? y(0) : y(v)).toFixed(1);
        if (area) d += "L" + a.toFixed(1) + "," + y(v).toFixed(1);
        startX = a;
        open = true;
      } else {
        d += "L" + a.toFixed(1) + "," + y(v).toFixed(1);
      }
      d += "L" + b.toFixed(1) + "," + y(v).toFixed(1);
      prevEnd = b;
    }
    close(prevEnd);
    return d;
  }

  function plot(spec, h) {
    const { w, l, r, t, b } = PLOT;
    const H = PLOT.h;
    const t0 = h.since;
    const t1 = Math.max(h.until, t0 + 1);
    const x = (s) => l + ((s - t0) / (t1 - t0)) * (w - l - r);
    const y = (v) => t + (1 - v / spec.max) * (H - t - b);
    const parts = [];
    for (const f of [0, 0.5, 1]) {
      const v = spec.max * f;
      parts.push(svg("line", { class: "grid", x1: l, x2: w - r, y1: y(v), y2: y(v) }));
      parts.push(svg("text", { class: "tick", x: l - 6, y: y(v) + 4, "text-anchor": "end" }, spec.yLabel(v)));
    }
    const { ticks, daily } = timeTicks(t0, t1);
    for (const s of ticks) {
      parts.push(svg("line", { class: "grid vertical", x1: x(s), x2: x(s), y1: t, y2: H - b }));
      parts.push(svg("text", { class: "tick", x: x(s), y: H - b + 16, "text-anchor": "middle" }, timeLabel(s, daily)));
    }
    for (const layer of spec.layers) {
      if (layer.kind === "bars") {
        const pad = layer.narrow ? 0.3 : 0.08;
        for (const p of h.points) {
          const v = p[layer.key];
          if (v === null || v === undefined || v <= 0) continue;
          const a = x(p.t);
          const e = x(Math.min(p.t + h.step, t1));
          const inset = (e - a) * pad;
          parts.push(svg("rect", { class: layer.cls, x: (a + inset).toFixed(1), width: Math.max(1, e - a - 2 * inset).toFixed(1),
            y: y(Math.min(v, spec.max)).toFixed(1), height: (y(0) - y(Math.min(v, spec.max))).toFixed(1) }));
        }
      } else if (layer.kind === "hline") {
        if (layer.value > 0) parts.push(svg("line", { class: layer.cls, x1: l, x2: w - r, y1: y(layer.value), y2: y(layer.value) }));
      } else {
        const d = stepPath(h.points, layer.key, x, y, h.step, t1, layer.kind === "area");
        if (d) parts.push(svg("path", { class: layer.cls, d: d, "data-series": layer.key }));
      }
    }
    parts.push(svg("line", { class: "axis", x1: l, x2: w - r, y1: y(0), y2: y(0) }));
    const label = spec.title + ". " + spec.summary;
    const chart = svg("svg", { viewBox: "0 0 " + w + " " + H, role: "img", "aria-label": label,
      class: "plot", "data-plot": spec.id }, svg("title", {}, label), ...parts);
    const legend = el("ul", { class: "legend" }, ...spec.layers.filter((x) => x.label).map((layer) =>
      el("li", {}, el("span", { class: "swatch " + layer.cls, "aria-hidden": "true" }), layer.label)));
    return el("figure", { class: "plot-box", id: "plot-" + spec.id },
      el("figcaption", {}, el("strong", {}, spec.title), el("span", { class: "summary" }, spec.summary)),
      chart, legend);
  }

  function peakOf(points, key) {
    let best = null;
    for (const p of points) {
      if (p[key] !== null && p[key] !== undefined && (best === null || p[key] > best[key])) best = p;
    }
    return best;
  }

  function drawHistory(h) {
    const pts = h.points;
    const daily = h.until - h.since > 2 * 86400;
    const when = (p) => (daily ? new Date(p.t * 1000).toLocaleString([], { weekday: "short", hour: "2-digit", minute: "2-digit" })
      : new Date(p.t * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" }));
    const own = !admin;
    const scope = own ? "Your " : course === ALL ? "" : courseName(course) + ": ";
    const allocPeak = peakOf(pts, "allocated_max");
    const span = pts.length ? Math.min(h.until, pts[pts.length - 1].t + h.step) - pts[0].t : 0;
    const allocMean = span > 0 ? pts.reduce((s, p) => s + p.allocated * (Math.min(h.until, p.t + h.step) - p.t), 0) / span : 0;
    const allocMax = niceMax(Math.max(own || course !== ALL ? 0 : h.capacity, allocPeak ? allocPeak.allocated_max : 0, 0.01));
    const queuePeak = peakOf(pts, "queue_max");
    const waitPeak = peakOf(pts, "wait_max_s");
    const waited = pts.reduce((s, p) => s + p.waited, 0);
    const grants = pts.reduce((s, p) => s + p.grants, 0);
    const withdrawn = pts.reduce((s, p) => s + p.withdrawn, 0);
    const specs = [
      {
        id: "allocation",
        title: scope + "GPU allocation",
        summary: allocPeak && allocPeak.allocated_max > 0
          ? "Peak " + gpusText(allocPeak.allocated_max) + " at " + when(allocPeak) + " · mean " + gpusText(allocMean)
          : "Nothing held",
        max: allocMax,
        // three significant digits: a peak of 0.01 GPU has its middle line at 0.005, not a second "0.01"
        yLabel: (v) => Number(v.toPrecision(3)).toString(),
        layers: [
          { kind: "area", key: "allocated", cls: "s-mean", label: "mean (GPUs)" },
          { kind: "line", key: "allocated_max", cls: "s-peak", label: "peak" },
          ...(own || course !== ALL ? [] : [{ kind: "hline", value: h.capacity, cls: "s-capacity", label: "capacity" }]),
        ],
      },
      {
        id: "queue",
        title: own ? "Your requests in the queue" : scope + "Queue length",
        summary: queuePeak && queuePeak.queue_max > 0
          ? "Peak " + queuePeak.queue_max + " waiting at " + when(queuePeak) + (withdrawn ? " · " + withdrawn + " gave up" : "")
          : "Nobody waited",
        max: niceMax(Math.max(1, queuePeak ? queuePeak.queue_max : 0)),
        yLabel: (v) => (Number.isInteger(v) ? String(v) : v.toFixed(1)),
        layers: [
          { kind: "area", key: "queue", cls: "s-mean queue", label: "mean waiting" },
          { kind: "line", key: "queue_max", cls: "s-peak queue", label: "peak" },
        ],
      },
      {
        id: "waits",
        title: scope + "Waits before a GPU",
        summary: waited
          ? waited + " of " + grants + " grants waited · longest " + shortDuration(waitPeak.wait_max_s)
          : grants + (grants === 1 ? " grant" : " grants") + ", none waited",
        max: niceSeconds(Math.max(60, waitPeak ? waitPeak.wait_max_s : 0)),
        yLabel: (v) => (v === 0 ? "0" : shortDuration(v)),
        layers: [
          { kind: "bars", key: "wait_max_s", cls: "s-wait-max", label: "longest wait" },
          { kind: "bars", key: "wait_mean_s", cls: "s-wait-mean", narrow: true, label: "mean wait" },
        ],
      },
    ];
    $("history").replaceChildren(...specs.map((s) => plot(s, h)));
    const stepText = window_(h.step);
    $("history-note").textContent = (own ? "Your own leases and requests only. " : "") +
      "Buckets of " + stepText + "; from the broker's records of leases and of the queue (kept since the broker's schema version 3).";
  }

  async function refreshHistory() {
    const q = new URLSearchParams({ since: range.since, step: range.step });
    if (admin && course !== ALL) q.set("group", course);
    try {
      const [h, usage] = await Promise.all([
        get("history?" + q.toString()),
        admin ? get("usage?by=group&since=7d") : Promise.resolve(null),
      ]);
      historyAt = Date.now();
      drawHistory(h);
      if (last) {
        last.usage = usage;
        drawCourseFilter(last);
        drawCourses(last);
      }
    } catch (e) {
      $("history-note").textContent = "History not updated: " + e.message;
    }
  }

  function setRange(button) {
    range = { since: button.dataset.since, step: button.dataset.step };
    for (const b of document.querySelectorAll(".range button")) {
      b.setAttribute("aria-pressed", String(b === button));
    }
    refreshHistory();
  }

  // -- the loop -------------------------------------------------------------------
  function draw(data, force) {
    drawCourseFilter(data);
    drawGpus(data.gpus);
    drawLeases(data.leases, data.gpus, force);
    drawQueue(data.queue);
    drawSessions(data.sessions);
    drawCourses(data);
    drawMyQuota(data.me);
    $("quotas-section").hidden = !admin;
    if (data.book) drawQuotas(data.book);
  }

  async function refresh(force) {
    const mine = ++asked;
    try {
      const me = await get("quotas/me"); // who am I: user, groups, admin
      admin = me.admin === true;
      const [gpus, leases, queue, book, sessions] = await Promise.all([
        get("gpus").then((b) => b.gpus),
        get(admin ? "leases?all=1" : "leases").then((b) => b.leases),
        get("queue").then((b) => b.queue),
        admin ? get("quotas") : Promise.resolve(null),
        get("sessions").then((b) => b.sessions, () => []), // an older broker has none
      ]);
      if (mine < drawn) return; // a newer refresh has drawn already (e.g. after a revoke)
      drawn = mine;
      $("who").textContent = "Signed in as " + me.user + (admin ? " (admin)" : "");
      last = { me, gpus, leases, queue, book, sessions, usage: last ? last.usage : null };
      draw(last, force === true);
      $("content").hidden = false;
      $("login").hidden = true;
      const updated = "Updated " + new Date().toLocaleTimeString();
      if (notice && Date.now() > notice.until) notice = null;
      $("status").textContent = notice ? notice.text + " · " + updated : updated;
      if (Date.now() - historyAt >= HISTORY_MS) await refreshHistory();
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
    historyAt = 0;
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
    const wanted = new URLSearchParams(window.location.search).get("course");
    if (wanted !== null) course = wanted;
    $("course").addEventListener("change", () => setCourse($("course").value));
    $("view").addEventListener("submit", (ev) => ev.preventDefault());
    for (const b of document.querySelectorAll(".range button")) {
      b.addEventListener("click", () => setRange(b));
    }
    $("revoke-form").addEventListener("submit", submitRevoke);
    $("revoke-reason").addEventListener("input", countReason);
    $("revoke-cancel").addEventListener("click", () => {
      revoking = null;
      $("revoke-dialog").close();
    });
    $("leases-h").setAttribute("tabindex", "-1");
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
