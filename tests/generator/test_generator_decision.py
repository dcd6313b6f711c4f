"""The engine loop's request ledger and decision rule, the pull-version rule and the generator
configs: pure logic, no vLLM."""

from __future__ import annotations

import asyncio

import pytest

from torchtitan_rl.generator import Generator, LoopAction, RequestLedger, WeightSyncPolicy
from torchtitan_rl.generator.loop_decision import EngineRequest
from torchtitan_rl.generator.pulls import PendingPulls
from torchtitan_rl.types import Sampling


def _request(rid: str) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=[5, 6], sampling=Sampling())


def _ledger(*, drain_before_pull: bool) -> RequestLedger:
    """A ledger whose futures belong to a fresh (never run) event loop."""
    return RequestLedger(drain_before_pull=drain_before_pull, loop=asyncio.new_event_loop())


def _left_engine(inbox: RequestLedger, rid: str) -> None:
    """The request finished (or failed): it leaves the engine and its caller is answered."""
    inbox.fail(rid, RuntimeError("finished"))


def _admit(inbox: RequestLedger, *rids: str) -> None:
    for rid in rids:
        inbox.submit(_request(rid))
    decision = inbox.decide()
    assert decision is not None and decision.action is LoopAction.STEP
    assert [r.request_id for r in decision.requests] == list(rids)


def test_idle_inbox_decides_nothing() -> None:
    assert _ledger(drain_before_pull=False).decide() is None


def test_step_admits_queued_requests_in_fcfs_order_then_keeps_stepping_them() -> None:
    inbox = _ledger(drain_before_pull=False)
    _admit(inbox, "b", "a", "c")
    again = inbox.decide()
    assert again is not None and again.action is LoopAction.STEP and again.requests == []
    for rid in ("b", "a", "c"):
        _left_engine(inbox, rid)
    assert inbox.decide() is None


def test_priority_is_close_then_pull_then_abort_then_step() -> None:
    inbox = _ledger(drain_before_pull=False)
    _admit(inbox, "running")
    inbox.submit(_request("queued"))
    inbox.request_abort(["running"])
    inbox.request_pull(1)
    inbox.request_close()
    close = inbox.decide()
    assert close is not None and close.action is LoopAction.CLOSE
    assert close.abort_request_ids == ["running"]
    inbox.close_requested = False
    pull = inbox.decide()
    assert pull is not None and (pull.action, pull.pull_version) == (LoopAction.PULL, 1)
    abort = inbox.decide()
    assert abort is not None and abort.action is LoopAction.ABORT
    assert abort.abort_request_ids == ["running"]
    step = inbox.decide()
    assert step is not None and step.action is LoopAction.STEP
    assert [r.request_id for r in step.requests] == ["queued"]


def test_drain_stops_admission_until_running_requests_finish_then_pulls() -> None:
    inbox = _ledger(drain_before_pull=True)
    _admit(inbox, "running")
    inbox.request_pull(3)
    inbox.submit(_request("waiting"))
    assert inbox.draining
    step = inbox.decide()
    assert step is not None and step.action is LoopAction.STEP and step.requests == []
    _left_engine(inbox, "running")
    pull = inbox.decide()
    assert pull is not None and (pull.action, pull.pull_version) == (LoopAction.PULL, 3)
    assert not inbox.draining
    step = inbox.decide()
    assert step is not None and [r.request_id for r in step.requests] == ["waiting"]


def test_news_that_ends_a_burst_is_what_decide_would_act_on() -> None:
    inbox = _ledger(drain_before_pull=False)
    _admit(inbox, "running")
    assert not inbox.has_news, "running requests alone: keep stepping"
    inbox.submit(_request("new"))
    assert inbox.has_news
    _ = inbox.decide()
    assert not inbox.has_news
    inbox.request_abort(["running"])
    assert inbox.has_news
    _ = inbox.decide()
    inbox.request_pull(1)
    assert inbox.has_news

    draining = _ledger(drain_before_pull=True)
    _admit(draining, "running")
    draining.request_pull(1)
    draining.submit(_request("held"))
    assert not draining.has_news, "a drain holds both the pull and the new request back"
    _left_engine(draining, "running")
    assert draining.has_news
    draining.request_close()
    assert draining.has_news


def test_hot_swap_pulls_while_requests_run() -> None:
    inbox = _ledger(drain_before_pull=False)
    _admit(inbox, "running")
    inbox.request_pull(1)
    pull = inbox.decide()
    assert pull is not None and pull.action is LoopAction.PULL
    assert list(inbox.in_engine) == ["running"]


def test_abort_removes_queued_requests_and_marks_running_ones() -> None:
    inbox = _ledger(drain_before_pull=False)
    _admit(inbox, "running", "done")
    inbox.submit(_request("queued"))
    removed, marked = inbox.request_abort(["queued", "running", "done", "unknown"])
    assert [r.request_id for r in removed] == ["queued"]
    assert marked == ["running", "done"]
    _left_engine(inbox, "done")  # finished before the abort decision: nothing to abort
    abort = inbox.decide()
    assert abort is not None and abort.abort_request_ids == ["running"]
    assert inbox.decide() is None


def test_abort_all_covers_queued_and_running() -> None:
    inbox = _ledger(drain_before_pull=False)
    _admit(inbox, "running")
    inbox.submit(_request("queued"))
    removed, marked = inbox.request_abort(None)
    assert [r.request_id for r in removed] == ["queued"] and marked == ["running"]


def test_duplicate_request_ids_and_stale_pull_versions_are_refused() -> None:
    inbox = _ledger(drain_before_pull=False)
    _admit(inbox, "a")
    with pytest.raises(ValueError, match="'a' is already in flight"):
        inbox.submit(_request("a"))

    async def pulls() -> None:  # the one pull-version rule (every rank, before rank 0's ledger)
        pending = PendingPulls()
        pending.check_new(5, current_version=4)
        pending.deliver(5, weights={})
        with pytest.raises(ValueError, match="a pull of version 5 is already pending"):
            pending.check_new(5, current_version=4)
        with pytest.raises(ValueError, match="must be > 5"):
            pending.check_new(4, current_version=3)
        with pytest.raises(ValueError, match="must be > 4"):
            PendingPulls().check_new(4, current_version=4)
        pending.entry(7)  # a PULL decision seen before this rank's pull call: not received
        pending.check_new(7, current_version=4)

    asyncio.run(pulls())


def test_the_ledger_answers_every_caller_once_and_checks_its_counts() -> None:
    """submit -> STEP -> ABORT -> output; a queued abort; fail_all: each future resolves once, the
    counts add up after every event, and a late output of a failed request is dropped."""
    inbox = _ledger(drain_before_pull=False)
    running = inbox.submit(_request("running"))
    queued = inbox.submit(_request("queued"))
    decision = inbox.decide()
    assert decision is not None and [r.request_id for r in decision.requests] == [
        "running", "queued"]
    inbox.admitted(decision.requests, {"queued": RuntimeError("vLLM refused it")}, now=0.0)
    assert isinstance(queued.exception(), RuntimeError)
    late = inbox.submit(_request("late"))
    removed, marked = inbox.request_abort(["late", "running"])
    assert [r.request_id for r in removed] == ["late"] and marked == ["running"]
    assert inbox.futures_of(marked) == [running]
    assert late.result().finish_reason == "abort" and late.result().token_ids == []
    abort = inbox.decide()
    assert abort is not None and abort.abort_request_ids == ["running"]
    assert inbox.num_in_engine == 1 and inbox.num_unresolved == 1
    inbox.fail_all(RuntimeError("closed"))
    assert isinstance(running.exception(), RuntimeError) and inbox.num_unresolved == 0
    assert (inbox.num_submitted, inbox.num_resolved) == (3, 3)
    inbox.fail("running", RuntimeError("late"))  # the engine lets go: dropped, not raised
    assert inbox.num_in_engine == 0 and inbox.num_gone == 3
    inbox.num_gone -= 1  # drift: the next event's check names it
    with pytest.raises(AssertionError, match="3 submitted != 2 gone"):
        inbox.request_pull(1)


def test_weight_sync_policy_rejects_invalid_combinations_in_one_line() -> None:
    with pytest.raises(ValueError) as info:
        WeightSyncPolicy(reset_prefix_cache=False, reset_running_requests=True)
    assert "reset_running_requests" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ValueError, match="mode must be one of"):
        WeightSyncPolicy(mode="later")  # type: ignore[arg-type]
    assert WeightSyncPolicy(mode="drain").drain_before_pull
    WeightSyncPolicy(reset_prefix_cache=False, reset_running_requests=False)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("tensor_parallel_degree", 0, "tensor_parallel_degree must be >= 1, got 0"),
        ("max_engine_steps_between_decisions", 0, "max_engine_steps_between_decisions must be"),
        ("kv_cache_bytes", -1, "kv_cache_bytes must be >= 1, got -1"),
        ("torch_num_threads", 0, "torch_num_threads must be >= 1 or None, got 0"),
    ],
)
def test_generator_config_names_the_bad_field(field: str, value: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Generator.Config(**{field: value})


def test_in_place_load_is_refused_where_it_cannot_work_in_one_line() -> None:
    in_place = WeightSyncPolicy(load="in_place")
    with pytest.raises(ValueError, match=r"weight_sync\.load='in_place' needs "
                                         r"tensor_parallel_degree=1") as info:
        Generator.Config(tensor_parallel_degree=2, weight_sync=in_place)
    assert "\n" not in str(info.value) and "weight_sync.load='reload'" in str(info.value)
    with pytest.raises(ValueError, match="enforce_eager=False"):
        Generator.Config(enforce_eager=False, weight_sync=in_place)
    with pytest.raises(ValueError, match="weight_sync.load must be one of"):
        WeightSyncPolicy(load="copy")  # type: ignore[arg-type]
    assert Generator.Config(weight_sync=in_place).weight_sync.load == "in_place"
    assert WeightSyncPolicy().load == "auto"  # in_place where it works (start_engine_loop)
    assert Generator.Config(tensor_parallel_degree=2).weight_sync.load == "auto"
