// dgemma playground: reads the server's event streams (fetch + Server-Sent Events framing, since
// EventSource cannot POST) and draws each denoising step as it arrives.
"use strict";

const $ = (id) => document.getElementById(id);
let INFO = null;

// ------------------------------------------------------------------------------------ streams
async function streamEvents(url, body, onEvent, signal) {
  const resp = await fetch(url, {
    method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body), signal,
  });
  if (!resp.ok) {
    let msg = `${resp.status} ${resp.statusText}`;
    try { msg = (await resp.json()).error || msg; } catch (e) { /* not JSON */ }
    throw new Error(msg);
  }
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buf += value;
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const frame = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      let event = "message", data = "";
      for (const line of frame.split("\n")) {
        if (line.startsWith(":")) continue;  // keep-alive comment
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data += line.slice(5).trim();
      }
      if (data) onEvent(event, JSON.parse(data));
    }
  }
}

function showError(prefix, msg) {
  const el = $(`${prefix}-error`);
  el.textContent = msg || "";
  el.hidden = !msg;
}

const fmt = (x, d = 2) => (typeof x === "number" ? x.toFixed(d) : "-");

// ------------------------------------------------------------------------------------ controls
function fillControls(prefix, model) {
  const sel = $(`${prefix}-step_type`);
  sel.innerHTML = "";
  for (const s of model.step_types || []) sel.add(new Option(s, s));
  const d = model.defaults || {};
  if (d.step_type) sel.value = d.step_type;
  if (d.num_steps) $(`${prefix}-num_steps`).value = d.num_steps;
  if (d.temperature !== undefined) $(`${prefix}-temperature`).value = d.temperature;
  if (d.early_stopping) $(`${prefix}-early_stopping`).value = d.early_stopping;
  if (d.threshold !== undefined) $(`${prefix}-threshold`).value = d.threshold;
  // only a model with a self-conditioning block has the switch; checked = the run's own setting
  const sc = $(`${prefix}-self_condition`);
  sc.parentElement.hidden = d.self_condition === null || d.self_condition === undefined;
  sc.checked = d.self_condition === true;
  const nr = $(`${prefix}-no_repeat`);  // the Text panel's; checked = the run's own setting
  if (nr) nr.checked = d.no_repeat === true;
  const canv = $(`${prefix}-max_canvases`);
  if (canv && model.max_canvases) canv.value = model.max_canvases;
  if (INFO) $(`${prefix}-num_steps`).max = INFO.limits.max_steps;
  syncThreshold(prefix);
}

function syncThreshold(prefix) {
  const step = $(`${prefix}-step_type`).value;
  $(`${prefix}-threshold`).parentElement.hidden = step !== "confidence";
  const nr = $(`${prefix}-no_repeat`);
  if (nr) nr.parentElement.hidden = step !== "commit";
}

function readControls(prefix) {
  const num = (id) => { const v = $(`${prefix}-${id}`).value; return v === "" ? null : Number(v); };
  const out = {
    step_type: $(`${prefix}-step_type`).value || null,
    num_steps: num("num_steps"),
    temperature: num("temperature"),
    early_stopping: $(`${prefix}-early_stopping`).value,
    delay_ms: num("delay_ms") || 0,
  };
  if (out.step_type === "confidence") out.threshold = num("threshold");
  if (!$(`${prefix}-self_condition`).parentElement.hidden) out.self_condition = $(`${prefix}-self_condition`).checked;
  const nr = $(`${prefix}-no_repeat`);
  if (nr && !nr.parentElement.hidden) out.no_repeat = nr.checked;
  return out;
}

function describeModel(prefix, m) {
  const el = $(`${prefix}-model`);
  if (!m.available) {
    el.textContent = `model unavailable: ${m.error}`;
    el.classList.add("unavailable");
    return;
  }
  el.classList.remove("unavailable");
  const what = m.kind === "run" ? "training run" : "pretrained";
  el.textContent = `model: ${m.source} (${what}, ${m.process} noise, canvas ${m.canvas_size})` +
    (m.loaded ? "" : " — loads on first use");
  el.classList.toggle("untrained", Boolean(m.warning));
  if (m.warning) el.textContent += ` — warning: ${m.warning}`;
  if (prefix === "t") showExamples(m.examples || []);
}

function showExamples(examples) {  // held-out prompts shipped with the model (its examples.jsonl)
  const sel = $("t-example");
  sel.closest("label").hidden = examples.length === 0;
  sel.replaceChildren(sel.options[0]);
  examples.forEach((ex, i) => {
    const opt = document.createElement("option");
    const q = ex.prompt.includes("Question:") ? ex.prompt.split("Question:").pop().trim() : ex.prompt;
    opt.value = String(i);
    opt.textContent = (ex.label ? `[${ex.label}] ` : "") + (q.length > 90 ? q.slice(0, 87) + "…" : q);
    sel.appendChild(opt);
  });
  sel.onchange = () => {
    const ex = examples[Number(sel.value)];
    if (!ex) return;
    $("prompt").value = ex.prompt;
    $("system").value = ex.system || "";
  };
}

function markLoaded(prefix, key) {  // a stream started: its model is loaded
  if (INFO && !INFO.models[key].loaded) {
    INFO.models[key].loaded = true;
    describeModel(prefix, INFO.models[key]);
  }
}

async function refreshInfo(prefix, key) {  // after a request: the model may have loaded
  try {
    INFO = await (await fetch("/api/info")).json();
    describeModel(prefix, INFO.models[key]);
  } catch (e) { /* the server went away; the next request will say so */ }
}

// ------------------------------------------------------------------------------------ sudoku
const board = $("board");
const cells = [];
for (let i = 0; i < 81; i++) {
  const el = document.createElement("div");
  el.dataset.base = `cell r${Math.floor(i / 9)} c${i % 9}`;
  el.className = el.dataset.base + " empty";
  el.dataset.kind = "empty";
  board.appendChild(el);
  cells.push(el);
}

function drawCells(list) {  // list of [digit, kind]
  list.forEach(([d, kind], i) => {
    const el = cells[i];
    if (el.textContent !== d) el.textContent = d;
    if (el.dataset.kind !== kind) {
      el.dataset.kind = kind;
      el.className = `${el.dataset.base} ${kind}`;
    }
  });
}

function normalisePuzzle(text) {
  return text.replace(/\s+/g, "").replace(/\./g, "0");
}

function previewPuzzle() {  // clues as typed; the server does the real validation on Solve
  const p = normalisePuzzle($("puzzle").value);
  drawCells(Array.from({length: 81}, (_, i) => {
    const ch = p[i] || "0";
    return /[1-9]/.test(ch) ? [ch, "clue"] : ["", "empty"];
  }));
  board.dataset.state = "idle";
  $("s-verdict").textContent = "";
  $("s-status").textContent = p.length === 81 || !p.length ? "" : `${p.length} of 81 cells typed`;
}

let sudokuAbort = null;

async function solve() {
  showError("s", "");
  $("s-verdict").textContent = "";
  $("s-verdict").className = "verdict";
  const body = {puzzle: $("puzzle").value, ...readControls("s")};
  if ($("s-verify").checked) body.verify_rounds = Number($("s-verify_rounds").value || 0);
  sudokuAbort = new AbortController();
  $("solve").disabled = true;
  $("s-stop").disabled = false;
  $("s-status").textContent = INFO && !INFO.models.sudoku.loaded ? "loading the model…" : "starting…";
  board.dataset.state = "solving";
  try {
    await streamEvents("/api/sudoku/solve", body, onSudokuEvent, sudokuAbort.signal);
  } catch (e) {
    if (e.name === "AbortError") {
      $("s-status").textContent += "  · stopped";
      board.dataset.state = "stopped";
    } else {
      showError("s", e.message);
      $("s-status").textContent = "";
      board.dataset.state = "error";
    }
  } finally {
    $("solve").disabled = false;
    $("s-stop").disabled = true;
    sudokuAbort = null;
    refreshInfo("s", "sudoku");
  }
}

function onSudokuEvent(event, d) {
  if (event === "start") {
    markLoaded("s", "sudoku");
    $("s-status").textContent = `${d.clues} clues · ${d.step_type}, ${d.num_steps} steps, T=${d.temperature}, seed ${d.seed}`;
  } else if (event === "step") {
    drawCells(d.cells);
    board.dataset.step = d.step;
    $("s-status").textContent =
      `step ${d.step}/${d.num_steps} · ${d.forwards} forwards · ${d.settled} cells committed · ` +
      `${fmt(d.tokens_per_forward)} tok/forward · ${fmt(d.elapsed)} s`;
  } else if (event === "round") {
    board.dataset.round = d.round;
    $("s-verdict").textContent = `round ${d.round} of at most ${d.rounds}: re-noising ${d.renoised} cells ` +
      `(${d.rule}, ${d.num_steps} steps)`;
    $("s-verdict").className = "verdict";
  } else if (event === "done") {
    drawCells(d.cells);
    board.dataset.state = "done";
    const s = d.stats;
    const slow = s.delay_seconds ? ` (+${fmt(s.delay_seconds, 1)} s slow motion)` : "";
    if (d.verified) {  // model-only and verified figures, never one number
      const v = d.verified;
      $("s-status").textContent = `done · model alone: ${d.model_only.forward_passes} forwards, ` +
        (d.model_only.solved ? "valid" : "not valid") + ` · verified: ${v.rounds} of up to ${v.max_rounds} rounds, ` +
        `${v.forward_passes} forwards, ${fmt(v.seconds)} s` + slow;
      $("s-verdict").textContent = `${d.verdict} — model alone: ${d.model_only.verdict}`;
    } else {
      $("s-status").textContent =
        `done · steps ${s.steps_used.join("+")} · ${s.forward_passes} forwards · ` +
        `${fmt(s.tokens_per_forward)} tok/forward · ${fmt(s.tokens_per_second, 1)} tok/s · ${fmt(s.seconds)} s` + slow;
      $("s-verdict").textContent = d.verdict;
    }
    $("s-verdict").className = "verdict " + (d.solved ? "ok" : "bad");
  } else if (event === "error") {
    showError("s", d.error);
    board.dataset.state = "error";
  }
}

async function randomPuzzle() {
  showError("s", "");
  const resp = await fetch(`/api/sudoku/random?difficulty=${$("difficulty").value}`);
  const d = await resp.json();
  if (!resp.ok) { showError("s", d.error); return; }
  $("puzzle").value = d.puzzle;
  previewPuzzle();
  $("s-status").textContent = `${d.difficulty} puzzle, ${d.clues} clues (seed ${d.seed})`;
}

// ------------------------------------------------------------------------------------ text
let textAbort = null;
const SPECIAL = /^<[^<>\s]+>$/;

function canvasBox(k) {
  let box = document.querySelector(`.canvas[data-index="${k}"]`);
  if (!box) {
    box = document.createElement("div");
    box.className = "canvas";
    box.dataset.index = k;
    $("canvases").appendChild(box);
  }
  return box;
}

function drawTokens(box, label, tokens) {
  const frag = document.createDocumentFragment();
  const head = document.createElement("span");
  head.className = "label";
  head.textContent = label;
  frag.appendChild(head);
  for (const [text, settled] of tokens) {
    const span = document.createElement("span");
    span.className = "tok " + (settled ? "settled" : "noisy") + (SPECIAL.test(text) ? " special" : "");
    span.textContent = text;
    frag.appendChild(span);
  }
  box.replaceChildren(frag);
}

async function generate() {
  showError("t", "");
  $("canvases").replaceChildren();
  const body = {prompt: $("prompt").value, ...readControls("t")};
  if ($("system").value.trim()) body.system = $("system").value;
  if ($("answer-prefix").value.trim()) body.prefix = $("answer-prefix").value;
  const mc = $("t-max_canvases").value;
  if (mc !== "") body.max_canvases = Number(mc);
  textAbort = new AbortController();
  $("generate").disabled = true;
  $("t-stop").disabled = false;
  $("canvases").dataset.state = "running";
  $("t-status").textContent = INFO && !INFO.models.text.loaded ? "loading the model (first request)…" : "starting…";
  try {
    await streamEvents("/api/text/generate", body, onTextEvent, textAbort.signal);
  } catch (e) {
    if (e.name === "AbortError") {
      $("t-status").textContent += "  · stopped";
      $("canvases").dataset.state = "stopped";
    } else {
      showError("t", e.message);
      $("t-status").textContent = "";
      $("canvases").dataset.state = "error";
    }
  } finally {
    $("generate").disabled = false;
    $("t-stop").disabled = true;
    textAbort = null;
    refreshInfo("t", "text");
  }
}

function onTextEvent(event, d) {
  if (event === "start") {
    markLoaded("t", "text");
    $("t-status").textContent = `${d.prompt_tokens} prompt tokens · ${d.step_type}, ${d.num_steps} steps, seed ${d.seed}` +
      (d.self_condition === false ? " · no self-conditioning" : "") + (d.no_repeat ? " · no repeats" : "") +
      (d.prefix ? ` · answer starts "${d.prefix}"` : "");
  } else if (event === "step") {
    drawTokens(canvasBox(d.canvas), `canvas ${d.canvas + 1} · step ${d.step}/${d.num_steps}`, d.tokens);
    $("t-status").textContent =
      `canvas ${d.canvas + 1} · step ${d.step}/${d.num_steps} · ${d.forwards} forwards · ` +
      `${fmt(d.tokens_per_forward)} tok/forward · ${fmt(d.elapsed)} s`;
  } else if (event === "canvas") {
    const box = canvasBox(d.canvas);
    drawTokens(box, `canvas ${d.canvas + 1} · ${d.steps} steps` + (d.ended ? " · end" : ""), d.tokens);
    box.classList.add("done");
  } else if (event === "done") {
    $("canvases").dataset.state = "done";
    const s = d.stats;
    $("t-status").textContent =
      `done · ${s.tokens} tokens · steps ${s.steps_used.join("+")} · ${s.forward_passes} forwards · ` +
      `${fmt(s.tokens_per_forward)} tok/forward · ${fmt(s.tokens_per_second, 1)} tok/s · ${fmt(s.seconds)} s` +
      (s.delay_seconds ? ` (+${fmt(s.delay_seconds, 1)} s slow motion)` : "");
  } else if (event === "error") {
    showError("t", d.error);
    $("canvases").dataset.state = "error";
  }
}

// ------------------------------------------------------------------------------------ start
async function init() {
  $("puzzle").addEventListener("input", previewPuzzle);
  $("random").addEventListener("click", randomPuzzle);
  $("clear").addEventListener("click", () => { $("puzzle").value = ""; previewPuzzle(); });
  $("solve").addEventListener("click", solve);
  $("s-stop").addEventListener("click", () => sudokuAbort && sudokuAbort.abort());
  $("generate").addEventListener("click", generate);
  $("t-stop").addEventListener("click", () => textAbort && textAbort.abort());
  $("s-step_type").addEventListener("change", () => syncThreshold("s"));
  $("t-step_type").addEventListener("change", () => syncThreshold("t"));
  try {
    INFO = await (await fetch("/api/info")).json();
  } catch (e) {
    showError("s", `cannot reach the server: ${e.message}`);
    return;
  }
  for (const [prefix, key, button] of [["s", "sudoku", "solve"], ["t", "text", "generate"]]) {
    const m = INFO.models[key];
    describeModel(prefix, m);
    if (m.available) fillControls(prefix, m);
    else {
      $(button).disabled = true;
      document.querySelector(`fieldset[data-prefix="${prefix}"]`).disabled = true;
      $(`${prefix}-threshold`).parentElement.hidden = true;
    }
  }
  document.body.dataset.ready = "1";
}

init();
