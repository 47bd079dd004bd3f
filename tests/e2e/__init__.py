"""End-to-end helpers: a tiny random model saved to disk and a real `specserve serve` process on a free
localhost port, one torch thread, its output in a log file (a full pipe would block the server)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from specserve.distributed import free_port
from tests.conftest import save_hf_folder, tiny_checkpoint

KV_BYTES = "8000000"     # ~1000 pages of the tiny model; the 1 GiB default takes seconds to allocate


def save_tiny_model(folder: Path, max_positions: int = 2048) -> Path:
    return save_hf_folder(tiny_checkpoint("llama", max_positions=max_positions), folder, torch.float32)


class ServerProcess:
    def __init__(self, log_path: Path, *args: str, model: Path | None = None, startup_s: float = 180) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        # the tests ask for the tiny model by the name a client would give it
        model_args = ["--model-path", str(model), "--kv-cache-memory", KV_BYTES, "--served-model-name",
                      "tiny-llama"] if model else []
        cmd = [sys.executable, "-m", "specserve.cli", "serve", *model_args, "--port", str(self.port),
               "--threads", "1", *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     cwd=Path(__file__).resolve().parents[2])
        deadline = time.monotonic() + startup_s
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start:\n{self.log()}")
            time.sleep(0.2)

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def log(self) -> str:
        return self.log_path.read_text()

    def metrics(self) -> dict[str, float]:
        """`name{label="v",...}` → value, from /metrics."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        values = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return values

    def wait_idle(self, timeout_s: float = 30) -> dict[str, float]:
        """Metrics once nothing runs and every KV page is free (fails the test after `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            idle = (m["specserve_num_requests_running"] == 0 and m["specserve_num_requests_waiting"] == 0
                    and m['specserve_kv_pages_used{pool="target"}'] == 0)
            if idle or time.monotonic() > deadline:
                assert idle, {k: v for k, v in m.items() if "requests" in k or "pages" in k}
                return m
            time.sleep(0.1)

    def stop(self, timeout_s: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
