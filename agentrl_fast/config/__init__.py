"""Typed run configuration: dataclasses, YAML files (``configs/``) and command-line overrides.

A :class:`RunConfig` nests the environment, the tiny model, the warm-start, the trainer
(:class:`~agentrl_fast.train.TrainConfig`, which nests the rollout
:class:`~agentrl_fast.harness.RolloutConfig` and its
:class:`~agentrl_fast.harness.SamplingParams`) and the evaluation. :func:`load_config` reads a
YAML file over the defaults; :func:`apply_overrides` applies ``section.field=value`` strings
(values parsed as YAML scalars). Unknown fields and wrong types fail at once with the dotted
name of the field; values are checked by the dataclasses themselves (``TrainConfig``,
``RolloutConfig``, ``SamplingParams`` raise naming the field) and by :func:`validate`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path


from agentrl_fast.config.distributed import DistributedConfig  # noqa: F401  (re-exported)
from agentrl_fast.config.errors import ConfigError  # noqa: F401  (re-exported)
from agentrl_fast.config.generator import GeneratorConfig
from agentrl_fast.config.rollout import RolloutConfig
from agentrl_fast.config.sampling import SamplingParams
from agentrl_fast.config.train import TrainConfig


@dataclass
class EnvConfig:
    """The environment: the built-in vault task (its fields here), the built-in dataset tool
    environment (``name: dataset``), or any object following the ``Environment`` protocol
    (``factory``); see docs/own-agent.md."""

    name: str = "vault"
    """``"vault"`` (the built-in memory task) or ``"dataset"`` (tasks from JSONL/Parquet files,
    tools from a module, a reward function: ``DatasetToolEnvironment``, configured by ``args``).
    Ignored when ``factory`` is set."""
    factory: str | None = None
    """``"package.module:callable"`` returning an ``Environment`` (name, tasks(split),
    start(task, memory, seed)), called with ``args`` as keyword arguments; the module is looked
    up on ``sys.path``, then in the working directory and the config file's folder."""
    args: dict = field(default_factory=dict)
    """Keyword arguments of ``factory``, or of ``DatasetToolEnvironment`` for
    ``name: dataset`` (relative file paths: the working directory, then the config's folder)."""
    min_vaults: int = 2
    """Vault task: fewest vaults a task asks for."""
    max_vaults: int = 3
    """Vault task: most vaults a task asks for."""
    jam_probability: float = 0.3
    """Vault task: chance a vault is jammed on its first opening (the model must retry)."""
    train_size: int = 10_000
    """Vault task: number of training tasks."""
    eval_size: int = 250
    """Vault task: number of held-out tasks (the warm-start's checks and the evaluation)."""
    error_penalty: float = 0.0
    """Vault task: reward subtracted per failed tool call, in [0, 1]."""


@dataclass
class ModelConfig:
    """The policy: a Hugging Face checkpoint (``path``) with its own tokenizer, or the tiny
    Qwen3-style model built in code (the shape fields) with the built-in tokenizer."""

    path: str | None = None
    """A Hugging Face causal-LM folder (or hub id) to train: loaded with ``from_pretrained``
    with its own tokenizer, which must have Qwen3's chat tokens; the critic starts from it. None:
    the built-in tiny model. A relative folder is looked up from the working directory, then
    the config file's folder."""
    dtype: str = "float32"
    """The weights' dtype when ``path`` is set: float32, bfloat16, float16 or auto (the
    checkpoint's own)."""
    tokenizer: str | None = None
    """A tokenizer folder ``AutoTokenizer`` loads instead of the model's own (with ``path``) or
    of the built-in one; it must have Qwen3's chat tokens."""
    hidden_size: int = 64
    """Built-in tiny model: hidden size."""
    num_layers: int = 2
    """Built-in tiny model: decoder layers."""
    num_heads: int = 4
    """Built-in tiny model: attention heads."""
    num_kv_heads: int = 2
    """Built-in tiny model: key/value heads (GQA when fewer than ``num_heads``)."""
    head_dim: int = 16
    """Built-in tiny model: dimension of each head."""
    vocab_size: int = 1024
    """Built-in tokenizer: most ids it learns from the environment's corpus."""
    fused_layers: bool = True
    """RMSNorm and SwiGLU on agentrl_fast's fused ops (Llama-family models: qwen3, qwen2, llama;
    other families keep their own layers)."""


@dataclass
class WarmStartConfig:
    """Supervised warm-start on expert demonstrations, stopped by a validation target.

    ``demos`` expert rollouts (the first train tasks) are imitated for at most ``steps`` AdamW
    steps at ``lr``, ``batch_sequences`` sub-traces a step. With ``target_success`` set, the
    policy runs greedily on ``check_tasks`` validation tasks every ``check_every`` steps (every
    ``fine_check_every`` once a check reaches ``fine_check_from``), and the warm-start ends when
    ``confirm_checks`` checks in a row reach ``target_success``, or at the first check
    ``max_fine_steps`` steps or more after the first fine check (None: no such cap). The
    validation tasks are the last held-out tasks, never among the ``eval.tasks`` of the final
    evaluation. Why a target and not a step count, two checks, a finer cadence and a cap: the
    supervised transition comes at a seed-dependent step, can be short, and can stall on a
    plateau where more steps over-train the policy (docs/experiments.md, warm-start stopping
    rule). ``load``: a saved warm-start (a run folder's ``warmstart.pt``) to start RL from
    instead (no demonstrations, no supervised steps).
    ``expert_save_probability`` / ``expert_read_probability`` / ``expert_retry_probability``
    below 1 make the expert careless (``expert_action``: it skips saving or reading back some
    codes, or gives up some jammed vaults), about every vault, or, with
    ``expert_careless_vaults`` < 1, about that share of vault names only (the same names in
    every task: a habit a policy can imitate, so its greedy decoding keeps it)."""

    demos: int = 2000
    steps: int = 800
    lr: float = 3e-3
    weight_decay: float = 0.0
    batch_sequences: int = 128
    target_success: float | None = 0.35
    check_every: int = 10
    check_tasks: int = 50
    confirm_checks: int = 2
    fine_check_every: int = 4
    fine_check_from: float = 0.2
    max_fine_steps: int | None = 200
    load: str | None = None
    # The main job's expert: careless about half the vault names (saves their codes in 30 % of
    # tasks), so the greedy warm-start keeps the habit (held out 0.3-0.4) and RL does the rest
    # (docs/experiments.md, "A habitual careless expert").
    expert_save_probability: float = 0.3
    expert_read_probability: float = 1.0
    expert_retry_probability: float = 1.0
    expert_careless_vaults: float = 0.5
    source: str = "auto"
    """What the warm-start imitates: ``"expert"`` (the vault task's scripted expert, ``demos``
    rollouts), ``"data"`` (the conversations of ``data``), ``"none"`` (RL from the model as it
    is), or ``"auto"``: ``data`` when set, else the expert on the vault task with the built-in
    model, else none (a checkpoint given by ``model.path`` starts RL as it is)."""
    data: str | None = None
    """A JSONL file of OpenAI-style conversations (``{"messages": [...], "tools": [...]}`` per
    line, tool calls included) to imitate (docs/own-agent.md)."""


@dataclass
class EvalConfig:
    """Evaluation on the held-out split: ``tasks`` tasks, sampled at ``temperature`` (0:
    greedy), after the warm-start and at the end; with ``every``, also during RL on a fixed
    subset, so success can be plotted against the step."""

    tasks: int = 200
    """Held-out tasks of the warm-start's and the final evaluation (the first ones of the
    split)."""
    temperature: float = 0.0
    """Sampling temperature of every evaluation (0: greedy)."""
    every: int | None = None
    """Periodic evaluation: after every this many RL steps (not the last: the final evaluation
    is there), the policy is evaluated on the first ``every_tasks`` held-out tasks, the same
    ones each time, as the final evaluation is (``eval`` rows of ``metrics.jsonl`` at the RL
    step, with ``eval_tasks`` and ``eval_seconds``; the run's summary gives the share of wall
    time it took, ``periodic_eval_share``). None: off. Every 10 steps on 40 tasks costs the
    main job under 4 % of its RL phase, 0.6-1.1 s an evaluation (measured: docs/training.md)."""
    every_tasks: int = 40
    """Periodic evaluation (``every``): how many held-out tasks, the first ones of the split
    (a subset of the final evaluation's ``tasks``, never the warm-start's validation tasks)."""


def _main_job_env() -> EnvConfig:
    """The main job's environment (the library's EnvConfig() keeps a library user's defaults).
    Each value that differs from EnvConfig()'s says why in the comment above it
    (docs/reference/config.md, written by tools/config_reference.py, shows them side by side)."""
    return EnvConfig(
        # Every task has three vaults: the held-out split (vault lists never in the train split)
        # is all 3-vault lists anyway, and RL on mixed 2-3-vault tasks learned a 2-vault
        # shortcut there (docs/experiments.md).
        min_vaults=3)


def _main_job_train() -> TrainConfig:
    """The main job's trainer, tuned on the vault task (docs/experiments.md); the library's
    TrainConfig() keeps a library user's general-purpose defaults. Each value that differs
    from TrainConfig()'s says why in the comment above it or on its line
    (docs/reference/config.md, written by tools/config_reference.py, shows them side by side)."""
    return TrainConfig(
        algo="ppo", tasks_per_step=8, epochs=1, policy_lr=1e-4, gamma=1.0, kl_coef=0.0,
        entropy_coef=0.0,
        # The RL phase of a run of a few minutes on 2 CPU cores: from the warm-start, 100 steps
        # took held-out success to 0.956 on average over seeds 0-4 (docs/experiments.md).
        steps=100,
        # Each of the main job's mini-batches (a quarter of a step's ~34k tokens in the tuning
        # runs) in one forward/backward: the tiny model's activations are small, and fewer
        # passes are faster (docs/experiments.md, speed).
        micro_batch_tokens=16384,
        # One pass over each batch in four mini-batches of whole rollouts (verl's default
        # ppo_epochs=1): four policy updates a step, half the learning cost of two epochs,
        # learning as fast per step (docs/experiments.md).
        mini_batches=4,
        # The rollout's own log-probs stand in for the old ones when synchronous (the main
        # job's TorchGenerator records them; one policy forward a step saved), recomputed when
        # asynchronous (--set train.max_staleness=k), which needs them.
        recompute_logprobs=None,
        # Lets --set train.max_staleness=k turn the main job asynchronous (its behaviour
        # importance weights need a cap); synchronous runs have weights exp(0) = 1, so the cap
        # changes nothing there.
        tis_cap=2.0,
        # The tiny separate critic learns the vault task's outcome values at 3e-3, kept from
        # the tuning runs (1e-3 was within noise on one seed; docs/experiments.md, critic).
        critic_lr=3e-3,
        # Lambda 1 through compactions: every action token's advantage is its rollout's
        # return minus the critic's value there, so the one final reward reaches every
        # sub-trace (docs/experiments.md); the policy's lambda is now lam_alpha's (below).
        lam=1.0,
        # The length-adaptive lambda (CompactionRL's alpha 1.5) for the policy's advantages:
        # in the critic study (seeds 0-2) it ended at or above lambda 1 on every default-task
        # seed and well above lambda 1 and GRPO on the long task's hardest seed (0.955 against
        # 0.895 / 0.88), within two held-out tasks of them elsewhere
        # (bench/results/critic_study.md; alpha 0.05 learned slower).
        lam_alpha=1.5,
        # The critic's targets keep lambda 1: the final reward carried to every sub-trace.
        critic_lam=1.0,
        # Each episode counts once, whatever its length: token-mean let long looping failures
        # outweigh short successes (docs/experiments.md).
        loss_agg_mode="rollout-mean",
        # The vault task's limits end the episode (scored 0): bootstrapping the critic's guess
        # made running into max_turns look as good as the critic's average.
        bootstrap_truncated=False,
        # The CLI gives every run a checkpoint folder: a checkpoint every 5 steps bounds what a
        # crash loses (--resume); the final state is always written.
        checkpoint_every=5,
        rollout=RolloutConfig(
            # Four rollouts of each task, so GRPO (--algo grpo) has groups to compare and PPO
            # and GRPO train on the same samples.
            samples_per_task=4,
            # The vault task tests memory across compactions: 186 tokens compact the expert's
            # episodes into 3.76 sub-traces on average (3-6), as 200 did before the chat format
            # became token-exact (its prompts shrank from 46 to 36 tokens), so codes must be
            # saved in memory.
            context_budget=186,
            # The expert finishes a 3-vault task in 13-16 turns; 24 leaves room for mistakes
            # and ends looping episodes early.
            max_turns=24,
            # The summary must fit the 186-token budget beside the system prompt and the task.
            summary_chars=200,
            sampling=SamplingParams(
                # At T = 1 a low-entropy policy's long episodes fail on sampling noise the
                # greedy policy never makes; 0.7 did better (docs/experiments.md).
                temperature=0.7,
                # The vault task's turns are short tool calls (the expert's at most 7 tokens);
                # a smaller cap leaves more of the 186-token budget before a compaction.
                max_new_tokens=24)))


@dataclass
class RunConfig:
    """A whole run; ``RunConfig()`` is the main job (what ``agentrl-fast train`` runs with no
    arguments; ``configs/default.yaml`` is its YAML, written by ``agentrl-fast config``).
    ``seed`` seeds everything (the model's weights, the warm-start, the trainer: it replaces
    ``train.seed``)."""

    seed: int = 0
    run_dir: str = "runs/default"
    base_dir: str | None = None
    """The folder a config file's user modules (``env.factory``, the dataset's tools and
    reward) and relative paths are also looked up in: the config file's folder (set by
    ``load_config``; kept in a run's saved config.yaml so ``agentrl-fast eval`` finds them)."""
    env: EnvConfig = field(default_factory=_main_job_env)
    model: ModelConfig = field(default_factory=ModelConfig)
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)
    train: TrainConfig = field(default_factory=_main_job_train)
    eval: EvalConfig = field(default_factory=EvalConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)


def _is_dataclass_type(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _check_type(name: str, tp, value):
    """``value`` as ``tp`` (ints accepted for floats), or ConfigError naming ``name``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _check_type(name, option, value)
            except ConfigError:
                continue
        raise ConfigError(f"{name}: expected {tp}, got {value!r}")
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
        try:
            return float(value)
        except ValueError:
            pass
    if tp in (int, float, str, bool):
        if isinstance(value, bool) and tp is not bool:
            raise ConfigError(f"{name}: expected {tp.__name__}, got {value!r}")
        if not isinstance(value, tp):
            raise ConfigError(f"{name}: expected {tp.__name__}, got {value!r}")
        return value
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{name}: expected a mapping, got {value!r}")
        return dict(value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name}: expected a list, got {value!r}")
        return tuple(value)
    return value


def _build(cls, data: dict, prefix: str, base=None):
    """An instance of dataclass ``cls`` from ``data`` over ``base`` (or the defaults)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"{name}: unknown field (known: {known})")
        tp = hints[key]
        current = getattr(base, key) if base is not None else None
        if _is_dataclass_type(tp):
            values[key] = _build(tp, value, f"{name}.", current)
        else:
            values[key] = _check_type(name, tp, value)
            if isinstance(values[key], dict) and isinstance(current, dict):
                values[key] = {**current, **values[key]}  # env.args.x=... refines env.args
    try:
        if base is not None:
            return dataclasses.replace(base, **values)
        return cls(**values)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {error}") from None


def to_dict(config) -> dict:
    """A plain dict (YAML-ready) of a config dataclass."""
    return dataclasses.asdict(config)


def to_yaml(config: RunConfig) -> str:
    """``config`` as the YAML ``load_config`` reads back (``configs/default.yaml`` is
    ``to_yaml(RunConfig())``)."""
    import yaml
    header = ("# The main job: RunConfig(), what `agentrl-fast train` runs with no arguments.\n"
              "# Written by `agentrl-fast config > configs/default.yaml`; `seed` replaces "
              "train.seed.\n")
    return header + yaml.safe_dump(to_dict(config), sort_keys=False)


def library_defaults() -> RunConfig:
    """The base of a run on a user's model or environment: the library's general-purpose
    defaults (``TrainConfig()``, ``EnvConfig()``) instead of the vault-tuned main job's."""
    return RunConfig(env=EnvConfig(), train=TrainConfig())


def names_own_agent(data: dict) -> bool:
    """Whether config ``data`` (a YAML mapping) names a model or environment of its own
    (``model.path``, ``env.factory``, or an ``env.name`` other than the vault task)."""
    model, env = data.get("model") or {}, data.get("env") or {}
    if not isinstance(model, dict) or not isinstance(env, dict):
        return False
    return bool(model.get("path") or env.get("factory") or env.get("name", "vault") != "vault")


def load_config(path: str | Path | None = None, base: RunConfig | None = None) -> RunConfig:
    """``base`` with the YAML file at ``path`` applied. The default base is the main job
    (``RunConfig()``), or :func:`library_defaults` when the file names its own model or
    environment (:func:`names_own_agent`): the main job's values are tuned for the vault task."""
    import yaml
    if path is None:
        return base if base is not None else RunConfig()
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path} is not valid YAML: {error}") from None
    if base is not None:
        config = base
    else:
        config = library_defaults() if isinstance(data, dict) and names_own_agent(data) \
            else RunConfig()
    if isinstance(data, dict) and "base_dir" not in data:
        data = {**data, "base_dir": str(Path(path).resolve().parent)}
    return _build(RunConfig, data, "", config)


def search_folders(config: RunConfig) -> list[str]:
    """Where a config's user modules and relative paths are looked up (modules after
    ``sys.path``): the working directory, then the config file's folder."""
    import os
    return [os.getcwd()] + ([config.base_dir] if config.base_dir else [])


def local_candidates(name: str, config: RunConfig) -> list[Path]:
    """Where a relative path of ``config`` may be, in lookup order (:func:`search_folders`)."""
    return [Path(folder) / name for folder in search_folders(config)]


def apply_overrides(config: RunConfig, overrides: list[str]) -> RunConfig:
    """Apply ``section.field=value`` strings (``train.rollout.context_budget=256``), all at
    once (checks across fields see every override; a later value of a field wins)."""
    merged = overrides_to_dict(overrides)
    return _build(RunConfig, merged, "", config) if merged else config


def overrides_to_dict(overrides: list[str]) -> dict:
    """``section.field=value`` strings as the nested mapping a YAML file would give."""
    import yaml
    merged: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected field=value "
                              "(e.g. train.kl_coef=0.01)")
        key, raw = item.split("=", 1)
        *sections, name = key.strip().split(".")
        target = merged
        for part in sections:
            if not isinstance(target.get(part, {}), dict):
                target[part] = {}  # an earlier override set the whole section: this refines it
            target = target.setdefault(part, {})
        target[name] = yaml.safe_load(raw) if raw else ""
    return merged


ENV_NAMES = ("vault", "dataset")
WARMSTART_SOURCES = ("auto", "expert", "data", "none")
MODEL_DTYPES = ("float32", "bfloat16", "float16", "auto")


def uses_vault(config: RunConfig) -> bool:
    """Whether the run's environment is the built-in vault task."""
    return config.env.factory is None and config.env.name == "vault"


def warmstart_source(config: RunConfig) -> str:
    """``warmstart.source`` with ``"auto"`` resolved (see :class:`WarmStartConfig`)."""
    w = config.warmstart
    if w.source != "auto":
        return w.source
    if w.data:
        return "data"
    return "expert" if uses_vault(config) and config.model.path is None else "none"


def _validate_env(config: RunConfig) -> None:
    env = config.env
    if env.factory is None and env.name not in ENV_NAMES:
        raise ConfigError(f"env.name: unknown environment {env.name!r} (built in: "
                          f"{', '.join(ENV_NAMES)}; or give env.factory: 'module:callable')")
    if uses_vault(config):
        if env.args:
            raise ConfigError("env.args: the vault environment takes its settings as env fields "
                              "(env.min_vaults, ...); env.args is for env.factory and "
                              "env.name=dataset")
        if config.eval.tasks > env.eval_size:
            raise ConfigError(f"eval.tasks ({config.eval.tasks}) exceeds env.eval_size "
                              f"({env.eval_size})")
    elif env.name == "dataset" and env.factory is None and "train" not in env.args:
        raise ConfigError("env.args.train: the dataset environment needs a train task file "
                          "(JSONL or Parquet)")


def _validate_periodic_eval(config: RunConfig) -> None:
    e = config.eval
    if e.every is not None and e.every < 1:
        raise ConfigError(f"eval.every must be >= 1 (or null: off), got {e.every}")
    if e.every_tasks < 1 or (e.every is not None and e.every_tasks > e.tasks):
        raise ConfigError(f"eval.every_tasks must be in [1, eval.tasks ({e.tasks})]: the "
                          f"periodic evaluation runs on the final evaluation's first tasks, "
                          f"got {e.every_tasks}")


def _validate_groups(config: RunConfig) -> None:
    train = config.train
    if train.advantage == "grpo" and train.rollout.samples_per_task < 2:
        raise ConfigError(f"train.rollout.samples_per_task must be >= 2 with GRPO's advantages "
                          f"(algo=grpo): a group of one rollout has no baseline, its advantage "
                          f"is 0; got {train.rollout.samples_per_task} (algo=ppo learns from "
                          "one rollout per task)")


def validate(config: RunConfig) -> None:
    """Checks that need more than one field (each message names the field)."""
    _validate_env(config)
    if config.warmstart.source not in WARMSTART_SOURCES:
        raise ConfigError(f"warmstart.source must be one of {', '.join(WARMSTART_SOURCES)}, "
                          f"got {config.warmstart.source!r}")
    if config.warmstart.source == "data" and not config.warmstart.data:
        raise ConfigError("warmstart.source=data needs warmstart.data (a JSONL of conversations)")
    if config.warmstart.data:
        if warmstart_source(config) != "data" or not config.warmstart.steps:
            raise ConfigError(f"warmstart.data is set but not used (warmstart.source="
                              f"{config.warmstart.source}, warmstart.steps="
                              f"{config.warmstart.steps}); use source data (or auto) and steps > 0")
        if not any(p.is_file() for p in local_candidates(config.warmstart.data, config)):
            raise ConfigError(f"warmstart.data: no such file {config.warmstart.data!r} (looked "
                              f"in {', '.join(search_folders(config))})")
    if config.model.dtype not in MODEL_DTYPES:
        raise ConfigError(f"model.dtype must be one of {', '.join(MODEL_DTYPES)}, "
                          f"got {config.model.dtype!r}")
    if not 0.0 <= config.env.error_penalty <= 1.0:
        raise ConfigError(f"env.error_penalty must be in [0, 1], got {config.env.error_penalty}")
    if config.eval.temperature < 0:
        raise ConfigError(f"eval.temperature must be >= 0, got {config.eval.temperature}")
    _validate_periodic_eval(config)
    _validate_groups(config)
    if config.warmstart.demos < 0 or config.warmstart.steps < 0:
        raise ConfigError("warmstart.demos and warmstart.steps must be >= 0")
    if config.warmstart.weight_decay < 0:
        raise ConfigError(f"warmstart.weight_decay must be >= 0, "
                          f"got {config.warmstart.weight_decay}")
    for name in ("expert_save_probability", "expert_read_probability",
                 "expert_retry_probability", "expert_careless_vaults"):
        if not 0.0 <= getattr(config.warmstart, name) <= 1.0:
            raise ConfigError(f"warmstart.{name} must be in [0, 1], "
                              f"got {getattr(config.warmstart, name)}")
    w = config.warmstart
    if w.target_success is not None:
        if not 0.0 < w.target_success <= 1.0:
            raise ConfigError(f"warmstart.target_success must be in (0, 1] (or null), "
                              f"got {w.target_success}")
        if w.confirm_checks < 1:
            raise ConfigError(f"warmstart.confirm_checks must be >= 1, got {w.confirm_checks}")
        if w.check_every < 1 or w.check_tasks < 1:
            raise ConfigError(f"warmstart.check_every and warmstart.check_tasks must be >= 1, "
                              f"got {w.check_every} and {w.check_tasks}")
        if w.fine_check_every < 1:
            raise ConfigError(f"warmstart.fine_check_every must be >= 1, got {w.fine_check_every}")
        if not 0.0 <= w.fine_check_from <= 1.0:
            raise ConfigError(f"warmstart.fine_check_from must be in [0, 1], "
                              f"got {w.fine_check_from}")
        if w.max_fine_steps is not None and w.max_fine_steps < 1:
            raise ConfigError(f"warmstart.max_fine_steps must be >= 1 (or null), "
                              f"got {w.max_fine_steps}")
        if uses_vault(config) and config.eval.tasks + w.check_tasks > config.env.eval_size:
            raise ConfigError(f"eval.tasks ({config.eval.tasks}) + warmstart.check_tasks "
                              f"({w.check_tasks}) exceed env.eval_size "
                              f"({config.env.eval_size}): the warm-start's validation tasks "
                              "are held-out tasks the final evaluation does not use")
    source = warmstart_source(config)
    if source == "expert" and not uses_vault(config):
        raise ConfigError("warmstart.source=expert: the scripted expert plays the vault task "
                          "only; give your environment's demonstrations as warmstart.data")
    if source == "expert" and config.warmstart.steps and not config.warmstart.demos:
        raise ConfigError("warmstart.steps > 0 needs warmstart.demos > 0")
    if w.load is not None and not any(p.is_file() for p in local_candidates(w.load, config)):
        raise ConfigError(f"warmstart.load: no such file {w.load!r} (a run folder's "
                          "warmstart.pt)")
    if config.model.num_heads % config.model.num_kv_heads:
        raise ConfigError(f"model.num_kv_heads: num_heads ({config.model.num_heads}) must be a "
                          f"multiple of num_kv_heads ({config.model.num_kv_heads})")
    sampling = config.train.rollout.sampling
    if config.generator.backend == "vllm":
        if sampling.top_k or sampling.top_p < 1.0:
            raise ConfigError("generator.backend=vllm: train.rollout.sampling.top_k/top_p must be "
                              "off (vLLM's log-probs after them are renormalized, not "
                              "log_softmax(logits / T))")
