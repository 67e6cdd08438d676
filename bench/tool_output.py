"""What one large tool answer costs the trainer, against an answer of exactly the byte cap.

    python -m bench.tool_output                    # a 50 MB answer from an in-process tool
    python -m bench.tool_output --mb 5 --no-cap    # the cost without rollout.max_tool_output_bytes
    python -m bench.tool_output --mcp stdio        # also receiving it over MCP (stdio or http)

One episode with the embedded model's tokenizer and a scripted engine: the model calls the tool,
reads its output, answers. The tool's answer is made before the episode starts (holding it is the
tool's cost); the episode's cost is the trainer's. Printed per case: wall time, the episode's peak
Python memory (tracemalloc, a second run) and its peak RSS over the RSS before it (VmHWM after
resetting it; Linux). `--mcp` times `MCPTool.acall` on a server that answers that many bytes: what
the `mcp` package costs to receive it, before any cut (needs `pip install 'agentgrpo[mcp]'`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from agentgrpo import Task, ToolEnv, tool  # noqa: E402
from agentgrpo.chat.format import ChatFormat  # noqa: E402
from agentgrpo.engine.base import Completion, SamplingParams  # noqa: E402
from agentgrpo.rollout.episode import EpisodeLimits, run_episode  # noqa: E402

LINE = "2026-12-05 12:00:00 INFO step done\n"
ANSWER = {"text": ""}
SERVER = """
import sys
from mcp.server.mcpserver import MCPServer
app = MCPServer("bench")
@app.tool()
def read(n: int) -> str:
    '''n bytes of log.'''
    line = %r
    return (line * (n // len(line) + 1))[:n]
if len(sys.argv) > 1:
    app.run("streamable-http", host="127.0.0.1", port=int(sys.argv[1]))
else:
    app.run()
"""


class Log(ToolEnv):
    @tool
    def read(self) -> str:
        """Read the whole log."""
        return ANSWER["text"]

    def reward(self, task, messages):
        return 1.0


class Scripted:
    """Calls `read`, then answers "done"."""

    def __init__(self, chat: ChatFormat) -> None:
        self.chat, self.n = chat, 0

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        text = '<tool_call>{"name": "read", "arguments": {}}</tool_call>' if self.n == 0 else "done"
        self.n += 1
        ids = self.chat.encode(text) + [self.chat.end_of_turn_id]
        return Completion(ids, [-0.5] * len(ids), "stop", "v0")


def _rss(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) << 10
    return 0


def episode_cost(chat: ChatFormat, text: str, limits: EpisodeLimits) -> tuple[float, int, int]:
    """(seconds, peak Python bytes, peak RSS bytes over the start) of one episode."""
    ANSWER["text"] = text

    def episode():
        task = Task(id="t", prompt="What does the log say?")
        params = SamplingParams(max_new_tokens=32)
        return run_episode(Log(), Scripted(chat), chat, task, params, limits=limits)

    Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the current RSS
    before = _rss("VmRSS:")
    t0 = time.perf_counter()
    asyncio.run(episode())
    seconds, rss = time.perf_counter() - t0, _rss("VmHWM:") - before
    tracemalloc.start()
    asyncio.run(episode())
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return seconds, peak, rss


def mcp_receive(transport: str, n: int) -> tuple[float, int]:
    """(seconds, peak RSS bytes over the start) of receiving n bytes from an MCP tool."""
    from agentgrpo.agents.mcp import MCPServer, MCPToolEnv

    script = Path(tempfile.mkdtemp()) / "server.py"
    script.write_text(SERVER % LINE)
    proc = None
    if transport == "http":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        proc = subprocess.Popen([sys.executable, str(script), str(port)], **quiet)
        server = MCPServer.http(f"http://127.0.0.1:{port}/mcp", open_timeout_s=60)
    else:
        server = MCPServer.stdio(sys.executable, str(script))

    class Remote(MCPToolEnv):
        mcp_servers = [server]

        def reward(self, task, messages):
            return 0.0

    env = Remote()
    try:
        for _ in range(100):  # the HTTP server takes a moment to listen
            try:
                env.reset(options={"task": Task(id="t", prompt="x")})
                break
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.1)
        remote = env.get_tools()["read"]
        Path("/proc/self/clear_refs").write_text("5")
        before = _rss("VmRSS:")
        t0 = time.perf_counter()
        asyncio.run(remote.acall({"n": n}))
        return time.perf_counter() - t0, _rss("VmHWM:") - before
    finally:
        env.close()
        if proc is not None:
            proc.terminate()
            proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=50.0, help="the large answer, in MB (10**6 bytes)")
    p.add_argument("--no-cap", action="store_true", help="max_tool_output_bytes=None")
    p.add_argument("--mcp", choices=["stdio", "http"], help="also time receiving it over MCP")
    args = p.parse_args()
    from transformers import AutoTokenizer

    from agentgrpo.models import default_model_path

    chat = ChatFormat(AutoTokenizer.from_pretrained(default_model_path()))
    limits = EpisodeLimits(max_tokens=10**8)
    if args.no_cap:
        limits = limits.model_copy(update={"max_tool_output_bytes": None})
    cap = EpisodeLimits().max_tool_output_bytes or 0
    n = int(args.mb * 1e6)
    huge = LINE * (n // len(LINE))
    at_cap = (LINE * (cap // len(LINE) + 1))[:cap]
    episode_cost(chat, at_cap, limits)  # warm-up
    rows = [(f"answer of the cap ({cap} B)", at_cap), (f"answer of {args.mb:g} MB", huge)]
    print(f"max_tool_output_bytes={limits.max_tool_output_bytes}")
    for name, text in rows:
        s, peak, rss = episode_cost(chat, text, limits)
        mib = f"Python peak {peak / 2**20:8.1f} MiB  RSS +{rss / 2**20:.1f} MiB"
        print(f"  {name:28s} {s:8.3f} s  {mib}")
    if args.mcp:
        s, rss = mcp_receive(args.mcp, n)
        print(f"  MCP {args.mcp} receive {args.mb:g} MB  {s:8.3f} s  RSS +{rss / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
