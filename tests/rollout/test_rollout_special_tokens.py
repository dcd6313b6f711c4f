"""Special tokens sampled inside a reply are counted per turn and in the step's rollout metrics
(the end-of-turn token that ends a stopped reply is not one of them)."""

from __future__ import annotations

from tests.rollout.rollout_testlib import CountingEnv, ScriptedGenerate, run, tiny_tokenizer
from torchtitan_rl.rollout import Rollouter, rollout_metrics


class SpecialGenerate(ScriptedGenerate):
    """Rollout 0 puts the pad token and <|im_start|> inside its first reply; others are clean."""

    async def __call__(self, request):  # type: ignore[no-untyped-def, override]
        completion = await super().__call__(request)
        if request.request_id.startswith("group=0/rollout=0/turn=0"):
            tok = self.tokenizer
            pad, im_start = tok.pad_token_id, tok.convert_tokens_to_ids("<|im_start|>")
            ids = completion.token_ids
            completion.token_ids = ids[:1] + [pad, im_start] + ids[1:]
            completion.token_logprobs = [-0.25] * len(completion.token_ids)
            completion.token_policy_versions = [7] * len(completion.token_ids)
        return completion


def test_special_tokens_inside_replies_are_counted() -> None:
    tok = tiny_tokenizer()
    assert tok.pad_token_id == 0 and tok.eos_token_id in tok.all_special_ids
    rollouter = Rollouter.Config(group_size=2, step_timeout_s=5.0).build(
        tokenizer=tok, make_env=lambda episode: CountingEnv(2))
    group = run(rollouter.run_group_rollouts(SpecialGenerate(lambda rid, _: "yes"), {}, 0))
    first, second = group.rollouts
    assert [t.completion_token_ids[-1] for t in first.turns] == [tok.eos_token_id] * 2
    assert [t.num_special_tokens for t in first.turns] == [2, 0]  # eos at the end not counted
    assert first.num_special_tokens == 2 and second.num_special_tokens == 0
    assert rollout_metrics([group])["rollout/num_special_tokens_in_replies"] == 2.0


def test_a_special_token_ending_a_truncated_reply_counts() -> None:
    """A reply cut by max_tokens did not stop on its end-of-turn token: a special last token is
    one the policy sampled mid-reply."""
    tok = tiny_tokenizer()
    rollouter = Rollouter.Config(group_size=2).build(tokenizer=tok,
                                                      make_env=lambda episode: CountingEnv(1))
    assert rollouter._count_special([5, tok.pad_token_id], "length") == 1
    assert rollouter._count_special([5, tok.eos_token_id], "stop") == 0
    assert rollouter._count_special([tok.eos_token_id, tok.eos_token_id], "stop") == 1
