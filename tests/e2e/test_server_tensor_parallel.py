"""`serve --tp-size 2`: answers as the one-rank server does; a killed rank fails the next request with 500 and the
server exits 1 within seconds."""
import os
import re
import signal
import time

import httpx
import pytest

from tests.e2e import ServerProcess, save_tiny_model

BODY = {"model": "tiny-llama", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_a_killed_rank_fails_the_request_with_500_and_the_server_exits_1(tiny_folder, tmp_path):
    one = ServerProcess(tmp_path / "tp1.log", model=tiny_folder)
    try:
        want = httpx.post(f"{one.url}/v1/completions", json=BODY, timeout=60).json()["choices"][0]["text"]
    finally:
        one.stop()
    server = ServerProcess(tmp_path / "tp2.log", "--tp-size", "2", "--shutdown-timeout", "2", model=tiny_folder)
    try:
        first = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=60)
        assert first.status_code == 200 and first.json()["choices"][0]["text"] == want
        rank = int(re.search(r"rank processes \[(\d+)\]", server.log()).group(1))
        os.kill(rank, signal.SIGKILL)
        killed = time.monotonic()
        second = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=60)
        exit_code = server.proc.wait(20)
        exited_after = time.monotonic() - killed
    finally:
        server.stop()
    assert second.status_code == 500
    assert second.json()["error"]["code"] == "engine_error" and "tp1 exited with code -9" in second.text
    assert exit_code == 1 and exited_after < 10
