"""Agent tasks: agent programs (the real `openai` client over real HTTP on 127.0.0.1) against the
run's episode endpoint, with scripted generate functions and the tiny model's real tokenizer.
What is checked: every call is captured with the generator's exact tokens, stitched into samples
as multi-turn rollouts are, with the Rollouter's request ids, seeds and budgets; every failure
has its status or HTTP error."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from examples.alphabet_sort import AlphabetSortTask
from tests.controller.letter_task import LetterTask
from tests.rollout.rollout_testlib import ScriptedGenerate, run, tiny_tokenizer
from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.rollout import (
    Rollouter,
    RolloutStatus,
    request_seed,
    rollout_group_to_training_samples,
)
from torchtitan_rl.rollout.agent_task import AgentTask
from torchtitan_rl.rollout.metrics import per_turn_reward_parts
from torchtitan_rl.types import Sampling

AGENTS = "tests.rollout.agent_testlib"


def _rollout_index(request_id: str) -> int:
    return int(request_id.split("/")[1].split("=")[1])


def _yes_for_first_two(rid: str, _: list[int]) -> str:
    return "yes" if _rollout_index(rid) < 2 else "no"


def _play(agent: str, reply: Any, *, sampling: Sampling | None = None, task_overrides=None,
          **rollouter_overrides) -> tuple[Any, ScriptedGenerate]:
    """One group of 4 rollouts of LetterTask's first episode, played by ``agent``."""
    task = AgentTask.Config(agent=f"{AGENTS}:{agent}", episodes=LetterTask.Config(num_prompts=2),
                            **(task_overrides or {})).build()
    cfg = Rollouter.Config(**{"group_size": 4, "max_turns": 3, "max_rollout_tokens": 256,
                              **rollouter_overrides})
    rollouter = cfg.build(tokenizer=tiny_tokenizer(), make_env=task.make_env)
    gen = ScriptedGenerate(reply)

    async def main() -> Any:
        try:
            return await rollouter.run_group_rollouts(
                gen, task.dataset("train")[0], 5, sampling=sampling or Sampling(max_tokens=8,
                                                                                  seed=100))
        finally:
            await task.aclose()

    return run(main()), gen


def test_agent_calls_are_captured_token_exactly_and_stitched_into_one_sample() -> None:
    group, gen = _play("three_turns", _yes_for_first_two, credit="turn")
    assert [r.status for r in group.rollouts] == [RolloutStatus.COMPLETED] * 4
    assert group.rewards == [3.0, 3.0, 0.0, 0.0]
    assert [t.reward for t in group.rollouts[0].turns] == [1.0, 1.0, 1.0]
    # the Rollouter's request ids, sessions and seeds; max_tokens: the agent's 6 under the run's 8
    assert sorted(c.request_id for c in gen.calls) == sorted(
        f"group=5/rollout={r}/turn={t}" for r in range(4) for t in range(3))
    for c in gen.calls:
        r, t = _rollout_index(c.request_id), int(c.request_id.rsplit("=", 1)[1])
        assert c.session_id == f"group=5/rollout={r}"
        assert c.sampling.seed == request_seed(100, 5, r, t)
        assert c.sampling.max_tokens == 6
    tokenizer = tiny_tokenizer()
    samples = rollout_group_to_training_samples(group)
    assert [s.sample_id for s in samples] == [f"group=5/rollout={r}/branch=0" for r in range(4)]
    for sample, rollout in zip(samples, group.rollouts):
        turns = rollout.turns
        calls = sorted((c for c in gen.calls if _rollout_index(c.request_id) ==
                        rollout.rollout_index), key=lambda c: c.request_id)
        assert [t.prompt_token_ids for t in turns] == [c.prompt_token_ids for c in calls]
        for prev, turn in zip(turns, turns[1:]):
            head = prev.prompt_token_ids + prev.completion_token_ids
            assert turn.prompt_token_ids[: len(head)] == head  # the generated ids, not re-encoded
        assert rollout.num_drift_events == 0
        assert [t.env_messages for t in turns] == [[{"role": "user", "content": "again 0"}],
                                                   [{"role": "user", "content": "again 1"}], []]
        trained = [tok for tok, m in zip(sample.token_ids, sample.loss_mask) if m]
        assert trained == [tok for t in turns for tok in t.completion_token_ids]
        assert sample.token_ids == turns[-1].prompt_token_ids + turns[-1].completion_token_ids
        assert set(sample.policy_versions) == {-1, 7}
        # the user messages between calls are environment tokens (mask 0), rendered by the template
        env_text = tokenizer.decode([tok for tok, m in zip(sample.token_ids, sample.loss_mask)
                                     if not m])
        assert "again 0" in env_text and "again 1" in env_text


def test_agent_that_rewrites_its_history_starts_a_new_branch() -> None:
    group, gen = _play("rewrites", _yes_for_first_two)
    samples = rollout_group_to_training_samples(group)
    assert [s.sample_id for s in samples] == [f"group=5/rollout={r}/branch={b}"
                                              for r in range(4) for b in range(2)]
    tokenizer = tiny_tokenizer()
    for rollout in group.rollouts:
        second = rollout.turns[1]
        fresh = tokenizer.apply_chat_template([{"role": "user", "content": "start over"}],
                                              tokenize=False, add_generation_prompt=True)
        assert second.prompt_token_ids == tokenizer.encode(fresh, add_special_tokens=False)


def test_completions_endpoint_takes_token_ids_and_text() -> None:
    group, gen = _play("completes", _yes_for_first_two)
    assert group.rewards == [2.0, 2.0, 0.0, 0.0]
    calls = [c for c in gen.calls if _rollout_index(c.request_id) == 0]
    assert sorted(c.prompt_token_ids for c in calls) == sorted(
        [[5, 6, 7], tiny_tokenizer().encode(LetterTask.Config(num_prompts=2).build()
                                            .dataset("train")[0])])
    assert {c.sampling.max_tokens for c in calls} == {4, 8}


def test_agent_errors_end_their_rollout_and_dropped_requests_abort() -> None:
    group, _ = _play("raises_on_no", _yes_for_first_two)
    assert [r.status for r in group.rollouts] == [RolloutStatus.COMPLETED] * 2 + [
        RolloutStatus.ERROR_ENV] * 2
    assert "agent broke" in group.rollouts[2].error
    assert group.rollouts[2].advantage is None  # excluded from training (error_reward None)
    assert len(group.rollouts[2].turns) == 1  # what it generated is still recorded

    group, _ = _play("three_turns",
                     lambda rid, _: None if rid == "group=5/rollout=1/turn=1" else "yes")
    assert group.rollouts[1].status is RolloutStatus.ERROR_ABORT
    assert "no completion" in group.rollouts[1].error
    assert group.rollouts[0].status is RolloutStatus.COMPLETED


def test_generator_failure_under_a_call_fails_the_group() -> None:
    def reply(rid: str, _: list[int]) -> str:
        if rid == "group=5/rollout=2/turn=1":
            raise ConnectionError("generator actor died")
        return "yes"

    with pytest.raises(ConnectionError, match="generator actor died"):
        _play("three_turns", reply)


def test_turn_cap_timeout_and_bad_returns() -> None:
    group, _ = _play("until_refused", _yes_for_first_two, max_turns=2)
    assert [r.status for r in group.rollouts] == [RolloutStatus.TRUNCATED_MAX_TURNS] * 4
    assert group.rewards == [2.0] * 4  # the agent caught the 409 and returned

    group, _ = _play("hangs", _yes_for_first_two, task_overrides={"timeout_s": 0.5})
    assert [r.status for r in group.rollouts] == [RolloutStatus.ERROR_TIMEOUT] * 4
    assert group.dropped and group.drop_reason == "all_errored"

    group, _ = _play("returns_text", _yes_for_first_two)
    assert group.rollouts[0].status is RolloutStatus.ERROR_ENV
    assert "agent returned 'done'" in group.rollouts[0].error
    assert re.search(r"is required at tests/rollout/agent_testlib.py:\d+ \(returns_text\)$",
                     group.rollouts[0].error)  # where the agent is

    group, _ = _play("rewrites", _yes_for_first_two, credit="turn")
    assert group.rollouts[0].status is RolloutStatus.ERROR_ENV
    assert "credit = 'turn' needs the agent to return (reward" in group.rollouts[0].error


def test_token_budget_is_a_400_and_truncates() -> None:
    group, gen = _play("until_refused", _yes_for_first_two, max_rollout_tokens=2)
    assert not gen.calls  # every prompt is longer than the budget: no generate call
    assert all(r.status is RolloutStatus.ERROR_ENV for r in group.rollouts)
    assert "BadRequestError" in group.rollouts[0].error
    assert "rollouter.max_rollout_tokens" in group.rollouts[0].error


def test_alphabet_sort_agent_plays_the_message_env_episode_token_for_token() -> None:
    """The demo agent sends the same prompts and scores the same as AlphabetSortEnv."""
    episodes = AlphabetSortTask.Config(seed=3, min_turns=3, max_turns=3)
    episode = episodes.build().dataset("train")[0]

    def oracle(rid: str, _: list[int]) -> str:
        r, t = _rollout_index(rid), int(rid.rsplit("=", 1)[1])
        tag = "alphabetical_sorted" if t == 0 else "combined_alphabetical_sorted"
        lines = list(episode.ground_truths[t]) if r % 2 == 0 else ["Nobody"]
        return f"<{tag}>\n" + "\n".join(lines) + f"\n</{tag}>"

    agent_task = AgentTask.Config(agent="examples.alphabet_sort.agent:run",
                                  episodes=episodes).build()
    groups = []
    for make_env in (episodes.build().make_env, agent_task.make_env):
        rollouter = Rollouter.Config(group_size=4, max_turns=3, max_rollout_tokens=512,
                                     credit="turn").build(tokenizer=tiny_tokenizer(),
                                                          make_env=make_env)

        async def main(rollouter: Rollouter = rollouter) -> Any:
            try:
                return await rollouter.run_group_rollouts(ScriptedGenerate(oracle), episode, 2,
                                                          sampling=Sampling(max_tokens=200))
            finally:
                await agent_task.aclose()

        groups.append(run(main()))
    env_group, agent_group = groups
    assert agent_group.rewards == env_group.rewards and agent_group.rewards[0] == 1.0
    assert [[t.reward for t in r.turns] for r in agent_group.rollouts] == [
        [t.reward for t in r.turns] for r in env_group.rollouts]
    # per-call rewards are the agent's per-turn figures (validation/turn_<t>/reward, eval)
    assert per_turn_reward_parts([agent_group]) == {
        (t, "reward"): values for (t, _), values in per_turn_reward_parts([env_group]).items()}
    assert [[t.prompt_token_ids for t in r.turns] for r in agent_group.rollouts] == [
        [t.prompt_token_ids for t in r.turns] for r in env_group.rollouts]
    assert rollout_group_to_training_samples(agent_group) == rollout_group_to_training_samples(
        env_group)


def test_agent_task_config_errors_name_the_key() -> None:
    letters = LetterTask.Config(num_prompts=2)
    with pytest.raises(ConfigError, match="task.agent: 'package.module:function' expected"):
        AgentTask.Config(agent="", episodes=letters).build()
    with pytest.raises(ConfigError, match="task.agent = 'tests.rollout.agent_testlib:nope'"):
        AgentTask.Config(agent=f"{AGENTS}:nope", episodes=letters).build()
    with pytest.raises(ConfigError, match="an `async def` function expected"):
        AgentTask.Config(agent=f"{AGENTS}:not_async", episodes=letters).build()
    with pytest.raises(ConfigError, match=r"it must take \(episode, client\)"):
        AgentTask.Config(agent=f"{AGENTS}:old_signature", episodes=letters).build()
    with pytest.raises(ConfigError, match="task.episodes.type: name the task"):
        AgentTask.Config(agent=f"{AGENTS}:hangs").build()
    with pytest.raises(ValueError, match="timeout_s must be > 0 or None, got 0"):
        AgentTask.Config(timeout_s=0)


def test_agent_run_config_parses_and_shares_the_main_jobs_warm_start() -> None:
    from torchtitan_rl.config.manager import parse_args
    from torchtitan_rl.controller.job import RLJob, _warm_start_fingerprint

    agent = parse_args(RLJob.Config, ["--config", "run_configs/alphabet_sort_agent.toml"]).config
    main = parse_args(RLJob.Config, ["--config", "run_configs/alphabet_sort_cpu.toml"]).config
    assert isinstance(agent.task, AgentTask.Config)
    assert agent.task.episodes == main.task
    assert _warm_start_fingerprint(agent.task) == _warm_start_fingerprint(main.task)
    for name in ("rollouter", "sampling", "loop", "validation", "warm_start", "seed"):
        assert getattr(agent, name) == getattr(main, name), name
    task = agent.task.build()
    assert task.dataset("train")[4] == main.task.build().dataset("train")[4]


def test_endpoint_answers_bad_keys_unknown_ended_and_malformed_requests() -> None:
    import httpx
    import openai

    from torchtitan_rl.rollout.agent_capture import EpisodeCapture, EpisodeLimits
    from torchtitan_rl.rollout.agent_server import EpisodeServer

    async def main() -> None:
        server = EpisodeServer()
        server.start()
        capture = EpisodeCapture(
            generate_fn=ScriptedGenerate(lambda rid, _: "yes"), tokenizer=tiny_tokenizer(),
            sampling=Sampling(max_tokens=8), base_seed=0, group_id=1, rollout_index=0, attempt=0,
            limits=EpisodeLimits(max_turns=4, max_rollout_tokens=256),
            count_special=lambda ids, finish: 0)
        episode = server.open(capture)
        url = server.base_url(episode)
        assert url == f"http://127.0.0.1:{server.port}/episodes/{episode}/v1"
        # a TCP socket by its proto, so asyncio sets TCP_NODELAY on each connection (else every
        # response's body waits ~40 ms for the client's delayed ACK)
        import socket

        assert server._sock.proto == socket.IPPROTO_TCP
        auth = {"Authorization": f"Bearer {server.api_key}"}
        good = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
        try:
            async with httpx.AsyncClient() as http:
                async def post(body: Any, path: str = "/chat/completions", *,
                               base: str = url, headers: dict | None = None) -> httpx.Response:
                    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
                    return await http.post(base + path, headers=headers or auth, **kwargs)

                r = await post(good, headers={"Authorization": "Bearer wrong"})
                assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
                assert r.headers["x-should-retry"] == "false"
                r = await post(good, base=url.replace(episode, "g9-r9-nothere"))
                assert r.status_code == 404
                assert "no episode g9-r9-nothere" in r.json()["error"]["message"]
                for body, param in [
                    ("{not json", "body"), ([1, 2], "body"),
                    ({"messages": good["messages"]}, "model"),
                    ({"model": "policy"}, "messages"),
                    ({"model": "policy", "messages": [{"role": "robot", "content": "x"}]},
                     "messages[0].role"),
                    ({"model": "policy", "messages": [{"role": "user"}]}, "messages[0].content"),
                    ({**good, "max_tokens": 0}, "max_tokens"),
                    ({**good, "stream": True}, "stream"),
                    ({**good, "n": 2}, "n"),
                    ({**good, "stop": ["\n"]}, "stop"),
                ]:
                    r = await post(body)
                    assert r.status_code == 400, (body, r.text)
                    assert r.json()["error"]["param"] == param, r.text
                    assert r.json()["error"]["message"].startswith(f"{param}:"), r.text
                r = await post({"model": "policy", "prompt": [1, 10**9]}, "/completions")
                assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
                assert not capture.turns  # no malformed request reached the generator
                r = await http.get(url + "/models", headers=auth)
                assert r.status_code == 200 and r.json()["data"][0]["id"] == "policy"
                r = await http.get(url + "/chat/completions", headers=auth)
                assert r.status_code == 405 and "POST expected" in r.json()["error"]["message"]
                r = await http.get(url.replace("/v1", "/v2") + "/models", headers=auth)
                assert r.status_code == 404 and "no route" in r.json()["error"]["message"]

                client = openai.AsyncOpenAI(base_url=url, api_key=server.api_key)
                reply = await client.chat.completions.create(model="policy", **{
                    "messages": good["messages"], "logprobs": True})
                assert reply.choices[0].message.content == "yes"
                assert [t.logprob for t in reply.choices[0].logprobs.content] == [-0.25] * len(
                    capture.turns[0].completion_token_ids)
                assert reply.usage.completion_tokens == len(capture.turns[0].completion_token_ids)
                server.close(episode)
                with pytest.raises(openai.ConflictError, match="has ended"):
                    await client.chat.completions.create(model="policy",
                                                         messages=good["messages"])
                await client.close()
        finally:
            await server.aclose()

    run(main())


def test_parse_requests_normalise_messages() -> None:
    from torchtitan_rl.rollout.agent_requests import (
        RequestError,
        parse_chat_request,
        parse_completion_request,
    )

    request = parse_chat_request({"model": "m", "max_completion_tokens": 5, "temperature": 0.3,
                                  "messages": [{"role": "user", "content": [
                                      {"type": "text", "text": "a"}, {"type": "text", "text": "b"}
                                  ]}, {"role": "assistant", "content": "c", "refusal": None}]})
    assert request.messages == [{"role": "user", "content": "ab"},
                                {"role": "assistant", "content": "c"}]
    assert request.max_tokens == 5
    assert parse_completion_request({"model": "m", "prompt": [[3, 4]]}).prompt == [3, 4]
    with pytest.raises(RequestError, match=r"messages\[0\].content\[0\]: only text parts"):
        parse_chat_request({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]})
    with pytest.raises(RequestError, match="prompt: one prompt expected"):
        parse_completion_request({"model": "m", "prompt": ["a", "b"]})


def test_the_agents_guide_shows_the_agent_as_it_is() -> None:
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2]
    doc = (root / "docs" / "agents.md").read_text()
    path = "examples/alphabet_sort/agent.py"
    [block] = re.findall(rf"`{re.escape(path)}`\n```python\n(.*?)```", doc, re.S)
    assert block == (root / path).read_text()
    assert "docs/agents.md" in (root / "README.md").read_text()


def test_tool_calls_come_back_parsed_and_tool_results_are_environment_tokens() -> None:
    """With task.tool_parser = "hermes", a reply holding a <tool_call> block reaches the agent as
    OpenAI tool_calls; the agent's `tool` message continues the same sample, unmasked."""
    from tests.rollout import agent_testlib

    agent_testlib.TOOL_REPLIES.clear()
    call_text = ('Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 40}}\n'
                 '</tool_call>')

    def reply(rid: str, _: list[int]) -> str:
        return call_text if rid.endswith("turn=0") else "It is 42."

    group, gen = _play("uses_a_tool", reply, sampling=Sampling(max_tokens=64, seed=1),
                       task_overrides={"tool_parser": "hermes"},
                       max_rollout_tokens=1024)  # the tools' listing: ~400 tiny-tokenizer tokens
    assert [r.status for r in group.rollouts] == [RolloutStatus.COMPLETED] * 4
    assert group.rewards == [1.0] * 4
    assert len(agent_testlib.TOOL_REPLIES) == 4
    ids = []
    for first in agent_testlib.TOOL_REPLIES:
        assert first["finish_reason"] == "tool_calls"
        assert first["message"]["content"] == "Let me add."
        [call] = first["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"]
        assert call["function"] == {"name": "add", "arguments": '{"a": 2, "b": 40}'}
        ids.append(call["id"])
    tokenizer = tiny_tokenizer()
    for sample, rollout in zip(rollout_group_to_training_samples(group), group.rollouts):
        first_turn, second_turn = rollout.turns
        assert rollout.num_drift_events == 0
        # one sample: the second prompt continues the first call's generated ids
        head = first_turn.prompt_token_ids + first_turn.completion_token_ids
        assert second_turn.prompt_token_ids[: len(head)] == head
        [tool_message] = first_turn.env_messages
        assert tool_message["role"] == "tool" and tool_message["content"] == "42"
        assert tool_message["tool_call_id"] in ids
        trained = [tok for tok, m in zip(sample.token_ids, sample.loss_mask) if m]
        assert trained == first_turn.completion_token_ids + second_turn.completion_token_ids
        assert "<tool_call>" in tokenizer.decode(first_turn.completion_token_ids)
        env_text = tokenizer.decode([tok for tok, m in zip(sample.token_ids, sample.loss_mask)
                                     if not m])
        assert "42" in env_text and "<tool_call>" not in env_text
    assert len(gen.calls) == 8


def test_an_agent_written_with_the_openai_agents_sdk_runs_unchanged() -> None:
    """An outside agent library (the OpenAI Agents SDK, its own Runner loop and function tool)
    against the endpoint: its requests are accepted as sent, the tool call reaches its tool, the
    tool's result goes back as environment tokens, and the episode is one token-exact sample."""
    from tests.rollout import agent_testlib

    agent_testlib.SDK_RESULTS.clear()
    call_text = ('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 40}}\n</tool_call>')

    def reply(rid: str, _: list[int]) -> str:
        return call_text if rid.endswith("turn=0") else "The sum is 42."

    group, gen = _play("openai_agents_sdk", reply, sampling=Sampling(max_tokens=64, seed=1),
                       task_overrides={"tool_parser": "hermes"},
                       max_rollout_tokens=1024)  # the tools' listing: ~400 tiny-tokenizer tokens
    assert [r.status for r in group.rollouts] == [RolloutStatus.COMPLETED] * 4, [
        r.error for r in group.rollouts]
    assert agent_testlib.SDK_RESULTS == [{"final_output": "The sum is 42.", "added": [42]}] * 4
    assert group.rewards == [1.0] * 4
    assert len(gen.calls) == 8
    for sample, rollout in zip(rollout_group_to_training_samples(group), group.rollouts):
        first_turn, second_turn = rollout.turns
        assert rollout.num_drift_events == 0  # the SDK's replayed history re-renders exactly
        head = first_turn.prompt_token_ids + first_turn.completion_token_ids
        assert second_turn.prompt_token_ids[: len(head)] == head
        [tool_message] = first_turn.env_messages
        assert tool_message["role"] == "tool" and tool_message["content"] == "42"
        trained = [tok for tok, m in zip(sample.token_ids, sample.loss_mask) if m]
        assert trained == first_turn.completion_token_ids + second_turn.completion_token_ids


def test_unknown_tool_parser_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="task.tool_parser = 'nope': not one of vLLM's tool "
                                          "parsers .*'hermes'"):
        AgentTask.Config(agent=f"{AGENTS}:three_turns", tool_parser="nope",
                         episodes=LetterTask.Config(num_prompts=2)).build()


def test_tools_reach_the_chat_template_and_bad_tools_are_a_400_before_generating() -> None:
    from tests.rollout.agent_testlib import ADD_TOOL
    from torchtitan_rl.rollout.agent_capture import EpisodeCapture, EpisodeLimits
    from torchtitan_rl.rollout.agent_requests import RequestError
    from torchtitan_rl.rollout.agent_tools import ToolCalls, load_tool_parser

    tokenizer = tiny_tokenizer()  # the project's template lists offered tools, as Qwen3's does
    gen = ScriptedGenerate(lambda rid, _: "no tools needed")
    capture = EpisodeCapture(
        generate_fn=gen, tokenizer=tokenizer, sampling=Sampling(max_tokens=32), base_seed=0,
        group_id=1, rollout_index=0, attempt=0,
        limits=EpisodeLimits(max_turns=4, max_rollout_tokens=1024),  # the tools' listing
        count_special=lambda ids, finish: 0,
        tool_calls=ToolCalls(load_tool_parser("hermes"), tokenizer))
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(RequestError, match=r"tools\[1\]: not an OpenAI function tool"):
        run(capture.chat(messages, [ADD_TOOL, {"type": "function"}]))
    assert not gen.calls  # refused before generating
    _, message = run(capture.chat(messages, [ADD_TOOL]))
    assert message == {"role": "assistant", "content": "no tools needed"}  # no call to parse
    prompt = tokenizer.decode(gen.calls[0].prompt_token_ids)
    assert prompt.startswith("<|im_start|>system\n# Tools\n")
    assert "<tools>\n" + json.dumps(ADD_TOOL) + "\n</tools>" in prompt


def test_hermes_reads_back_the_tool_calls_the_chat_template_renders() -> None:
    """What the project's template teaches a model to write (Qwen3's <tool_call> blocks) is what
    vLLM's hermes parser reads back, text before the calls included."""
    from tests.rollout.agent_testlib import ADD_TOOL
    from torchtitan_rl.rollout.agent_tools import ToolCalls, load_tool_parser

    tokenizer = tiny_tokenizer()
    calls = [{"id": "c1", "type": "function",
              "function": {"name": "add", "arguments": '{"a": 2, "b": 40}'}},
             {"id": "c2", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "add"},
         {"role": "assistant", "content": "Adding.", "tool_calls": calls}],
        tools=[ADD_TOOL], tokenize=False)
    reply = text.rsplit("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")
    message = ToolCalls(load_tool_parser("hermes"), tokenizer).parse(
        reply, ToolCalls.validate([ADD_TOOL]))
    # hermes keeps the text up to the first <tool_call>, the newline before it included (the
    # capture trains the generated text itself, never a re-render of the parsed message)
    assert message["content"] == "Adding.\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == [("add", {"a": 2, "b": 40}), ("add", {"a": 1})]
