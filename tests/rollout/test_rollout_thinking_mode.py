"""`rollouter.enable_thinking` reaches every chat-template render: rollouts (hence validation, eval
and HTTP rollouts, which all go through the Rollouter) and the warm start's conversations.

The project's own ChatML template does not read `enable_thinking`, so the test gives the tiny model's
tokenizer a small template of its own with the two Qwen3 rules that matter here: `enable_thinking=false`
ends the generation prompt with an empty think block, and an assistant reply that ends the
conversation is rendered inside one (an earlier reply is not). Scripted generate functions: no
engine, no process.
"""

from __future__ import annotations

import pathlib
import tomllib

import pytest

from tests.rollout.rollout_testlib import CountingEnv, ScriptedGenerate, run
from torchtitan_rl.assets.tokenizer import CHAT_TEMPLATE
from torchtitan_rl.assets.warm_start import _tokenize_with_assistant_mask
from torchtitan_rl.config.manager import parse_args
from torchtitan_rl.controller.job import RLJob, _warm_start_fingerprint
from torchtitan_rl.rollout import Rollouter
from torchtitan_rl.rollout.token_env import chat_template_kwargs
from torchtitan_rl.types import Sampling

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
EMPTY_THINK = "<think>\n\n</think>\n\n"
# ChatML + those two rules (default: thinking on, as Qwen3's).
THINKING_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and loop.last %}"
    "{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}"
)


@pytest.fixture
def thinking_tokenizer(tiny_model_dir):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))  # own copy: not the cached one
    tokenizer.chat_template = THINKING_TEMPLATE
    return tokenizer


def _rollouts(tokenizer, enable_thinking: bool | None, num_turns: int = 1):  # type: ignore[no-untyped-def]
    gen = ScriptedGenerate(lambda rid, _: "yes")
    rollouter = Rollouter.Config(group_size=2, step_timeout_s=5.0,
                                 enable_thinking=enable_thinking).build(
        tokenizer=tokenizer, make_env=lambda episode: CountingEnv(num_turns))
    group = run(rollouter.run_group_rollouts(gen, {}, 0, sampling=Sampling(max_tokens=8)))
    return gen, group


def _first_prompt_text(tokenizer, enable_thinking: bool | None) -> str:  # type: ignore[no-untyped-def]
    gen, group = _rollouts(tokenizer, enable_thinking)
    first_prompts = [c.prompt_token_ids for c in gen.calls if c.request_id.endswith("turn=0")]
    assert len(first_prompts) == 2 and all(r.num_drift_events == 0 for r in group.rollouts)
    return tokenizer.decode(first_prompts[0], skip_special_tokens=False)


def test_chat_template_kwargs_none_passes_nothing() -> None:
    assert chat_template_kwargs(None) == {}
    assert chat_template_kwargs(False) == {"enable_thinking": False}
    assert chat_template_kwargs(True) == {"enable_thinking": True}


def test_rollout_prompts_follow_enable_thinking(thinking_tokenizer) -> None:  # type: ignore[no-untyped-def]
    off = _first_prompt_text(thinking_tokenizer, False)
    on = _first_prompt_text(thinking_tokenizer, True)
    default = _first_prompt_text(thinking_tokenizer, None)
    assert off.endswith("<|im_start|>assistant\n" + EMPTY_THINK)
    assert on.endswith("<|im_start|>assistant\n") and "<think>" not in on
    assert default == on  # None: the template's own default (thinking on here, as in Qwen3)


def test_dropped_think_block_of_an_earlier_turn_is_counted_drift(thinking_tokenizer) -> None:  # type: ignore[no-untyped-def]
    # Qwen3's template renders an earlier reply without its (empty) think block, so the re-rendered
    # history does not extend the tokens generated under `enable_thinking=false`: TokenEnv falls
    # back to a full re-render and counts it, never silently.
    _, group = _rollouts(thinking_tokenizer, False, num_turns=2)
    assert all(r.num_drift_events == 1 for r in group.rollouts)


def test_project_chatml_renders_alike_whatever_the_setting(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert tokenizer.chat_template == CHAT_TEMPLATE
    texts = {_first_prompt_text(tokenizer, setting) for setting in (None, True, False)}
    assert len(texts) == 1


def test_warm_start_renders_with_the_same_setting(thinking_tokenizer) -> None:  # type: ignore[no-untyped-def]
    conversation = [{"role": "user", "content": "say yes"}, {"role": "assistant", "content": "yes"}]
    tok = thinking_tokenizer

    def split(enable_thinking: bool | None) -> tuple[str, str]:
        ids, mask = _tokenize_with_assistant_mask(tok, conversation,
                                                  chat_template_kwargs(enable_thinking))
        prompt = tok.decode([t for t, m in zip(ids, mask) if not m], skip_special_tokens=False)
        learned = tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
        return prompt, learned

    # off: the empty think block is part of the prompt, as in the rollouts' prompts
    head = "<|im_start|>user\nsay yes<|im_end|>\n<|im_start|>assistant\n"
    prompt, learned = split(False)  # (the newline after <|im_end|> is not learned either)
    assert (prompt, learned) == (head + EMPTY_THINK + "\n", "yes<|im_end|>")
    # the template's default (thinking on): the model learns to write the empty block itself
    prompt, learned = split(None)
    assert (prompt, learned) == (head + "\n", EMPTY_THINK + "yes<|im_end|>")


def test_job_carries_the_setting_to_plan_and_warm_start_key(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    config = parse_args(RLJob.Config, ["--rollouter.enable_thinking", "false"]).config
    assert config.rollouter.enable_thinking is False
    assert parse_args(RLJob.Config, []).config.rollouter.enable_thinking is None
    task = RLJob.Config().task
    plain = _warm_start_fingerprint(task)
    # None keeps the key warm starts were cached under before the setting existed
    assert _warm_start_fingerprint(task, None) == plain
    assert len({plain, _warm_start_fingerprint(task, False), _warm_start_fingerprint(task, True)}) == 3


@pytest.mark.parametrize("name", ["qwen3_0.6b.toml", "qwen3_0.6b_slurm.toml",
                                  "qwen3_0.6b_kubernetes.toml"])
def test_qwen3_run_configs_set_thinking_mode_explicitly(name: str) -> None:
    with open(REPO_ROOT / "run_configs" / name, "rb") as f:
        data = tomllib.load(f)
    assert isinstance(data["rollouter"].get("enable_thinking"), bool), (
        f"{name}: set rollouter.enable_thinking (Qwen3's template reads it)")
