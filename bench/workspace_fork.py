"""Forking a task's workspace for a group: overlay and hard links against copying, in one run.

    python bench/workspace_fork.py [--mb 50] [--files 400] [--group 8] [--rounds 3] [--json OUT]

A workspace of `--mb` MB in `--files` files (seeded random bytes) is prepared once per fork mode
(`SandboxConfig.fork`), then a group of `--group` sessions is started on it at once and closed,
`--rounds` times; mode `none` starts the group without a workspace (a session's own cost).
Printed per mode: the one-off preparation, the group's start (all sessions
answering), its close (forks removed), the bytes its forks added on disk, and the group start's
ratio to `copy` (a full copy per session: the baseline). A plain `shutil.copytree` of the tree,
`--group` times, without any sandbox, is measured beside them, and so is one session alone
(start, a first and a second shell call, close). Each mode's last session checks its fork in the
jail (`Session.checksum`) against the prepared checksum. Needs root (namespaces).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agentgrpo.verify.sandbox import Sandbox, SandboxConfig  # noqa: E402
from agentgrpo.verify.workspace import Workspace  # noqa: E402

MODES = ("none", "copy", "hardlink", "overlay")


def make_workspace(mb: int, files: int, seed: int = 0) -> Workspace:
    rng = random.Random(seed)
    size = (mb << 20) // files
    tree = {
        f"pkg{i % 20}/data_{i:04d}.bin": rng.getrandbits(8 * size).to_bytes(size, "little")
        for i in range(files)
    }
    return Workspace(files=tree)


def inodes(path: str) -> dict[int, int]:
    """Inode -> bytes of blocks allocated, for everything under `path`."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            found[st.st_ino] = st.st_blocks * 512
    return found


async def group_round(
    sb: Sandbox, spec: Workspace | None, group: int, shared: set[int]
) -> tuple[float, float, int]:
    """Start `group` sessions at once, then close them: the two times and the bytes the forks
    added on disk (blocks of inodes the prepared tree does not hold)."""
    t0 = time.perf_counter()
    sessions = await asyncio.gather(*(sb.session(spec) for _ in range(group)))
    started = time.perf_counter() - t0
    forks = inodes(os.path.join(sb._store().dir, "forks"))
    used = sum(n for ino, n in forks.items() if ino not in shared)
    t1 = time.perf_counter()
    await asyncio.gather(*(s.close() for s in sessions))
    return started, time.perf_counter() - t1, used


async def bench_mode(mode: str, spec: Workspace, args: argparse.Namespace, state: str) -> dict:
    """One fork mode: prepare, `rounds` group rounds, one in-jail checksum. Mode "none" starts
    sessions without a workspace: what a session itself costs."""
    fork = "overlay" if mode == "none" else mode
    sb = Sandbox(backend="namespaces", config=SandboxConfig(slots=1, fork=fork, state_dir=state))
    ws = None if mode == "none" else spec
    try:
        t0 = time.perf_counter()
        prepared = sb.prepare(spec) if ws is not None else None
        prep = time.perf_counter() - t0
        shared = set(inodes(prepared.path)) if prepared else set()
        rounds = [await group_round(sb, ws, args.group, shared) for _ in range(args.rounds)]
        one = await sb.session(ws)
        t1 = time.perf_counter()
        same = prepared is None or await one.checksum() == prepared.checksum
        check_s = time.perf_counter() - t1
        await one.close()
    finally:
        sb.close()
    return {
        "mode": mode,
        "prepare_s": prep,
        "group_start_s": statistics.median(r[0] for r in rounds),
        "group_close_s": statistics.median(r[1] for r in rounds),
        "fork_disk_mb": statistics.median(r[2] for r in rounds) / 2**20,
        "checksum_in_jail_s": check_s,
        "forks_identical": same,
    }


async def one_session(state: str, n: int = 10) -> dict:
    """Medians over `n` sessions one after another, without a workspace: start, two shell calls
    (the first starts bash), close."""
    sb = Sandbox(backend="namespaces", config=SandboxConfig(slots=1, state_dir=state))
    times: dict[str, list[float]] = {"start_s": [], "first_call_s": [], "call_s": [], "close_s": []}
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            ws = await sb.session(None)
            t1 = time.perf_counter()
            await ws.run("true")
            t2 = time.perf_counter()
            await ws.run("true")
            t3 = time.perf_counter()
            await ws.close()
            t4 = time.perf_counter()
            for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                times[k].append(v)
    finally:
        sb.close()
    return {k: statistics.median(v) for k, v in times.items()}


def plain_copies(spec: Workspace, group: int, state: str) -> float:
    src = tempfile.mkdtemp(dir=state)
    for name, data in spec.files.items():
        os.makedirs(os.path.join(src, os.path.dirname(name)), exist_ok=True)
        with open(os.path.join(src, name), "wb") as f:
            f.write(data)
    t0 = time.perf_counter()
    for i in range(group):
        shutil.copytree(src, f"{src}-{i}")
    took = time.perf_counter() - t0
    for i in range(group):
        shutil.rmtree(f"{src}-{i}")
    shutil.rmtree(src)
    return took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=50)
    p.add_argument("--files", type=int, default=400)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    spec = make_workspace(args.mb, args.files)
    state = tempfile.mkdtemp(prefix="agentgrpo-bench-ws-")
    try:
        results = [asyncio.run(bench_mode(m, spec, args, state)) for m in MODES]
        raw = plain_copies(spec, args.group, state)
        single = asyncio.run(one_session(state))
    finally:
        shutil.rmtree(state, ignore_errors=True)
    base = next(r for r in results if r["mode"] == "copy")["group_start_s"]
    print(
        f"workspace: {args.mb} MB in {args.files} files; group of {args.group}; "
        f"median of {args.rounds} rounds; {os.cpu_count()} CPUs"
    )
    print(
        f"{'fork':<9} {'prepare':>8} {'group start':>12} {'vs copy':>8} {'close':>8} "
        f"{'fork disk':>10} {'checksum':>9} identical"
    )
    for r in results:
        print(
            f"{r['mode']:<9} {r['prepare_s']:>7.3f}s {r['group_start_s']:>11.3f}s "
            f"{r['group_start_s'] / base:>7.2f}x {r['group_close_s']:>7.3f}s "
            f"{r['fork_disk_mb']:>8.1f}MB {r['checksum_in_jail_s']:>8.3f}s {r['forks_identical']}"
        )
    print(f"plain shutil.copytree x{args.group}, no sandbox: {raw:.3f}s")
    print(
        "one session alone (median of 10): "
        + ", ".join(f"{k.removesuffix('_s')} {v * 1000:.0f} ms" for k, v in single.items())
    )
    if args.json:
        out = {"args": vars(args), "results": results, "plain_copies_s": raw, "one": single}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
