"""The learner's state on disk: the two checkpoint formats `Learner.save` / `Learner.load` use.

Its own stage (serialisation, not optimisation); every function is collective: all ranks call it
with the same directory, on a filesystem they all see.
- `full` (default): rank 0 writes HF safetensors (only the adapter with LoRA) and `learner.pt`
  (optimizer state as full tensors keyed by parameter name, scheduler, step), gathered to rank 0
  under FSDP: it loads on any number of ranks, at the price of the whole state in rank 0's memory.
- `sharded`: every rank writes its own shards under `dcp/` (torch.distributed.checkpoint), in
  parallel; DCP reshards on load. There is no HF weights file in it.
`load` tells the formats apart by the files (a `dcp/` directory); `load_weights` reads the weights
of either into one process, with no process group (`agentgrpo eval`). Reading a checkpoint never
runs code: `learner.pt` with `weights_only=True`, DCP's pickled `.metadata` through an unpickler
that builds only DCP's own records (`_METADATA_TYPES`) and raises `UnsafeCheckpoint` on any other
name. The threat: docs/security.md ("Checkpoints"); the formats: docs/learner.md.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
import torch.serialization
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from agentgrpo.learner.lora import adapter_weights
from agentgrpo.models.embedded import read_safetensors

if TYPE_CHECKING:
    from agentgrpo.learner.learner import Learner


class UnsafeCheckpoint(ValueError):
    """A checkpoint file asks to run code (or to read outside its directory) when it is read."""


# Every name a `.metadata` that torch's FileSystemWriter wrote refers to (torch 2.13): DCP's
# records, torch.Size, dtypes and layouts (looked up by name), and the path it was saved to.
_METADATA_TYPES = {
    ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_filesystem._StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "WindowsPath"): pathlib.PurePosixPath,  # a checkpoint written on Windows: inert
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata records and nothing else: any other name is refused before it is
    looked up, so a planted `.metadata` cannot call anything (os.system, open, eval...)."""

    def find_class(self, module: str, name: str) -> Any:
        found = _METADATA_TYPES.get((module, name))
        dtype = getattr(torch, name, None) if module == "torch" else None
        if found is None and isinstance(dtype, torch.dtype):
            found = dtype
        if found is None:
            raise UnsafeCheckpoint(
                f"its DCP metadata names {module}.{name}, which is not one of DCP's metadata "
                "types: refused without unpickling it (agentgrpo never runs code from a "
                "checkpoint; this one was not written by torch.distributed.checkpoint, or was "
                "altered since)"
            )
        return found


class _SafeReader(dcp.FileSystemReader):
    """torch's DCP reader, with `.metadata` read by `_MetadataUnpickler` and every data file kept
    inside the checkpoint's directory."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = Path(self.path) / ".metadata"
        try:
            metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        except UnsafeCheckpoint as e:
            raise UnsafeCheckpoint(f"{path}: {e}") from None
        except (pickle.UnpicklingError, EOFError, TypeError, AttributeError) as e:
            raise UnsafeCheckpoint(
                f"{path}: unreadable DCP metadata ({type(e).__name__}: {e})"
            ) from None
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise UnsafeCheckpoint(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
        for info in (metadata.storage_data or {}).values():
            # A plain str only: a pickled PosixPath can print as a harmless name while its parts
            # (what DCP joins to the directory) lead elsewhere.
            name = getattr(info, "relative_path", None)
            if type(name) is not str:
                raise UnsafeCheckpoint(
                    f"{path}: names a data file by a {type(name).__name__}, not a file name"
                )
            if not name or "/" in name or "\\" in name or "\0" in name or name in (".", ".."):
                raise UnsafeCheckpoint(f"{path}: names data file {name!r} outside its directory")
            if (Path(self.path) / name).is_symlink():
                raise UnsafeCheckpoint(f"{path}: data file {name!r} is a symbolic link")
        if metadata.storage_meta is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values with `weights_only=True` (its own
    reads them with `weights_only=False`)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _dcp_load(state: dict[str, Any], directory: Path, *, no_dist: bool) -> None:
    reader = _SafeReader(directory)
    reader.read_metadata()  # first, so a refusal raises as itself (dcp.load wraps what it raises)
    dcp.load(state, storage_reader=reader, planner=_SafePlanner(), no_dist=no_dist)


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s unsharded state dict on rank 0's CPU, keyed by parameter name (empty on other
    ranks when there are several)."""
    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def save(learner: Learner, directory: Path) -> None:
    schedule = {"scheduler": learner.scheduler.state_dict(), "step": learner.step}
    optimizer = learner.optimizer.optimizer  # under accelerate's wrapper
    if learner.cfg.checkpoint_format == "sharded":
        model_sd, optim_sd = get_state_dict(learner.model, optimizer)
        dcp.save(
            {"model": model_sd, "optim": optim_sd},
            checkpoint_id=directory / "dcp",
            no_dist=learner.accelerator.num_processes == 1,
        )
        if learner.is_main:
            torch.save(schedule, directory / "learner.pt")
        return
    weights = full_weights(learner.model)
    optim = get_optimizer_state_dict(
        learner.model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if not learner.is_main:
        return
    sd = {k.removeprefix("model."): v for k, v in weights.items()}
    learner.unwrapped.save_pretrained(directory, state_dict=sd, safe_serialization=True)
    torch.save({"optimizer": optim, **schedule}, directory / "learner.pt")


def load(learner: Learner, directory: Path) -> None:
    if (directory / "dcp").is_dir():
        _load_sharded(learner, directory)
    else:
        _load_full(learner, directory)


def _load_full(learner: Learner, directory: Path) -> None:
    _load_full_weights(
        learner.model, learner.unwrapped, directory, lora=learner.cfg.lora is not None
    )
    st = torch.load(directory / "learner.pt", weights_only=True, map_location="cpu")
    set_optimizer_state_dict(
        learner.model,
        learner.optimizer.optimizer,
        st["optimizer"],
        options=StateDictOptions(full_state_dict=True),
    )
    _load_schedule(learner, st)


def _load_full_weights(
    policy: torch.nn.Module, model: torch.nn.Module, directory: Path, *, lora: bool
) -> None:
    """The weights of a full-format checkpoint into `policy` (the learner's `PolicyForward`, plain,
    DDP or FSDP-sharded) whose transformers or peft model is `model`; ValueError if they do not
    fit."""
    if lora:
        weights = adapter_weights(model, directory)
        needed = [n for n, _ in model.named_parameters() if "lora_" in n]
    else:
        weights = read_safetensors(directory)
        needed = list(model.state_dict())
        if getattr(model.config, "tie_word_embeddings", False):  # lm_head is saved once
            needed = [k for k in needed if k != "lm_head.weight"]
    known = set(model.state_dict())
    missing = [k for k in needed if k not in weights]
    unexpected = [k for k in weights if k not in known]
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {directory} does not match the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    full = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(policy, {f"model.{k}": v for k, v in weights.items()}, options=full)


def _load_sharded(learner: Learner, directory: Path) -> None:
    # The live (sharded) state dicts are the template: DCP reads into them, resharding when the
    # checkpoint was written by another number of ranks; a missing key raises (RuntimeError).
    model_sd, optim_sd = get_state_dict(learner.model, learner.optimizer.optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    _dcp_load(state, directory / "dcp", no_dist=learner.accelerator.num_processes == 1)
    set_state_dict(
        learner.model,
        learner.optimizer.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
    )
    _load_schedule(
        learner, torch.load(directory / "learner.pt", weights_only=True, map_location="cpu")
    )


def _load_schedule(learner: Learner, st: dict[str, Any]) -> None:
    learner.scheduler.load_state_dict(st["scheduler"])
    learner.step = int(st["step"])


def load_weights(policy: torch.nn.Module, directory: Path, *, lora: bool) -> None:
    """Only the model weights of the checkpoint in `directory`, either format, into `policy`, in
    this one process: no process group, no optimizer state read (what evaluation needs).

    `policy` is a plain `PolicyForward` around the model built as the learner builds it (the peft
    model when `lora`), so its parameter names are the ones the learner saved. A sharded
    checkpoint's tensors are assembled from however many ranks wrote them (DCP reads the full
    tensors of `policy` as its template, `no_dist`), and only the `model` part of its state is
    requested, so the optimizer's shards are not read. Raises ValueError or RuntimeError (a missing
    key) when the checkpoint does not fit the model.
    """
    if not (directory / "dcp").is_dir():
        _load_full_weights(policy, policy.model, directory, lora=lora)
        return
    model_sd = get_model_state_dict(policy)
    _dcp_load({"model": model_sd}, directory / "dcp", no_dist=True)
    set_model_state_dict(policy, model_sd)


def holds_lora(directory: Path) -> bool:
    """Whether the checkpoint in `directory` was written by a LoRA run (its weights are
    adapters)."""
    if (directory / "dcp").is_dir():
        names = _SafeReader(directory / "dcp").read_metadata().state_dict_metadata
        return any(".lora_A." in name for name in names)
    return (directory / "adapter_model.safetensors").is_file()
