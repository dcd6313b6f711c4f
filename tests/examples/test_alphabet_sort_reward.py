"""AlphabetSort reward: the rules of the field notes, case by case."""

from __future__ import annotations

import difflib

import pytest

from examples.alphabet_sort.reward import alphabet_sort_reward, turn_score

GT1 = ["AnaBo", "MarcChardin", "ZoeAdams"]
GT2 = ["AnaBo", "BenDu // new name!", "MarcChardin", "ZoeAdams"]


def _block(lines: list[str], tag: str = "alphabetical_sorted") -> str:
    return f"<{tag}>\n" + "\n".join(lines) + f"\n</{tag}>"


def _ratio(pred: list[str], expected: list[str]) -> float:
    return difflib.SequenceMatcher(
        None, "\n".join(p.lower() for p in pred), "\n".join(e.lower() for e in expected)
    ).ratio()


def test_reward_perfect_answer_scores_one() -> None:
    assert alphabet_sort_reward([_block(GT1)], [GT1]) == 1.0
    # whitespace and case inside the block do not matter
    assert alphabet_sort_reward(["ok\n" + _block(["  anabo ", "", "MARCCHARDIN", "ZoeAdams"])],
                                [GT1]) == 1.0


def test_reward_missing_tag_scores_zero() -> None:
    assert alphabet_sort_reward(["\n".join(GT1)], [GT1]) == 0.0
    # the wrong tag for the turn is a missing tag
    assert alphabet_sort_reward([_block(GT1, "combined_alphabetical_sorted")], [GT1]) == 0.0
    assert alphabet_sort_reward([_block([])], [GT1]) == 0.0


def test_reward_partial_answer_is_similarity_to_the_power() -> None:
    pred = ["AnaBo", "MarcChardin"]
    expected = _ratio(pred, GT1) ** 4
    assert 0.0 < expected < 1.0
    assert alphabet_sort_reward([_block(pred)], [GT1]) == pytest.approx(expected)
    assert alphabet_sort_reward([_block(pred)], [GT1], similarity_power=1) == pytest.approx(
        _ratio(pred, GT1))


def test_reward_wrong_order_scores_below_one() -> None:
    pred = ["ZoeAdams", "MarcChardin", "AnaBo"]
    score = alphabet_sort_reward([_block(pred)], [GT1])
    assert score == pytest.approx(_ratio(pred, GT1) ** 4)
    assert score < 0.9


def test_reward_extra_lines_cost_similarity() -> None:
    pred = GT1 + ["ExtraName"]
    score = alphabet_sort_reward([_block(pred)], [GT1])
    assert score == pytest.approx(_ratio(pred, GT1) ** 4)
    assert 0.0 < score < 1.0


def test_reward_new_name_markers_are_part_of_the_answer() -> None:
    tag = "combined_alphabetical_sorted"
    replies = [_block(GT1), _block(GT2, tag)]
    assert alphabet_sort_reward(replies, [GT1, GT2]) == 1.0
    unmarked = [line.replace(" // new name!", "") for line in GT2]
    score = alphabet_sort_reward([_block(GT1), _block(unmarked, tag)], [GT1, GT2])
    assert score == pytest.approx((1.0 + _ratio(unmarked, GT2) ** 4) / 2)
    assert score < 1.0


def test_reward_several_attempts_count_only_when_each_improves() -> None:
    bad, better = ["ZoeAdams", "AnaBo"], GT1
    improving = _block(bad) + "\nwait\n" + _block(better)
    assert turn_score(improving, GT1, 0, power=4) == 1.0
    worsening = _block(better) + _block(bad)
    assert turn_score(worsening, GT1, 0, power=4) == 0.0
    repeated = _block(better) + _block(better)  # equal is not an improvement
    assert turn_score(repeated, GT1, 0, power=4) == 0.0


def test_reward_missing_turns_score_zero_and_extra_replies_are_ignored() -> None:
    assert alphabet_sort_reward([_block(GT1)], [GT1, GT2]) == pytest.approx(0.5)
    assert alphabet_sort_reward([_block(GT1), "x", "y"], [GT1]) == 1.0
    assert alphabet_sort_reward([], [GT1]) == 0.0


def test_reward_without_power_per_turn_powers_the_mean() -> None:
    pred = ["AnaBo", "MarcChardin"]
    s = _ratio(pred, GT1)
    got = alphabet_sort_reward([_block(pred), ""], [GT1, GT2], power_per_turn=False)
    assert got == pytest.approx(((s + 0.0) / 2) ** 4)
    got_per_turn = alphabet_sort_reward([_block(pred), ""], [GT1, GT2])
    assert got_per_turn == pytest.approx(s ** 4 / 2)


def test_reward_rejects_nonpositive_power() -> None:
    with pytest.raises(ValueError, match="similarity_power must be >= 1, got 0"):
        alphabet_sort_reward([""], [GT1], similarity_power=0)
