// trainyard dashboard: plain JS, no dependencies, no build step. Talks to its own origin only.
"use strict";
(() => {
  const POLL_MS = 1000;
  const TERMINAL = new Set(["succeeded", "failed", "cancelled", "pruned"]);
  const CANCELLABLE = new Set(["queued", "running"]);
  // A pruned trial's retry runs it to its end (from its last checkpoint), outside its sweep's search.
  const RETRYABLE = new Set(["failed", "cancelled", "pruned"]);
  const SVG = "http://www.w3.org/2000/svg";

  // ---- small helpers -------------------------------------------------------------------------

  const $ = (id) => document.getElementById(id);

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined || c === false) continue;
      node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return node;
  }

  function svg(tag, attrs, ...children) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined) continue;
      if (k === "text") node.textContent = v;
      else node.setAttribute(k, String(v));
    }
    for (const c of children.flat()) if (c) node.append(c);
    return node;
  }

  function setText(node, text) {
    text = text === null || text === undefined ? "" : String(text);
    if (node.textContent !== text) node.textContent = text;
  }

  function setAttr(node, name, value) {
    value = String(value);
    if (node.getAttribute(name) !== value) node.setAttribute(name, value);
  }

  const isNum = (v) => typeof v === "number" && Number.isFinite(v);

  function fmtBytes(n) {
    if (!isNum(n)) return "–";
    if (Math.abs(n) >= 2 ** 30) return (n / 2 ** 30).toFixed(2) + " GiB";
    if (Math.abs(n) >= 2 ** 20) return (n / 2 ** 20).toFixed(0) + " MiB";
    if (Math.abs(n) >= 2 ** 10) return (n / 2 ** 10).toFixed(0) + " KiB";
    return n + " B";
  }

  const fmtLoss = (v) => (isNum(v) ? (Math.abs(v) >= 1000 ? v.toExponential(2) : v.toFixed(4)) : "–");
  const fmtPct = (v) => (isNum(v) ? (v * 100).toFixed(1) + "%" : "–");

  function fmtDuration(s) {
    if (!isNum(s)) return "–";
    s = Math.max(0, s);
    if (s < 60) return s.toFixed(s < 10 ? 1 : 0) + " s";
    const m = Math.floor(s / 60);
    if (m < 60) return `${m} m ${String(Math.floor(s % 60)).padStart(2, "0")} s`;
    return `${Math.floor(m / 60)} h ${String(m % 60).padStart(2, "0")} m`;
  }

  // The API sends ISO times; Unix seconds (the sweeps contract's first draft) are read as well.
  const parseTime = (t) => (isNum(t) ? t * 1000 : t ? Date.parse(t) : NaN);

  function fmtTime(iso) {
    const t = parseTime(iso);
    return Number.isNaN(t) ? "–" : new Date(t).toLocaleString();
  }

  /** Seconds the job has spent in its current phase (waiting, running, or how long it ran). */
  // A job that runs on Slurm: its allocation as the agent last saw it (docs/scaling-out.md, "Slurm").
function slurmFact(slurm) {
  if (!slurm || !slurm.id) return null;
  const where = slurm.nodes ? ` on ${slurm.nodes}` : "";
  const why = slurm.reason && slurm.state === "PENDING" ? ` (${slurm.reason})` : "";
  return `job ${slurm.id} · ${slurm.partition || "?"} · ${slurm.state || "?"}${why}${where}`;
}

function jobTime(job) {
    const now = Date.now();
    const created = parseTime(job.created_at), started = parseTime(job.started_at);
    const finished = parseTime(job.finished_at);
    if (job.state === "queued") return { label: "waiting", s: (now - created) / 1000 };
    if (job.state === "running") return { label: "running", s: (now - (started || created)) / 1000 };
    if (!Number.isNaN(finished)) {
      const from = Number.isNaN(started) ? created : started;
      return { label: "took", s: (finished - from) / 1000 };
    }
    return { label: "", s: NaN };
  }

  /** What the job is, from its `summary` (list items carry no spec: a prediction's rows were megabytes). */
  function jobSummary(job) {
    const s = job.summary || {};
    if (job.kind === "predict") {
      const what = isNum(s.rows) ? `${s.rows} rows` : s.dataset ? `${s.dataset}/${s.split || "val"}` : "";
      return `model of job ${s.model_job}` + (what ? ` · ${what}` : "");
    }
    if (job.kind === "run") return `entrypoint ${s.entrypoint}`;
    return [s.arch, s.dataset].filter(Boolean).join(" · ");
  }

  /** A metric of any scale: losses, accuracies, a run job's own numbers. */
  function fmtValue(v) {
    if (!isNum(v)) return "–";
    if (v !== 0 && (Math.abs(v) >= 1000 || Math.abs(v) < 1e-3)) return v.toExponential(3);
    return v.toFixed(4);
  }

  /** A `keep: best` job whose kept epoch is not its last: {epoch: the kept one, last: the last recorded}. */
  function keptBest(job) {
    const r = job.result || {};
    const last = (job.latest_metrics || {}).epoch;
    return r.kept === "best" && isNum(r.kept_epoch) && r.kept_epoch !== last ? { epoch: r.kept_epoch, last } : null;
  }

  /** The summary's label for a metric of the last epoch where the model kept is another's: which epoch it is. */
  function lastOf(job, key) {
    const kept = keptBest(job);
    return kept && isNum((job.latest_metrics || {})[key]) && isNum(kept.last) ? ` (last epoch, ${kept.last})` : "";
  }

  function latest(job, key) {
    const m = job.latest_metrics || {};
    if (isNum(m[key])) return m[key];
    const r = job.result || {};
    if (isNum(r[key])) return r[key];
    if (key === "val_accuracy" && isNum(r.accuracy)) return r.accuracy;
    return null;
  }

  function badge(state, testid) {
    return el("span", { class: `badge state-${state}`, "data-testid": testid, "data-state": state, text: state });
  }

  function updateBadge(node, state) {
    setText(node, state);
    setAttr(node, "class", `badge state-${state}`);
    setAttr(node, "data-state", state);
  }

  // ---- API access -----------------------------------------------------------------------------------
  // The token is never in this script: signing in posts it to /session, which keeps it in an HttpOnly cookie
  // that the browser sends with each call below (and that no script, ours or an injected one, can read).

  class Unauthorized extends Error {}
  class ApiError extends Error {
    constructor(status, detail) {
      super(`${status}: ${detail}`);
      this.status = status;
    }
  }

  // Earlier versions kept the token in local storage: it goes, now that the cookie holds it.
  try { localStorage.removeItem("trainyard.token"); } catch (e) { /* storage disabled: nothing kept */ }

  /** The response's body; with options.withHeaders, {body, headers}. */
  async function api(path, options = {}) {
    const { withHeaders, ...init } = options;
    const headers = { Accept: "application/json", ...(init.headers || {}) };
    // Relative to the page (not "/jobs"), so that the dashboard also works behind a proxy under a path prefix.
    const r = await fetch(path.replace(/^\//, ""), { ...init, headers, cache: "no-store", credentials: "same-origin" });
    if (r.status === 401) throw new Unauthorized("the API wants a token");
    if (!r.ok) {
      let detail = r.statusText;
      try {
        const body = await r.json();
        detail = typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
      } catch (e) { /* not JSON */ }
      throw new ApiError(r.status, detail);
    }
    const type = r.headers.get("content-type") || "";
    const body = type.includes("json") ? await r.json() : await r.text();
    return withHeaders ? { body, headers: r.headers } : body;
  }

  // ---- polling and routing -----------------------------------------------------------------------

  let timer = null;
  let generation = 0; // bumped on every tick and route change: late answers of older ticks are dropped
  let authNeeded = false;

  function route() {
    const h = location.hash;
    let m = h.match(/^#\/jobs\/(\d+)\/?$/);
    if (m) return { view: "job", id: Number(m[1]) };
    m = h.match(/^#\/sweeps\/(\d+)\/?$/);
    if (m) return { view: "sweep", id: Number(m[1]) };
    return /^#\/sweeps\/?$/.test(h) ? { view: "sweeps" } : { view: "list" };
  }

  // A job's MLflow run (GET /jobs/{id}'s tracking.mlflow): a link to its page, and whether the tracker has it all.
  function mlflowFact(run) {
    if (!run) return null;
    const state = run.error ? ` · not sent yet: ${run.error}` : run.complete ? " · complete" : " · being sent";
    if (!run.run_id) return `run not made yet${state}`;
    const name = `run ${run.run_id.slice(0, 8)}`;
    const link = run.url ? el("a", { href: run.url, target: "_blank", rel: "noopener noreferrer",
                                     "data-testid": "job-mlflow", text: name }) : name;
    return [link, `${run.model_version ? ` · model version ${run.model_version}` : ""}${state}`];
  }

  function setStatus(text, kind) {
    const node = $("status");
    setText(node, text);
    setAttr(node, "class", `status ${kind || ""}`);
  }

  async function tick() {
    clearTimeout(timer);
    timer = null;
    if (authNeeded) return;
    const gen = ++generation;
    const current = () => gen === generation;
    try {
      if (!document.hidden) {
        const r = route();
        if (r.view === "job") await refreshJob(r.id, current);
        else if (r.view === "sweep") await refreshSweep(r.id, current);
        else if (r.view === "sweeps") await refreshSweeps(current);
        else await refreshList(current);
        if (current()) setStatus("live", "ok");
        if (current() && !whoAsked) showWho();
      }
    } catch (e) {
      if (e instanceof Unauthorized) {
        // Refused after the page was in: the token was revoked, or its user left its project.
        showAuth(whoAsked ? "This browser's token was refused (revoked?): sign in again." : "");
        return;
      }
      if (current()) setStatus(e instanceof ApiError ? `error ${e.message}` : "server unreachable, retrying", "bad");
    }
    if (current() && !authNeeded) timer = setTimeout(tick, POLL_MS);
  }

  function showView() {
    const r = route();
    for (const v of ["list", "job", "sweeps", "sweep"]) $(`view-${v}`).hidden = r.view !== v;
    const titles = { job: `Job ${r.id} · `, sweep: `Sweep ${r.id} · `, sweeps: "Sweeps · " };
    document.title = `${titles[r.view] || ""}trainyard`;
    // A sweep's trial pages count as the jobs section: they are jobs.
    const sweeps = r.view === "sweeps" || r.view === "sweep";
    for (const [id, on] of [["nav-jobs", !sweeps], ["nav-sweeps", sweeps]]) {
      if (on) $(id).setAttribute("aria-current", "page");
      else $(id).removeAttribute("aria-current");
    }
    if (r.view === "job" && jobView.id !== r.id) resetJobView(r.id);
    if (r.view === "sweep" && sweepView.id !== r.id) resetSweepView(r.id);
  }

  window.addEventListener("hashchange", () => {
    showView();
    tick();
  });
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden) tick();
  });

  // ---- signing in and out ---------------------------------------------------------------------------

  let whoAsked = false;

  function showAuth(refused) {
    authNeeded = true;
    clearTimeout(timer);
    $("auth").hidden = false;
    $("main").hidden = true;
    $("session").hidden = true;
    const err = $("token-error");
    err.hidden = !refused;
    setText(err, refused || "");
    setStatus("sign-in needed", "bad");
    $("token-input").focus();
  }

  /** Who the page acts as (GET /me): the user, and the project whose jobs it shows. */
  async function showWho() {
    whoAsked = true;
    $("session").hidden = false;
    let me = null;
    try {
      me = await api("/me");
    } catch (e) {
      // A server without /me (or a passing failure): the page works on, without a name to show.
    }
    const who = $("who");
    who.hidden = !me;
    if (!me) return;
    const where = me.project ? `project ${me.project}` : me.admin ? "all projects" : "";
    setText(who, [me.user, me.admin ? "(admin)" : "", where ? `· ${where}` : ""].filter(Boolean).join(" "));
    setAttr(who, "data-user", me.user);
    setAttr(who, "data-project", me.project || "");
  }

  $("token-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const input = $("token-input");
    // The token goes from the field to the request's body and nowhere else: the field is emptied at once.
    const body = JSON.stringify({ token: input.value.trim() });
    input.value = "";
    const submit = $("token-submit");
    submit.disabled = true;
    try {
      await api("/session", { method: "POST", headers: { "Content-Type": "application/json" }, body });
    } catch (e) {
      const refused = e instanceof Unauthorized || (e instanceof ApiError && e.status === 422);
      showAuth(refused ? "That token was refused: it is wrong, revoked, or no longer in its project."
                       : `Could not sign in: ${e.message}`);
      return;
    } finally {
      submit.disabled = false;
    }
    // A fresh page: nothing of an earlier session's views is kept.
    location.reload();
  });

  $("sign-out").addEventListener("click", async () => {
    try {
      await api("/session", { method: "DELETE" });
    } catch (e) {
      setStatus(`could not sign out: ${e.message}`, "bad");
      return;
    }
    location.reload();
  });

  // ---- cancel, retry, pin and delete ---------------------------------------------------------------

  function actionButton(id, action, label) {
    return el("button", {
      type: "button", class: `btn btn-${action}`, "data-action": action, "data-job": id,
      "aria-label": `${label} job ${id}`, "data-testid": `${action}-${id}`, hidden: true, text: label,
    });
  }

  function actionButtons(id) {
    return [actionButton(id, "cancel", "Cancel"), actionButton(id, "retry", "Retry")];
  }

  // The job page's buttons: cancel and retry, then pin (or unpin) and delete (an ended job nothing keeps).
  function jobPageButtons(id) {
    return [...actionButtons(id), actionButton(id, "pin", "Pin"), actionButton(id, "delete", "Delete")];
  }

  function updatePageActions(buttons, job) {
    const [, , pin, del] = buttons;
    updateActions(buttons, job.state);
    const action = job.pinned ? "unpin" : "pin", label = job.pinned ? "Unpin" : "Pin";
    if (pin.dataset.action !== action) {
      pin.dataset.action = action;
      pin.textContent = label;
      setAttr(pin, "aria-label", `${label} job ${job.id}`);
      setAttr(pin, "title", job.pinned ? "let this job be deleted" : "keep this job from deletion (its model is in use)");
    }
    if (pin.hidden) pin.hidden = false;
    const showDelete = TERMINAL.has(job.state) && !job.pinned;
    if (del.hidden === showDelete) del.hidden = !showDelete;
  }

  function updateActions(buttons, state) {
    const [cancel, retry] = buttons;
    const showCancel = CANCELLABLE.has(state), showRetry = RETRYABLE.has(state);
    if (cancel.hidden === showCancel) cancel.hidden = !showCancel;
    if (retry.hidden === showRetry) retry.hidden = !showRetry;
    const label = state === "pruned" ? "Run to end" : "Retry";
    if (retry.textContent !== label) {
      retry.textContent = label;
      setAttr(retry, "aria-label", `${label} job ${retry.dataset.job}`);
      setAttr(retry, "title", state === "pruned" ? "run this pruned trial to its last epoch, outside its sweep" : "");
    }
  }

  document.addEventListener("click", async (ev) => {
    const button = ev.target.closest("button[data-action]");
    if (!button || button.disabled) return;
    const { action, job } = button.dataset;
    const asked = `Delete job ${job}, its metrics, model, checkpoints and log? This cannot be undone.`;
    if (action === "delete" && !confirm(asked)) return;
    button.disabled = true;
    try {
      if (action === "delete") {
        await api(`/jobs/${job}`, { method: "DELETE" });
        setStatus(`job ${job}: deleted`, "ok");
        location.hash = "#/";
        return;
      }
      await api(`/jobs/${job}/${action}`, { method: "POST" });
      const done = { cancel: "cancelled", retry: "requeued", pin: "pinned", unpin: "unpinned" };
      setStatus(`job ${job}: ${done[action]}`, "ok");
    } catch (e) {
      if (e instanceof Unauthorized) { showAuth(); return; }
      setStatus(`could not ${action} job ${job}: ${e.message}`, "bad");
    } finally {
      button.disabled = false;
    }
    tick();
  });

  // ---- the job list ----------------------------------------------------------------------------------

  const rows = new Map(); // job id -> row parts, updated in place so buttons and focus survive polling

  function progressBar(label) {
    const fill = el("span", { class: "bar-fill" });
    const bar = el("span", {
      class: "bar", role: "progressbar", "aria-label": label, "aria-valuemin": 0, "aria-valuemax": 100,
    }, fill);
    const text = el("span", { class: "num bar-text" });
    return { node: el("span", { class: "progress" }, bar, text), bar, fill, text };
  }

  function updateProgress(p, job) {
    const { epoch, epochs } = job.progress || {};
    let frac = null, text = "";
    if (isNum(epochs) && epochs > 0) {
      frac = Math.min(1, (epoch || 0) / epochs);
      text = `${epoch || 0}/${epochs}`;
    } else if (job.state === "succeeded") {
      frac = 1;
    }
    const width = frac === null ? "0%" : `${(frac * 100).toFixed(1)}%`;
    if (!p.drawn) {
      // The first width is shown as is; later changes slide.
      p.fill.style.transition = "none";
      p.fill.style.width = width;
      void p.fill.offsetWidth;
      p.fill.style.transition = "";
      p.drawn = true;
    } else if (p.fill.style.width !== width) {
      p.fill.style.width = width;
    }
    setAttr(p.bar, "aria-valuenow", frac === null ? 0 : Math.round(frac * 100));
    setAttr(p.bar, "data-state", job.state);
    setText(p.text, text);
  }

  function makeRow(id) {
    const href = `#/jobs/${id}`;
    const link = el("a", { href, class: "num", text: `${id}` });
    const name = el("a", { href, class: "job-name" });
    const summary = el("span", { class: "muted job-summary" });
    const state = badge("queued", `job-state-${id}`);
    const progress = progressBar(`Job ${id} progress`);
    const loss = el("td", { class: "num", "data-testid": `job-loss-${id}` });
    const acc = el("td", { class: "num", "data-testid": `job-acc-${id}` });
    const device = el("td", { class: "device" });
    const time = el("td", { class: "num" });
    const buttons = actionButtons(id);
    const tr = el("tr", { "data-testid": `job-row-${id}`, "data-job": id },
      el("td", { class: "num" }, link),
      el("td", null, name, summary),
      el("td", null, state),
      el("td", null, progress.node),
      loss, acc, device, time,
      el("td", { class: "actions" }, buttons));
    return { tr, name, summary, state, progress, loss, acc, device, time, buttons };
  }

  function updateRow(row, job) {
    setText(row.name, job.name || `${job.kind} job`);
    setText(row.summary, jobSummary(job) + (job.sweep ? ` · sweep ${job.sweep.id} trial ${job.sweep.trial}` : "")
      + (job.waiting_for ? ` · waiting: ${job.waiting_for}` : ""));
    updateBadge(row.state, job.state);
    setAttr(row.state, "title", job.waiting_for ? `no worker can take it: ${job.waiting_for}` : job.state);
    setAttr(row.tr, "data-state", job.state);
    updateProgress(row.progress, job);
    setText(row.loss, fmtLoss(latest(job, "train_loss")));
    setText(row.acc, fmtPct(latest(job, "val_accuracy")));
    const requested = job.requested_device || "auto";
    // A job on several devices shows each rank's ("cuda:0 + cuda:1").
    const ran = job.ranks ? job.ranks.map((r) => r.device).join(" + ") : job.device;
    setText(row.device, ran || requested);
    setAttr(row.device, "title", `requested: ${requested}`);
    const t = jobTime(job);
    setText(row.time, fmtDuration(t.s));
    setAttr(row.time, "title", `${t.label} · created ${fmtTime(job.created_at)}`);
    updateActions(row.buttons, job.state);
  }

  async function refreshList(current) {
    const [jobs, devices, storage] = await Promise.all([api("/jobs?limit=100&include=result"), api("/devices"),
                                                       ifAllowed(api("/storage"))]);
    if (!current()) return;
    syncRows($("jobs-body"), rows, jobs.data, makeRow, updateRow);
    $("jobs-empty").hidden = jobs.count > 0;
    setText($("jobs-count"), pageCount(jobs));
    renderDevices(devices);
    $("storage-panel").hidden = storage === null;
    if (storage !== null) renderStorage(storage);
  }

  /** The answer, or null where this user may not read it (403: an admin's panel). */
  async function ifAllowed(answer) {
    try {
      return await answer;
    } catch (e) {
      if (e instanceof ApiError && e.status === 403) return null;
      throw e;
    }
  }

  // A list page's rows in the page's order, each kept (and updated in place) while its item is listed.
  function syncRows(body, cache, items, make, update) {
    const seen = new Set();
    items.forEach((item, i) => {
      let row = cache.get(item.id);
      if (!row) {
        row = make(item.id);
        cache.set(item.id, row);
      }
      update(row, item);
      if (body.children[i] !== row.tr) body.insertBefore(row.tr, body.children[i] || null);
      seen.add(item.id);
    });
    for (const [id, row] of cache) {
      if (!seen.has(id)) {
        row.tr.remove();
        cache.delete(id);
      }
    }
  }

  function pageCount(page) {
    const shown = page.data.length;
    return page.count > shown ? `newest ${shown} of ${page.count}` : `${page.count} total`;
  }

  // ---- devices -----------------------------------------------------------------------------------------

  function workerItem(w) {
    const job = w.job_id ? el("a", { href: `#/jobs/${w.job_id}`, text: `job ${w.job_id}` }) : el("span", { class: "muted", text: "no job" });
    return el("li", { class: "worker", "data-testid": `worker-${w.id}`, "data-state": w.state },
      badge(w.state, null), " ",
      w.draining ? el("span", { class: "badge state-draining", "data-testid": `worker-draining-${w.id}`, text: "draining" }) : null,
      w.draining ? " " : null,
      el("span", { class: "mono", text: w.id }), " ",
      // A member's view has no pid (admins' only).
      el("span", { class: "muted", text: w.pid == null ? w.host : `${w.host}:${w.pid}` }), " · ", job,
      el("span", { class: "muted hb", text: ` · heartbeat ${fmtDuration(w.last_heartbeat_age_s)} ago` }),
      // Why it cannot use its device (and the fix): it takes no job until it can.
      w.unavailable ? el("div", { class: "unavailable", "data-testid": `worker-unavailable-${w.id}`, text: w.unavailable }) : null);
  }

  function workerList(workers) {
    if (!workers.length) return el("p", { class: "muted", text: "No worker on this device." });
    return el("ul", { class: "workers" }, workers.map(workerItem));
  }

  /** A memory bar: the track is the total; segments are laid over each other from the left. */
  function memoryBar(label, total, segments) {
    const track = el("div", { class: "mem-track", role: "img", "aria-label": label });
    for (const seg of segments) {
      if (!isNum(seg.value)) continue;
      const pct = total > 0 ? Math.min(100, (seg.value / total) * 100) : 0;
      const node = el("div", { class: `mem-seg ${seg.cls}`, "data-testid": seg.testid, "data-bytes": seg.value,
                               title: `${seg.name}: ${fmtBytes(seg.value)}` });
      node.style.width = `${pct.toFixed(2)}%`;
      track.append(node);
    }
    const legend = el("div", { class: "mem-legend" },
      segments.map((seg) => el("span", { class: "mem-key" },
        el("span", { class: `swatch ${seg.cls}` }), `${seg.name} `,
        el("span", { class: "num", text: fmtBytes(seg.value) }))),
      el("span", { class: "mem-key" }, "total ", el("span", { class: "num", text: fmtBytes(total) })));
    return el("div", { class: "mem" }, track, legend);
  }

  function sumTorch(workers, key) {
    let total = null;
    for (const w of workers) {
      const v = w.torch && w.torch[key];
      if (isNum(v) && w.state !== "stopped" && w.state !== "lost") total = (total || 0) + v;
    }
    return total;
  }

  function gpuCard(d, host) {
    const name = d.index === null || d.index === undefined ? "GPU" : `cuda:${d.index}`;
    const reserved = sumTorch(d.workers, "memory_reserved");
    const allocated = sumTorch(d.workers, "memory_allocated");
    const util = isNum(d.utilization_gpu) ? ` · ${d.utilization_gpu}% busy` : "";
    const id = host ? `gpu-${host}-${d.index}` : `gpu-${d.index}`;
    return el("article", { class: "device-card", "data-testid": id, "data-uuid": d.uuid },
      el("h3", null, el("span", { class: "mono", text: name }), ` ${d.name} `,
        el("span", { class: "muted", text: `compute ${d.compute_capability}${util}` })),
      memoryBar(`${name} memory: ${fmtBytes(d.memory_used)} used of ${fmtBytes(d.memory_total)}, ` +
                `${fmtBytes(reserved)} reserved and ${fmtBytes(allocated)} allocated by PyTorch`,
        d.memory_total, [
          { name: "used (NVML)", cls: "seg-used", value: d.memory_used, testid: `${id}-used` },
          { name: "torch reserved", cls: "seg-reserved", value: reserved, testid: `${id}-reserved` },
          { name: "torch allocated", cls: "seg-allocated", value: allocated, testid: `${id}-allocated` },
        ]),
      // NVML could not read it, or a card in MIG mode without an instance.
      d.problem ? el("p", { class: "problem", "data-testid": `${id}-problem`, text: d.problem }) : null,
      workerList(d.workers));
  }

  function cpuCard(cpu, host) {
    const used = isNum(cpu.memory_total) && isNum(cpu.memory_available) ? cpu.memory_total - cpu.memory_available : null;
    return el("article", { class: "device-card", "data-testid": host ? `cpu-${host}` : "cpu" },
      el("h3", null, "CPU ",
        el("span", { class: "muted", text: `${cpu.cores} cores` })),
      memoryBar(`RAM: ${fmtBytes(used)} used of ${fmtBytes(cpu.memory_total)}`, cpu.memory_total,
        [{ name: "RAM used", cls: "seg-used", value: used, testid: "cpu-used" }]),
      workerList(cpu.workers || []));
  }

  let devicesKey = "";

  function renderDevices(d) {
    // Rebuilt only when something shown changed (heartbeat ages are rounded to whole seconds).
    const key = JSON.stringify(d, (k, v) => (k === "last_heartbeat_age_s" ? Math.round(v) : v));
    if (key === devicesKey) return;
    devicesKey = key;
    const versions = [["torch", d.torch_version], ["CUDA", d.cuda_version], ["cuDNN", d.cudnn_version],
                      ["driver", d.driver_version]].filter(([, v]) => v).map(([k, v]) => `${k} ${v}`);
    setText($("versions"), versions.join(" · "));
    // One section per host (GPUs keyed by UUID on the host they are on); a host with no GPU and no
    // worker (an API-only container) is left out.
    let hosts = d.hosts || [{ host: null, cuda_devices: d.cuda_devices, cpu: d.cpu }];
    const used = hosts.filter((h) => h.cuda_devices.length || (h.cpu.workers || []).length || (h.other_workers || []).length);
    if (used.length) hosts = used;
    const many = hosts.length > 1;
    const gpus = `${d.cuda_devices.length} GPU(s)` + (many ? ` on ${hosts.length} hosts` : "");
    setText($("devices-summary"), d.cuda_available ? gpus : "no CUDA device");
    $("devices").replaceChildren(...hosts.flatMap((h) => [
      many ? el("h3", { class: "host", "data-testid": `host-${h.host}`, text: h.host }) : null,
      ...h.cuda_devices.map((g) => gpuCard(g, many ? h.host : null)),
      // GPU workers on no GPU NVML lists (an unavailable worker, with its reason).
      (h.other_workers || []).length ? el("article", { class: "device-card", "data-testid": `other-workers-${h.host}` },
        el("h3", null, "GPU workers without a listed GPU"), workerList(h.other_workers)) : null,
      cpuCard(h.cpu, many ? h.host : null),
    ].filter(Boolean)));
  }

  // ---- storage ------------------------------------------------------------------------------------------

  let storageKey = "";

  /** What the store holds by kind (GET /storage: the collector's last measure, every TRAINYARD_COLLECT_S); a
   *  member's answer holds their project's total instead, one row. */
  function renderStorage(s) {
    const key = JSON.stringify([s.kinds, s.project, s.measured_at, s.store]);
    if (key === storageKey) return;
    storageKey = key;
    const summary = $("storage-summary");
    setText(summary, s.measured_at ? `measured ${fmtTime(s.measured_at)}` : "not measured yet");
    setAttr(summary, "title", s.store ?? `project ${s.project ? s.project.name : ""}`);
    const rows = s.project ? { [`project ${s.project.name}`]: s.project } : s.kinds;
    $("storage-body").replaceChildren(...Object.entries(rows).map(([kind, u]) =>
      el("tr", { "data-testid": `storage-${kind}`, "data-bytes": u.bytes, "data-objects": u.objects },
        el("td", { text: kind === "cache" ? "cache (this host's copies)" : kind }),
        el("td", { class: "num", title: `${u.bytes} bytes`, text: fmtBytes(u.bytes) }),
        el("td", { class: "num", text: String(u.objects) }))));
  }

  // ---- one job -------------------------------------------------------------------------------------------

  const LOG_TAIL_BYTES = 64 * 1024;
  const jobView = { id: null, buttons: null, progress: null, metricsKey: null, logKey: null, specKey: null };

  // The head the job and sweep pages share (#job-… and #sweep-…), emptied for a new one: its title, state
  // badge, action buttons and a new progress bar (returned, for the page to move), no "missing" note, no facts.
  function resetHead(page, title, state, actions) {
    const progress = progressBar(`${title} progress`);
    $(`${page}-actions`).replaceChildren(...actions);
    $(`${page}-progress`).replaceChildren(progress.node);
    $(`${page}-state`).replaceChildren(badge(state, `${page}-state`));
    setText($(`${page}-title`), title);
    $(`${page}-missing`).hidden = true;
    $(`${page}-facts`).replaceChildren();
    return progress;
  }

  function resetJobView(id) {
    jobView.id = id;
    jobView.metricsKey = jobView.logKey = jobView.specKey = null;
    jobView.buttons = jobPageButtons(id);
    jobView.progress = resetHead("job", `Job ${id}`, "queued", jobView.buttons);
    $("job-result").replaceChildren();
    setText($("job-spec"), "");
    setText($("job-log"), "");
    $("job-error-panel").hidden = true;
    $("loss-chart-box").replaceChildren(lossChart([], null));
    $("acc-chart-box").replaceChildren(accuracyChart([], null));
    $("lr-panel").hidden = true;
    $("job-sweep-link").hidden = true;
  }

  function facts(dl, pairs) {
    dl.replaceChildren(...pairs.filter(([, v]) => v !== null && v !== undefined && v !== "")
      .flatMap(([k, v]) => [el("dt", { text: k }), el("dd", null, v)]));
  }

  function valueText(v) {
    if (isNum(v)) return Number.isInteger(v) ? String(v) : String(Number(v.toPrecision(6)));
    if (v === null || v === undefined) return "–";
    if (typeof v === "object") return JSON.stringify(v);
    return String(v);
  }

  // The object at path; null, once the element missingId says it does not exist, on a 404.
  async function readOrMissing(path, missingId, what, current) {
    try {
      return await api(path);
    } catch (e) {
      if (e instanceof ApiError && e.status === 404 && current()) {
        $(missingId).hidden = false;
        setText($(missingId), `${what} does not exist.`);
        return null;
      }
      throw e;
    }
  }

  /** Every epoch record of the job, a page at a time (the server bounds each page's bytes). */
  async function allMetrics(id) {
    const out = [];
    let since = 0;
    for (;;) {
      const page = await api(`/jobs/${id}/metrics` + (since ? `?since=${since}` : ""), { withHeaders: true });
      out.push(...page.body);
      const next = page.headers.get("X-Next-Since");
      if (next === null || !page.body.length) return out;
      since = next;
    }
  }

  async function refreshJob(id, current) {
    const job = await readOrMissing(`/jobs/${id}`, "job-missing", `Job ${id}`, current);
    if (job === null) return;
    const { epoch } = job.progress || {};
    const key = `${job.state}/${job.runs}/${epoch}`;
    const running = !TERMINAL.has(job.state);
    const wantMetrics = key !== jobView.metricsKey;
    const wantLog = running || key !== jobView.logKey;
    const [metrics, log] = await Promise.all([
      wantMetrics ? allMetrics(id) : null,
      // Only the log's latest lines (it may be megabytes): GET /jobs/{id}/logs has the whole of it.
      wantLog ? api(`/jobs/${id}/logs?tail=${LOG_TAIL_BYTES}`) : null,
    ]);
    if (!current() || jobView.id !== id) return;

    setText($("job-title"), job.name ? `Job ${id} · ${job.name}` : `Job ${id}`);
    updateBadge($("job-state").firstChild, job.state);
    updatePageActions(jobView.buttons, job);
    updateProgress(jobView.progress, job);

    const t = jobTime(job);
    const requested = job.requested_device || "auto";
    const m = job.latest_metrics || {};
    const sweep = job.sweep;
    const back = $("job-sweep-link");
    back.hidden = !sweep;
    if (sweep) {
      setAttr(back, "href", `#/sweeps/${sweep.id}`);
      setText(back, `\u2190 Sweep ${sweep.id} (trial ${sweep.trial})`);
    }
    facts($("job-facts"), [
      ["kind", `${job.kind} · ${jobSummary(job)}`],
      ["sweep", sweep ? [el("a", { href: `#/sweeps/${sweep.id}`, "data-testid": "job-sweep",
                                   text: `sweep ${sweep.id}, trial ${sweep.trial}` }),
                         ` · ${paramsText(sweep.params)}`] : null],
      ["waiting for", job.waiting_for || null],
      ["device", job.device ? `${job.device} (requested ${requested})` : `requested ${requested}`],
      ["worker", job.worker_id],
      ["Slurm", slurmFact(job.slurm)],
      ["attempt", `${job.attempt} of ${job.max_attempts} (${job.runs} run${job.runs === 1 ? "" : "s"})`],
      ["created", fmtTime(job.created_at)],
      ["started", job.started_at ? fmtTime(job.started_at) : null],
      ["finished", job.finished_at ? fmtTime(job.finished_at) : null],
      [t.label, fmtDuration(t.s)],
      ["train loss" + lastOf(job, "train_loss"), isNum(latest(job, "train_loss")) ? fmtLoss(latest(job, "train_loss")) : null],
      ["val loss" + lastOf(job, "val_loss"), isNum(latest(job, "val_loss")) ? fmtLoss(latest(job, "val_loss")) : null],
      [(job.kind === "predict" ? "accuracy" : "val accuracy") + lastOf(job, "val_accuracy"),
        isNum(latest(job, "val_accuracy")) ? fmtPct(latest(job, "val_accuracy")) : null],
      ["throughput", isNum(m.samples_per_s) ? `${Math.round(m.samples_per_s).toLocaleString()} samples/s` : null],
      ["checkpoint", isNum(job.checkpoint_epoch) ? `epoch ${job.checkpoint_epoch}` : null],
      ["MLflow", mlflowFact(job.tracking && job.tracking.mlflow)],
      ["peak CUDA memory", isNum(job.peak_memory_allocated)
        ? `${fmtBytes(job.peak_memory_allocated)} allocated, ${fmtBytes(job.peak_memory_reserved)} reserved` : null],
    ]);

    const specKey = JSON.stringify(job.spec);
    if (specKey !== jobView.specKey) {
      jobView.specKey = specKey;
      setText($("job-spec"), JSON.stringify(job.spec, null, 2));
    }

    const errPanel = $("job-error-panel");
    errPanel.hidden = !job.error;
    setText($("error-title"), job.state === "pruned" ? "Pruned" : "Error");
    if (job.error) {
      const { message, ...rest } = job.error;
      facts($("job-error"), [["message", message], ...Object.entries(rest).map(([k, v]) => [k, valueText(v)])]);
      const earlier = (job.errors || []).slice(0, -1);
      $("job-errors").replaceChildren(...(earlier.length ? [
        el("h4", { text: "Earlier attempts" }),
        el("ul", { class: "earlier" }, earlier.map((e) => el("li", null,
          el("span", { class: "mono", text: `attempt ${e.attempt}` }), ` ${e.class || ""}: ${e.message || e.type || ""}`))),
      ] : []));
    } else if (job.errors && job.errors.length) {
      // A retried job: the errors of earlier attempts stay visible.
      errPanel.hidden = false;
      facts($("job-error"), [["earlier errors", String(job.errors.length)]]);
      $("job-errors").replaceChildren(el("ul", { class: "earlier" }, job.errors.map((e) => el("li", null,
        el("span", { class: "mono", text: `attempt ${e.attempt}` }), ` ${e.class || ""}: ${e.message || e.type || ""}`))));
    }

    const result = $("job-result");
    if (job.result) {
      const kept = keptBest(job);
      result.replaceChildren(...(kept ? [el("p", { class: "muted", "data-testid": "job-result-kept", text:
        `The model kept is epoch ${kept.epoch}'s, the best evaluated (keep: best): the losses below are that ` +
        `epoch's.${isNum(kept.last) ? ` The summary above shows the last epoch, ${kept.last}.` : ""}` })] : []),
      el("table", { class: "kv" }, el("tbody", null,
        Object.entries(job.result).filter(([, v]) => v !== null)
          .map(([k, v]) => el("tr", null, el("th", { scope: "row", text: k }), el("td", { class: "num", text: valueText(v) }))))));
    } else {
      result.replaceChildren(el("p", { class: "muted", text: job.state === "succeeded" ? "No result." : "Once the job has succeeded." }));
    }

    $("job-charts").hidden = job.kind === "predict"; // a prediction has no epochs
    if (metrics) {
      jobView.metricsKey = key;
      const total = (job.progress && job.progress.epochs) || null;
      const empty = TERMINAL.has(job.state) ? "no epochs recorded" : "no epochs yet";
      $("loss-chart-box").replaceChildren(lossChart(metrics, total, empty));
      $("acc-chart-box").replaceChildren(accuracyChart(metrics, total, empty));
      // train jobs report the lr of each epoch (train.lr_schedule); a run job may report its own
      const lr = perEpoch(metrics, "lr");
      $("lr-panel").hidden = !lr.length;
      if (lr.length) $("lr-chart-box").replaceChildren(lrChart(lr, total));
    }
    if (log !== null) {
      jobView.logKey = key;
      const pre = $("job-log");
      const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
      setText(pre, log || "(nothing logged yet)");
      if (atBottom) pre.scrollTop = pre.scrollHeight;
    }
  }

  // ---- sweeps: the list ----------------------------------------------------------------------------------

  const FINISHED_TRIAL = ["succeeded", "pruned", "failed", "cancelled"];

  function paramsText(params) {
    return Object.entries(params || {}).map(([k, v]) => `${k}=${valueText(v)}`).join(", ");
  }

  /** "3 succeeded · 1 pruned · 2 running": the states a sweep's trials are in, empty ones left out. */
  function countsText(counts) {
    const order = ["running", "queued", "succeeded", "pruned", "failed", "cancelled"];
    const keys = [...order, ...Object.keys(counts || {}).filter((k) => !order.includes(k))];
    return keys.filter((k) => (counts || {})[k]).map((k) => `${counts[k]} ${k}`).join(" · ");
  }

  function sweepTime(s) {
    const created = parseTime(s.created_at), finished = parseTime(s.finished_at);
    if (!Number.isNaN(finished)) return { label: "took", s: (finished - created) / 1000 };
    return { label: "running", s: (Date.now() - created) / 1000 };
  }

  function bestText(s) {
    return s.best && isNum(s.best.value) ? `${fmtValue(s.best.value)} (trial ${s.best.trial})` : "–";
  }

  const sweepRows = new Map(); // sweep id -> row parts, updated in place like the job list's

  function makeSweepRow(id) {
    const href = `#/sweeps/${id}`;
    const parts = {
      name: el("a", { href, class: "job-name" }),
      state: badge("running", `sweep-state-${id}`),
      method: el("td"),
      metric: el("td"),
      trials: el("td", { "data-testid": `sweep-trials-${id}` }),
      best: el("td", { class: "num", "data-testid": `sweep-best-${id}` }),
      time: el("td", { class: "num" }),
    };
    parts.tr = el("tr", { "data-testid": `sweep-row-${id}`, "data-sweep": id },
      el("td", { class: "num" }, el("a", { href, class: "num", text: `${id}` })),
      el("td", null, parts.name), el("td", null, parts.state),
      parts.method, parts.metric, parts.trials, parts.best, parts.time);
    return parts;
  }

  function updateSweepRow(row, s) {
    setText(row.name, s.name || `sweep ${s.id}`);
    updateBadge(row.state, s.state);
    setAttr(row.tr, "data-state", s.state);
    setText(row.method, s.method);
    setText(row.metric, `${s.metric} (${s.direction === "maximize" ? "max" : "min"})`);
    const counts = countsText(s.counts);
    setText(row.trials, `${s.trial_count}/${s.max_trials}` + (counts ? ` · ${counts}` : ""));
    setText(row.best, bestText(s));
    setAttr(row.best, "title", s.best ? paramsText(s.best.params) : "no trial has a value yet");
    const t = sweepTime(s);
    setText(row.time, fmtDuration(t.s));
    setAttr(row.time, "title", `${t.label} · created ${fmtTime(s.created_at)}`);
  }

  async function refreshSweeps(current) {
    const sweeps = await api("/sweeps?limit=100");
    if (!current()) return;
    syncRows($("sweeps-body"), sweepRows, sweeps.data, makeSweepRow, updateSweepRow);
    $("sweeps-empty").hidden = sweeps.count > 0;
    setText($("sweeps-count"), pageCount(sweeps));
  }

  // ---- one sweep -------------------------------------------------------------------------------------------

  const sweepView = {
    id: null, sweep: null, cancel: null, progress: null, rows: new Map(), columnsKey: null,
    sort: { key: "trial", dir: 1 }, curvesKey: null, scatterKey: null, specKey: null, param: null,
    curves: null, curvesSince: 0,
  };

  /** A trial's state: a pruned one's job is `pruned` (one pruned before that state existed: failed, class "pruned"). */
  const trialState = (t) => (t.failure === "pruned" ? "pruned" : t.state);
  const isBest = (t, sweep) => Boolean(t.best || (sweep.best && sweep.best.trial === t.trial));

  function resetSweepView(id) {
    Object.assign(sweepView, { id, sweep: null, columnsKey: null, curvesKey: null, scatterKey: null, specKey: null,
                               curves: null, curvesSince: 0 });
    sweepView.rows = new Map();
    sweepView.sort = { key: "trial", dir: 1 };
    sweepView.cancel = el("button", {
      type: "button", class: "btn btn-cancel", "aria-label": `Cancel sweep ${id}`, "data-testid": `cancel-sweep-${id}`,
      hidden: true, text: "Cancel", onclick: () => cancelSweep(id, sweepView.cancel),
    });
    sweepView.progress = resetHead("sweep", `Sweep ${id}`, "running", [sweepView.cancel]);
    $("trials-head").replaceChildren();
    $("trials-body").replaceChildren();
    $("trials-empty").hidden = true;
    setText($("trials-count"), "");
    setText($("sweep-spec"), "");
    $("curves-chart-box").replaceChildren(curvesChart({ trials: [] }, null, "val_loss"));
    $("scatter-chart-box").replaceChildren();
    $("scatter-param").replaceChildren();
  }

  async function cancelSweep(id, button) {
    if (button.disabled) return;
    button.disabled = true;
    try {
      await api(`/sweeps/${id}/cancel`, { method: "POST" });
      setStatus(`sweep ${id}: cancelled`, "ok");
    } catch (e) {
      if (e instanceof Unauthorized) { showAuth(); return; }
      setStatus(`could not cancel sweep ${id}: ${e.message}`, "bad");
    } finally {
      button.disabled = false;
    }
    tick();
  }

  // The server pages a sweep's curves (GET /sweeps/{id}/curves?since=): a refresh reads a few pages of the points
  // recorded since the last, and the page keeps at most CURVE_POINTS of them.
  const CURVE_PAGES = 5, CURVE_POINTS = 500000;

  /** The sweep's curves with the points recorded since the last read merged in (an epoch's last point holds). */
  async function readCurves(id) {
    let held = sweepView.curves;
    const count = () => held.trials.reduce((n, t) => n + t.points.length, 0);
    for (let n = 0; n < CURVE_PAGES && !(held && count() >= CURVE_POINTS); n++) {
      const page = await api(`/sweeps/${id}/curves?since=${sweepView.curvesSince}`);
      if (sweepView.id !== id) return null;
      const paged = typeof page.next === "number"; // else the whole curves, every time
      const before = new Map(((paged && held) ? held.trials : []).map((t) => [t.trial, t.points]));
      held = { ...page, trials: (page.trials || []).map((t) => ({ ...t, points: (before.get(t.trial) || []).concat(t.points || []) })) };
      sweepView.curves = held;
      if (paged) sweepView.curvesSince = page.next;
      if (!page.more) break;
    }
    return held && count() >= CURVE_POINTS ? { ...held, more: false } : held;
  }

  async function refreshSweep(id, current) {
    const sweep = await readOrMissing(`/sweeps/${id}`, "sweep-missing", `Sweep ${id}`, current);
    if (sweep === null) return;
    const trials = sweep.trials || [];
    // The curves change only when a trial reports an epoch or changes state.
    const curvesKey = JSON.stringify(trials.map((t) => [t.trial, t.state, t.failure, t.epoch, t.value, t.best]));
    const curves = curvesKey !== sweepView.curvesKey ? await readCurves(id) : null;
    if (!current() || sweepView.id !== id) return;
    sweepView.sweep = sweep;

    setText($("sweep-title"), sweep.name ? `Sweep ${id} · ${sweep.name}` : `Sweep ${id}`);
    updateBadge($("sweep-state").firstChild, sweep.state);
    const running = sweep.state === "running";
    if (sweepView.cancel.hidden === running) sweepView.cancel.hidden = !running;
    const counts = sweep.counts || {};
    const ended = FINISHED_TRIAL.reduce((n, k) => n + (counts[k] || 0), 0);
    updateProgress(sweepView.progress, { state: sweep.state, progress: { epoch: ended, epochs: sweep.max_trials } });

    const spec = sweep.spec || {};
    const best = sweep.best;
    const t = sweepTime(sweep);
    facts($("sweep-facts"), [
      ["method", sweep.method + (spec.pruner ? ` · ${spec.pruner.type} pruner` : "")],
      ["metric", `${sweep.metric} (${sweep.direction})`],
      ["trials", `${sweep.trial_count} made of ${sweep.max_trials} · at most ${sweep.max_concurrent} at once`],
      ["trial states", countsText(counts) || null],
      ["best", best ? el("span", { "data-testid": "sweep-best" },
        el("a", { href: `#/jobs/${best.job_id}`, text: `trial ${best.trial} (job ${best.job_id})` }),
        ` · ${sweep.metric} ${fmtValue(best.value)} · ${paramsText(best.params)}`) : "no trial has a value yet"],
      ["error", sweep.error || null],
      ["created", fmtTime(sweep.created_at)],
      ["finished", sweep.finished_at ? fmtTime(sweep.finished_at) : null],
      [t.label, fmtDuration(t.s)],
    ]);

    const params = sweepParams(sweep);
    renderTrials(sweep, trials, params);
    renderScatterSelect(params);
    const scatterKey = JSON.stringify([sweepView.param, trials.map((t) => [t.params, t.value, t.state, t.failure, t.best])]);
    if (scatterKey !== sweepView.scatterKey) {
      sweepView.scatterKey = scatterKey;
      drawScatter();
    }
    if (curves) {
      sweepView.curvesKey = curves.more ? null : curvesKey; // points left: read on at the next refresh
      const total = Math.max(0, ...trials.map((t) => t.epochs).filter(isNum)) || null;
      const chart = curvesChart(curves, total, sweep.metric, TERMINAL.has(sweep.state) ? "no epochs recorded" : "no epochs yet");
      const note = chart.getAttribute("data-clip-note");
      $("curves-chart-box").replaceChildren(chart,
        ...(note ? [el("p", { class: "muted chart-note", "data-testid": "curves-clip-note", text: note })] : []));
    }
    const specKey = JSON.stringify(spec);
    if (specKey !== sweepView.specKey) {
      sweepView.specKey = specKey;
      setText($("sweep-spec"), JSON.stringify(spec, null, 2));
    }
  }

  /** The searched parameters in the spec's order (any a trial has beyond them after). */
  function sweepParams(sweep) {
    const names = Object.keys((sweep.spec && sweep.spec.parameters) || {});
    for (const t of sweep.trials || []) for (const k of Object.keys(t.params || {})) if (!names.includes(k)) names.push(k);
    return names;
  }

  // ---- one sweep: the trials table, sortable by any column ----------------------------------------------------

  function trialColumns(sweep, params) {
    return [
      { key: "trial", label: "Trial", num: true, get: (t) => t.trial },
      { key: "job", label: "Job", num: true, get: (t) => t.job_id },
      { key: "state", label: "State", get: (t) => trialState(t) + (t.failure && t.failure !== "pruned" ? ` ${t.failure}` : "") },
      ...params.map((p) => ({ key: `param:${p}`, label: p, num: true, param: p, get: (t) => (t.params || {})[p] })),
      // best first on the first click, whichever way the metric goes
      { key: "value", label: sweep.metric, num: true, get: (t) => t.value, first: sweep.direction === "maximize" ? -1 : 1 },
      { key: "epoch", label: "Epoch", num: true, get: (t) => t.epoch },
    ];
  }

  /** Numbers by value, anything else (lists, strings) by its text; missing values last either way. */
  function compareValues(a, b) {
    const none = (v) => v === null || v === undefined || (typeof v === "number" && !Number.isFinite(v));
    if (none(a) || none(b)) return none(a) - none(b);
    if (typeof a === "number" && typeof b === "number") return a - b;
    const ta = typeof a === "string" ? a : JSON.stringify(a), tb = typeof b === "string" ? b : JSON.stringify(b);
    return ta.localeCompare(tb, undefined, { numeric: true });
  }

  function sortTrials(trials, columns) {
    const col = columns.find((c) => c.key === sweepView.sort.key) || columns[0];
    const dir = sweepView.sort.dir;
    return [...trials].sort((a, b) => {
      const va = col.get(a), vb = col.get(b);
      const missing = (va === null || va === undefined) - (vb === null || vb === undefined);
      if (missing) return missing; // a trial with no value yet stays at the bottom in both directions
      return compareValues(va, vb) * dir || a.trial - b.trial;
    });
  }

  function renderTrialsHead(columns) {
    $("trials-head").replaceChildren(...columns.map((c) => {
      const active = sweepView.sort.key === c.key;
      const sort = active ? (sweepView.sort.dir > 0 ? "ascending" : "descending") : "none";
      return el("th", {
        scope: "col", class: `sortable${c.num ? " num" : ""}`, "aria-sort": sort, "data-sort": c.key,
        "data-testid": `trials-sort-${c.key}`,
        onclick: () => {
          sweepView.sort = active ? { key: c.key, dir: -sweepView.sort.dir } : { key: c.key, dir: c.first || 1 };
          if (sweepView.sweep) renderTrials(sweepView.sweep, sweepView.sweep.trials || [], sweepParams(sweepView.sweep), true);
        },
      }, el("button", { type: "button", class: "sort", title: `sort by ${c.label}` }, c.label,
        el("span", { class: "arrow", "aria-hidden": "true", text: active ? (sweepView.sort.dir > 0 ? " \u25B2" : " \u25BC") : "" })));
    }));
  }

  function trialRow(t, sweep, params) {
    const best = isBest(t, sweep);
    const state = trialState(t);
    const href = `#/jobs/${t.job_id}`;
    const failure = t.failure && t.failure !== "pruned" ? el("span", { class: "muted failure", text: ` ${t.failure}` }) : null;
    return el("tr", {
      class: best ? "best" : null, "data-testid": `trial-row-${t.trial}`, "data-trial": t.trial, "data-job": t.job_id,
      "data-state": state, "data-best": best ? "true" : "false",
    },
      el("td", { class: "num" }, el("a", { href, class: "num", text: `${t.trial}` }),
        best ? el("span", { class: "best-tag", "data-testid": "best-trial", title: `the best ${sweep.metric} so far`, text: "best" }) : null),
      el("td", { class: "num" }, el("a", { href, text: `job ${t.job_id}` })),
      el("td", null, badge(state, `trial-state-${t.trial}`), failure),
      params.map((p) => el("td", { class: "num", "data-param": p, text: valueText((t.params || {})[p]) })),
      el("td", { class: "num", "data-testid": `trial-value-${t.trial}`, "data-value": isNum(t.value) ? t.value : "",
                 title: isNum(t.value) ? String(t.value) : null, text: fmtValue(t.value) }),
      el("td", { class: "num", text: isNum(t.epochs) ? `${t.epoch || 0}/${t.epochs}` : valueText(t.epoch) }));
  }

  function renderTrials(sweep, trials, params, force) {
    const columns = trialColumns(sweep, params);
    const columnsKey = JSON.stringify([columns.map((c) => [c.key, c.label]), sweepView.sort]);
    if (columnsKey !== sweepView.columnsKey) {
      sweepView.columnsKey = columnsKey;
      renderTrialsHead(columns);
      force = true;
    }
    // Rows are rebuilt only when their trial changed, so that a focused link survives polling.
    const body = $("trials-body");
    const seen = new Set();
    sortTrials(trials, columns).forEach((t, i) => {
      const key = JSON.stringify([t, isBest(t, sweep), params]);
      let row = sweepView.rows.get(t.trial);
      if (!row || row.key !== key || force) {
        const tr = trialRow(t, sweep, params);
        if (row) row.tr.replaceWith(tr);
        row = { tr, key };
        sweepView.rows.set(t.trial, row);
      }
      if (body.children[i] !== row.tr) body.insertBefore(row.tr, body.children[i] || null);
      seen.add(t.trial);
    });
    for (const [n, row] of sweepView.rows) {
      if (!seen.has(n)) {
        row.tr.remove();
        sweepView.rows.delete(n);
      }
    }
    $("trials-empty").hidden = trials.length > 0;
    setText($("trials-count"), `${trials.length} trial${trials.length === 1 ? "" : "s"}`);
  }

  // ---- one sweep: which parameter the scatter plot shows ----------------------------------------------------------

  function renderScatterSelect(params) {
    const select = $("scatter-param");
    if (!params.includes(sweepView.param)) sweepView.param = params[0] || null;
    const key = JSON.stringify(params);
    if (select.dataset.params !== key) {
      select.dataset.params = key;
      select.replaceChildren(...params.map((p) => el("option", { value: p, text: p })));
    }
    if (sweepView.param !== null && select.value !== sweepView.param) select.value = sweepView.param;
    // one parameter: nothing to choose
    select.hidden = $("scatter-param-label").hidden = params.length < 2;
  }

  $("scatter-param").addEventListener("change", (ev) => {
    sweepView.param = ev.target.value;
    sweepView.scatterKey = null;
    drawScatter();
  });

  function drawScatter() {
    const sweep = sweepView.sweep;
    if (!sweep || sweepView.param === null) {
      $("scatter-chart-box").replaceChildren();
      return;
    }
    const p = sweepView.param;
    const param = ((sweep.spec && sweep.spec.parameters) || {})[p] || null;
    const points = (sweep.trials || []).filter((t) => isNum(t.value) && t.params && p in t.params)
      .map((t) => ({ x: t.params[p], y: t.value, trial: t.trial, state: trialState(t), best: isBest(t, sweep) }));
    $("scatter-chart-box").replaceChildren(scatterChart({
      testid: "scatter-chart", param: p, spec: param, metric: sweep.metric, points,
      empty: TERMINAL.has(sweep.state) ? "no trial reported a value" : "no values yet",
    }));
  }

  // ---- charts (inline SVG) ----------------------------------------------------------------------------------

  function niceStep(range, count) {
    const raw = range / Math.max(1, count);
    const mag = 10 ** Math.floor(Math.log10(raw));
    const f = raw / mag;
    return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 2.5 ? 2.5 : f <= 5 ? 5 : 10) * mag;
  }

  function ticks(min, max, count) {
    if (!(max > min)) return [min];
    const step = niceStep(max - min, count);
    const out = [];
    for (let v = Math.ceil(min / step - 1e-9) * step; v <= max + step * 1e-9; v += step) out.push(Number(v.toPrecision(12)));
    return out;
  }

  /** One point per epoch (the last record wins), for each series. */
  function perEpoch(metrics, key) {
    const by = new Map();
    for (const m of metrics) if (isNum(m.epoch) && isNum(m[key])) by.set(m.epoch, m[key]);
    return [...by.entries()].sort((a, b) => a[0] - b[0]);
  }

  /** A y range of whole ticks around the values, so that every point lies within the grid; [0, 1] if none. */
  function niceRange(values) {
    if (!values.length) return [0, 1];
    let ymin = Math.min(...values), ymax = Math.max(...values);
    if (ymin === ymax) { ymin -= Math.abs(ymin) * 0.1 || 0.5; ymax += Math.abs(ymax) * 0.1 || 0.5; }
    const step = niceStep(ymax - ymin, 4);
    const lo = Math.floor(ymin / step) * step;
    // losses never go below 0
    return [ymin >= 0 && lo < 0 ? 0 : lo, Math.ceil(ymax / step) * step];
  }

  /** Tick labels by format, with more digits where the format would label two ticks alike (a narrow range). */
  function tickLabels(values, format) {
    let labels = values.map((v) => format(v));
    for (let p = 4; new Set(labels).size < labels.length && p <= 12; p++) {
      labels = values.map((v) => Number(v.toPrecision(p)).toString());
    }
    return labels;
  }

  /** Grid lines and labels of a y axis on [ymin, ymax]. */
  function yGrid(grid, ymin, ymax, y, L, R, W, yFormat) {
    const values = ticks(ymin, ymax, 5);
    const labels = tickLabels(values, yFormat);
    values.forEach((v, i) => {
      grid.append(svg("line", { x1: L, x2: W - R, y1: y(v), y2: y(v) }));
      grid.append(svg("text", { x: L - 6, y: y(v) + 4, class: "tick y", text: labels[i] }));
    });
  }

  /** The nearest-rank q-quantile of sorted values. */
  const quantile = (sorted, q) => sorted[Math.min(sorted.length - 1, Math.max(0, Math.ceil(q * sorted.length) - 1))];

  /** A y range for the bulk of the values, or null when none lies far outside it: values more than the span of
   * the middle 90% (5th to 95th percentile) beyond it are left off the axis, so that one trial's spike does not
   * press every other curve flat. */
  function bulkRange(values) {
    if (values.length < 20) return null;
    const sorted = [...values].sort((a, b) => a - b);
    const lo = quantile(sorted, 0.05), hi = quantile(sorted, 0.95), span = hi - lo;
    const min = sorted[0], max = sorted[sorted.length - 1];
    if (!(span > 0) || (max <= hi + span && min >= lo - span)) return null;
    const range = niceRange([min < lo - span ? lo - span * 0.15 : min, max > hi + span ? hi + span * 0.15 : max]);
    return range[0] <= min && range[1] >= max ? null : range;
  }

  function lineChart({ testid, title, series, totalEpochs, yFixed, yFormat, empty, legend, bulk }) {
    const W = 640, H = 260, L = 56, R = 16, T = 30, B = 36;
    const all = series.flatMap((s) => s.points);
    const epochs = new Set(all.map((p) => p[0]));
    const maxEpoch = Math.max(1, totalEpochs || 0, ...all.map((p) => p[0]));
    const clip = !yFixed && bulk ? bulkRange(all.map((p) => p[1])) : null;
    const [ymin, ymax] = yFixed || clip || niceRange(all.map((p) => p[1]));
    const x = (e) => L + (maxEpoch === 1 ? (W - L - R) / 2 : ((e - 1) / (maxEpoch - 1)) * (W - L - R));
    // A value off a clipped axis is drawn on its edge.
    const y = (v) => T + (1 - (Math.min(ymax, Math.max(ymin, v)) - ymin) / (ymax - ymin)) * (H - T - B);

    const counts = series.map((s) => `${s.label} ${s.points.length}`).join(", ");
    const root = svg("svg", {
      viewBox: `0 0 ${W} ${H}`, class: "chart", role: "img", "data-testid": testid,
      "data-points": epochs.size, "aria-label": `${title}: ${counts} epochs plotted`,
      "data-ymin": ymin, "data-ymax": ymax, "data-clipped": clip ? "true" : "false",
    });
    if (clip) {
      const off = all.filter((p) => p[1] > ymax || p[1] < ymin).map((p) => p[1]);
      const past = (v) => (v > ymax ? v - ymax : ymin - v);
      const far = off.reduce((a, v) => (past(v) > past(a) ? v : a), off[0]);
      root.setAttribute("data-clip-note", `The y axis follows the bulk of the curves (${yFormat(ymin, true)} to ` +
        `${yFormat(ymax, true)}): ${off.length} point${off.length === 1 ? "" : "s"} beyond it (as far as ` +
        `${yFormat(far, true)}) drawn on its edge.`);
    }
    const grid = svg("g", { class: "grid" });
    yGrid(grid, ymin, ymax, y, L, R, W, yFormat);
    const xt = ticks(1, maxEpoch, Math.min(8, maxEpoch - 1 || 1)).filter((e) => Number.isInteger(e) && e >= 1);
    for (const e of (xt.length ? xt : [1])) {
      grid.append(svg("line", { x1: x(e), x2: x(e), y1: H - B, y2: H - B + 4, class: "tick-mark" }));
      grid.append(svg("text", { x: x(e), y: H - B + 17, class: "tick x", text: String(e) }));
    }
    grid.append(svg("line", { x1: L, x2: W - R, y1: H - B, y2: H - B, class: "axis" }));
    grid.append(svg("text", { x: (L + W - R) / 2, y: H - 3, class: "axis-label", text: "epoch" }));
    root.append(grid);

    // Many series (a sweep's trials) share a few legend entries instead of one each.
    let lx = L;
    for (const entry of legend || series) {
      root.append(svg("g", { class: `legend ${entry.cls}`, transform: `translate(${lx}, 12)` },
        svg("line", { x1: 0, x2: 18, y1: 0, y2: 0 }),
        svg("text", { x: 24, y: 4, text: entry.label })));
      lx += 40 + entry.label.length * 7.5;
    }
    series.forEach((s) => {
      const g = svg("g", { class: `series ${s.cls}`, "data-series": s.key, "data-points": s.points.length,
                           ...(s.attrs || {}) });
      if (s.points.length > 1) {
        g.append(svg("path", { d: s.points.map((p, j) => `${j ? "L" : "M"}${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(" ") }));
      }
      if (s.points.length <= 80) {
        for (const [e, v] of s.points) {
          g.append(svg("circle", { cx: x(e).toFixed(1), cy: y(v).toFixed(1), r: 3,
                                   ...(v > ymax || v < ymin ? { class: "clipped" } : {}) },
            svg("title", { text: `epoch ${e}: ${s.label} ${yFormat(v, true)}` })));
        }
      }
      root.append(g);
    });
    if (!all.length) root.append(svg("text", { x: W / 2, y: H / 2, class: "empty", text: empty || "no epochs yet" }));
    return root;
  }

  function lossChart(metrics, totalEpochs, empty) {
    return lineChart({
      testid: "loss-chart", title: "Loss per epoch", totalEpochs, empty,
      series: [
        { key: "train_loss", label: "train loss", cls: "s-train", points: perEpoch(metrics, "train_loss") },
        { key: "val_loss", label: "val loss", cls: "s-val", points: perEpoch(metrics, "val_loss") },
        // a run job's own losses ("loss", "recon_loss", ...)
        ...otherKeys(metrics, /(^|_)loss$/, ["train_loss", "val_loss"]).map((key) => (
          { key, label: key.replace(/_/g, " "), cls: "s-other", points: perEpoch(metrics, key) })),
      ],
      yFormat: (v, precise) => (precise ? fmtLoss(v) : Number(v.toPrecision(3)).toString()),
    });
  }

  function lrChart(points, totalEpochs) {
    return lineChart({
      testid: "lr-chart", title: "Learning rate per epoch", totalEpochs,
      series: [{ key: "lr", label: "lr", cls: "s-train", points }],
      yFormat: (v) => Number(v.toPrecision(3)).toString(),
    });
  }

  /** Metric names matching re, beyond those already charted, in the order they first appear. */
  function otherKeys(metrics, re, known) {
    const keys = [];
    for (const m of metrics) {
      for (const k of Object.keys(m)) {
        if (re.test(k) && !known.includes(k) && !keys.includes(k) && isNum(m[k])) keys.push(k);
      }
    }
    return keys.slice(0, 4);
  }

  function accuracyChart(metrics, totalEpochs, empty) {
    return lineChart({
      testid: "accuracy-chart", title: "Validation accuracy per epoch", totalEpochs, empty, yFixed: [0, 1],
      series: [
        { key: "val_accuracy", label: "val accuracy", cls: "s-acc", points: perEpoch(metrics, "val_accuracy") },
        ...otherKeys(metrics, /(^|_)accuracy$/, ["val_accuracy"]).map((key) => (
          { key, label: key.replace(/_/g, " "), cls: "s-other", points: perEpoch(metrics, key) })),
      ],
      yFormat: (v, precise) => (precise ? fmtPct(v) : `${Math.round(v * 100)}%`),
    });
  }

  /** One point per epoch, the last reported winning (a retried trial reports its resumed epochs again). */
  function lastPerEpoch(points) {
    const by = new Map();
    for (const [e, v] of points) if (isNum(e) && isNum(v)) by.set(e, v);
    return [...by.entries()].sort((a, b) => a[0] - b[0]);
  }

  /** Every trial's curve of the sweep's metric: the best drawn heavier, pruned trials dashed. */
  function curvesChart(curves, totalEpochs, metric, empty) {
    const trials = curves.trials || [];
    const series = trials.map((t) => {
      const pruned = t.failure === "pruned";
      const cls = ["s-trial", `tc-${t.trial % 8}`, t.best ? "best" : "", pruned ? "pruned" : "",
                   !pruned && (t.state === "failed" || t.state === "cancelled") ? "stopped" : ""].filter(Boolean).join(" ");
      return {
        key: `trial-${t.trial}`, label: `trial ${t.trial}`, cls, points: lastPerEpoch(t.points || []),
        attrs: { "data-trial": t.trial, "data-job": t.job_id, "data-best": t.best ? "true" : "false",
                 "data-pruned": pruned ? "true" : "false" },
      };
    });
    // The best last, so that it is drawn over the others.
    series.sort((a, b) => (a.attrs["data-best"] === "true") - (b.attrs["data-best"] === "true"));
    const best = trials.find((t) => t.best);
    const legend = [
      ...(best ? [{ label: `best (trial ${best.trial})`, cls: `s-trial tc-${best.trial % 8} best` }] : []),
      { label: "other trials", cls: "s-trial legend-plain" },
      ...(trials.some((t) => t.failure === "pruned") ? [{ label: "pruned", cls: "s-trial pruned legend-plain" }] : []),
    ];
    return lineChart({
      testid: "curves-chart", title: `${curves.metric || metric} per epoch, every trial`, totalEpochs, empty,
      series, legend: trials.length ? legend : [], bulk: true,
      yFormat: (v, precise) => (precise ? fmtValue(v) : Number(v.toPrecision(3)).toString()),
    });
  }

  /** Tick values of a log axis: 1, 2, 5 x 10^k in range (powers of ten alone when those are too many). */
  function logTicks(lo, hi) {
    const out = [];
    for (let k = Math.floor(Math.log10(lo)); k <= Math.ceil(Math.log10(hi)); k++) {
      for (const m of [1, 2, 5]) {
        const v = Number((m * 10 ** k).toPrecision(12));
        if (v >= lo * (1 - 1e-9) && v <= hi * (1 + 1e-9)) out.push(v);
      }
    }
    if (out.length > 8) return out.filter((v) => Number.isInteger(Math.round(Math.log10(v) * 1e6) / 1e6));
    return out.length >= 2 ? out : [lo, hi];
  }

  const fmtTick = (v) => (v !== 0 && Math.abs(v) < 1e-3 ? v.toExponential(0) : Number(v.toPrecision(3)).toString());

  /** A parameter (x) against the metric (y), one point per trial with a value. Ranges use the searched interval (a
   * log axis where the range was searched on a log scale); choices are evenly spaced categories in the spec's order. */
  function scatterChart({ testid, param, spec, metric, points, empty }) {
    const W = 640, H = 260, L = 56, R = 16, T = 30, B = 36, PAD = 14;
    const key = (v) => (typeof v === "string" ? v : JSON.stringify(v));
    const numeric = spec ? spec.type !== "choice" : points.every((p) => isNum(p.x));
    let scale, xTicks, x;
    if (numeric) {
      const xs = points.map((p) => p.x).filter(isNum);
      let lo = Math.min(...xs, ...(spec && isNum(spec.low) ? [spec.low] : []));
      let hi = Math.max(...xs, ...(spec && isNum(spec.high) ? [spec.high] : []));
      if (!Number.isFinite(lo)) [lo, hi] = [0, 1];
      const log = Boolean(spec && spec.log) && lo > 0;
      scale = log ? "log" : "linear";
      const f = log ? Math.log10 : (v) => v;
      const [flo, fhi] = [f(lo), f(hi)];
      x = (v) => (fhi === flo ? (L + W - R) / 2 : L + PAD + ((f(v) - flo) / (fhi - flo)) * (W - L - R - 2 * PAD));
      const at = log ? logTicks(lo, hi) : ticks(lo, hi, 6);
      const labels = tickLabels(at, fmtTick);
      xTicks = at.map((v, i) => [x(v), labels[i]]);
    } else {
      scale = "category";
      const cats = spec ? spec.values.map(key) : [];
      for (const p of points) if (!cats.includes(key(p.x))) cats.push(key(p.x));
      const at = (i) => L + ((i + 0.5) / Math.max(1, cats.length)) * (W - L - R);
      x = (v) => at(cats.indexOf(key(v)));
      xTicks = cats.map((c, i) => {
        const text = spec && i < spec.values.length ? valueText(spec.values[i]) : c;
        return [at(i), text.length > 14 ? text.slice(0, 13) + "\u2026" : text];
      });
    }
    // A margin above and below, so that no point sits on the axis.
    const ys = points.map((p) => p.y);
    const margin = ys.length ? (Math.max(...ys) - Math.min(...ys)) * 0.08 : 0;
    const low = ys.length && Math.min(...ys) >= 0 ? Math.max(0, Math.min(...ys) - margin) : Math.min(...ys) - margin;
    const [ymin, ymax] = niceRange(ys.length ? [low, Math.max(...ys) + margin] : []);
    const y = (v) => T + (1 - (v - ymin) / (ymax - ymin)) * (H - T - B);

    const root = svg("svg", {
      viewBox: `0 0 ${W} ${H}`, class: "chart scatter", role: "img", "data-testid": testid, "data-points": points.length,
      "data-scale": scale, "data-param": param,
      "aria-label": `${metric} against ${param} (${scale} axis): ${points.length} trials plotted`,
    });
    const grid = svg("g", { class: "grid" });
    const yFormat = (v) => Number(v.toPrecision(3)).toString();
    yGrid(grid, ymin, ymax, y, L, R, W, yFormat);
    for (const [at, text] of xTicks) {
      grid.append(svg("line", { x1: at, x2: at, y1: H - B, y2: H - B + 4, class: "tick-mark" }));
      grid.append(svg("text", { x: at, y: H - B + 17, class: "tick x", text }));
    }
    grid.append(svg("line", { x1: L, x2: W - R, y1: H - B, y2: H - B, class: "axis" }));
    grid.append(svg("text", { x: (L + W - R) / 2, y: H - 3, class: "axis-label",
                              text: `${param}${scale === "log" ? " (log scale)" : ""}` }));
    grid.append(svg("text", { x: L, y: 14, class: "axis-label y-label", text: metric }));
    root.append(grid);

    const g = svg("g", { class: "points" });
    // The best last, so that it is drawn over the others.
    for (const p of [...points].sort((a, b) => a.best - b.best)) {
      g.append(svg("circle", {
        cx: x(p.x).toFixed(1), cy: y(p.y).toFixed(1), r: p.best ? 6 : 4,
        class: `pt state-${p.state}${p.best ? " best" : ""}`, "data-trial": p.trial, "data-best": p.best ? "true" : "false",
      }, svg("title", { text: `trial ${p.trial}${p.best ? " (best)" : ""} · ${param} ${valueText(p.x)} · ${metric} ${fmtValue(p.y)}` })));
    }
    root.append(g);
    if (!points.length) root.append(svg("text", { x: W / 2, y: H / 2, class: "empty", text: empty || "no values yet" }));
    return root;
  }

  // ---- start -----------------------------------------------------------------------------------------------------

  showView();
  tick();
})();
