"""HttpGenerateFn against a real vLLM OpenAI-compatible server, and against broken stand-ins.

    vllm_server (module fixture): python -m vllm.entrypoints.openai.api_server, tiny model,
        127.0.0.1, a free port; ready when GET /health answers 200 (bounded deadline);
        terminated (then killed) after the module
    multi-turn:   Rollouter + AlphabetSortTask --GenerateRequest--> HttpGenerateFn --> server
    equivalence:  the same requests over HTTP and through our own in-process LLMEngine
    errors (no vLLM, fast): a closed port, a stdlib HTTP server answering badly or never
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.server
import json
import logging
import math
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from examples.alphabet_sort import AlphabetSortTask
from tests.rollout.rollout_testlib import REPO_ROOT, CountingEnv, run, tiny_tokenizer
from torchtitan_rl.rollout import HttpGenerateFn, Rollouter, RolloutGroup, RolloutStatus
from torchtitan_rl.types import GenerateRequest, Sampling

logger = logging.getLogger(__name__)

SERVED_NAME = "tiny"
READY_DEADLINE_S = 420.0  # 2 shared cores: start-up took ~70 s beside other test runs
# The random tiny model almost never samples its end token: one id in five as an extra stop token
# ends replies within a few tokens ("stop"), so the env asks the next turn instead of the rollout
# ending TRUNCATED_LENGTH.
STOP_TOKEN_IDS = list(range(3, 1024, 5))
# Measured: 0.0 (bit-identical, float32 on both sides, 64 tokens greedy and 64 seeded); the margin
# covers batch-shape differences in CPU kernels (~1e-6 elsewhere in this project).
LOGPROB_TOLERANCE = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Server:
    base_url: str
    model_dir: pathlib.Path
    start_s: float


def _log_tail(path: pathlib.Path, n: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from torchtitan_rl.assets.make_model import ensure_model

    model_dir = ensure_model("tiny", REPO_ROOT / "assets" / "models")
    port = _free_port()
    log_path = tmp_path_factory.mktemp("vllm_server") / "server.log"
    env = dict(os.environ)
    # The server runs as a user would start it: its own engine-core process (this test process
    # sets VLLM_ENABLE_V1_MULTIPROCESSING=0 for in-process engines), and the KV cache sized by
    # --kv-cache-memory-bytes (VLLM_CPU_KVCACHE_SPACE, set by conftest, would override the flag).
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", SERVED_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "512", "--dtype", "float32", "--enforce-eager",
        "--kv-cache-memory-bytes", str(64 << 20),
        # As our engines: per-request seeds crash vllm-cpu 0.32 under chunked prefill.
        "--no-enable-chunked-prefill", "--seed", "0",
    ]
    start = time.monotonic()
    with open(log_path, "wb") as log:
        # Own process group: the API server's engine-core and worker children go with it.
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        base_url = f"http://127.0.0.1:{port}"
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM server exited with {proc.returncode}:\n{_log_tail(log_path)}")
            try:
                with urllib.request.urlopen(base_url + "/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - start > READY_DEADLINE_S:
                pytest.fail(f"vLLM server not ready after {READY_DEADLINE_S} s:\n"
                            f"{_log_tail(log_path)}")
            time.sleep(0.5)  # poll interval, not synchronisation: readiness is the /health answer
        start_s = time.monotonic() - start
        logger.info("vLLM server ready after %.1f s (log %s)", start_s, log_path)
        yield Server(base_url=base_url, model_dir=model_dir, start_s=start_s)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        try:  # children the server left behind, in the group it led
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# ---- against the real server ----

def _alphabet_rollouter(tokenizer: Any) -> tuple[Any, Rollouter]:
    task = AlphabetSortTask.Config(seed=0, min_turns=2, max_turns=3).build()
    rollouter = Rollouter.Config(group_size=2, max_turns=3, max_rollout_tokens=500,
                                 drop_zero_std_groups=False, seed=1234).build(
        tokenizer=tokenizer, make_env=task.make_env)
    return task, rollouter


@pytest.mark.slow
def test_http_multi_turn_rollouts_through_rollouter(vllm_server: Server) -> None:
    from transformers import AutoTokenizer

    task, rollouter = _alphabet_rollouter(AutoTokenizer.from_pretrained(str(vllm_server.model_dir)))
    fn = HttpGenerateFn.Config(base_url=vllm_server.base_url, model=SERVED_NAME, timeout_s=120.0,
                               max_retries=0, policy_version=3).build()
    sampling = Sampling(max_tokens=32, temperature=1.0, stop_token_ids=STOP_TOKEN_IDS)
    episodes = [task.dataset("train")[i] for i in range(2)]

    async def main() -> tuple[list[RolloutGroup], RolloutGroup]:
        async with fn:
            groups = await asyncio.gather(*(
                rollouter.run_group_rollouts(fn, episode, group_id=i, sampling=sampling)
                for i, episode in enumerate(episodes)))
            again = await rollouter.run_group_rollouts(fn, episodes[0], group_id=0,
                                                       sampling=sampling)
        return list(groups), again

    start = time.monotonic()
    groups, again = run(main(), timeout_s=600.0)
    logger.info("3 groups over HTTP in %.1f s", time.monotonic() - start)

    num_turns = 0
    for group, episode in zip(groups, episodes):
        assert len(group.rollouts) == 2
        for rollout in group.rollouts:
            assert rollout.status is RolloutStatus.COMPLETED, (rollout.status, rollout.error)
            assert len(rollout.turns) == episode.num_turns >= 2
            for turn in rollout.turns:
                n = len(turn.completion_token_ids)
                assert n > 0
                assert len(turn.completion_logprobs) == len(turn.policy_versions) == n
                assert turn.policy_versions == [3] * n
                assert all(math.isfinite(x) and x <= 0.0 for x in turn.completion_logprobs)
                assert turn.finish_reason == "stop"
            for prev, nxt in zip(rollout.turns, rollout.turns[1:]):
                # token in, token out: the next prompt extends exactly what the server returned
                head = prev.prompt_token_ids + prev.completion_token_ids
                assert nxt.prompt_token_ids[:len(head)] == head
            num_turns += len(rollout.turns)
    metrics = fn.metrics()
    assert metrics["http_generate/completions"] == num_turns + sum(
        len(r.turns) for r in again.rollouts)
    assert all(metrics[f"http_generate/errors/{k}"] == 0
               for k in ("connection", "timeout", "http_status", "malformed"))
    # seeds reach the server: the same group again gives the same tokens, siblings differ
    def tokens(group: RolloutGroup) -> list[list[list[int]]]:
        return [[t.completion_token_ids for t in r.turns] for r in group.rollouts]
    assert tokens(again) == tokens(groups[0])
    assert tokens(groups[0])[0] != tokens(groups[0])[1]


def _in_process_generate(model_dir: pathlib.Path,
                         requests: list[tuple[str, list[int], Sampling]]) -> dict[str, Any]:
    """Our own engine (torchtitan_rl.generator.vllm_engine), stepped to the end: id -> output."""
    from torchtitan_rl.generator import Generator
    from torchtitan_rl.generator.loop_decision import EngineRequest
    from torchtitan_rl.generator.vllm_engine import add_request, build_engine

    engine = build_engine(Generator.Config(model_dir=str(model_dir), max_model_len=512,
                                           kv_cache_bytes=64 << 20))
    for rid, prompt, sampling in requests:
        add_request(engine, EngineRequest(request_id=rid, prompt_token_ids=prompt,
                                          sampling=sampling))
    outputs: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.outputs[0]
    del engine
    return outputs


@pytest.mark.slow
def test_http_matches_in_process_engine(vllm_server: Server) -> None:
    tokenizer = tiny_tokenizer()
    task = AlphabetSortTask.Config(seed=0).build()
    prompt = tokenizer.encode(task.dataset("train")[0].prompts[0], add_special_tokens=False)
    requests = [
        ("greedy", prompt, Sampling(max_tokens=64, temperature=0.0)),
        ("seeded", prompt, Sampling(max_tokens=64, temperature=1.0, seed=12345)),
    ]
    fn = HttpGenerateFn.Config(base_url=vllm_server.base_url + "/v1", timeout_s=120.0).build()

    async def over_http() -> list[Any]:
        async with fn:
            return list(await asyncio.gather(*(
                fn(GenerateRequest(prompt_token_ids=p, request_id=rid, sampling=s))
                for rid, p, s in requests)))

    http_out = dict(zip((r[0] for r in requests), run(over_http(), timeout_s=300.0)))
    local = _in_process_generate(vllm_server.model_dir, requests)
    for rid, _, _ in requests:
        completion = http_out[rid]
        assert completion is not None and completion.finish_reason == "length"
        assert completion.token_ids == list(local[rid].token_ids), rid
        local_logprobs = [pos[t].logprob for t, pos in zip(local[rid].token_ids,
                                                           local[rid].logprobs)]
        diff = max(abs(a - b) for a, b in zip(completion.token_logprobs, local_logprobs))
        logger.info("%s: %d tokens equal, max |logprob diff| %.3g", rid,
                    len(completion.token_ids), diff)
        assert diff <= LOGPROB_TOLERANCE, (rid, diff)


# ---- errors, without vLLM ----

class _StubHandler(http.server.BaseHTTPRequestHandler):
    """Answers by the path's first segment: /<mode>/v1/completions."""

    protocol_version = "HTTP/1.1"
    server: _StubServer

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.received.append((self.path, dict(self.headers), raw))
        mode = self.path.strip("/").split("/")[0]
        if mode == "hang":
            self.server.release.wait(60)  # never answers while the test runs
            return
        body = json.loads(raw)
        choice: dict[str, Any] = {"index": 0, "text": "", "finish_reason": "stop",
                                  "token_ids": [11, 12, 13],
                                  "prompt_token_ids": body["prompt"],
                                  "logprobs": {"token_logprobs": [-0.5, -1.0, -1.5]}}
        status, payload = 200, None
        if mode == "badjson":
            payload = b"{not json"
        elif mode == "nofields":
            del choice["token_ids"]
        elif mode == "mismatch":
            choice["logprobs"]["token_logprobs"] = [-0.5, -1.0]
        elif mode == "status500":
            status = 500
        elif mode == "status400":
            status = 400
        if payload is None:
            payload = json.dumps({"choices": [choice]} if status == 200
                                 else {"error": {"message": "stub", "code": status}}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:  # quiet test output
        pass


class _StubServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _StubHandler)
        self.received: list[tuple[str, dict[str, str], bytes]] = []
        self.release = threading.Event()

    def url(self, mode: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/{mode}"


@pytest.fixture(scope="module")
def stub() -> Iterator[_StubServer]:
    server = _StubServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.release.set()
    server.shutdown()
    server.server_close()


def _request(rid: str = "group=0/rollout=0/turn=0") -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=[5, 6, 7], request_id=rid,
                           session_id="group=0/rollout=0",
                           sampling=Sampling(max_tokens=8, temperature=0.7, top_k=20, seed=99,
                                             stop_token_ids=[4]))


def _call(config: HttpGenerateFn.Config, request: GenerateRequest) -> tuple[Any, HttpGenerateFn]:
    fn = config.build()

    async def main() -> Any:
        async with fn:
            return await fn(request)

    return run(main(), timeout_s=30.0), fn  # the bound: a hang fails here, not in CI's timeout


def test_http_well_formed_reply_and_request_fields(stub: _StubServer) -> None:
    completion, fn = _call(HttpGenerateFn.Config(base_url=stub.url("ok"), model="m",
                                                 policy_version=7), _request())
    assert completion.token_ids == [11, 12, 13]
    assert completion.token_logprobs == [-0.5, -1.0, -1.5]
    assert completion.token_policy_versions == [7, 7, 7]
    assert completion.finish_reason == "stop"
    assert completion.prompt_token_ids == [5, 6, 7]
    assert completion.metrics.num_output_tokens == 3
    path, headers, raw = stub.received[-1]
    assert path == "/ok/v1/completions"
    assert headers["X-Request-Id"] == "group=0/rollout=0/turn=0"
    assert headers["X-Session-ID"] == "group=0/rollout=0"
    body = json.loads(raw)
    assert body["prompt"] == [5, 6, 7] and body["model"] == "m"
    sampled = (body["max_tokens"], body["temperature"], body["top_k"], body["seed"])
    assert sampled == (8, 0.7, 20, 99)
    assert body["stop_token_ids"] == [4] and body["logprobs"] == 0
    assert body["return_token_ids"] is True and body["skip_special_tokens"] is False
    assert fn.metrics()["http_generate/completions"] == 1


def test_http_server_down_returns_none_and_counts(caplog: pytest.LogCaptureFixture) -> None:
    port = _free_port()  # bound then closed: nothing listens there
    with caplog.at_level(logging.WARNING, logger="torchtitan_rl.rollout.http_generate"):
        completion, fn = _call(HttpGenerateFn.Config(base_url=f"http://127.0.0.1:{port}",
                                                     max_retries=1, retry_backoff_s=0.01),
                               _request("group=4/rollout=1/turn=2"))
    assert completion is None
    metrics = fn.metrics()
    assert metrics["http_generate/errors/connection"] == 2  # the first attempt and one retry
    assert metrics["http_generate/retries"] == 1 and metrics["http_generate/dropped"] == 1
    assert any("group=4/rollout=1/turn=2" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)


@pytest.mark.parametrize("mode, kind, attempts", [
    ("badjson", "malformed", 1), ("nofields", "malformed", 1), ("mismatch", "malformed", 1),
    ("status400", "http_status", 1), ("status500", "http_status", 2),
])
def test_http_bad_replies_return_none_and_count(stub: _StubServer, mode: str, kind: str,
                                                attempts: int) -> None:
    completion, fn = _call(HttpGenerateFn.Config(base_url=stub.url(mode), max_retries=1,
                                                 retry_backoff_s=0.01), _request())
    assert completion is None
    metrics = fn.metrics()
    assert metrics[f"http_generate/errors/{kind}"] == attempts  # 5xx is retried, the rest not
    assert sum(metrics[f"http_generate/errors/{k}"] for k in
               ("connection", "timeout", "http_status", "malformed")) == attempts
    assert metrics["http_generate/dropped"] == 1


def test_http_server_that_never_answers_times_out(stub: _StubServer) -> None:
    start = time.monotonic()
    completion, fn = _call(HttpGenerateFn.Config(base_url=stub.url("hang"), timeout_s=0.5,
                                                 max_retries=2), _request())
    logger.info("hung request returned after %.2f s", time.monotonic() - start)
    assert completion is None
    assert fn.metrics()["http_generate/errors/timeout"] == 1  # timeouts are not retried
    assert fn.metrics()["http_generate/dropped"] == 1


def test_http_dropped_requests_end_rollouts_error_abort() -> None:
    """A dead server fails rollouts, not the group: the Rollouter gets None, not an exception."""
    rollouter = Rollouter.Config(group_size=2, max_turns=3, max_rollout_tokens=200).build(
        tokenizer=tiny_tokenizer(), make_env=lambda _: CountingEnv(num_turns=2))
    fn = HttpGenerateFn.Config(base_url=f"http://127.0.0.1:{_free_port()}", max_retries=0).build()

    async def main() -> RolloutGroup:
        async with fn:
            return await rollouter.run_group_rollouts(fn, None, group_id=0)

    group = run(main(), timeout_s=30.0)
    assert [r.status for r in group.rollouts] == [RolloutStatus.ERROR_ABORT] * 2
    assert group.dropped and group.drop_reason == "all_errored"
    assert fn.metrics()["http_generate/errors/connection"] == 2
