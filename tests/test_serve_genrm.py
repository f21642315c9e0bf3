"""scripts/serve_genrm.sh: starts the server, waits for /health + /v1/models, fails clearly (vLLM replaced by a
fake `vllm` executable, since vLLM cannot run here)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]

FAKE_VLLM = textwrap.dedent("""\
    #!{python}
    # Fake `vllm serve MODEL --port P ...`: MODE=ok serves /health + /v1/models after a short delay,
    # MODE=die exits at once, MODE=sick answers 503 forever.
    import os, sys, time, json
    from http.server import BaseHTTPRequestHandler, HTTPServer
    args = sys.argv[1:]
    assert args[0] == "serve", args
    port = int(args[args.index("--port") + 1])
    mode = os.environ["FAKE_MODE"]
    print("fake vllm", args, "CUDA_VISIBLE_DEVICES=" + os.environ.get("CUDA_VISIBLE_DEVICES", ""),
          "pid=" + str(os.getpid()), flush=True)
    if mode == "die":
        print("RuntimeError: CUDA out of memory (fake)", flush=True)
        sys.exit(3)
    time.sleep(0.5)
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a): pass
        def do_GET(self):
            ok = mode == "ok" and self.path in ("/health", "/v1/models")
            body = json.dumps({{"data": [{{"id": args[1]}}]}}).encode()
            self.send_response(200 if ok else 503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
    HTTPServer(("127.0.0.1", port), H).serve_forever()
    """)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_script(tmp_path, mode, *extra):
    fake = tmp_path / "fake_vllm"
    fake.write_text(FAKE_VLLM.format(python=sys.executable))
    fake.chmod(0o755)
    env = dict(os.environ, VLLM_BIN=str(fake), FAKE_MODE=mode)
    log = tmp_path / "server.log"
    cmd = ["bash", str(REPO / "scripts" / "serve_genrm.sh"), "--model", "tiny/genrm", "--port", str(free_port()),
           "--gpus", "3", "--log", str(log), *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60), log


def test_serve_genrm_waits_until_healthy(tmp_path):
    proc, log = run_script(tmp_path, "ok", "--", "--gpu-memory-utilization", "0.5")
    assert proc.returncode == 0, proc.stderr
    pid = int(proc.stdout.strip().splitlines()[-1])
    try:
        assert "healthy at" in proc.stdout
        text = log.read_text()
        assert "CUDA_VISIBLE_DEVICES=3" in text and "'--gpu-memory-utilization', '0.5'" in text
        assert "'--limit-mm-per-prompt'" in text
    finally:
        os.kill(pid, signal.SIGTERM)


def test_serve_genrm_reports_a_dead_server(tmp_path):
    proc, _ = run_script(tmp_path, "die")
    assert proc.returncode == 1
    assert "exited before becoming healthy" in proc.stderr and "CUDA out of memory (fake)" in proc.stderr


def test_serve_genrm_times_out_and_stops_the_server(tmp_path):
    t0 = time.time()
    proc, _ = run_script(tmp_path, "sick", "--timeout", "3")
    assert proc.returncode == 1 and "not healthy after 3s" in proc.stderr
    assert time.time() - t0 < 30
    pid = int(proc.stderr.split("stopping pid ")[1].split(";")[0])
    assert not alive(pid)


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting for a reaper counts as dead)."""
    for _ in range(20):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        status = Path(f"/proc/{pid}/status")
        if status.exists() and "\nState:\tZ" in status.read_text():
            return False
        time.sleep(0.25)
    return True
