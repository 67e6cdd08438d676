"""Two CPU processes that form a gloo group (env:// rendezvous on a free local port), shared by the
tests that compare 2 ranks with 1 process."""

from __future__ import annotations

import os
import socket
import sys

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_gloo(fn, *args) -> None:
    """Run `fn(rank, *args)` in 2 fresh processes; `fn` must be a module-level (picklable)
    function."""
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(free_port(), fn, args), nprocs=2, join=True)


def _rank(rank: int, port: int, fn, args) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)  # two ranks share this machine's cores
    fn(rank, *args)
    if torch.distributed.is_initialized():  # exiting with the group alive can abort the process
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    # Done, and nothing is left to run: skip the interpreter's teardown, where a C++ thread still
    # joinable at static destruction aborted a rank ("terminate called without an active
    # exception", SIGABRT) in about 1 of 4 CI runs, after every check of the test had passed. Seen
    # in the FSDP tests and in test_two_gloo_processes_equal_one_process, whose ranks had already
    # destroyed their group.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
