"""The rollout viewer's page: what the recorder keeps for it (each token and its generator
logprob), what the page embeds (every recorded rollout of both sets, the step metrics), that no
text a model wrote can break out of the page's script, that unreadable lines are counted, the
command that rewrites it, the bound on the steps it holds; in headless Chromium on a made-up run, the page-at-a-time drawing and
model text shown as text. The page on a real job's run: tests/metrics/rollout_viewer_browser.py,
called by test_controller_multi_turn_job.py."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re

from tests.rollout.rollout_testlib import tiny_tokenizer
from torchtitan_rl.metrics import rollout_viewer
from torchtitan_rl.metrics.rollout_viewer import main, write_viewer
from torchtitan_rl.rollout import RolloutRecorder, RolloutStatus
from torchtitan_rl.rollout.types import Rollout, RolloutGroup, RolloutTurn

HOSTILE_TEXT = "</script><script>document.title='pwned'</script><!--"
"""A completion that would end the page's data script if it were embedded unescaped."""


def _embedded(page: pathlib.Path) -> dict:
    match = re.search(r'<script id="data" type="application/json">(.*?)</script>',
                      page.read_text(), re.S)
    assert match is not None
    return json.loads(match.group(1))


def _group(tokenizer) -> RolloutGroup:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode(" sorted: Ann, Bob", add_special_tokens=False)
    turn = RolloutTurn(
        turn_index=0, request_id="group=3/rollout=0/turn=0", prompt_token_ids=[1, 2, 3],
        completion_token_ids=ids, completion_logprobs=[-0.123456] * (len(ids) - 1) + [math.nan],
        policy_versions=[0] * len(ids), finish_reason="stop",
        reward_parts={"turn_score": 0.5}, reward=0.5, advantage=0.25)
    rollouts = [Rollout(group_id=3, rollout_index=i, status=status, turns=[turn], reward=reward,
                        advantage=reward - 0.5)
                for i, (status, reward) in enumerate([(RolloutStatus.COMPLETED, 1.0),
                                                      (RolloutStatus.TRUNCATED_LENGTH, 0.0)])]
    return RolloutGroup(group_id=3, episode={"episode_id": "train/7"}, rollouts=rollouts)


def test_recorder_keeps_each_token_and_its_generator_logprob_and_writes_the_viewer(tmp_path):
    tokenizer = tiny_tokenizer()
    group = _group(tokenizer)
    recorder = RolloutRecorder.Config(every_k_steps=1).build(run_dir=tmp_path)
    assert recorder.write_viewer() == tmp_path / "rollout_viewer.html"  # before any: an empty page
    assert _embedded(tmp_path / "rollout_viewer.html")["sets"]["training"] == []
    assert recorder.maybe_record(0, [group], tokenizer)
    line = json.loads((tmp_path / "rollouts" / "rollouts.jsonl").read_text().splitlines()[0])
    turn = line["turns"][0]
    ids = group.rollouts[0].turns[0].completion_token_ids
    assert len(turn["completion_tokens"]) == len(ids) == len(turn["completion_logprobs"])
    assert "".join(turn["completion_tokens"]) == turn["completion_text"] == " sorted: Ann, Bob"
    assert turn["completion_logprobs"] == [-0.1235] * (len(ids) - 1) + [None]  # NaN: None

    page = recorder.write_viewer()
    assert page == tmp_path / "rollout_viewer.html"
    data = _embedded(page)
    assert [r["sample_id"] for r in data["sets"]["training"]] == ["group=3/rollout=0",
                                                                  "group=3/rollout=1"]
    assert data["sets"]["training"][0]["turns"][0] == turn
    assert data["sets"]["validation"] == []
    assert recorder.record_validation(4, [group], tokenizer)  # a validation: the other set
    validation = _embedded(recorder.write_viewer())["sets"]["validation"]
    assert [(r["step"], r["sample_id"]) for r in validation] == [(4, "group=3/rollout=0"),
                                                                 (4, "group=3/rollout=1")]
    # max_validation_groups: a validation's first episodes only, every sample of each
    capped = RolloutRecorder.Config(max_validation_groups=1).build(run_dir=tmp_path / "capped")
    other = dataclasses.replace(group, group_id=4)
    assert capped.record_validation(6, [group, other], tokenizer)
    assert [json.loads(line)["sample_id"] for line in capped.validation_path.read_text(
        ).splitlines()] == ["group=3/rollout=0", "group=3/rollout=1"]
    assert RolloutRecorder.Config(viewer=False).build(run_dir=tmp_path).write_viewer() is None
    assert RolloutRecorder.Config(every_k_steps=0).build(run_dir=tmp_path).write_viewer() is None


def test_viewer_embeds_rollouts_and_step_metrics_and_escapes_model_text(tmp_path):
    record = {"step": 0, "sample_id": "group=0/rollout=0", "group_id": 0, "status": "completed",
              "reward": 1.0, "advantage": 0.5, "num_turns": 1,
              "turns": [{"completion_text": HOSTILE_TEXT, "reward_parts": {}}]}
    (tmp_path / "rollouts").mkdir()
    (tmp_path / "rollouts" / "rollouts.jsonl").write_text(
        json.dumps(record) + "\n" + '{"step": 10, "sample_id": "cut sho')  # a killed run's line
    (tmp_path / "rollouts" / "validation.jsonl").write_text("[1, 2]\n")  # not a rollout
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in [
        {"step": 2, "validation/reward_mean": 0.5},
        {"step": 0, "rollout_reward/mean": 0.25, "loss/entropy_mean": math.nan, "not/shown": 1.0},
        {"step": 0, "time/step_s": 2.0}]) + "\n")
    page = write_viewer(tmp_path)
    text = page.read_text()
    assert text.count("</script>") == 2  # the page's data and code, no other
    assert HOSTILE_TEXT not in text
    data = _embedded(page)
    assert data["sets"]["training"] == [record]  # the text itself is intact
    assert data["num_skipped_lines"] == 2
    assert data["sets"]["validation"] == []
    assert data["step_metrics"] == {"0": {"rollout_reward/mean": 0.25, "loss/entropy_mean": None,
                                          "time/step_s": 2.0},
                                    "2": {"validation/reward_mean": 0.5}}
    assert not list(tmp_path.glob("*.partial"))


def test_viewer_holds_the_last_max_steps_recorded_steps_read_from_the_files_end(tmp_path,
                                                                                 monkeypatch):
    """recorder.viewer_max_steps: the page holds the last N recorded steps of each set and the
    step metrics from its first training step on, read backwards in blocks (a line across a
    block's edge, a cut-short last line, non-ASCII text); None holds every step."""
    (tmp_path / "rollouts").mkdir()
    text = "Zoë " * 300  # multi-byte characters across the 1 KiB blocks below
    training = [{"step": step, "group_id": g, "turns": [{"completion_text": text}]}
                for step in range(0, 100, 10) for g in range(3)]
    (tmp_path / "rollouts" / "rollouts.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in training) + '{"step": 100, "gro', encoding="utf-8")
    validation = [{"step": step, "group_id": 0, "turns": []} for step in (0, 50, 90)]
    (tmp_path / "rollouts" / "validation.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in validation))
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": step, "rollout_reward/mean": step / 100}) + "\n"
        for step in range(100)))
    monkeypatch.setattr(rollout_viewer, "READ_BLOCK_BYTES", 1024)
    data = _embedded(write_viewer(tmp_path, max_steps=2))
    assert data["sets"]["training"] == training[-6:]  # steps 80 and 90, in file order
    assert data["sets"]["validation"] == validation[-2:]
    assert data["num_skipped_lines"] == 1  # the cut-short line
    assert sorted(map(int, data["step_metrics"])) == list(range(80, 100))
    assert data["max_steps"] == 2
    everything = _embedded(write_viewer(tmp_path))
    assert everything["sets"]["training"] == training
    assert everything["sets"]["validation"] == validation
    assert len(everything["step_metrics"]) == 100
    recorder = RolloutRecorder.Config(viewer_max_steps=3).build(run_dir=tmp_path)
    assert len(_embedded(recorder.write_viewer())["sets"]["training"]) == 9


def test_viewer_command_rewrites_the_page_and_names_what_is_missing(tmp_path, capsys):
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert main([str(tmp_path)]) == 2
    assert "no recorded rollouts at" in capsys.readouterr().err
    (tmp_path / "rec").mkdir()
    (tmp_path / "rec" / "r.jsonl").write_text(json.dumps({"step": 0, "turns": []}) + "\n")
    assert main([str(tmp_path), "--rollouts", "rec/r.jsonl", "--out", "view.html"]) == 0
    assert _embedded(tmp_path / "view.html")["sets"]["training"] == [{"step": 0, "turns": []}]


def test_viewer_in_a_browser_draws_a_page_at_a_time_and_shows_model_text_as_text(tmp_path):
    """Headless Chromium on a made-up run folder: 450 rollouts draw 200 at a time behind a
    "show more" button, and a completion holding markup is shown as text, never run."""
    from tests.metrics.headless_chromium import HeadlessChromium, require_chromium

    require_chromium()
    turn = {"completion_text": HOSTILE_TEXT, "completion_tokens": [HOSTILE_TEXT[:9],
                                                                   HOSTILE_TEXT[9:]],
            "completion_logprobs": [-0.5, None], "reward_parts": {}, "num_completion_tokens": 2,
            "num_prompt_tokens": 3, "prompt_added_text": "<b>prompt</b>", "finish_reason": "stop",
            "reward": None, "advantage": None, "drift": False}
    (tmp_path / "rollouts").mkdir()
    (tmp_path / "rollouts" / "rollouts.jsonl").write_text("".join(
        json.dumps({"step": i // 300, "sample_id": f"group={i // 4}/rollout={i % 4}",
                    "group_id": i // 4, "status": "completed", "reward": i / 450,
                    "advantage": None if i % 7 == 0 else 0.5 - i / 450, "num_turns": 1,
                    "turns": [turn]}) + "\n" for i in range(450)))
    page = write_viewer(tmp_path)
    with HeadlessChromium() as browser:
        browser.open(page)
        count = "document.querySelectorAll('.rollout').length"
        more = "document.querySelector('.more')"
        assert browser.evaluate(count) == 200
        assert browser.evaluate(f"{more}.textContent") == "show 200 more of 250"
        browser.evaluate(f"{more}.click()")
        assert browser.evaluate(count) == 400
        browser.evaluate(f"{more}.click()")
        assert browser.evaluate(count) == 450
        assert browser.evaluate(f"{more}.hidden") is True
        assert browser.evaluate("document.querySelector('.completion').textContent") == \
            HOSTILE_TEXT
        assert browser.evaluate("document.querySelector('.prompt').textContent") == \
            "<b>prompt</b>"
        assert browser.evaluate("document.querySelectorAll('main script, .prompt b').length") == 0
        assert browser.evaluate("document.title") == f"rollouts: {tmp_path.name}"
        assert "none (not trained)" in browser.evaluate(
            "document.querySelector('.rollout-head').textContent")  # rollout 0: left out
        assert browser.console_errors == []
