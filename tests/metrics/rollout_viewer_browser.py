"""The rollout viewer in a real headless Chromium, checked against the run folder it was made from.

``assert_viewer_works(run_dir)`` is the check a job test calls on its finished run: the page the
run wrote (rollout_viewer.html) loads from file:// with no console error, shows one row per
recorded rollout (counts and texts from rollouts.jsonl itself), and its step, status, reward and
text filters, the side-by-side step, the URL fragment and the validations' rollouts
(validation.jsonl) give exactly the rows the files say.

A screenshot of a run's page (the one in docs/images/ came from here)::

    python -m tests.metrics.rollout_viewer_browser RUN_DIR OUT.png ['step=0&compare=5']
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys
from collections import Counter
from typing import Any

from tests.metrics.headless_chromium import HeadlessChromium
from torchtitan_rl.metrics.rollout_viewer import (
    DEFAULT_ROLLOUTS_PATH,
    DEFAULT_VIEWER_PATH,
    VALIDATION_FILE,
)

_SET = """((id, value) => {{
  const input = document.getElementById(id);
  if (input.type === "checkbox") input.checked = value; else input.value = value;
  input.dispatchEvent(new Event(input.tagName === "SELECT" || input.type === "checkbox"
                                ? "change" : "input"));
  return input.value;
}})({id!r}, {value})"""

_ROWS = "[...document.querySelectorAll('{scope} .rollout')].map(r => [Number(r.dataset.step), " \
        "r.dataset.sampleId, r.dataset.status, Number(r.dataset.reward)])"


def _set(browser: HeadlessChromium, element_id: str, value: Any) -> None:
    browser.evaluate(_SET.format(id=element_id, value=json.dumps(value)))


def _rows(browser: HeadlessChromium, scope: str = "") -> list[tuple[int, str, str, float]]:
    return [tuple(row) for row in browser.evaluate(_ROWS.format(scope=scope))]


def _expected(records: list[dict[str, Any]], keep: Any = lambda r: True
              ) -> list[tuple[int, str, str, float]]:
    return [(r["step"], r["sample_id"], r["status"], r["reward"]) for r in records if keep(r)]


def assert_viewer_works(run_dir: pathlib.Path, screenshot: pathlib.Path | None = None) -> None:
    page = run_dir / DEFAULT_VIEWER_PATH
    records = [json.loads(line) for line in
               (run_dir / DEFAULT_ROLLOUTS_PATH).read_text().splitlines()]
    assert 1 < len(records) <= 200, "one page of rows (the page draws 200 before 'show more')"
    steps = sorted({r["step"] for r in records})
    assert len(steps) >= 2, "two steps to put side by side"

    with HeadlessChromium() as browser:
        browser.open(page)
        # every recorded rollout, in the file's order, with the page's count
        assert _rows(browser) == _expected(records)
        assert browser.evaluate("document.getElementById('count').textContent") == \
            f"{len(records)} of {len(records)} rollouts"
        assert browser.evaluate("[...document.querySelectorAll('#step option')].map(o => o.value)"
                                ) == ["all", *map(str, steps)]
        # every turn of the first rollout, its completion token by token
        first = records[0]
        turns = browser.evaluate(
            "[...document.querySelector('.rollout').querySelectorAll('.turn')].map(t => "
            "[t.querySelector('.completion').textContent, t.querySelectorAll('.tok').length, "
            "t.querySelector('.turn-head').textContent])")
        assert len(turns) == first["num_turns"] == len(first["turns"])
        for (text, num_tokens, head), turn in zip(turns, first["turns"], strict=True):
            assert text == "".join(turn["completion_tokens"])
            assert num_tokens == turn["num_completion_tokens"] == len(turn["completion_logprobs"])
            for name in turn["reward_parts"]:
                assert name in head
            if turn["advantage"] is not None:
                assert f"turn advantage {turn['advantage']:.3f}" in head

        # one step
        _set(browser, "step", str(steps[-1]))
        assert _rows(browser) == _expected(records, lambda r: r["step"] == steps[-1])
        _set(browser, "step", "all")
        # one status (the rarest: a real cut)
        status = min(Counter(r["status"] for r in records).items(), key=lambda kv: kv[1])[0]
        _set(browser, "status", status)
        assert _rows(browser) == _expected(records, lambda r: r["status"] == status)
        _set(browser, "status", "all")
        # a reward range: from the median up
        median = statistics.median(r["reward"] for r in records)
        _set(browser, "reward-min", str(median))
        shown = _rows(browser)
        assert shown == _expected(records, lambda r: r["reward"] >= median)
        assert 0 < len(shown) < len(records) or len({r["reward"] for r in records}) == 1
        _set(browser, "reward-min", "")
        # text in a completion
        needle = next(t["completion_text"] for r in records for t in r["turns"]
                      if t["completion_text"].strip())[:3]
        _set(browser, "text", needle)
        assert _rows(browser) == _expected(records, lambda r: any(
            needle.lower() in t["completion_text"].lower() for t in r["turns"]))
        _set(browser, "text", "")
        # two steps side by side: one column each
        _set(browser, "step", str(steps[0]))
        _set(browser, "compare", str(steps[1]))
        assert browser.evaluate("document.querySelectorAll('.column').length") == 2
        assert _rows(browser, ".column:nth-child(1)") == _expected(
            records, lambda r: r["step"] == steps[0])
        assert _rows(browser, ".column:nth-child(2)") == _expected(
            records, lambda r: r["step"] == steps[1])
        # tokens coloured by the generator's logprob, each with its value in its title
        _set(browser, "colour", "logprob")
        titles = browser.evaluate("[...document.querySelectorAll('.tok')].slice(0, 3).map(t => "
                                  "[t.title, t.style.backgroundColor])")
        assert titles and all("generator logprob" in title and colour for title, colour in titles)
        # the filters are in the URL: the same view again from a link
        fragment = browser.evaluate("location.hash.slice(1)")
        assert f"step={steps[0]}" in fragment and f"compare={steps[1]}" in fragment
        browser.open(page, f"step={steps[-1]}&status={status}")
        assert _rows(browser) == _expected(
            records, lambda r: r["step"] == steps[-1] and r["status"] == status)
        # the validations' rollouts: the other set, with their own steps
        validation = [json.loads(line) for line in
                      (run_dir / DEFAULT_ROLLOUTS_PATH).with_name(VALIDATION_FILE).read_text(
                      ).splitlines()]
        assert validation, "the run validated: its rollouts are kept"
        browser.open(page)
        _set(browser, "set", "validation")
        assert _rows(browser) == _expected(validation)
        assert browser.evaluate("[...document.querySelectorAll('#step option')].map(o => o.value)"
                                ) == ["all", *map(str, sorted({r["step"] for r in validation}))]
        assert "set=validation" in browser.evaluate("location.hash")
        if screenshot is not None:
            browser.open(page)
            browser.screenshot(screenshot)
        assert browser.console_errors == []


def main(argv: list[str]) -> int:
    run_dir, out, *fragment = argv
    with HeadlessChromium(width=1280, height=860) as browser:
        browser.open(pathlib.Path(run_dir) / DEFAULT_VIEWER_PATH, fragment[0] if fragment else "")
        browser.screenshot(pathlib.Path(out))
        if browser.console_errors:
            print("console errors:", browser.console_errors, file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
