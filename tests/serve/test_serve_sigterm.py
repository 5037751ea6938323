"""SIGTERM while requests are in flight: flexh2o-serve (a process of its own, the KV cache on the disk tier) stops
taking connections, answers every open request in full, frees the engine and exits 0 with nothing left under
--offload-dir."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from serve_helpers import client, metric, served_checkpoint, wait_for, wait_ready

pytest.importorskip("tokenizers")
pytest.importorskip("openai")
pytest.importorskip("fastapi")

STOP_S = 120  # the drain answers 4 requests of 64 tiny-model tokens, then the engine closes


def _port(proc, timeout: float = 120) -> int:
    """The port from the server's start line on stderr ('... on http://127.0.0.1:PORT/v1 ...')."""
    seen = []
    for line in proc.stderr:  # bounded: the process is killed by the caller's timeout if it never prints
        seen.append(line)
        m = re.search(r"on http://127\.0\.0\.1:(\d+)/v1", line)
        if m:
            return int(m.group(1))
    raise AssertionError("the server printed no start line:\n" + "".join(seen))


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_and_exits_0(tmp_path, offload_dir):
    ckpt, _ = served_checkpoint(str(tmp_path))
    argv = [sys.executable, "-m", "flexh2o.cli.serve", "--path", ckpt, "--port", "0", "--percent", "100", "0", "0",
            "0", "--gpu-batch-size", "2", "--prompt-len", "8", "--gen-len", "64", "--offload-dir", offload_dir,
            "--ignore-eos", "--no-warmup", "--stats-interval", "0"]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        url = f"http://127.0.0.1:{_port(proc)}"
        wait_ready(url, proc=proc)
        assert any(d.startswith("flexh2o-run-") for d in os.listdir(offload_dir))  # the cache's run dir on disk

        def ask(i):
            stream = client(url, timeout=STOP_S).completions.create(model="ckpt", prompt=[5 + i, 6], max_tokens=64,
                                                                     stream=True, stream_options={"include_usage":
                                                                                                  True})
            return [c.usage.completion_tokens for c in stream if c.usage][0]
        with ThreadPoolExecutor(4) as pool:
            answers = [pool.submit(ask, i) for i in range(4)]  # 2 in rows, 2 queued
            wait_for(lambda: metric(url, "flexh2o_queue_length") == 2 and metric(url, "flexh2o_rows_busy") == 2,
                     what="two requests running and two queued")
            proc.send_signal(signal.SIGTERM)
            assert [a.result(timeout=STOP_S) for a in answers] == [64] * 4  # each answered in full
        assert proc.wait(timeout=STOP_S) == 0
        assert "stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert os.listdir(offload_dir) == [], os.listdir(offload_dir)
