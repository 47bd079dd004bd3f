"""`serve --dp-size 2`: concurrent requests spread over both replicas (replica 1 in a process of its own), each
answered once with the output one engine gives, and /metrics sums the replicas; SIGTERM stops the replica
process too; a replica killed mid-request fails that request with 500, /health answers 503 and the server exits
1; a replica that cannot start is a clear error; --dp-size 0 is refused."""
import asyncio
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from specserve.cli import main
from specserve.engine import LLM
from specserve.server.replicas import RemoteReplica, ReplicaError, replica_args
from specserve.types import SamplingParams
from tests.e2e import KV_BYTES, ServerProcess, save_tiny_model

CONTEXT = 2048
PROMPTS = ["Once upon a time", "The sea is", "abc abc abc", "1, 2, 3,", "hello", "Tell me a story."]
MAX_TOKENS, SEED = 16, 7


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), max_positions=CONTEXT)


def replica_pid(server: ServerProcess) -> int:
    return int(re.search(r"data-parallel replica 1 started as process (\d+)", server.log()).group(1))


def running(pid: int) -> bool:
    """Whether the process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def complete_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return await asyncio.gather(*(client.post("/v1/completions", json=body) for body in bodies))


def test_two_replicas_answer_each_request_once_as_one_engine_does(tiny_folder, tmp_path):
    server = ServerProcess(tmp_path / "server.log", "--dp-size", "2", model=tiny_folder)
    pid = replica_pid(server)
    # greedy, and sampled with a seed: either gives the same tokens on any replica
    params = [SamplingParams(temperature=t, seed=SEED, max_new_tokens=MAX_TOKENS, ignore_eos=True)
              for t in (0.0, 1.0)]
    jobs = [(prompt, p) for prompt in PROMPTS for p in params]
    try:
        responses = asyncio.run(complete_all(server.url, [
            {"model": "tiny-llama", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": p.temperature,
             "seed": SEED, "ignore_eos": True} for prompt, p in jobs]))
        m = server.wait_idle()
    finally:
        exit_code = server.stop()
    assert exit_code == 0 and "Traceback" not in server.log()
    assert not running(pid)

    assert [r.status_code for r in responses] == [200] * len(jobs)
    offline = LLM(model_path=str(tiny_folder), memory_bytes=int(KV_BYTES), num_threads=1)
    expected = [out.text for out in offline.generate([prompt for prompt, _ in jobs], [p for _, p in jobs])]
    assert [r.json()["choices"][0]["text"] for r in responses] == expected
    routed = [m[f'specserve_requests_routed_total{{replica="{i}"}}'] for i in (0, 1)]
    assert min(routed) > 0 and sum(routed) == len(jobs)
    assert m['specserve_requests_finished_total{finish_reason="length"}'] == len(jobs)
    assert m["specserve_generation_tokens_total"] == len(jobs) * MAX_TOKENS      # both replicas' tokens


def test_a_killed_replica_fails_its_request_with_500_and_the_server_exits_1(tiny_folder, tmp_path):
    server = ServerProcess(tmp_path / "server.log", "--dp-size", "2", "--shutdown-timeout", "2", model=tiny_folder)
    pid = replica_pid(server)
    long = {"model": "tiny-llama", "prompt": "hi", "max_tokens": CONTEXT - 8, "ignore_eos": True}
    responses: dict[int, httpx.Response] = {}

    def post(replica: int) -> None:
        responses[replica] = httpx.post(f"{server.url}/v1/completions", json=long, timeout=60)

    def wait_routed(replica: int) -> None:
        deadline = time.monotonic() + 30
        while server.metrics().get(f'specserve_requests_routed_total{{replica="{replica}"}}', 0) < 1:
            assert time.monotonic() < deadline, f"no request reached replica {replica}"
            time.sleep(0.05)

    # the least loaded replica takes each request: the first goes to replica 0, the second to replica 1
    clients = [threading.Thread(target=post, args=(replica,)) for replica in (0, 1)]
    try:
        for replica, client in enumerate(clients):
            client.start()
            wait_routed(replica)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        # the server learns of the death from the replica's pipe, a moment after the kill
        while httpx.get(f"{server.url}/health", timeout=5).status_code != 503:
            assert time.monotonic() - killed < 5, "/health still answers 200 five seconds after the kill"
            time.sleep(0.05)
        exit_code = server.proc.wait(20)
        exited_after = time.monotonic() - killed
        for client in clients:
            client.join()
    finally:
        server.stop()
    assert exit_code == 1 and exited_after < 10
    assert responses[1].status_code == 500
    error = responses[1].json()["error"]
    assert error["code"] == "engine_error" and "replica 1 died (killed by SIGKILL)" in error["message"]
    # the other replica's request ran on through the drain: finished, or aborted once the grace period was over
    assert responses[0].status_code == 200
    assert responses[0].json()["choices"][0]["finish_reason"] in ("length", "abort")
    assert not running(pid)


def test_a_replica_that_cannot_start_is_a_clear_error(tmp_path):
    missing = tmp_path / "no-such-model"
    replica = RemoteReplica(1, replica_args({"model_path": str(missing), "num_threads": 1}, 1))
    try:
        with pytest.raises(ReplicaError, match=f"data-parallel replica 1 failed to start: .*{missing}"):
            replica.wait_ready()
    finally:
        replica.kill()
    assert not replica.alive


def test_dp_size_below_1_is_refused(capsys):
    assert main(["serve", "--dp-size", "0"]) == 2
    assert "--dp-size must be at least 1, got 0" in capsys.readouterr().err
