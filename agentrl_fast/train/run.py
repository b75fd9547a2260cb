"""One training run from a :class:`~agentrl_fast.config.RunConfig`: build the environment (the
vault task, the dataset tool environment or ``env.factory``'s), the tokenizer and the policy
(``model.path``'s checkpoint, or the built-in tiny model), warm-start on demonstrations (the
vault expert's, or ``warmstart.data``'s), train with PPO or GRPO, evaluate on the held-out
split, and leave a run folder behind:

``config.yaml``, ``metrics.jsonl`` (one JSON line per step, plus warm-start, critic warm-up
and eval lines),
TensorBoard events (``tb/``), ``curves.png`` (reward and success), ``summary.txt``,
``warmstart.pt`` (the policy RL starts from),
``checkpoints/`` (resumable), ``export/`` (``save_pretrained`` of the final models).

Under ``torchrun`` every rank runs this: the warm-start on each (the same demonstrations and
seeds; rank 0's result is broadcast), evaluation and training shared by the ranks
(:mod:`agentrl_fast.train.distributed`), the run folder written by rank 0.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pickle
import time
from pathlib import Path
from typing import Callable

import torch

from agentrl_fast.config import (ConfigError, RunConfig, local_candidates, to_dict, validate,
                                 warmstart_source)
from agentrl_fast.harness import ChatFormat, RolloutEngine, rollout_metrics
from agentrl_fast.harness.trajectory import Trajectory
from agentrl_fast.generators import Generator, ScriptedGenerator, TorchGenerator
from agentrl_fast.envs import build_tokenizer, expert_action
from agentrl_fast.envs.from_config import make_environment
from agentrl_fast.harness.environment import close_environment
from agentrl_fast.models.fused import FAMILIES as FUSED_FAMILIES, use_fused_layers
from agentrl_fast.models.pretrained import check_vocabulary, load_causal_lm, load_tokenizer
from agentrl_fast.models.tiny import tiny_qwen3
from agentrl_fast.train.distributed import World, init_world, shutdown
from agentrl_fast.train.metrics_log import MetricsLogger
from agentrl_fast.train.ppo import Trainer
from agentrl_fast.train.serving import run_generator
from agentrl_fast.train.demos import load_demonstrations
from agentrl_fast.train.sft import demonstrations, sft


def build(config: RunConfig):
    """``(environment, chat_format, policy)`` of a config; checks that a sub-trace's prompt and
    one turn fit the context budget and the model."""
    validate(config)
    environment = make_environment(config)
    try:
        tokenizer, policy = _policy_and_tokenizer(config, environment)
        try:
            chat = ChatFormat(tokenizer)
        except (TypeError, ValueError) as error:
            field = ("model.tokenizer" if config.model.tokenizer else "model.path"
                     if config.model.path else "env (its corpus trains the built-in tokenizer)")
            raise ConfigError(f"{field}: {error}") from None
        _check_budget(config, chat, environment, policy)
    except BaseException:
        close_environment(environment)  # its servers (MCP) stop with the failed build
        raise
    return environment, chat, policy


def _policy_and_tokenizer(config: RunConfig, environment):
    """The tokenizer (``model.tokenizer``, the checkpoint's own, or the built-in one trained on
    the environment's corpus) and the policy (``model.path``, or the built-in tiny model)."""
    m = config.model
    path = _local_or_hub(m.path, config) if m.path else None
    tokenizer_path = _local_or_hub(m.tokenizer, config) if m.tokenizer else path
    try:
        if tokenizer_path:
            tokenizer = load_tokenizer(tokenizer_path)
        else:
            tokenizer = build_tokenizer(getattr(environment, "corpus", list)(),
                                        vocab_size=m.vocab_size,
                                        words=getattr(environment, "words", tuple)())
    except ValueError as error:
        field = ("model.tokenizer" if m.tokenizer else "model.path" if m.path
                 else "model.vocab_size")
        raise ConfigError(f"{field}: {error}") from None
    if path is None:
        policy = tiny_qwen3(len(tokenizer), hidden_size=m.hidden_size, num_layers=m.num_layers,
                            num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
                            head_dim=m.head_dim, seed=config.seed)
    else:
        try:
            policy = load_causal_lm(path, m.dtype)
            check_vocabulary(policy, tokenizer)
        except ValueError as error:
            raise ConfigError(f"model.path: {error}") from None
    if m.fused_layers and getattr(policy.config, "model_type", None) in FUSED_FAMILIES:
        use_fused_layers(policy)
    return tokenizer, policy


def _local_or_hub(name: str, config: RunConfig) -> str:
    """``name`` as a folder from the working directory or the config's folder, else as given
    (a hub id)."""
    return next((str(p) for p in local_candidates(name, config) if p.exists()), name)


def resolve_paths(config: RunConfig) -> RunConfig:
    """``config`` with its relative local paths (model, tokenizer, warm-start files, the dataset
    environment's task files) made absolute where they are found (:func:`_local_or_hub`), so
    the run folder's ``config.yaml`` means the same from any directory (``agentrl-fast
    eval``); names found nowhere stay as given (hub ids; the errors come where they load)."""
    def absolute(name: str | None) -> str | None:
        if name is None:
            return None
        found = Path(_local_or_hub(name, config)).expanduser()
        return str(found.resolve()) if found.exists() else name

    m, w, env = config.model, config.warmstart, config.env
    args = dict(env.args)
    if env.factory is None and env.name == "dataset":
        args.update({key: absolute(args[key]) for key in ("train", "eval")
                     if isinstance(args.get(key), str)})
        if isinstance(args.get("mcp_servers"), list):  # their template folders
            args["mcp_servers"] = [
                {**server, "rollout_dir_template": absolute(server["rollout_dir_template"])}
                if isinstance(server, dict) and isinstance(server.get("rollout_dir_template"),
                                                           str) else server
                for server in args["mcp_servers"]]
    return dataclasses.replace(
        config, model=dataclasses.replace(m, path=absolute(m.path), tokenizer=absolute(m.tokenizer)),
        warmstart=dataclasses.replace(w, data=absolute(w.data), load=absolute(w.load)),
        env=dataclasses.replace(env, args=args))


def _check_budget(config: RunConfig, chat: ChatFormat, environment, policy) -> None:
    """The longest first prompt (of 50 train tasks and the held-out ones, up to 1000) plus a
    turn fits ``context_budget`` and ``max_total_tokens``; the budget fits the model's
    positions."""
    rollout = config.train.rollout
    engine = RolloutEngine(ScriptedGenerator(lambda context: "", chat), chat, environment,
                           rollout)
    tasks = list(environment.tasks("train")[:50]) + list(environment.tasks("eval")[:1000])
    longest = max(len(engine.prompt_ids(task)) for task in tasks)
    need = longest + rollout.sampling.max_new_tokens + 2
    if need > rollout.max_total_tokens:
        raise ConfigError(f"train.rollout.max_total_tokens ({rollout.max_total_tokens}) is "
                          f"smaller than a first prompt ({longest} tokens) and one turn; use at "
                          f"least {need}")
    if need > rollout.context_budget:
        raise ConfigError(f"train.rollout.context_budget ({rollout.context_budget}) is smaller than "
                          f"the system prompt, tools and task ({longest} tokens) plus "
                          f"train.rollout.sampling.max_new_tokens "
                          f"({rollout.sampling.max_new_tokens}) and the turn's end; use at least "
                          f"{need}")
    positions = getattr(policy.config, "max_position_embeddings", None)
    if positions is not None and rollout.context_budget > positions:
        raise ConfigError(f"train.rollout.context_budget ({rollout.context_budget}) exceeds the "
                          f"model's max_position_embeddings ({positions})")


def expert_demonstrations(config: RunConfig, chat: ChatFormat, environment) -> list:
    """The warm-start's demonstrations: the (possibly careless) expert of ``config.warmstart``
    on the first ``warmstart.demos`` train tasks, through the real rollout engine. A careless
    expert is imitated as it is, failures included; a careful one by its successes."""
    w = config.warmstart
    probabilities = dict(save_probability=w.expert_save_probability,
                         read_probability=w.expert_read_probability,
                         retry_probability=w.expert_retry_probability)
    careless = any(p != 1.0 for p in probabilities.values())
    demos = demonstrations(functools.partial(expert_action, **probabilities,
                                             careless_vaults=w.expert_careless_vaults),
                           chat, environment,
                           environment.tasks("train")[:w.demos], config.train.rollout,
                           seed=config.seed, successful_only=not careless)
    if not any(t.metrics["success"] for t in demos):  # (a careless one keeps its failures)
        raise ConfigError(f"warmstart.demos: the expert solved none of {w.demos} tasks within "
                          f"the train.rollout limits (max_turns={config.train.rollout.max_turns}, "
                          f"context_budget={config.train.rollout.context_budget}); raise them")
    return demos


def _demonstrations(config: RunConfig, chat: ChatFormat, environment) -> list:
    """What the warm-start imitates (``warmstart.source``): the expert's rollouts, the
    sub-traces of ``warmstart.data``, or nothing."""
    source = warmstart_source(config)
    if source == "expert":
        return expert_demonstrations(config, chat, environment)
    if source == "none":
        return []
    path = _local_or_hub(config.warmstart.data, config)
    try:
        return load_demonstrations(path, chat, max_tokens=config.train.rollout.context_budget)
    except ValueError as error:
        raise ConfigError(f"warmstart.data: {error}") from None


def evaluate(policy, chat: ChatFormat, environment, config: RunConfig, *, seed: int = 0,
             world: World | None = None, tasks: list | None = None,
             generator: Generator | None = None) -> dict:
    """Success rate and mean reward on ``tasks`` (default: the first ``eval.tasks`` held-out
    tasks), one rollout each at ``eval.temperature`` with the training rollout limits;
    ``world``: the ranks share the tasks (``policy``, whole and the same on every rank, runs
    locally). ``generator``: the run's (default a TorchGenerator on ``policy``), given the
    policy's weights first."""
    rollout = dataclasses.replace(
        config.train.rollout, samples_per_task=1, schedule="lockstep",
        sampling=dataclasses.replace(config.train.rollout.sampling,
                                     temperature=config.eval.temperature))
    if generator is None:
        generator = TorchGenerator(policy, pad_id=chat.tokenizer.pad_token_id or 0)
    else:
        generator.update_weights(policy)
    engine = RolloutEngine(generator, chat, environment, rollout)
    if tasks is None:
        tasks = environment.tasks("eval")[:config.eval.tasks]
    if world is None:
        return rollout_metrics(engine.run(tasks, seed=seed))
    mine = engine.run(world.tasks(tasks), seed=seed)
    return rollout_metrics(world.in_task_order(world.all_gather(mine), len(tasks), 1))


def target_confirmed(successes: list[float], target: float, confirm: int) -> bool:
    """Whether the last ``confirm`` validation checks (``successes``, oldest first) all reached
    ``target``."""
    return len(successes) >= confirm and all(s >= target for s in successes[-confirm:])


def check_interval(successes: list[float], warmstart) -> int:
    """Steps from the last validation check to the next: ``warmstart.fine_check_every`` once a
    check (``successes``, oldest first) reached ``warmstart.fine_check_from`` (the supervised
    transition has begun), else ``warmstart.check_every``."""
    started = any(s >= warmstart.fine_check_from for s in successes)
    return warmstart.fine_check_every if started else warmstart.check_every


def fine_steps_spent(checks: list[dict], warmstart) -> bool:
    """Whether the last validation check (``checks``: ``{"sft_step", "check_success"}``, oldest
    first) comes ``warmstart.max_fine_steps`` or more steps after the first check that reached
    ``warmstart.fine_check_from``: on a long plateau past the transition's start more supervised
    steps over-train the policy (docs/experiments.md)."""
    if warmstart.max_fine_steps is None:
        return False
    first = next((c["sft_step"] for c in checks
                  if c["check_success"] >= warmstart.fine_check_from), None)
    return first is not None and checks[-1]["sft_step"] - first >= warmstart.max_fine_steps


def warm_start(config: RunConfig, policy, chat: ChatFormat, environment, demos: list, *,
               log: Callable[[dict], None] | None = None,
               generator: Generator | None = None) -> tuple[list[float], list[dict]]:
    """Supervised warm-start of ``policy`` on ``demos`` (:func:`expert_demonstrations`'s
    trajectories, or sub-traces: :func:`~agentrl_fast.train.demos.load_demonstrations`) as
    ``config.warmstart`` says; returns the loss of each step and the validation checks
    (``{"sft_step", "check_success", "check_reward"}``), each also passed to ``log``. It ends
    after ``warmstart.steps`` steps, or at the check that makes ``warmstart.confirm_checks``
    checks in a row whose greedy success on the last ``warmstart.check_tasks`` held-out tasks
    (never among the final evaluation's first ``eval.tasks``:
    :func:`~agentrl_fast.config.validate`) reaches ``warmstart.target_success``
    (:func:`target_confirmed`), or at the check that spends ``warmstart.max_fine_steps``
    (:func:`fine_steps_spent`); the checks come as :func:`check_interval` says, on
    ``generator`` (:func:`evaluate`)."""
    w = config.warmstart
    checks: list[dict] = []
    validation = environment.tasks("eval")[-w.check_tasks:]

    def reached(step: int, losses: list[float]) -> bool:
        if w.target_success is None:
            return False
        successes = [c["check_success"] for c in checks]
        last = checks[-1]["sft_step"] if checks else 0
        if step - last < check_interval(successes, w):
            return False
        result = evaluate(policy, chat, environment, config, seed=config.seed, tasks=validation,
                          generator=generator)
        checks.append({"sft_step": step, "check_success": result["success"],
                       "check_reward": result["reward"],
                       "check_tool_error_rate": result["tool_error_rate"]})
        if log is not None:
            log(checks[-1])
        return (target_confirmed(successes + [result["success"]], w.target_success,
                                 w.confirm_checks) or fine_steps_spent(checks, w))

    sub_traces = [s for d in demos for s in (d.sub_traces if isinstance(d, Trajectory) else [d])]
    losses = sft(policy, sub_traces, steps=w.steps, lr=w.lr,
                 weight_decay=w.weight_decay, batch_sequences=w.batch_sequences,
                 seed=config.seed, stop=reached, log=log,
                 share_prefixes=config.train.share_prefixes)
    return losses, checks


def load_warm_start(policy, path: str) -> None:
    """``policy``'s weights from a saved warm-start (a run folder's ``warmstart.pt``); a
    :class:`ConfigError` naming ``warmstart.load`` when the file is not one of this model's."""
    try:
        policy.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    except (RuntimeError, OSError, EOFError, ValueError, TypeError,
            pickle.UnpicklingError) as error:
        raise ConfigError(f"warmstart.load: {path!r} is not a state dict of this run's model "
                          f"({str(error).splitlines()[0]})") from None


def _forget_steps_after(path: Path, step: int, critic_warmup_step: int) -> None:
    """Drop the metrics rows of steps after ``step`` (the checkpoint a run resumed from), and
    of critic warm-up steps after ``critic_warmup_step`` (the warm-up has its own numbering):
    a killed run may have logged steps it had not checkpointed, and they are run again."""
    if not path.exists():
        return

    def kept_row(row: dict) -> bool:
        if row["kind"] == "critic_warmup":
            return row["step"] <= critic_warmup_step
        return row["kind"] == "warmstart" or row["step"] <= step

    lines = path.read_text().splitlines()
    kept = [line for line in lines if kept_row(json.loads(line))]
    if len(kept) != len(lines):
        with open(path, "w") as file:  # the same file: the open append handle writes after it
            file.write("".join(line + "\n" for line in kept))


class PeriodicEval:
    """``eval.every``: after every that many RL steps but the last (the final evaluation's),
    :func:`evaluate` on the first ``eval.every_tasks`` held-out tasks, written as an ``eval``
    row at the step; ``seconds``: the time they took (every rank evaluates its share)."""

    def __init__(self, config: RunConfig, trainer: Trainer, chat: ChatFormat, environment,
                 world: World | None, generator: Generator | None, outputs, print_fn):
        self.config, self.trainer, self.chat, self.environment = (config, trainer, chat,
                                                                  environment)
        self.world, self.generator, self.outputs, self.print_fn = (world, generator, outputs,
                                                                   print_fn)
        self.seconds = 0.0

    def after_step(self, step: int) -> None:
        every = self.config.eval.every
        if every is None or step % every or step >= self.config.train.steps:
            return
        start = time.perf_counter()
        tasks = self.environment.tasks("eval")[:self.config.eval.every_tasks]
        result = evaluate(self.trainer.rollout_policy, self.chat, self.environment, self.config,
                          seed=self.config.seed, world=self.world, tasks=tasks,
                          generator=self.generator)
        seconds = time.perf_counter() - start
        self.seconds += seconds
        if self.outputs is not None:
            self.outputs.write("eval", step, {**result, "eval_tasks": len(tasks),
                                              "eval_seconds": seconds})
        self.print_fn(f"eval at step {step}: success {result['success']:.3f} on {len(tasks)} "
                      f"held-out tasks ({seconds:.1f} s)")


def plot_curves(run_dir: Path) -> Path:
    """``curves.png``: train reward and success per step, eval success points."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot([r["step"] for r in train], [r["reward"] for r in train], label="train reward")
    axis.plot([r["step"] for r in train], [r["success"] for r in train], label="train success")
    axis.plot([r["step"] for r in evals], [r["success"] for r in evals], "o--",
              label="eval success (held out)")
    axis.set_xlabel("step")
    axis.set_ylim(-0.02, 1.02)
    axis.grid(alpha=0.3)
    axis.legend()
    path = run_dir / "curves.png"
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def train_run(config: RunConfig, *, progress: bool = True,
              print_fn: Callable[[str], None] = print, resume: bool = False) -> dict:
    """The whole run (see the module doc); returns the summary. ``resume``: continue from the
    run folder's checkpoints (the warm-start is then not redone); a run folder that holds
    checkpoints is an error without it."""
    if not resume and any((Path(config.run_dir) / "checkpoints").glob("step-*")):
        raise ConfigError(f"run_dir {config.run_dir} holds checkpoints of an earlier run: "
                          "continue it with --resume (train_run(..., resume=True)), or give a "
                          "new --run-dir to start over")
    config = resolve_paths(config)
    world = init_world(config.train.distributed)
    summary = _train_run(config, progress, print_fn, world)
    shutdown()  # after a failure the process just exits: torchrun stops the other ranks
    return summary


def _train_run(config: RunConfig, progress: bool, print_fn, world: World | None) -> dict:
    start = time.perf_counter()
    main = world is None or world.is_main
    if not main:
        print_fn, progress = (lambda *args, **kwargs: None), False
    torch.manual_seed(config.seed)
    environment, chat, policy = build(config)
    run_dir = Path(config.run_dir)
    if config.generator.backend != "torch":
        run_dir.mkdir(parents=True, exist_ok=True)
    try:
        with run_generator(config, policy, chat.tokenizer, run_dir,
                           world is not None) as generator:
            return _phases(config, progress, print_fn, world, start, main, environment, chat,
                           policy, generator)
    finally:
        close_environment(environment)  # the run's shared resources (MCP servers)


def _phases(config: RunConfig, progress: bool, print_fn, world: World | None, start: float,
            main: bool, environment, chat: ChatFormat, policy, generator) -> dict:
    """Warm-start, its evaluation, RL and the final evaluation, on ``generator``."""
    run_dir = Path(config.run_dir)
    resuming = any((run_dir / "checkpoints").glob("step-*"))
    demos = []
    if not resuming and config.warmstart.load is not None:  # before the run folder is written
        load_warm_start(policy, _local_or_hub(config.warmstart.load, config))
        print_fn(f"warm-start: loaded {config.warmstart.load}")
    elif not resuming and config.warmstart.steps:
        demos = _demonstrations(config, chat, environment)
    if world is not None:  # every rank must be at this point before rank 0 writes the folder
        world.barrier()
    outputs = None
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        import yaml
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
        outputs = MetricsLogger(run_dir)
    warm_file = run_dir / "warmstart.json"
    train = dataclasses.replace(config.train, seed=config.seed,
                                checkpoint_dir=str(run_dir / "checkpoints"),
                                checkpoint_every=config.train.checkpoint_every)
    if not resuming:
        if demos:
            losses, checks = warm_start(
                config, policy, chat, environment, demos,
                log=(lambda m: outputs.write("warmstart", m["sft_step"], m)) if main else None,
                generator=generator)
            reached = (f", validation success {checks[-1]['check_success']:.2f} at the last "
                       "check" if checks else "")
            what = ("expert rollouts" if warmstart_source(config) == "expert"
                    else f"conversations of {config.warmstart.data}")
            print_fn(f"warm-start: {len(demos)} {what}, {len(losses)} steps, "
                     f"loss {losses[0]:.3f} -> {losses[-1]:.3f}{reached}")
        if main:  # RL can start again from here (warmstart.load)
            torch.save(policy.state_dict(), run_dir / "warmstart.pt")
        if world is not None:
            world.broadcast_parameters(policy)
        before = evaluate(policy, chat, environment, config, seed=config.seed, world=world,
                          generator=generator)
        if main:
            outputs.write("eval", 0, before)
            warm_file.write_text(json.dumps(before))
        print_fn(f"warm-start eval: success {before['success']:.3f}, reward {before['reward']:.3f} "
                 f"({time.perf_counter() - start:.0f} s since the start)")
    if world is not None:
        world.barrier()  # warmstart.json is written
    before = json.loads(warm_file.read_text())
    rl_start = time.perf_counter()
    trainer = Trainer(policy, chat, environment, train, log=print_fn, world=world,
                      generator=generator, resume=resuming)
    if resuming and main:
        _forget_steps_after(run_dir / "metrics.jsonl", trainer.step_index,
                            trainer.critic_warmup_index)
    periodic = PeriodicEval(config, trainer, chat, environment, world, generator, outputs,
                            print_fn)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=train.steps, initial=trainer.step_index, desc=train.algo, unit="step",
                   dynamic_ncols=True)

    def on_step(metrics):
        if outputs is not None:
            outputs.write("train", metrics["step"], metrics)
        if bar is not None:
            bar.set_postfix(reward=f"{metrics['reward']:.2f}", success=f"{metrics['success']:.2f}",
                            kl=f"{metrics.get('approx_kl', 0.0):.1e}",
                            clip=f"{metrics.get('clipfrac', 0.0):.2f}",
                            tok_s=f"{metrics['tokens_per_second']:.0f}",
                            **({"wait": f"{metrics['learner_wait_seconds']:.1f}s",
                                "buf": metrics["buffer_groups"],
                                "roll_tok_s": f"{metrics['rollout_tokens_per_second']:.0f}"}
                               if "buffer_groups" in metrics else {}))
            bar.update(1)
        periodic.after_step(metrics["step"])

    def on_warmup(metrics):
        if outputs is not None:
            outputs.write("critic_warmup", metrics["step"], metrics)
        if metrics["step"] == train.critic_warmup_steps:
            print_fn(f"critic warm-up: {metrics['step']} steps before RL, value loss "
                     f"{metrics.get('value_loss', float('nan')):.4f} at the last")

    try:
        trainer.train(callback=on_step, warmup_callback=on_warmup)
    finally:
        trainer.close()  # the asynchronous rollout producer, if any
    if bar is not None:
        bar.close()
    final_exists = (run_dir / "checkpoints" / f"step-{trainer.step_index:09d}").exists()
    if world is not None:
        final_exists = world.broadcast(final_exists)  # the same decision on every rank
    if not final_exists:
        trainer.save_checkpoint()  # the final state, whatever checkpoint_every is
    after = evaluate(trainer.rollout_policy, chat, environment, config, seed=config.seed,
                     world=world, generator=generator)
    trainer.export(run_dir / "export")
    summary = {"algo": train.algo, "steps": trainer.step_index, "seed": config.seed,
               "eval_tasks": config.eval.tasks, "warmstart_success": before["success"],
               "warmstart_reward": before["reward"], "final_success": after["success"],
               "final_reward": after["reward"], "seconds": time.perf_counter() - start,
               "rl_seconds": time.perf_counter() - rl_start,  # this process's RL phase and eval
               "ranks": world.size if world is not None else 1}
    if config.eval.every is not None:  # this process's periodic evaluations' share of its time
        summary.update(periodic_eval_seconds=periodic.seconds,
                       periodic_eval_share=periodic.seconds / summary["seconds"])
    if not main:
        return summary
    outputs.write("eval", trainer.step_index, after)
    outputs.close()
    plot_curves(run_dir)
    (run_dir / "summary.txt").write_text(
        "".join(f"{key}: {value}\n" for key, value in summary.items()))
    print_fn(f"run folder: {run_dir} (metrics.jsonl, tb/, curves.png, summary.txt, checkpoints/, "
             "export/)")
    print_fn(f"eval success: {after['success']:.3f} (warm-start: {before['success']:.3f})")
    return summary
