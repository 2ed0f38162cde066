// The chat page: conversations, streaming answers and speculation made visible.

import { ApiError, getJSON, onKeyNeeded, streamEvents } from "./api.js";
import { acceptanceChart } from "./chart.js";
import { renderMarkdown } from "./markdown.js";
import {
  getKey, loadConversations, loadSettings, newConversation, saveConversations, saveSettings, setKey,
} from "./store.js";

const $ = (id) => document.getElementById(id);

let settings = loadSettings();
let conversations = loadConversations();
let current = conversations[0] || newConversation();
let props = null;             // the server's /props
let running = null;           // {controller, conv, msg} while an answer streams
const emptyState = $("empty");  // shown while the conversation is empty (detached otherwise)
const emptyModel = $("empty-model");

// ------------------------------------------------------------------ storage
function persist() {
  const list = conversations.filter((c) => c.messages.length);
  const dropped = saveConversations(list);
  if (dropped) {
    conversations = loadConversations();
    notice(`The browser's storage is full: the ${dropped} oldest conversation(s) were not kept.`);
  }
}

let persistTimer = 0;
function persistSoon() {
  if (!persistTimer) persistTimer = setTimeout(() => { persistTimer = 0; persist(); }, 1000);
}

function notice(text) {
  const n = document.createElement("div");
  n.className = "notice";
  n.textContent = text;
  $("messages").prepend(n);
  setTimeout(() => n.remove(), 8000);
}

// ------------------------------------------------------------------ conversation list
function renderList() {
  const ul = $("conversations");
  ul.replaceChildren();
  for (const c of conversations) {
    if (!c.messages.length) continue;
    const li = document.createElement("li");
    li.className = c === current ? "active" : "";
    const open = document.createElement("button");
    open.type = "button";
    open.className = "conv";
    open.textContent = c.title || "(untitled)";
    open.title = c.title || "";
    open.addEventListener("click", () => { switchTo(c); closeSide(); });
    const del = document.createElement("button");
    del.type = "button";
    del.className = "icon del";
    del.textContent = "×";
    del.title = "Delete this conversation";
    del.setAttribute("aria-label", `Delete ${c.title || "conversation"}`);
    del.addEventListener("click", () => {
      if (!confirm(`Delete “${c.title || "this conversation"}”?`)) return;
      if (running && running.conv === c) stop();
      conversations = conversations.filter((x) => x !== c);
      if (current === c) current = conversations[0] || newConversation();
      persist();
      renderAll();
    });
    li.append(open, del);
    ul.appendChild(li);
  }
}

function switchTo(c) {
  if (running) stop();
  current = c;
  renderAll();
}

// ------------------------------------------------------------------ messages
function fmt(x, digits = 1) {
  return Number.isFinite(x) ? x.toFixed(digits) : "–";
}

// The line under an answer: tokens, speed, acceptance figures and the per-position chart.
function metaOf(msg, live) {
  const meta = document.createElement("div");
  meta.className = "meta";
  const n = msg.n || 0;
  const parts = [];
  const t = msg.timings;
  let tps = t && t.predicted_per_second;
  if (live && !(tps > 0) && msg.t0 && n) tps = n / ((performance.now() - msg.t0) / 1000);
  parts.push(`${n} tokens`);
  if (tps > 0) parts.push(`${fmt(tps)} tok/s`);
  const s = msg.stats;
  if (s && s.num_drafts > 0) {
    parts.push(`acceptance length ${fmt(s.mean_acceptance_length, 2)}`);
    parts.push(`${s.num_accepted_tokens}/${s.num_draft_tokens} drafts accepted (${fmt(100 * s.acceptance_rate, 0)}%)`);
  } else if (msg.spec === false) {
    parts.push("no speculation");
  }
  if (msg.status === "stopped") parts.push("stopped");
  else if (msg.finish === "length") parts.push("token limit reached");
  const text = document.createElement("span");
  text.className = "figures";
  text.textContent = parts.join(" · ");
  meta.appendChild(text);
  if (s && Array.isArray(s.per_position_acceptance) && s.per_position_acceptance.length) {
    const chart = document.createElement("span");
    chart.className = "chartbox";
    const lab = document.createElement("span");
    lab.className = "chart-label";
    lab.textContent = "accepted % by draft position";
    chart.append(lab, acceptanceChart(s.per_position_acceptance));
    meta.appendChild(chart);
  }
  if (msg.accepted > 0) {
    const legend = document.createElement("span");
    legend.className = "legend";
    const sw = document.createElement("span");
    sw.className = "tk tk-draft swatch";
    sw.textContent = "draft";
    legend.append(sw, " = accepted draft token");
    meta.appendChild(legend);
  }
  return meta;
}

function button(label, title, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = label;
  b.title = title;
  b.addEventListener("click", onClick);
  return b;
}

function fillAssistant(el, msg, live) {
  const body = el.querySelector(".body");
  if (msg.content) {
    const runs = Array.isArray(msg.runs) && msg.runs.every(Number.isInteger) ? msg.runs : null;
    renderMarkdown(body, msg.content, runs);
  } else if (live) {
    body.replaceChildren();
    const dots = document.createElement("span");
    dots.className = "typing";
    dots.textContent = "…";
    body.appendChild(dots);
  } else {
    body.replaceChildren();
  }
  el.querySelector(".meta")?.remove();
  el.querySelector(".error")?.remove();
  if (msg.error) {
    const err = document.createElement("div");
    err.className = "error";
    err.textContent = msg.error;
    el.insertBefore(err, el.querySelector(".actions"));
  }
  if (msg.n || msg.status || msg.timings) el.insertBefore(metaOf(msg, live), el.querySelector(".actions"));
}

function messageEl(msg, i, msgs) {
  const el = document.createElement("article");
  el.className = `msg ${msg.role === "user" ? "user" : "assistant"}`;
  const body = document.createElement("div");
  body.className = "body";
  el.appendChild(body);
  const actions = document.createElement("div");
  actions.className = "actions";
  el.appendChild(actions);
  const last = i === msgs.length - 1;
  if (msg.role === "user") {
    body.textContent = msg.content;  // the user's text is shown as typed, never as markup
    const lastUser = msgs.findLastIndex((m) => m.role === "user") === i;
    if (lastUser && !running) actions.appendChild(button("Edit", "Edit this message and answer again", () => editMessage(el, i)));
  } else {
    fillAssistant(el, msg, false);
    if (last && !running) actions.appendChild(button("Regenerate", "Answer this message again", regenerate));
  }
  return el;
}

function renderMessages() {
  const box = $("messages");
  box.replaceChildren();
  if (!current.messages.length) {
    box.appendChild(emptyState);
    return;
  }
  current.messages.forEach((m, i, all) => box.appendChild(messageEl(m, i, all)));
  box.scrollTop = box.scrollHeight;
}

function renderCtx() {
  const nctx = props && props.n_ctx;
  const used = current.ctx || 0;
  $("ctx-text").textContent = nctx ? `ctx ${used} / ${nctx}` : "ctx –";
  $("ctx-text").parentElement.title = nctx ? `Context used by this conversation: ${used} of ${nctx} tokens` : "";
  $("ctx-bar").style.width = nctx ? `${Math.min(100, (100 * used) / nctx)}%` : "0";
}

function renderAll() {
  renderList();
  renderMessages();
  renderCtx();
}

// ------------------------------------------------------------------ generation
function pushRun(runs, len, draft) {
  if (runs.length && runs[runs.length - 1] === draft) runs[runs.length - 2] += len;
  else runs.push(len, draft);
}

function requestBody() {
  const messages = [];
  if (settings.system.trim()) messages.push({ role: "system", content: settings.system });
  for (const m of current.messages) {
    if (m.role === "assistant" && !m.content) continue;
    messages.push({ role: m.role, content: m.content });
  }
  const body = {
    model: props ? props.model_path : undefined,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number(settings.temperature),
    top_p: Number(settings.top_p),
    max_tokens: Math.max(1, Math.floor(Number(settings.max_tokens) || 1)),
  };
  const nmax = props ? props.speculative_n_max || 0 : 0;
  if (nmax > 0 && settings.k !== null && settings.k !== "" && Number(settings.k) !== nmax) {
    body.speculative = { num_speculative_tokens: Math.max(0, Math.min(nmax, Math.floor(Number(settings.k)))) };
  }
  return body;
}

function setRunning(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  $("messages").setAttribute("aria-busy", String(on));
  document.body.classList.toggle("running", on);
}

async function generate() {
  const conv = current;
  const body = requestBody();
  const msg = { role: "assistant", content: "", runs: [], n: 0, accepted: 0, t0: performance.now() };
  conv.messages.push(msg);
  conv.updated = Date.now();
  if (!conversations.includes(conv)) conversations.unshift(conv);
  const controller = new AbortController();
  running = { controller, conv, msg };
  setRunning(true);
  renderList();
  renderMessages();
  const box = $("messages");
  const el = box.lastElementChild;
  fillAssistant(el, msg, true);

  let frame = 0;
  const draw = () => {
    frame = 0;
    const stick = box.scrollHeight - box.scrollTop - box.clientHeight < 80;
    fillAssistant(el, msg, true);
    if (stick) box.scrollTop = box.scrollHeight;
  };
  try {
    for await (const ev of streamEvents("v1/chat/completions", body, controller.signal)) {
      if (ev.usage) {
        msg.usage = ev.usage;
        conv.ctx = ev.usage.total_tokens;
        renderCtx();
      }
      const x = ev.mtpllm;
      if (x) {
        msg.n += x.draft.length;
        msg.accepted += x.accepted;
        if (x.stats) msg.stats = x.stats;
        if (x.timings) msg.timings = x.timings;
        if (x.timings && !x.stats && msg.n) msg.spec = false;
      }
      const ch = ev.choices && ev.choices[0];
      if (ch) {
        const text = (ch.delta && ch.delta.content) || "";
        if (text) {
          msg.content += text;
          // a chunk is one token's text, or the text of a few whose bytes made one character:
          // marked as draft when all of them were accepted drafts
          pushRun(msg.runs, text.length, x && x.draft.length && x.accepted === x.draft.length ? 1 : 0);
        }
        if (ch.finish_reason) msg.finish = ch.finish_reason;
      }
      if (!frame) frame = requestAnimationFrame(draw);
      persistSoon();
    }
  } catch (e) {
    if (e.name === "AbortError") msg.status = "stopped";
    else msg.error = e instanceof ApiError || e instanceof Error ? e.message : String(e);
  } finally {
    if (frame) cancelAnimationFrame(frame);
    delete msg.t0;
    running = null;
    setRunning(false);
    conv.updated = Date.now();
    persist();
    if (conv === current) {
      renderMessages();
      renderCtx();
    }
  }
}

function stop() {
  if (running) running.controller.abort();
}

async function send() {
  const input = $("input");
  const text = input.value;
  if (!text.trim() || running) return;
  input.value = "";
  autosize();
  if (!current.title) current.title = text.trim().replace(/\s+/g, " ").slice(0, 80);
  current.messages.push({ role: "user", content: text });
  await generate();
}

function regenerate() {
  if (running) return;
  while (current.messages.length && current.messages[current.messages.length - 1].role === "assistant") {
    current.messages.pop();
  }
  if (current.messages.length) generate();
}

function editMessage(el, i) {
  if (running) return;
  const msg = current.messages[i];
  const body = el.querySelector(".body");
  const actions = el.querySelector(".actions");
  const ta = document.createElement("textarea");
  ta.className = "edit";
  ta.value = msg.content;
  ta.rows = Math.min(12, msg.content.split("\n").length + 1);
  body.replaceChildren(ta);
  const save = () => {
    if (!ta.value.trim()) return;
    msg.content = ta.value;
    current.messages.splice(i + 1);
    if (i === 0) current.title = ta.value.trim().replace(/\s+/g, " ").slice(0, 80);
    generate();
  };
  actions.replaceChildren(button("Save & send", "Answer the edited message", save),
    button("Cancel", "Keep the message as it was", renderMessages));
  ta.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); save(); }
    if (e.key === "Escape") { e.preventDefault(); e.stopPropagation(); renderMessages(); }
  });
  ta.focus();
}

// ------------------------------------------------------------------ settings and the API key
function showSettings() {
  $("set-system").value = settings.system;
  $("set-temperature").value = settings.temperature;
  $("set-top-p").value = settings.top_p;
  $("set-max-tokens").value = settings.max_tokens;
  const nmax = props ? props.speculative_n_max || 0 : 0;
  const k = $("set-k");
  k.max = nmax;
  k.disabled = nmax === 0;
  k.value = nmax === 0 ? 0 : (settings.k === null ? nmax : Math.min(settings.k, nmax));
  $("k-note").textContent = nmax > 0
    ? `This server drafts with ${props.speculative} (k up to ${nmax}); 0 turns speculation off for your answers.`
    : "This server runs without speculative decoding (start it with e.g. --spec-type draft-mtp).";
  $("set-marks").checked = settings.marks;
  $("forget-key").hidden = !getKey();
  $("settings").showModal();
}

function num(id, lo, hi, fallback) {
  const v = Number($(id).value);
  return Number.isFinite(v) && $(id).value !== "" ? Math.min(hi, Math.max(lo, v)) : fallback;
}

function saveSettingsForm() {
  const nmax = props ? props.speculative_n_max || 0 : 0;
  settings = {
    ...settings,
    system: $("set-system").value,
    temperature: num("set-temperature", 0, 2, settings.temperature),
    top_p: num("set-top-p", 0.01, 1, settings.top_p),
    max_tokens: Math.floor(num("set-max-tokens", 1, 1e6, settings.max_tokens)),
    k: nmax > 0 ? Math.floor(num("set-k", 0, nmax, nmax)) : settings.k,
    marks: $("set-marks").checked,
  };
  saveSettings(settings);
  applyMarks();
}

function applyMarks() {
  $("app").classList.toggle("marks-on", settings.marks);
  $("toggle-marks").setAttribute("aria-pressed", String(settings.marks));
}

let keyResolve = null;
let keyAsked = null;  // one dialog for every request that was refused meanwhile
onKeyNeeded((why) => {
  if (keyAsked) return keyAsked;
  keyAsked = new Promise((resolve) => {
    keyResolve = resolve;
    $("key-why").textContent = why;
    $("key-input").value = "";
    $("keydlg").showModal();
    $("key-input").focus();
  }).finally(() => { keyAsked = null; });
  return keyAsked;
});

function closeKey(value) {
  const r = keyResolve;
  keyResolve = null;
  if ($("keydlg").open) $("keydlg").close();
  if (r) r(value);
}

// ------------------------------------------------------------------ page
function autosize() {
  const ta = $("input");
  ta.style.height = "auto";
  ta.style.height = `${Math.min(ta.scrollHeight, 240)}px`;
}

function closeSide() {
  $("app").classList.remove("side-open");
}

async function loadProps() {
  try {
    props = await getJSON("props");
  } catch (e) {
    notice(`Cannot read the server's settings: ${e.message}`);
    return;
  }
  const name = String(props.model_path || "model").split(/[\\/]/).pop();
  $("model-name").textContent = name;
  emptyModel.textContent = name;
  document.title = `${name} · mtpllm`;
  const spec = $("spec-label");
  spec.textContent = props.speculative || "no speculation";
  spec.title = props.speculative ? `Speculative decoding: ${props.speculative} (method:draft length)` : "";
  spec.classList.toggle("spec", Boolean(props.speculative));
  spec.classList.toggle("off", !props.speculative);
  renderCtx();
}

function init() {
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  $("input").addEventListener("input", autosize);
  $("stop").addEventListener("click", stop);
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && running && !document.querySelector("dialog[open]")) {
      e.preventDefault();
      stop();
    }
  });
  $("new-chat").addEventListener("click", () => {
    if (running) stop();
    current = newConversation();
    renderAll();
    closeSide();
    $("input").focus();
  });
  $("open-side").addEventListener("click", () => $("app").classList.add("side-open"));
  $("close-side").addEventListener("click", closeSide);
  $("scrim").addEventListener("click", closeSide);
  $("open-settings").addEventListener("click", showSettings);
  $("settings-cancel").addEventListener("click", () => $("settings").close());
  $("settings-form").addEventListener("submit", saveSettingsForm);
  $("forget-key").addEventListener("click", () => { setKey(""); $("forget-key").hidden = true; });
  $("toggle-marks").addEventListener("click", () => {
    settings = { ...settings, marks: !settings.marks };
    saveSettings(settings);
    applyMarks();
  });
  $("key-form").addEventListener("submit", (e) => { e.preventDefault(); closeKey($("key-input").value.trim()); });
  $("key-cancel").addEventListener("click", () => closeKey(""));
  $("keydlg").addEventListener("cancel", (e) => { e.preventDefault(); closeKey(""); });
  window.addEventListener("storage", (e) => {  // another tab changed the conversations
    if (e.key === "mtpllm.conversations" && !running) {
      const id = current.id;
      conversations = loadConversations();
      current = conversations.find((c) => c.id === id) || current;
      renderAll();
    }
  });
  applyMarks();
  renderAll();
  loadProps();
  $("input").focus();
}

init();
