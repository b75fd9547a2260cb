"""The run's environment from its config: the vault task, the dataset tool environment, or a
user's ``env.factory``; its protocol checked before anything runs."""

from __future__ import annotations

import dataclasses

from agentrl_fast.config import (ConfigError, EnvConfig, RunConfig, search_folders, uses_vault,
                                 warmstart_source)
from agentrl_fast.config.imports import import_object
from agentrl_fast.envs.dataset import DatasetToolEnvironment
from agentrl_fast.envs.vault import VaultEnvironment
from agentrl_fast.harness.environment import (check_environment, check_episode,
                                              close_environment, close_episode)
from agentrl_fast.harness.memory import MemoryStore

# The EnvConfig fields that are the vault task's arguments.
_VAULT_FIELDS = tuple(f.name for f in dataclasses.fields(EnvConfig)
                      if f.name not in ("name", "factory", "args"))


def make_environment(config: RunConfig):
    """The environment ``config.env`` describes; a :class:`ConfigError` naming the field when it
    cannot be built or does not follow the ``Environment`` protocol."""
    env = config.env
    if uses_vault(config):
        return VaultEnvironment(**{name: getattr(env, name) for name in _VAULT_FIELDS})
    search = search_folders(config)
    if env.factory is not None:
        factory = import_object(env.factory, "env.factory", search)
        if not callable(factory):
            raise ConfigError(f"env.factory: {env.factory!r} is a {type(factory).__name__}, "
                              "not a callable")
        where = f"env.factory ({env.factory})"
        environment = _call(factory, env.args, where)
    else:
        if "search" in env.args:
            raise ConfigError("env.args.search: set by the run (the working directory and the "
                              "config's folder); leave it out")
        environment = _call(DatasetToolEnvironment, {**env.args, "search": search}, "env.args")
    field = "env.factory" if env.factory is not None else "env.args"
    try:
        try:
            check_environment(environment)
        except TypeError as error:
            raise ConfigError(f"{field}: {error}") from None
        _check_splits(environment, config)
        _check_first_episode(environment, field)
    except BaseException:
        close_environment(environment)  # what it started (MCP servers) stops with the error
        raise
    return environment


def _check_first_episode(environment, field: str) -> None:
    """Start an episode of the first train task (on a throwaway memory) and check it follows the
    ``Episode`` protocol, so a missing member stops the run before any model is loaded."""
    task = environment.tasks("train")[0]
    with MemoryStore() as store:
        try:
            episode = environment.start(task, store.namespace("check"), 0)  # as the engine does
        except Exception as error:  # noqa: BLE001 - the user's code: say where it failed
            raise ConfigError(f"{field}: {type(environment).__name__}.start({task.id!r}) raised "
                              f"{type(error).__name__}: {error}") from None
        try:
            check_episode(episode, environment)
        except TypeError as error:
            raise ConfigError(f"{field}: {error}") from None
        finally:
            close_episode(episode)


def _call(factory, args: dict, where: str):
    try:
        return factory(**args)
    except ConfigError:
        raise
    except TypeError as error:  # most often an argument the factory does not take
        raise ConfigError(f"{where}: {error} (env.args: {sorted(args)})") from None
    except (ValueError, OSError, ImportError) as error:  # bad arguments: the message says it
        raise ConfigError(f"{where}: {error}") from None
    except Exception as error:  # noqa: BLE001 - the user's code: say where it failed
        raise ConfigError(f"{where}: {type(error).__name__}: {error}") from None


def _check_splits(environment, config: RunConfig) -> None:
    """Both splits have tasks, and the evaluation's fit in the held-out split."""
    for split in ("train", "eval"):
        try:
            tasks = environment.tasks(split)
        except Exception as error:  # noqa: BLE001 - the user's code: name where it failed
            raise ConfigError(f"env: {type(environment).__name__}.tasks({split!r}) raised "
                              f"{type(error).__name__}: {error}") from None
        if not tasks:
            raise ConfigError(f"env: {type(environment).__name__}.tasks({split!r}) is empty")
    held_out = len(environment.tasks("eval"))
    if config.eval.tasks > held_out:
        raise ConfigError(f"eval.tasks ({config.eval.tasks}) exceeds the environment's "
                          f"held-out split ({held_out} tasks); set eval.tasks to at most "
                          f"{held_out}")
    w = config.warmstart
    checks = (w.target_success is not None and w.steps > 0 and w.load is None
              and warmstart_source(config) != "none")
    if checks and config.eval.tasks + w.check_tasks > held_out:
        raise ConfigError(f"warmstart.check_tasks ({w.check_tasks}) + eval.tasks "
                          f"({config.eval.tasks}) exceed the environment's held-out split "
                          f"({held_out} tasks): the warm-start's validation tasks (the last "
                          "check_tasks held-out tasks) must stay out of the final evaluation; "
                          "lower them, or set warmstart.target_success: null (a fixed number "
                          "of warm-start steps, no checks)")
