"""Typed run configuration: YAML file + dotted command-line overrides, validated at start-up.

Each stage owns its config model next to its code (`RolloutConfig` in rollout.py, `LossConfig`
in loss.py, `EngineConfig` in engine/config.py, ...); this module composes them and holds the
run-level settings (model, env, train loop, evaluation, logging), so that the run-level modules
(train, evaluate, log, ...) import it and it imports none of them. Every model forbids unknown
keys, so a misspelt key is an error that names it instead of a setting silently ignored.
"""

from __future__ import annotations

import inspect
import traceback
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from agentgrpo.algo.advantage import AdvantageConfig
from agentgrpo.algo.loss import LossConfig
from agentgrpo.algo.shaping import ShapingConfig
from agentgrpo.chat.format import ChatFormat
from agentgrpo.chat.shipped import load_template
from agentgrpo.checks.reward_audit import AuditConfig
from agentgrpo.engine.config import EngineConfig
from agentgrpo.engine.weight_sync import WeightSyncConfig
from agentgrpo.env.base import Env, get_env_class, tasks_from_file
from agentgrpo.learner.learner import LearnerConfig
from agentgrpo.rollout.episode import EpisodeLimits, RolloutConfig
from agentgrpo.run.log import mask_secrets
from agentgrpo.types import Task


class ConfigError(ValueError):
    """A config file or override is invalid; the message names each offending key."""


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(
        None, description="model directory; None = the embedded SmolLM2-135M-Instruct"
    )
    chat_template: str | None = Field(
        None,
        description="the chat template overriding the tokenizer's: a Jinja file, or the name of "
        "one shipped in agentgrpo/chat/templates/ (qwen2_5, qwen3, llama3_1, gptoss, ...)",
    )
    tool_parser: str = Field(
        "auto",
        description="tool-call parser name (agentgrpo.chat.parsers."
        "PARSERS: hermes, llama3_json, qwen3_xml, glm4, deepseek_v3, harmony, "
        "pythonic) or auto: the one for the chat template's format",
    )
    end_of_turn: list[str] | None = Field(
        None,
        description="the tokens that end an assistant turn, all of them stop tokens; None = "
        "detected from the chat template (GPT-OSS: [<|call|>, <|return|>]; GLM-4.5: "
        "[<|observation|>, <|user|>], its turn ending at the next message's role token), else "
        "the tokenizer's EOS. Given, they override the detection",
    )


class EnvConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("calculator", description="registered env name or module:Class")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="env constructor arguments")
    tasks: dict[str, Any] = Field(default_factory=dict, description="arguments of Env.load_tasks")
    audit: AuditConfig = Field(
        default_factory=AuditConfig,
        description="the verifier audits: known reward hacks at start-up, flaky verdicts in "
        "training (agentgrpo.checks.reward_audit)",
    )

    def env_class(self) -> type[Env]:
        """The class `name` names; a name that names none is a ConfigError (env.name)."""
        try:
            return get_env_class(self.name)
        except ValueError as e:
            raise ConfigError(f"env.name: {e}") from None

    def load_tasks(self, env_cls: type[Env], split: str, seed: int) -> list[Task]:
        """`env_cls.load_tasks(split, seed, **tasks)`. An env with no task source, arguments its
        `load_tasks` (or `tasks_from_file`) does not take, a task file that is missing or has a bad
        row, and a TypeError or ValueError raised by a custom `load_tasks` (how one rejects options
        it takes through `**kwargs`, or values out of range) are ConfigErrors (env.tasks) that name
        where it was raised; anything else a custom `load_tasks` raises is its own."""
        args = dict(self.tasks)
        file = args.pop("file", None)
        if isinstance(file, str):
            try:
                file.format(split=split)
            except (KeyError, IndexError, ValueError) as e:
                raise ConfigError(
                    f"env.tasks.file {file!r}: {{split}} is the only placeholder it may "
                    f"hold (double other braces): {e!r}"
                ) from None
        try:
            inspect.signature(env_cls.load_tasks).bind(split, seed=seed, **self.tasks)
            if (
                file is not None
                and getattr(env_cls.load_tasks, "__func__", None) is Env.load_tasks.__func__
            ):
                inspect.signature(tasks_from_file).bind(file, split=split, **args)
        except TypeError as e:
            raise ConfigError(
                f"env.tasks: {env_cls.__name__}.load_tasks cannot take {self.tasks}: {e}"
            ) from None
        try:
            tasks = env_cls.load_tasks(split, seed=seed, **self.tasks)
            if isinstance(tasks, Iterable):
                return list(tasks)
        except NotImplementedError as e:
            raise ConfigError(f"env.tasks: {e}") from None
        except OSError as e:
            if file is None:
                raise
            raise ConfigError(
                f"env.tasks.file: cannot read the tasks of split {split!r}: {e}"
            ) from None
        except (TypeError, ValueError) as e:
            if file is not None:
                if isinstance(e, TypeError):
                    raise
                raise ConfigError(f"env.tasks.file: {e}") from None
            # the deepest line of the env's own file (a library it called may have raised), else the
            # raise itself; the whole traceback stays on the ConfigError as its cause
            frames = traceback.extract_tb(e.__traceback__)
            try:
                own = inspect.getsourcefile(env_cls)
            except (
                TypeError,
                OSError,
            ):  # defined in __main__ without a file (a notebook, python -c)
                own = None
            where = next((f for f in reversed(frames) if f.filename == own), frames[-1])
            raise ConfigError(
                f"env.tasks {self.tasks}: {env_cls.__name__}.load_tasks({split!r}) raised "
                f"{type(e).__name__}: {e} (at {where.filename}:{where.lineno})"
            ) from e
        raise ConfigError(
            f"env.tasks: {env_cls.__name__}.load_tasks({split!r}) returned "
            f"{type(tasks).__name__}, not a list of Task"
        )


class MixtureEntry(EnvConfig):
    """One environment of a mixture (`envs:`): any env, its weight, and its own episode limits."""

    weight: float = Field(1.0, gt=0, description="its share of the tasks drawn (by weight)")
    label: str | None = Field(
        None,
        description="its name in metrics (env/<label>/...), task ids and the report; default: "
        "the env's name, numbered when two entries share it",
    )
    rollout: dict[str, Any] = Field(
        default_factory=dict,
        description="episode limits of this env's episodes over the run's rollout settings: "
        f"{', '.join(EpisodeLimits.model_fields)}",
    )

    @model_validator(mode="after")
    def _limits_only(self) -> MixtureEntry:
        unknown = sorted(set(self.rollout) - set(EpisodeLimits.model_fields))
        if unknown:
            raise ValueError(
                f"rollout {unknown}: an env of a mixture may set only episode limits "
                f"({', '.join(EpisodeLimits.model_fields)}); sampling and batch settings are "
                "the run's"
            )
        if self.label is not None and not self.label.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"label {self.label!r}: letters, digits, _ and - only")
        return self


class TrainLoopConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    steps: int = Field(20, ge=0, description="optimizer steps")
    save_every: int = Field(0, ge=0, description="checkpoint every K steps (0 = only at the end)")
    save_every_s: float | None = Field(
        600.0,
        gt=0,
        description="also checkpoint after a step that starts training this many seconds after "
        "the last checkpoint (None = off): a SIGKILL or OOM kill loses at most this much work",
    )
    keep_checkpoints: int = Field(
        2,
        ge=1,
        description="checkpoints kept after each save: the one just written and the newest ones "
        "numbered below it; and as many of the newest rejected-step-* ones a resume set aside "
        "(agentgrpo.run.checkpoint.save)",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="how many updates behind the learner a trained sample may be (its policy lag: "
        "the learner's version minus the oldest weights that sampled any of its tokens). 0: each "
        "step samples, then trains (synchronous); 1: the next step samples while this one trains; "
        "k: groups are sampled continuously and each step takes the ready ones, never one beyond "
        "k. One scheduler runs them all (agentgrpo.run.pipeline)",
    )
    overlap_rollouts: bool = Field(
        False,
        description="deprecated, for existing configs: the same as max_staleness: 1",
    )

    @model_validator(mode="after")
    def _one_staleness(self) -> TrainLoopConfig:
        if self.overlap_rollouts:  # the old name: folded into the one the code reads
            if self.max_staleness not in (0, 1):
                raise ValueError(
                    f"train.overlap_rollouts is max_staleness: 1, but max_staleness is "
                    f"{self.max_staleness}; set only max_staleness"
                )
            self.max_staleness = 1
        return self


class LogConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tensorboard: bool = Field(True, description="write TensorBoard event files")
    progress: bool = Field(
        True,
        description="show a progress bar per step (one plain line per step when not a terminal)",
    )
    wandb_project: str | None = Field(
        None,
        description="Weights & Biases project; set it to log there too (pip install "
        "'agentgrpo[wandb]'; the API key comes from WANDB_API_KEY or `wandb login`, never from "
        "this config)",
    )
    wandb_entity: str | None = Field(
        None, description="W&B team or user; None = your default entity"
    )
    wandb_name: str | None = Field(
        None, description="W&B run name; None = the run directory's name"
    )

    @model_validator(mode="after")
    def _wandb_needs_a_project(self) -> LogConfig:
        orphans = [
            f"log.{k}" for k in ("wandb_entity", "wandb_name") if getattr(self, k) is not None
        ]
        if orphans and self.wandb_project is None:
            raise ValueError(
                f"{', '.join(orphans)} set without log.wandb_project: nothing would go to "
                "W&B; set log.wandb_project too, or drop them"
            )
        return self


class EvalConfig(BaseModel):
    """What `agentgrpo eval` samples and how it scores; sampling settings come from `rollout`."""

    model_config = ConfigDict(extra="forbid")

    split: str = Field("eval", description="task split passed to Env.load_tasks")
    every: int = Field(
        0, ge=0, description="during training: evaluate every K steps, logged as eval/* (0 = never)"
    )
    num_tasks: int | None = Field(
        100, ge=1, description="the first N tasks of the split (None = all)"
    )
    samples_per_task: int = Field(4, ge=1, description="trajectories per task (the n of pass@k)")
    pass_k: list[int] = Field(
        default_factory=lambda: [1], description="k values of pass@k, each <= samples_per_task"
    )
    success_threshold: float = Field(
        1.0, description="a trajectory passes when its reward is >= this"
    )
    checkpoint: str = Field(
        "latest",
        description="'latest' = newest intact checkpoint of output_dir (an "
        "error when it has none), 'none' = the base model, or a checkpoint "
        "directory (verified); any format: full, LoRA (set learner.lora as in "
        "training) or sharded",
    )
    output_dir: str | None = Field(
        None, description="where results go (None = <output_dir>/eval-<split>)"
    )

    @model_validator(mode="after")
    def _k_fits(self) -> EvalConfig:
        bad = [k for k in self.pass_k if not 1 <= k <= self.samples_per_task]
        if bad:
            raise ValueError(
                f"pass_k {bad}: each k must be between 1 and samples_per_task "
                f"({self.samples_per_task})"
            )
        return self


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    output_dir: str = Field(
        "runs/default", description="run directory (resumed if it holds a checkpoint)"
    )
    seed: int = Field(0, description="seed of task order, sampling and initialisation")
    deterministic: bool = Field(
        False,
        description="bit-identical runs: the same config on the same machine (threads, libraries) "
        "gives the same tokens, losses and weights at every step, also across a kill and resume. "
        "torch's deterministic algorithms for the whole process, and the local engine decodes one "
        "sequence at a time without its prefix cache (engine.max_batch_size: 1, "
        "engine.prefix_cache_tokens: 0, set here), since a row's logits change in their last bits "
        "with the rows batched beside it; not with SGLang, train.max_staleness >= 2 or "
        "engine.partial_rollouts, whose results depend on timing (docs/learner.md)",
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    envs: list[MixtureEntry] | None = Field(
        None,
        description="a mixture instead of env: tasks drawn from these envs by weight, each group "
        "from one env, metrics split by env (agentgrpo.run.mixture)",
    )
    engine: EngineConfig = Field(default_factory=EngineConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    shaping: ShapingConfig = Field(default_factory=ShapingConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    train: TrainLoopConfig = Field(default_factory=TrainLoopConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    log: LogConfig = Field(default_factory=LogConfig)

    def chat_format(self, tokenizer: Any) -> ChatFormat:
        """The chat format this run's rollouts use (training and evaluation alike): `tokenizer`
        with `model.chat_template` (or its own), `model.tool_parser` and the rollout's template
        settings."""
        path = self.model.chat_template
        return ChatFormat(
            tokenizer,
            template=load_template(path) if path else None,
            parser=self.model.tool_parser,
            end_of_turn=self.model.end_of_turn,
            fallback=self.rollout.template_fallback,
            template_kwargs=self.rollout.chat_template_kwargs,
            trajectory_mode=self.rollout.trajectory_mode,
        )

    @model_validator(mode="after")
    def _env_or_envs(self) -> RunConfig:
        if self.envs is not None:
            if "env" in self.model_fields_set:
                raise ValueError("set env (one environment) or envs (a mixture), not both")
            if not self.envs:
                raise ValueError("envs is empty: name at least one environment, or use env")
            for entry in self.envs:
                RolloutConfig.model_validate({**self.rollout.model_dump(), **entry.rollout})
        return self

    @model_validator(mode="after")
    def _off_policy_is_corrected(self) -> RunConfig:
        # Samples up to max_staleness updates old: an importance correction against the sampling
        # logprobs is required (verl's rollout correction, TRL's vllm_importance_sampling_*), and
        # both need the learner's own pi_old (`_tis_has_two_logprobs`).
        k = self.train.max_staleness
        if k and self.loss.tis == "none" and self.loss.mis == "none":
            raise ValueError(
                f"train.max_staleness={k} trains on samples from weights up to {k} update(s) old, "
                "and no importance correction is set: set "
                "loss.tis (token | sequence) or loss.mis (token | sequence | geometric), with "
                "learner.old_logprobs: recompute"
            )
        return self

    @model_validator(mode="after")
    def _tis_has_two_logprobs(self) -> RunConfig:
        # TIS and MIS weigh pi_old against the engine's sampling logprobs; with old_logprobs=rollout
        # pi_old is those logprobs, the learner has no second set to pass, and every step would
        # raise.
        if self.loss.tis != "none" and self.learner.old_logprobs != "recompute":
            raise ValueError(
                f"loss.tis={self.loss.tis} needs learner.old_logprobs=recompute: TIS weighs "
                "tokens by min(pi_old / pi_rollout, loss.tis_cap) with pi_old recomputed by the "
                f"learner, and with learner.old_logprobs={self.learner.old_logprobs} pi_old is "
                "the rollout's own logprobs; set learner.old_logprobs: recompute, or loss.tis: none"
            )
        if self.loss.mis != "none" and self.learner.old_logprobs != "recompute":
            raise ValueError(
                f"loss.mis={self.loss.mis} needs learner.old_logprobs=recompute: MIS weighs "
                "tokens by pi_old / pi_rollout and rejects those outside [loss.mis_low, "
                "loss.mis_high], with pi_old recomputed by the learner; with "
                f"learner.old_logprobs={self.learner.old_logprobs} pi_old is the rollout's own "
                "logprobs (the ratio is always 1); set learner.old_logprobs: recompute, or "
                "loss.mis: none"
            )
        return self

    @model_validator(mode="after")
    def _deterministic_runs(self) -> RunConfig:
        # What timing decides cannot repeat bit for bit: refused; the local engine's batching
        # (which rows share a decode step) is taken out of the numbers by decoding one at a time.
        if not self.deterministic:
            return self
        timed = {
            f"engine.kind={self.engine.kind} (the servers batch requests as they arrive)": (
                self.engine.kind in ("sglang", "vllm")
            ),
            f"train.max_staleness={self.train.max_staleness} (which groups a step trains "
            "depends on when they finish)": self.train.max_staleness >= 2,
            "engine.partial_rollouts (an update lands at whichever decode step it meets)": (
                self.engine.partial_rollouts
            ),
            "shaping.dynamic_sampling with train.max_staleness=1 (which step a replacement group "
            "fills depends on when the groups it replaces finish)": (
                self.shaping.dynamic_sampling and self.train.max_staleness == 1
            ),
        }
        if clash := [name for name, on in timed.items() if on]:
            raise ValueError(f"deterministic: true cannot hold with {'; '.join(clash)}")
        for name, value in (("max_batch_size", 1), ("prefix_cache_tokens", 0)):
            given = getattr(self.engine, name)
            if name in self.engine.model_fields_set and given != value:
                raise ValueError(
                    f"deterministic: true decodes one sequence at a time without a prefix cache "
                    f"(a row's logits change with the rows batched beside it), but engine.{name} "
                    f"is {given}; leave it unset or set {value}"
                )
            setattr(self.engine, name, value)
        return self

    @model_validator(mode="after")
    def _mini_batches_fit(self) -> RunConfig:
        # Mini-batches hold whole groups: more of them than groups per step would silently be fewer.
        if self.learner.mini_batches > self.rollout.tasks_per_step:
            raise ValueError(
                f"learner.mini_batches={self.learner.mini_batches} but a step has "
                f"rollout.tasks_per_step={self.rollout.tasks_per_step} groups, and a "
                "mini-batch holds whole groups: at most tasks_per_step mini-batches"
            )
        return self

    @model_validator(mode="after")
    def _overlong_buffer_fits(self) -> RunConfig:
        # checked here, at start-up, not at the first train step after the first rollouts
        buffer = self.shaping.overlong_buffer_len
        if buffer is not None and buffer > self.rollout.max_tokens:
            raise ValueError(
                f"shaping.overlong_buffer_len={buffer} is longer than rollout.max_tokens="
                f"{self.rollout.max_tokens}, the length it counts back from"
            )
        return self

    @model_validator(mode="after")
    def _released_while_training_only(self) -> RunConfig:
        # Overlapped steps sample while the learner trains: the servers' memory cannot be lent then.
        sglang, k = self.engine.sglang, self.train.max_staleness
        if sglang is not None and sglang.release_memory_during_training and k:
            raise ValueError(
                "engine.sglang.release_memory_during_training with train.max_staleness="
                f"{k}: the servers sample while the learner trains, so they "
                "cannot free their memory meanwhile; turn one of them off"
            )
        return self


def _field_annotation(model: type[BaseModel], parts: list[str]) -> Any:
    """The type annotation of the setting at dotted path `parts` of `model`; None where the path
    leaves the typed models (an unknown key, or inside a free-form dict such as env.kwargs)."""
    annotation: Any = model
    for p in parts:
        options = (
            get_args(annotation)
            if get_origin(annotation) in (Union, types.UnionType)
            else (annotation,)
        )
        sub = [
            o
            for o in options
            if get_origin(o) is None and isinstance(o, type) and issubclass(o, BaseModel)
        ]
        if not sub or p not in sub[0].model_fields:
            return None
        annotation = sub[0].model_fields[p].annotation
    return annotation


def _is_text(annotation: Any) -> bool:
    """Whether a setting holds only text: `str` or `str | None` (not a list, dict, number, ...)."""
    options = (
        get_args(annotation)
        if get_origin(annotation) in (Union, types.UnionType)
        else (annotation,)
    )
    return str in options and all(o in (str, type(None)) for o in options)


def apply_override(
    data: dict[str, Any], override: str, model: type[BaseModel] | None = None
) -> None:
    """Apply `a.b.c=value` to a nested dict; the value is parsed as YAML (`3` is a number, `[1, 2]`
    a list, `null` None), except that a text setting of `model` (a `str` or `str | None` field) gets
    the text as written: `output_dir=2024` is the directory "2024", `log.wandb_name=run #1` keeps
    its `#1`. There only a quoted value (`'"x"'`, quotes removed) and `null` / `~` (None, where the
    field allows it) are read as YAML."""
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like key.path=value")
    key, _, raw = override.partition("=")
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {override!r}: empty key segment")
    node = data
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {p!r} is not a section")
        node = child
    text = raw.strip()
    if model is not None and _is_text(_field_annotation(model, parts)):
        quoted = len(text) >= 2 and text[0] == text[-1] and text[0] in "'\""
        value: Any = (
            _yaml_value(override, text) if quoted or text in ("null", "Null", "NULL", "~") else text
        )
    else:
        value = _yaml_value(override, text) if text else ""
    node[parts[-1]] = value


def _yaml_value(override: str, text: str) -> Any:
    return load_yaml(text, f"override {override!r}: the value")


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


# The most values (each scalar, list and mapping counts one) a config may hold once YAML's aliases
# are expanded. Real configs hold a few hundred; aliases of aliases grow exponentially (a 373-byte
# file once expanded to an 18 MB config.yaml, one level more to hours of dumping).
MAX_CONFIG_VALUES = 100_000


def check_expanded_size(data: Any, what: str) -> None:
    """ConfigError when `data` (as YAML loaded it, aliases shared, not copied) expands to more than
    MAX_CONFIG_VALUES values, or holds itself (a recursive alias). Counts each shared collection
    once per reference without walking it again, so a bomb is refused in time linear in the file."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()

    def size(node: Any) -> int:
        if not isinstance(node, (dict, list)):
            return 1
        if id(node) in sizes:
            return sizes[id(node)]
        if id(node) in open_:
            raise ConfigError(f"{what}: a YAML alias refers to a collection holding it (a cycle)")
        open_.add(id(node))
        items = [x for kv in node.items() for x in kv] if isinstance(node, dict) else node
        n = 1
        for item in items:
            n += size(item)
            if n > MAX_CONFIG_VALUES:
                raise ConfigError(
                    f"{what}: expands to over {MAX_CONFIG_VALUES} values through YAML aliases "
                    "(`*name` repeating an `&name` anchor, nested); write the values out or "
                    "shorten them"
                )
        open_.discard(id(node))
        sizes[id(node)] = n
        return n

    try:
        size(data)
    except RecursionError:
        raise ConfigError(f"{what}: nested too deeply") from None


def load_yaml(text: str, what: str) -> Any:
    """`text` parsed as YAML (safe_load: plain data, no tags that build objects), refused when its
    aliases expand it past MAX_CONFIG_VALUES (`check_expanded_size`); ConfigError names `what`."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} is not valid YAML: {_one_line(e)}") from None
    except RecursionError:
        raise ConfigError(f"{what}: nested too deeply") from None
    check_expanded_size(data, what)
    return data


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """The validated run config of YAML file `path` (None: the defaults) with `key.path=value`
    overrides applied in order (see `apply_override`); ConfigError names the file, the override or
    each invalid key when something is wrong (a missing file and YAML syntax errors included)."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"cannot read the config file {path}: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path} is not valid YAML: {_one_line(e)}") from None
        data = load_yaml(text, str(path)) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
    for o in overrides:
        apply_override(data, o, RunConfig)
    check_expanded_size(data, f"the config {path or ''} with its overrides".replace("  ", " "))
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"])
            msg = (
                "unknown key (not a setting of this section)"
                if err["type"] == "extra_forbidden"
                else err["msg"]
            )
            msg = msg.removeprefix("Value error, ")  # a validator's own message names its keys
            lines.append(f"  {loc}: {msg}" if loc else f"  {msg}")
        raise ConfigError(
            f"invalid config{f' {path}' if path else ''}:\n" + "\n".join(lines)
        ) from None


def dump_config(cfg: RunConfig) -> str:
    """The effective config as YAML, secrets masked (a mixture's without the unused `env`)."""
    data = cfg.model_dump(mode="json", exclude={"env"} if cfg.envs is not None else None)
    return yaml.safe_dump(mask_secrets(data), sort_keys=False)
