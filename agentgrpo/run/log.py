"""The run directory's logs: metrics.jsonl, trajectories.jsonl, TensorBoard events, optional W&B.

A run directory holds `config.yaml` (the effective config, secrets masked by `mask_secrets`),
`metrics.jsonl` (one object per step), `trajectories.jsonl` (one object per trajectory),
`tensorboard/` and `checkpoints/`. Lines are flushed as they are written, so a killed run keeps
everything it logged. A resumed run moves the rows of the steps it trains again to
`*.after-step-<K>.jsonl` (`set_aside_after`), so the logs hold each step once. `agentgrpo report`
(report.py) turns them into one HTML page; `Progress` (progress.py, re-exported here) is the
terminal's view of a run.

W&B is used only when `log.wandb_project` is set, and `wandb` is imported only then. Its API key
comes from `WANDB_API_KEY` or `wandb login`, never from the config, and the config sent to it is
masked. `RUN_DIR/wandb_id` keeps the W&B run id, so a resumed run continues the same W&B run.
"""

from __future__ import annotations

import json
import math
import os
import re
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentgrpo.run.progress import Progress  # noqa: F401 - re-exported: callers import it here
from agentgrpo.types import Advantage, Group

if TYPE_CHECKING:
    from agentgrpo.run.config import RunConfig

SECRET_WORDS = (
    "key",
    "keys",
    "token",
    "secret",
    "secrets",
    "password",
    "passwords",
    "passwd",
    "pass",
    "authorization",
    "auth",
    "bearer",
    "credential",
    "credentials",
    "cookie",
    "cookies",
    "signature",
    "signatures",
)
_BEARER = re.compile(r"^\s*(bearer|basic|token)\s+\S", re.IGNORECASE)
# Values that are credentials whatever their key is called: the prefixes of common API keys
# (OpenAI/Anthropic `sk-`, Hugging Face `hf_`, GitHub `ghp_`/`github_pat_`, Slack `xox?-`, AWS
# `AKIA`, W&B's 40 hex digits are too like a hash to tell), followed by 8 or more key characters:
# a self-hosted server's key can be that short (issue 42: `sk-` + 8 was written in clear), and
# masking a value that only looks like a key costs less than writing a key out.
_KEY_LIKE = re.compile(r"\b(?:sk-|hf_|gh[pousr]_|github_pat_|xox[abprs]-|AKIA)[A-Za-z0-9_\-]{8,}")
_URL_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.\-]*://)[^/@\s]+@")
_URL_PARAM = re.compile(r"(?P<name>[?&;][^=&#;\s]+=)(?P<value>[^&#;\s]*)")


def _secret_key(key: Any) -> bool:
    """A key one of whose `_`/`-`/`.`-separated words ends in a secret word: api_key, apiKey,
    api_keys, hf_token, password, Authorization; not row_tokens or max_tokens (counts, not
    tokens)."""
    return any(w.endswith(SECRET_WORDS) for w in re.split(r"[_\-.]", str(key).lower()))


def _masked(v: Any) -> Any:
    """Everything under a secret key: strings masked, at any depth (lists and dicts of keys too)."""
    if isinstance(v, str):
        return "***" if v else v
    if isinstance(v, dict):
        return {k: _masked(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_masked(x) for x in v]
    return v


def _masked_text(text: str) -> str:
    """`text` with API-key-looking values, URL credentials (`user:pass@`) and the values of
    secret-named URL parameters (`?api_key=...`) replaced by '***'."""
    if _BEARER.match(text):
        return "***"
    text = _KEY_LIKE.sub("***", text)
    text = _URL_USERINFO.sub(r"\g<scheme>***@", text)
    return _URL_PARAM.sub(
        lambda m: m["name"] + "***" if _secret_key(m["name"][1:-1]) and m["value"] else m[0], text
    )


def mask_secrets(obj: Any) -> Any:
    """Replace the strings under keys that look like secrets (api_key, api_keys, token, passwd,
    signature, Authorization, ...), at any depth below them, with '***'; elsewhere, strings that
    carry an HTTP credential (`Bearer ...`) entirely, and the API-key-looking values (`sk-...`),
    URL credentials (`https://user:pass@host`) and secret URL parameters within strings."""
    if isinstance(obj, dict):
        return {k: (_masked(v) if _secret_key(k) else mask_secrets(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [mask_secrets(v) for v in obj]
    if isinstance(obj, str):
        return _masked_text(obj)
    return obj


def _finite(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


class RunLogger:
    """Writes a run's metrics and trajectories: JSONL always, TensorBoard and W&B when enabled.

    Example (JSONL only; a run makes its logger with `RunLogger.from_config(run_dir, cfg)`):
        >>> import pathlib, tempfile
        >>> from agentgrpo.run.log import RunLogger
        >>> with tempfile.TemporaryDirectory() as run_dir:
        ...     logger = RunLogger(pathlib.Path(run_dir), tensorboard=False)
        ...     logger.log_step(1, {"reward_mean": 0.5, "loss": float("nan")})  # NaN: null
        ...     logger.close()
        ...     print(pathlib.Path(run_dir, "metrics.jsonl").read_text(), end="")
        {"step": 1, "reward_mean": 0.5, "loss": null}
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        tensorboard: bool = True,
        wandb_project: str | None = None,
        wandb_entity: str | None = None,
        wandb_name: str | None = None,
        config: dict[str, Any] | None = None,
        fresh: bool = False,
    ) -> None:
        """`fresh=True` replaces the JSONL files a directory already holds (an evaluation's);
        otherwise they are appended to (a resumed run)."""
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        # W&B first: a missing package or a bad login fails before any file is opened
        self._wandb = (
            self._init_wandb(wandb_project, wandb_entity, wandb_name, config)
            if wandb_project
            else None
        )
        mode = "w" if fresh else "a"
        self._metrics = open(run_dir / "metrics.jsonl", mode, encoding="utf-8")
        self._trajs = open(run_dir / "trajectories.jsonl", mode, encoding="utf-8")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))

    @classmethod
    def from_config(cls, run_dir: Path, cfg: RunConfig) -> RunLogger:
        """The logger a training run's `log:` section asks for (the config goes to W&B, masked)."""
        log = cfg.log
        return cls(
            run_dir,
            tensorboard=log.tensorboard,
            wandb_project=log.wandb_project,
            wandb_entity=log.wandb_entity,
            wandb_name=log.wandb_name,
            config=cfg.model_dump(mode="json"),
        )

    def _init_wandb(
        self, project: str, entity: str | None, name: str | None, config: dict[str, Any] | None
    ):
        try:
            import wandb
        except ImportError as e:
            raise ImportError(
                "log.wandb_project is set but wandb is not installed: "
                "pip install 'agentgrpo[wandb]' (or unset log.wandb_project)"
            ) from e
        id_file = self.run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:16]
        id_file.write_text(run_id + "\n")
        return wandb.init(
            project=project,
            entity=entity,
            name=name or self.run_dir.name,
            id=run_id,
            resume="allow",
            dir=str(self.run_dir),
            config=mask_secrets(config or {}),
        )

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: _finite(v) for k, v in metrics.items()}}
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        scalars = {
            k: v
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        }
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def log_groups(
        self, step: int, groups: Iterable[Group], advantages: Mapping[str, Advantage] | None = None
    ) -> None:
        """One row per trajectory: its record joined with its score and advantage (by id; a
        trajectory without an advantage was not trained on: `advantage` null)."""
        advantages = advantages or {}
        for g in groups:
            for t in g.trajectories:
                row = t.to_dict(g.score(t), advantages.get(t.id))
                self._trajs.write(json.dumps({"step": step, **row}) + "\n")
        self._trajs.flush()

    def close(self) -> None:
        self._metrics.close()
        self._trajs.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def set_aside_after(run_dir: Path, step: int) -> dict[str, int]:
    """Move the rows of steps after `step` out of `metrics.jsonl` and `trajectories.jsonl` into
    `metrics.after-step-<step>.jsonl` / `trajectories.after-step-<step>.jsonl` beside them
    (nothing is deleted), and return how many rows each file gave up.

    A run resumed from the checkpoint of `step` trains the later steps again; their old rows, from
    the timeline the kill cut off, would otherwise stand twice in the logs and the report. A line
    that does not parse (a kill in the middle of a write) goes aside too. Files that lose no row
    are only read; the others are rewritten through a temporary file and a rename. Each call's rows
    are one timeline and get files of their own: a second resume to the same step writes
    `*.after-step-<step>.2.jsonl`, a third `.3`, ... (`aside_name` says which), never appending
    one timeline to another's file.
    """
    n = 1
    while any(aside_path(run_dir, name, step, n).exists() for name in _LOGS):
        n += 1
    moved: dict[str, int] = {}
    for name in _LOGS:
        path = run_dir / name
        if not path.is_file():
            continue
        with open(path, "rb") as src:  # a streamed read-only pass first: most resumes move nothing
            moved[name] = sum(not _kept(line, step) for line in src if line.strip())
        if not moved[name]:
            continue
        tmp = run_dir / f".{name}.tmp"
        with (
            open(path, "rb") as src,
            open(tmp, "wb") as keep,
            open(aside_path(run_dir, name, step, n), "xb") as aside,
        ):
            for line in src:
                if line.strip():
                    (keep if _kept(line, step) else aside).write(_ended(line))
            keep.flush()
            os.fsync(keep.fileno())
        os.replace(tmp, path)
    return moved


_LOGS = ("metrics.jsonl", "trajectories.jsonl")


def aside_path(run_dir: Path, name: str, step: int, n: int = 1) -> Path:
    """Where the `n`-th timeline set aside after `step` from log `name` goes."""
    stem, nth = name.removesuffix(".jsonl"), "" if n == 1 else f".{n}"
    return run_dir / f"{stem}.after-step-{step}{nth}.jsonl"


def aside_name(run_dir: Path, name: str, step: int) -> str:
    """The file name the latest `set_aside_after(run_dir, step)` gave log `name`'s rows."""
    n = 1
    while any(aside_path(run_dir, log, step, n + 1).exists() for log in _LOGS):
        n += 1
    return aside_path(run_dir, name, step, n).name


_STEP_PREFIX = re.compile(rb'\{"step": (\d+)[,}]')  # how RunLogger starts every row


def _kept(line: bytes, step: int) -> bool:
    """Whether a row belongs to a step up to `step`; read from its prefix, else parsed (a cut line
    is not kept)."""
    if line.endswith(b"\n") and (m := _STEP_PREFIX.match(line)):  # a whole line, as written
        return int(m.group(1)) <= step
    try:
        row_step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return False
    return isinstance(row_step, int) and row_step <= step


def _ended(line: bytes) -> bytes:
    return line if line.endswith(b"\n") else line + b"\n"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
