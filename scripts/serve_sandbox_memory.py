"""Peak memory of `agentgrpo serve-sandbox` while it parses three large request bodies at once.

    PYTHONPATH=. python scripts/serve_sandbox_memory.py [--mb 15] [--bodies 3]

Starts the server in a subprocess (namespaces backend: run as root), sends `--bodies` JSON bodies
of `--mb` MB at once, each a list of empty objects (the shape that costs json.loads the most
memory per byte), and prints the server's resident peak (VmHWM) before and after. The bodies are
valid /run requests ({"code": "print(1)", "pad": [{}, ...]}); the server ignores `pad`.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time


def peak_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=15)
    ap.add_argument("--bodies", type=int, default=3)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agentgrpo.cli",
            "serve-sandbox",
            "--port",
            str(port),
            "--backend",
            "namespaces",
            "--max-body-mb",
            "16",
        ],
        env={**os.environ},
        stderr=subprocess.DEVNULL,
    )
    import httpx

    try:
        for _ in range(200):
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        before = peak_mb(server.pid)
        n = int(args.mb * (1 << 20)) // 3
        body = b'{"code": "print(1)", "pad": [' + b"{}," * (n - 1) + b"{}]}"
        codes = []

        def post() -> None:
            r = httpx.post(
                f"http://127.0.0.1:{port}/run",
                content=body,
                timeout=300,
                headers={"Content-Type": "application/json"},
            )
            codes.append(r.status_code)

        threads = [threading.Thread(target=post) for _ in range(args.bodies)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(
            f"{args.bodies} bodies of {len(body) / (1 << 20):.1f} MB: answers {sorted(codes)}; "
            f"server peak RSS {before:.0f} MB before, {peak_mb(server.pid):.0f} MB after"
        )
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
