"""The built-in long-horizon environment: collect the codes of several vaults, keeping them in
memory across context compactions, recovering from jammed vaults, and answer them in order.

A task names ``k`` vaults. ``open_vault(name)`` returns ``vault <name>: code <code>``, except
that some vaults are jammed on their first opening (the tool raises; the model reads the error
and must open the vault again), a vault shows its code once (opening it again raises: it is
empty) and unknown names raise. The context budget is small, so the conversation is compacted
into sub-traces and codes seen earlier are gone from the context: the agent must
``memory_write`` each code when it sees it and ``memory_read`` the codes it no longer sees
before answering (the compaction summary lists the memory keys); a code neither saved nor in
view is lost (the answer writes ``none`` in its place). The answer is the codes in the task's
order (``Codes: falcon tiger``); the reward is the fraction of positions right, success all of
them.

Everything is a pure function of the task id (world: names, codes, jammed vaults) and no tool
reads the clock, so episodes are deterministic. Splits: ``"train"`` and a held-out ``"eval"``
whose vault lists never occur in ``"train"``.

:func:`expert_action` is a scripted policy that reads the context text and returns the next
assistant output; :class:`~agentrl_fast.harness.generation.ScriptedGenerator` runs it through
the real rollout engine (warm-start demonstrations and tests). With ``save_probability`` or
``read_probability`` below 1 it is a careless expert that skips saving, or reading back, some
codes (a fixed choice per task and vault): demonstrations RL can improve on.
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass, field
from typing import Sequence

from agentrl_fast.harness.chat_format import IM_START, TOOL_RESPONSE_CLOSE
from agentrl_fast.harness.environment import SPLITS, Task
from agentrl_fast.harness.memory import MemoryNamespace
from agentrl_fast.harness.rollout import derive_seed
from agentrl_fast.harness.tool_calls import ToolCall, parse_tool_calls
from agentrl_fast.harness.tools import Tool, ToolResult, tool

VAULT_NAMES = ("amber", "birch", "cedar", "delta", "ember", "frost", "grove", "haven", "iris",
               "jade", "kite", "lotus", "maple", "noble", "onyx", "pearl", "quartz", "raven",
               "sage", "tulip", "umber", "violet", "willow", "yarrow", "zephyr", "aspen", "basil",
               "coral", "dune", "elm")
CODE_WORDS = ("falcon", "tiger", "otter", "heron", "lynx", "bison", "crane", "eagle", "gecko",
              "hyena", "ibis", "jackal", "koala", "lemur", "moose", "newt", "ocelot", "panda",
              "quail", "robin", "seal", "tapir", "viper", "walrus", "yak", "zebra")
SYSTEM_PROMPT = ("You open vaults to collect their codes. A vault shows its code once: save "
                 "each code with memory_write as soon as you see it; your context may be reset, "
                 "then read saved codes with memory_read. A jammed vault opens on a second try. "
                 "Answer with the codes in the task's order, like: Codes: falcon tiger")
LOST_CODE = "none"  # the answer's word for a code the agent no longer has
MEMORY_TOOLS = ("memory_write", "memory_read")
_TASK_PATTERN = re.compile(r"Collect the codes of vaults ([a-z ,]+?)\.")
_ANSWER_PATTERN = re.compile(r"Codes:\s*(.*)", re.S)


@dataclass(frozen=True)
class VaultWorld:
    vaults: tuple[str, ...]
    codes: tuple[str, ...]
    jammed: frozenset[str]


def task_prompt(vaults: Sequence[str]) -> str:
    return f"Collect the codes of vaults {', '.join(vaults)}."


def _world(seed_text: str, min_vaults: int, max_vaults: int, jam_probability: float) -> VaultWorld:
    rng = random.Random(seed_text)
    k = rng.randint(min_vaults, max_vaults)
    vaults = tuple(rng.sample(VAULT_NAMES, k))
    codes = tuple(rng.choice(CODE_WORDS) for _ in vaults)
    jammed = frozenset(v for v in vaults if rng.random() < jam_probability)
    return VaultWorld(vaults, codes, jammed)


def score(answer: str | None, codes: Sequence[str]) -> float:
    """Fraction of positions right: the words after ``Codes:`` (punctuation ignored) against
    the task's codes, over the longer of the two lists."""
    if not answer:
        return 0.0
    match = _ANSWER_PATTERN.search(answer)
    if not match:
        return 0.0
    given = re.findall(r"[a-z]+", match.group(1).lower())
    right = sum(1 for expected, answered in zip(codes, given) if expected == answered)
    return right / max(len(codes), len(given))  # extra words cost like wrong ones


@dataclass
class VaultEpisode:
    world: VaultWorld
    memory: MemoryNamespace
    system_prompt: str = SYSTEM_PROMPT
    reward: float = 0.0
    opened: dict = field(default_factory=dict)

    def __post_init__(self):
        self.prompt = task_prompt(self.world.vaults)
        codes = dict(zip(self.world.vaults, self.world.codes))

        @tool
        def open_vault(name: str) -> str:
            """Open a vault and read its code.

            Args:
                name: The vault's name.
            """
            if name not in codes:
                raise ValueError(f"no vault named {json.dumps(name)}")
            self.opened[name] = self.opened.get(name, 0) + 1
            jammed = name in self.world.jammed
            if jammed and self.opened[name] == 1:
                raise RuntimeError(f"vault {name} is jammed; open it again")
            if self.opened[name] > 1 + jammed:  # its one showing is past
                raise RuntimeError(f"vault {name} is empty; it showed its code once")
            return f"vault {name}: code {codes[name]}"

        memory_tools = [t for t in self.memory.tools() if t.name in MEMORY_TOOLS]
        self.tools = [open_vault, *memory_tools]

    def after_tools(self, calls: Sequence[ToolCall], results: Sequence[ToolResult]) -> float:
        return 0.0

    def finish(self, answer: str | None) -> float:
        self.reward = score(answer, self.world.codes)
        return self.reward

    @property
    def success(self) -> bool:
        return self.reward == 1.0


class VaultEnvironment:
    """The built-in environment (see the module doc). ``min_vaults``/``max_vaults`` per task,
    ``jam_probability`` per vault, ``train_size``/``eval_size`` tasks per split."""

    name = "vault"

    def __init__(self, min_vaults: int = 2, max_vaults: int = 3, jam_probability: float = 0.3,
                 train_size: int = 10_000, eval_size: int = 200):
        if not 1 <= min_vaults <= max_vaults <= len(VAULT_NAMES):
            raise ValueError(f"VaultEnvironment: need 1 <= min_vaults <= max_vaults <= "
                             f"{len(VAULT_NAMES)}, got {min_vaults}, {max_vaults}")
        if not 0.0 <= jam_probability <= 1.0:
            raise ValueError(f"VaultEnvironment: jam_probability must be in [0, 1], "
                             f"got {jam_probability}")
        if train_size < 1 or eval_size < 1:
            raise ValueError("VaultEnvironment: train_size and eval_size must be >= 1")
        self.min_vaults, self.max_vaults = min_vaults, max_vaults
        self.jam_probability = jam_probability
        self.train_size, self.eval_size = train_size, eval_size
        self._tasks: dict[str, list[Task]] = {}

    def _make_task(self, split: str, index: int) -> Task:
        world = _world(f"vault/{split}/{index}", self.min_vaults, self.max_vaults,
                       self.jam_probability)
        return Task(f"{split}-{index}", task_prompt(world.vaults), {"world": world})

    def tasks(self, split: str) -> list[Task]:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        if split not in self._tasks:
            if split == "train":
                self._tasks[split] = [self._make_task("train", i) for i in range(self.train_size)]
            else:
                seen = {t.data["world"].vaults for t in self.tasks("train")}
                possible = sum(math.perm(len(VAULT_NAMES), k)
                               for k in range(self.min_vaults, self.max_vaults + 1))
                held_out, index = [], 0
                while len(held_out) < self.eval_size:
                    if index >= 1000 * self.eval_size:  # the draw finds (almost) nothing new
                        raise ValueError(
                            f"VaultEnvironment: cannot draw {self.eval_size} held-out tasks whose "
                            f"vault lists never occur in the {self.train_size} train tasks (those "
                            f"use {len(seen)} of the {possible} possible lists); lower "
                            f"train_size or eval_size, or raise max_vaults")
                    candidate = self._make_task("eval", index)
                    index += 1
                    if candidate.data["world"].vaults not in seen:
                        held_out.append(candidate)
                self._tasks[split] = held_out
        return self._tasks[split]

    def start(self, task: Task, memory: MemoryNamespace, seed: int) -> VaultEpisode:
        return VaultEpisode(task.data["world"], memory)

    def words(self) -> tuple[str, ...]:
        """Entity names the built-in tokenizer keeps whole (one id wherever they appear)."""
        return VAULT_NAMES + CODE_WORDS + (LOST_CODE,)

    def corpus(self) -> list[str]:
        """Text for the built-in tokenizer: the prompts, tool outputs and expert actions."""
        lines = [SYSTEM_PROMPT]
        for name in VAULT_NAMES:
            lines.append(f"vault {name}: code falcon. vault {name} is jammed; open it again. "
                         f"vault {name} is empty; it showed its code once")
            lines.append(_call_text("open_vault", {"name": name}))
            lines.append(_call_text("memory_read", {"key": name}))
            for code in CODE_WORDS:
                lines.append(_call_text("memory_write", {"key": name, "value": code}))
        lines.append("Codes: " + " ".join(CODE_WORDS) + f" {LOST_CODE}")
        lines.append(task_prompt(VAULT_NAMES))
        # The system turn with the tools header starts every sub-trace: weigh it so its words
        # and JSON become few tokens.
        from agentrl_fast.harness.chat_format import render_messages
        from agentrl_fast.harness.memory import MemoryStore
        with MemoryStore() as store:
            episode = self.start(self.tasks("train")[0], store.namespace("corpus"), seed=0)
            header = render_messages([{"role": "system", "content": episode.system_prompt}],
                                     tools=[t.schema for t in episode.tools])
        return lines + [header] * 50


# ---------------------------------------------------------------------------------------------
# The scripted expert.

def _call_text(name: str, arguments: dict) -> str:
    return ("<tool_call>\n" + json.dumps({"name": name, "arguments": arguments},
                                         ensure_ascii=False) + "\n</tool_call>")


def _current_task_vaults(context: str) -> list[str]:
    matches = _TASK_PATTERN.findall(context)
    return [v.strip() for v in matches[-1].split(",")] if matches else []


def _chooses(vaults: Sequence[str], vault: str, what: str, probability: float) -> bool:
    """The careless expert's fixed choice to do ``what`` for ``vault`` in this task."""
    if probability >= 1.0:
        return True
    return derive_seed(what, ",".join(vaults), vault) / 2 ** 63 < probability


def expert_action(context: str, save_probability: float = 1.0,
                  read_probability: float = 1.0, retry_probability: float = 1.0) -> str:
    """The next assistant output for the vault task, read from the context text alone: save a
    code seen but not saved, open a vault neither seen nor saved nor emptied (again if it was
    jammed), read a saved code no longer in view, else answer (``none`` for a lost code).

    A careless expert (fixed choices per task and vault): ``save_probability`` < 1 saves each
    code with that probability (a code not saved is lost once compaction drops it from view);
    ``read_probability`` < 1 reads each saved code it no longer sees with that probability before
    answering (``none`` for the others); ``retry_probability`` < 1 opens a jammed vault again
    with that probability, else gives it up (moves on; ``none`` in the answer)."""
    vaults = _current_task_vaults(context)
    known: dict[str, str] = {}
    saved: set[str] = set()
    emptied = set(re.findall(r"vault ([a-z]+) is empty", context))
    jammed = set(re.findall(r"vault ([a-z]+) is jammed", context))
    # The compaction summary lists saved keys and may repeat recent tool results.
    for listed in re.findall(r"Saved in memory: ([a-z, ]+)\.", context):
        saved.update(k.strip() for k in listed.split(",") if k.strip())
    for name, code in re.findall(r"vault ([a-z]+): code ([a-z]+)", context):
        known[name] = code
    for name, code in re.findall(r'- memory_read \{"key": "([a-z]+)"\}: ([a-z]+)\b', context):
        known[name] = code
    # Pair each call with its response, in order.
    turns = context.split(f"{IM_START}assistant\n")[1:]
    for turn in turns:
        calls = [c for c in parse_tool_calls(turn) if c.ok]
        responses = re.findall(r"<tool_response>\n(.*?)\n" + re.escape(TOOL_RESPONSE_CLOSE),
                               turn, flags=re.S)
        for call, response in zip(calls, responses):
            if response.startswith("Error"):
                continue
            if call.name == "memory_write":
                saved.add(call.arguments.get("key"))
            elif call.name == "memory_read":
                known[call.arguments.get("key")] = response.strip()
    for vault in vaults:
        if vault in known and vault not in saved and _chooses(vaults, vault, "save",
                                                              save_probability):
            return _call_text("memory_write", {"key": vault, "value": known[vault]})
    # Vaults are opened in the task's order: one before a vault already seen was opened (its
    # code, if neither saved nor in view, is lost).
    seen = [i for i, v in enumerate(vaults) if v in known or v in saved or v in emptied]
    for i, vault in enumerate(vaults):
        if vault not in known and vault not in saved and vault not in emptied \
                and not (seen and i < max(seen)):
            if vault in jammed and not _chooses(vaults, vault, "retry", retry_probability):
                continue  # given up: the next vault is opened, this code is lost
            return _call_text("open_vault", {"name": vault})
    for vault in vaults:
        if vault not in known and vault in saved and _chooses(vaults, vault, "read",
                                                              read_probability):
            return _call_text("memory_read", {"key": vault})
    return "Codes: " + " ".join(known.get(v, LOST_CODE) for v in vaults)
