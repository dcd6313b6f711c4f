"""The rollout viewer: a run's recorded rollouts as one self-contained HTML page.

    rollouts/rollouts.jsonl (RolloutRecorder) + metrics.jsonl
        --write_viewer(run_dir)--> run_dir/rollout_viewer.html (inline CSS, JS and data)

The page needs no server and no network: open it from the run folder (file://). It shows the
recorded rollouts, the training ones and the validations' (``validation.jsonl``), step by step
and group by group: every turn (the prompt text the turn added, the completion), each turn's
reward parts, reward and advantage, the rollout's status, reward and advantage; the completion's
tokens coloured by their advantage or by the generator's logprob of the sampled token; filters by
step, status, reward and text; a second step side by side. The filters live in the page's URL
(``#step=10&compare=20&status=completed``), so a link or a bookmark reopens the same view.

The recorder rewrites it after each step it records and the job at the run's end
(``recorder.viewer``); for an existing run folder::

    python -m torchtitan_rl.metrics.rollout_viewer runs/<name>

Every value the page shows comes from the files the run already writes; the trainer's own
per-token logprobs are not kept (only their step-level gap to the generator's, in the metrics,
which the page shows in each step's header).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import sys
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_ROLLOUTS_PATH = "rollouts/rollouts.jsonl"
DEFAULT_VIEWER_PATH = "rollout_viewer.html"
VALIDATION_FILE = "validation.jsonl"
"""The validations' rollouts, beside the training rollouts' file (RolloutRecorder)."""
READ_BLOCK_BYTES = 1 << 20
"""What a bounded read (``read_json_lines(last_steps=...)``) takes from a file's end at a time."""

STEP_METRICS = (
    "rollout_reward/mean",
    "rollout_reward/std",
    "validation/reward_mean",
    "loss/trainer_minus_generator_logprob_mean",
    "loss/trainer_generator_abs_logprob_diff_mean",
    "loss/trainer_generator_abs_logprob_diff_max",
    "loss/entropy_mean",
    "time/step_s",
)
"""The per-step metrics shown in each step's header (those the run logged)."""


class _NonFinite:
    """``json.loads(..., parse_constant=)``: NaN and +-Infinity become None (JSON.parse refuses
    them), and ``seen`` says whether the line had any."""

    def __init__(self) -> None:
        self.seen = False

    def __call__(self, name: str) -> None:
        self.seen = True


def read_json_lines(path: pathlib.Path, *, last_steps: int | None = None,
                    since_step: int | None = None) -> tuple[list[tuple[str, dict[str, Any]]], int]:
    """(the line as the page embeds it, the object) for each JSON object line of ``path`` (none
    when it does not exist), and the number of lines that were not one (a line cut short by a
    killed run): those are skipped, counted and logged. A line is embedded as written unless it
    holds NaN or Infinity (then re-written with null there).

    ``last_steps``: only the lines of the file's last that many steps (by their ``step``);
    ``since_step``: only the lines of steps from it on. Either reads the file from its end, as
    far back as those lines go (the files are written in step order; a resume cuts what it
    replays), so the work does not grow with the run's length."""
    if not path.exists():
        return [], 0
    bounded = last_steps is not None or since_step is not None
    lines = _lines_from_the_end(path) if bounded else enumerate(
        path.read_text(encoding="utf-8").splitlines(), start=1)
    found, num_bad, steps = [], 0, set()
    for where, line in lines:
        if not line.strip():
            continue
        non_finite = _NonFinite()
        try:
            record = json.loads(line, parse_constant=non_finite)
        except json.JSONDecodeError as e:
            num_bad += 1
            logger.warning("%s line %s skipped: not JSON (%s)", path, where, e)
            continue
        if not isinstance(record, dict):
            num_bad += 1
            logger.warning("%s line %s skipped: not a JSON object", path, where)
            continue
        if bounded:
            step = record.get("step")
            if since_step is not None and isinstance(step, int) and step < since_step:
                break
            if last_steps is not None and step not in steps:
                if len(steps) == last_steps:
                    break
                steps.add(step)
        found.append((json.dumps(record) if non_finite.seen else line.strip(), record))
    if bounded:
        found.reverse()
    return found, num_bad


def _lines_from_the_end(path: pathlib.Path) -> Iterator[tuple[str, str]]:
    """``path``'s lines, last first, read `READ_BLOCK_BYTES` at a time from the end: ("N from
    the end", the line)."""
    with path.open("rb") as f:
        position = f.seek(0, os.SEEK_END)
        rest = b""
        number = 0
        while position > 0:
            size = min(READ_BLOCK_BYTES, position)
            position -= size
            f.seek(position)
            block = f.read(size) + rest
            parts = block.split(b"\n")
            rest = parts[0]  # may continue in the block before
            for raw in reversed(parts[1:]):
                number += 1
                yield f"{number} from the end", raw.decode("utf-8", errors="replace")
        if rest:
            yield f"{number + 1} from the end", rest.decode("utf-8", errors="replace")


def read_step_metrics(path: pathlib.Path, since_step: int | None = None
                      ) -> dict[int, dict[str, float | None]]:
    """{step: the `STEP_METRICS` it logged} from metrics.jsonl, of the steps from ``since_step``
    on (None: all; later lines of a step win, as after a resume; a non-finite value is None)."""
    by_step: dict[int, dict[str, float | None]] = {}
    for _, record in read_json_lines(path, since_step=since_step)[0]:
        step = record.get("step")
        if isinstance(step, int):
            by_step.setdefault(step, {}).update(
                {key: record[key] for key in STEP_METRICS if key in record})
    return {step: values for step, values in sorted(by_step.items()) if values}


def page_data(run_dir: pathlib.Path, rollouts_path: str = DEFAULT_ROLLOUTS_PATH,
              max_steps: int | None = None) -> tuple[str, dict[str, int]]:
    """The JSON the page embeds, and the number of rollouts of each set in it: the run's name,
    the step metrics (the validations' among them) and the recorded rollouts in file order
    (step, group, rollout), the training rollouts' and the validations' (``validation.jsonl``
    beside them: RolloutRecorder.record_validation), of each set the last ``max_steps`` steps
    recorded (None: all; then the step metrics are those from the first training step shown on,
    so that no file is read whole). The rollout lines go
    in as written (no parse-and-dump of megabytes at every step). ``<`` is escaped, so no text
    a model wrote can close the page's script element."""
    path = run_dir / rollouts_path
    sets: dict[str, list[str]] = {}
    num_bad = 0
    first_step: int | None = None
    for name, file in (("training", path), ("validation", path.with_name(VALIDATION_FILE))):
        lines, bad = read_json_lines(file, last_steps=max_steps)
        sets[name], num_bad = [line for line, _ in lines], num_bad + bad
        if name == "training" and max_steps is not None:
            first_step = min((record["step"] for _, record in lines
                              if isinstance(record.get("step"), int)), default=None)
    head = json.dumps({
        "run_name": run_dir.resolve().name,
        "rollouts_path": rollouts_path,
        "max_steps": max_steps,
        "step_metrics": {str(step): values for step, values in
                         read_step_metrics(run_dir / "metrics.jsonl", first_step).items()},
        "num_skipped_lines": num_bad,
    }, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    rollouts = ",".join(f'"{name}":[{",".join(lines)}]' for name, lines in sets.items())
    payload = head[:-1] + ',"sets":{' + rollouts + "}}"
    return payload.replace("<", "\\u003c"), {name: len(lines) for name, lines in sets.items()}


def write_viewer(run_dir: str | pathlib.Path, *, rollouts_path: str = DEFAULT_ROLLOUTS_PATH,
                 viewer_path: str = DEFAULT_VIEWER_PATH,
                 max_steps: int | None = None) -> pathlib.Path:
    """(Re)write the page from the run folder's files, the last ``max_steps`` recorded steps
    of each set (page_data); returns its path. The file is replaced whole (written beside it,
    then renamed), so a browser never reads half a page."""
    run_dir = pathlib.Path(run_dir)
    out = run_dir / viewer_path
    out.parent.mkdir(parents=True, exist_ok=True)
    payload, counts = page_data(run_dir, rollouts_path, max_steps)
    partial = out.with_name(out.name + ".partial")
    partial.write_text(_PAGE.replace("/*DATA*/", payload), encoding="utf-8")
    os.replace(partial, out)
    logger.info("rollout viewer: %d training and %d validation rollouts in %s",
                counts["training"], counts["validation"], out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_rl.metrics.rollout_viewer",
        description="(Re)write a run folder's rollout viewer, one HTML page to open in a browser.")
    parser.add_argument("run_dir", type=pathlib.Path, help="the run folder (runs/<name>)")
    parser.add_argument("--rollouts", default=DEFAULT_ROLLOUTS_PATH,
                        help="the recorded rollouts, relative to the run folder "
                             "(recorder.path; default %(default)s)")
    parser.add_argument("--out", default=DEFAULT_VIEWER_PATH,
                        help="the page, relative to the run folder (default %(default)s)")
    parser.add_argument("--max-steps", type=int, default=0,
                        help="only the last N recorded steps of the training rollouts and of the "
                             "validations (recorder.viewer_max_steps; default 0: all)")
    args = parser.parse_args(argv)
    # Errors are one `error:` line with exit 2, as the train and eval commands' are.
    if not args.run_dir.is_dir():
        print(f"error: run_dir: {args.run_dir} is not a folder", file=sys.stderr)
        return 2
    if not (args.run_dir / args.rollouts).exists():
        print(f"error: --rollouts: no recorded rollouts at {args.run_dir / args.rollouts} "
              f"(recorder.every_k_steps = 0, or another recorder.path: pass it here)",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    write_viewer(args.run_dir, rollouts_path=args.rollouts, viewer_path=args.out,
                 max_steps=args.max_steps or None)
    return 0


_PAGE = r"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>rollouts</title>
<style>
  body { font: 13px/1.4 system-ui, sans-serif; margin: 0; color: #1d1d1f; background: #f4f4f6; }
  header { position: sticky; top: 0; z-index: 2; background: #fff; border-bottom: 1px solid #ccc;
           padding: 6px 12px; }
  header h1 { font-size: 15px; margin: 0 12px 4px 0; display: inline-block; }
  #summary { color: #555; }
  #controls { display: flex; flex-wrap: wrap; gap: 6px 14px; align-items: center; margin-top: 4px; }
  #controls label { white-space: nowrap; }
  #controls input[type=number] { width: 5em; }
  #count { color: #555; margin-left: auto; }
  #legend span { display: inline-block; padding: 0 4px; border-radius: 2px; }
  main { display: flex; gap: 10px; padding: 10px; align-items: flex-start; }
  .column { flex: 1 1 0; min-width: 0; }
  .column > h2 { font-size: 14px; margin: 0 0 6px; }
  .step { margin-bottom: 14px; }
  .step > h3 { font-size: 13px; margin: 8px 0 4px; padding: 4px 6px; background: #e2e6ee;
               border-radius: 3px; }
  .step-metrics { font-weight: normal; color: #444; }
  .group { margin: 6px 0 2px; color: #555; font-size: 12px; }
  .rollout { background: #fff; border: 1px solid #d6d6da; border-radius: 4px; margin: 4px 0;
             padding: 4px 8px; }
  .rollout-head { display: flex; flex-wrap: wrap; gap: 4px 12px; }
  .status { padding: 0 5px; border-radius: 3px; background: #ddd; }
  .status.completed { background: #cfeccf; }
  .status.truncated_length, .status.truncated_max_turns { background: #f6e3b4; }
  .status.error_timeout, .status.error_env, .status.error_abort { background: #f4c2c2; }
  .turn { border-left: 3px solid #c9cfdc; margin: 4px 0 2px; padding-left: 6px; }
  .turn-head { color: #555; font-size: 12px; }
  pre { white-space: pre-wrap; word-break: break-word; margin: 2px 0; font: 12px/1.45 ui-monospace,
        monospace; }
  .prompt { color: #666; }
  .completion .tok { border-radius: 2px; }
  details > summary { cursor: pointer; color: #666; font-size: 12px; }
  .error { color: #a00; }
  .more { margin: 6px 0; }
  .empty { color: #777; padding: 12px; }
</style>
</head>
<body>
<header>
  <h1 id="title">rollouts</h1><span id="summary"></span>
  <div id="controls">
    <label>rollouts <select id="set"></select></label>
    <label>step <select id="step"></select></label>
    <label>side by side with <select id="compare"></select></label>
    <label>status <select id="status"></select></label>
    <label>reward from <input id="reward-min" type="number" step="any"></label>
    <label>to <input id="reward-max" type="number" step="any"></label>
    <label>text <input id="text" type="search" placeholder="in completions"></label>
    <label>colour tokens by <select id="colour">
      <option value="advantage">advantage</option>
      <option value="logprob">generator logprob</option>
      <option value="none">nothing</option>
    </select></label>
    <label><input id="prompts" type="checkbox"> prompts open</label>
    <span id="legend"></span>
    <span id="count"></span>
  </div>
</header>
<main id="columns"></main>
<script id="data" type="application/json">/*DATA*/</script>
<script>
"use strict";
const DATA = JSON.parse(document.getElementById("data").textContent);
const PAGE_SIZE = 200;  // rollouts drawn per column before a "show more" button
const $ = (id) => document.getElementById(id);
const ALL = Object.values(DATA.sets).flat();
const STATUSES = [...new Set(ALL.map((r) => r.status))].sort();
let SET = "training", ROLLOUTS = [], STEPS = [];  // the set shown (useSet)

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}
function fmt(x, digits = 3) {
  return x === null || x === undefined ? "n/a" : (typeof x === "number" ? x.toFixed(digits) : String(x));
}
function option(select, value, label) {
  const o = el("option", null, label); o.value = value; select.appendChild(o);
}

// ---- controls <-> URL hash ------------------------------------------------------------------
function fillControls() {
  for (const [name, rollouts] of Object.entries(DATA.sets)) option($("set"), name, `${name} (${rollouts.length})`);
  option($("status"), "all", "any");
  for (const s of STATUSES) option($("status"), s, s);
}
function useSet(name) {  // the training or the validation rollouts: their steps in the step lists
  SET = name in DATA.sets ? name : "training";
  $("set").value = SET;
  ROLLOUTS = DATA.sets[SET];
  STEPS = [...new Set(ROLLOUTS.map((r) => r.step))].sort((a, b) => a - b);
  $("step").replaceChildren(); $("compare").replaceChildren();
  option($("step"), "all", "all steps");
  option($("compare"), "", "(none)");
  for (const s of STEPS) { option($("step"), String(s), String(s)); option($("compare"), String(s), String(s)); }
}
const FIELDS = { set: "set", step: "step", compare: "compare", status: "status", rmin: "reward-min",
                 rmax: "reward-max", text: "text", colour: "colour" };
function readHash() {
  const params = new URLSearchParams(location.hash.slice(1));
  useSet(params.get("set") || "training");
  for (const [key, id] of Object.entries(FIELDS)) {
    if (!params.has(key)) continue;
    const value = params.get(key), input = $(id);
    if (input.tagName === "SELECT" && ![...input.options].some((o) => o.value === value)) continue;
    input.value = value;
  }
  $("prompts").checked = params.get("prompts") === "1";
}
function writeHash() {
  const params = new URLSearchParams();
  for (const [key, id] of Object.entries(FIELDS)) {
    const value = $(id).value;
    const isDefault = (key === "set" && value === "training") ||
      (key === "step" && value === "all") || (key === "status" && value === "all") ||
      (key === "colour" && value === "advantage") || value === "";
    if (!isDefault) params.set(key, value);
  }
  if ($("prompts").checked) params.set("prompts", "1");
  history.replaceState(null, "", "#" + params.toString());
}
function filters() {
  const num = (id) => ($(id).value === "" ? null : Number($(id).value));
  return { status: $("status").value, rmin: num("reward-min"), rmax: num("reward-max"),
           text: $("text").value.toLowerCase() };
}
function keep(r, f) {
  if (f.status !== "all" && r.status !== f.status) return false;
  if (f.rmin !== null && !(r.reward >= f.rmin)) return false;
  if (f.rmax !== null && !(r.reward <= f.rmax)) return false;
  if (f.text) {
    const texts = (r.turns || []).map((t) => t.completion_text || "").join("\n").toLowerCase();
    if (!texts.includes(f.text)) return false;
  }
  return true;
}

// ---- colours --------------------------------------------------------------------------------
// Advantages are scaled by the page's largest |advantage| (the 95th percentile, so one outlier
// does not wash out the rest): a run without std normalisation has advantages far below 1.
const ADVANTAGE_SCALE = (() => {
  const sizes = DATA.sets.training.flatMap((r) => (r.turns || []).map((t) => Math.abs(t.advantage ?? r.advantage ?? 0)))
    .filter((a) => a > 0).sort((a, b) => a - b);
  return sizes.length ? sizes[Math.floor(0.95 * (sizes.length - 1))] : 1;
})();
function advantageColour(a) {
  if (a === null || a === undefined) return "";
  const x = Math.max(-1, Math.min(1, a / ADVANTAGE_SCALE));
  return x >= 0 ? `rgba(40, 160, 60, ${0.12 + 0.6 * x})` : `rgba(210, 50, 50, ${0.12 - 0.6 * x})`;
}
function logprobColour(lp) {
  if (lp === null || lp === undefined) return "rgba(120, 120, 120, 0.35)";
  const x = Math.min(1, -lp / 5);  // 0: the generator was sure; 1: logprob <= -5
  return `rgba(240, 140, 20, ${0.05 + 0.75 * x})`;
}
function drawLegend() {
  const legend = $("legend"); legend.replaceChildren();
  const mode = $("colour").value;
  const add = (text, colour) => { const s = el("span", null, text); s.style.background = colour; legend.appendChild(s); };
  const scale = Number(ADVANTAGE_SCALE.toPrecision(2));
  if (mode === "advantage") { add(`advantage <= -${scale}`, advantageColour(-scale)); add("0", advantageColour(0)); add(`>= +${scale}`, advantageColour(scale)); }
  if (mode === "logprob") { add("logprob 0", logprobColour(0)); add("-2.5", logprobColour(-2.5)); add("<= -5", logprobColour(-5)); }
}

// ---- one rollout ----------------------------------------------------------------------------
function drawCompletion(turn, advantage, mode) {
  const pre = el("pre", "completion");
  const tokens = turn.completion_tokens;
  if (!Array.isArray(tokens)) {  // a run recorded before tokens were kept
    pre.textContent = turn.completion_text;
    if (mode === "advantage") pre.style.background = advantageColour(advantage);
    return pre;
  }
  const logprobs = turn.completion_logprobs || [];
  tokens.forEach((text, i) => {
    const span = el("span", "tok", text);
    const lp = logprobs[i];
    span.title = `token ${i}: ${JSON.stringify(text)}  generator logprob ${fmt(lp)}  advantage ${fmt(advantage)}`;
    if (mode === "advantage") span.style.background = advantageColour(advantage);
    else if (mode === "logprob") span.style.background = logprobColour(lp);
    pre.appendChild(span);
  });
  return pre;
}
function drawRollout(r, mode, promptsOpen) {
  const box = el("div", "rollout");
  box.dataset.step = r.step; box.dataset.status = r.status; box.dataset.reward = r.reward;
  box.dataset.sampleId = r.sample_id;
  const head = el("div", "rollout-head");
  head.appendChild(el("b", null, r.sample_id));
  head.appendChild(el("span", "status " + r.status, r.status));
  head.appendChild(el("span", null, "reward " + fmt(r.reward)));
  if (SET === "training")
    head.appendChild(el("span", null, "advantage " + (r.advantage === null ? "none (not trained)" : fmt(r.advantage))));
  head.appendChild(el("span", null, `${r.num_turns} turn${r.num_turns === 1 ? "" : "s"}`));
  box.appendChild(head);
  if (r.error) box.appendChild(el("div", "error", r.error));
  (r.turns || []).forEach((t, i) => {
    const turn = el("div", "turn");
    const advantage = t.advantage ?? r.advantage;
    const parts = Object.entries(t.reward_parts || {}).map(([k, v]) => `${k} ${fmt(v)}`).join(", ");
    let line = `turn ${i}: ${t.num_completion_tokens} tokens, ${t.finish_reason}`;
    if (parts) line += ` · reward parts: ${parts}`;
    if (t.reward !== null && t.reward !== undefined) line += ` · turn reward ${fmt(t.reward)}`;
    if (t.advantage !== null && t.advantage !== undefined) line += ` · turn advantage ${fmt(t.advantage)}`;
    if (t.drift) line += " · drift";
    turn.appendChild(el("div", "turn-head", line));
    const prompt = el("details");
    prompt.open = promptsOpen;
    prompt.appendChild(el("summary", null, `prompt added (${t.num_prompt_tokens} prompt tokens in all)`));
    prompt.appendChild(el("pre", "prompt", t.prompt_added_text));
    turn.appendChild(prompt);
    turn.appendChild(drawCompletion(t, advantage, mode));
    box.appendChild(turn);
  });
  return box;
}

// ---- columns --------------------------------------------------------------------------------
function stepHeader(step) {
  const h = el("h3", null, `step ${step} `);
  const m = DATA.step_metrics[String(step)] || {};
  const bits = [];
  if ("rollout_reward/mean" in m) bits.push(`reward mean ${fmt(m["rollout_reward/mean"])}`);
  if ("rollout_reward/std" in m) bits.push(`std ${fmt(m["rollout_reward/std"])}`);
  if ("loss/trainer_generator_abs_logprob_diff_mean" in m)
    bits.push(`|trainer - generator logprob| mean ${fmt(m["loss/trainer_generator_abs_logprob_diff_mean"], 4)}` +
              ` max ${fmt(m["loss/trainer_generator_abs_logprob_diff_max"], 4)}`);
  if ("loss/entropy_mean" in m) bits.push(`entropy ${fmt(m["loss/entropy_mean"])}`);
  if ("validation/reward_mean" in m) bits.push(`validation ${fmt(m["validation/reward_mean"])}`);
  if ("time/step_s" in m) bits.push(`${fmt(m["time/step_s"], 1)} s`);
  h.appendChild(el("span", "step-metrics", bits.join(" · ")));
  return h;
}
function drawColumn(title, steps, f, mode, promptsOpen) {
  const column = el("section", "column");
  column.appendChild(el("h2", null, title));
  const chosen = ROLLOUTS.filter((r) => steps.includes(r.step) && keep(r, f));
  let drawn = 0, stepBox = null, lastStep = null, lastGroup = null;
  function drawMore() {
    const end = Math.min(chosen.length, drawn + PAGE_SIZE);
    for (; drawn < end; drawn++) {
      const r = chosen[drawn];
      if (r.step !== lastStep) {
        stepBox = el("div", "step"); stepBox.dataset.step = r.step;
        stepBox.appendChild(stepHeader(r.step)); column.insertBefore(stepBox, more);
        lastStep = r.step; lastGroup = null;
      }
      if (r.group_id !== lastGroup) {
        let text = `group ${r.group_id}`;
        if (r.episode_id !== null && r.episode_id !== undefined) text += ` · episode ${r.episode_id}`;
        if (r.group_dropped) text += ` · dropped (${r.group_dropped}): not trained`;
        stepBox.appendChild(el("div", "group", text));
        lastGroup = r.group_id;
      }
      stepBox.appendChild(drawRollout(r, mode, promptsOpen));
    }
    more.hidden = drawn >= chosen.length;
    more.textContent = `show ${Math.min(PAGE_SIZE, chosen.length - drawn)} more of ${chosen.length - drawn}`;
  }
  const more = el("button", "more"); more.addEventListener("click", drawMore);
  column.appendChild(more);
  if (!chosen.length) column.insertBefore(el("div", "empty", "no rollout matches the filters"), more);
  drawMore();
  return [column, chosen.length];
}
function render() {
  writeHash(); drawLegend();
  const f = filters(), mode = $("colour").value, promptsOpen = $("prompts").checked;
  let step = $("step").value;
  const compare = $("compare").value;
  if (compare !== "" && step === "all" && STEPS.length) step = String(STEPS[0]);
  const columns = $("columns"); columns.replaceChildren();
  const [a, numA] = drawColumn(step === "all" ? "all steps" : `step ${step}`,
                               step === "all" ? STEPS : [Number(step)], f, mode, promptsOpen);
  columns.appendChild(a);
  let shown = numA;
  if (compare !== "") {
    const [b, numB] = drawColumn(`step ${compare}`, [Number(compare)], f, mode, promptsOpen);
    columns.appendChild(b); shown += numB;
  }
  $("count").textContent = `${shown} of ${ROLLOUTS.length} rollouts`;
}
function main() {
  document.title = `rollouts: ${DATA.run_name}`;
  $("title").textContent = `${DATA.run_name}: recorded rollouts`;
  const bits = [];
  const validations = Object.entries(DATA.step_metrics)
    .filter(([, m]) => "validation/reward_mean" in m)
    .map(([step, m]) => `${step}: ${fmt(m["validation/reward_mean"])}`);
  if (validations.length) bits.push(`validation reward at step ${validations.join(", ")}`);
  if (DATA.num_skipped_lines) bits.push(`${DATA.num_skipped_lines} unreadable lines skipped`);
  if (DATA.max_steps) bits.push(`the last ${DATA.max_steps} recorded steps at most (all: ${DATA.rollouts_path})`);
  $("summary").textContent = bits.join(" · ");
  fillControls(); readHash();
  if (!ALL.length) {
    $("columns").appendChild(el("div", "empty", `no rollouts recorded yet in ${DATA.rollouts_path}`));
    $("count").textContent = "0 rollouts";
    return;
  }
  $("set").addEventListener("change", () => { useSet($("set").value); render(); });
  for (const id of ["step", "compare", "status", "colour", "prompts"]) $(id).addEventListener("change", render);
  for (const id of ["reward-min", "reward-max", "text"]) $(id).addEventListener("input", render);
  render();
}
main();
</script>
</body>
</html>
"""


if __name__ == "__main__":
    sys.exit(main())
