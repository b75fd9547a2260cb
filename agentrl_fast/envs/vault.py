"""The built-in long-horizon environment: collect the codes of several vaults, keeping them in
memory across context compactions, recovering from jammed vaults, then hand them in.

A task names ``k`` vaults. ``open_vault(name)`` returns ``vault <name>: code <code>``, except
that some vaults are jammed on their first opening (the tool raises; the model reads the error
and must open the vault again), a vault shows its code once (opening it again raises: it is
empty) and unknown names raise. ``submit_code(vault, code)`` hands in one vault's code, once
per vault, and only after every vault has been opened (a jammed attempt counts); it answers
with the vaults left to submit (``submitted; left: cedar, iris``). The context
budget is small, so the conversation is compacted into sub-traces and codes seen earlier are
gone from the context: the agent must ``memory_write`` each code when it sees it and, once
every vault is open, ``memory_read`` each code back and submit it (the compaction summary lists
the memory keys); a code neither saved nor in view is lost (``none`` is submitted for it). The
episode ends with a text answer (``Done.``); the reward is the fraction of vaults whose right
code was submitted, success all of them.

Everything is a pure function of the task id (world: names, codes, jammed vaults) and no tool
reads the clock, so episodes are deterministic. Splits: ``"train"`` and a held-out ``"eval"``
whose vault lists never occur in ``"train"``.

:func:`expert_action` is a scripted policy that reads the context text and returns the next
assistant output; :class:`~agentrl_fast.generators.scripted.ScriptedGenerator` runs it through
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
from typing import Mapping, Sequence

from agentrl_fast.harness.chat_format import IM_END, IM_START, TOOL_RESPONSE_CLOSE
from agentrl_fast.harness.environment import SPLITS, Task
from agentrl_fast.harness.memory import MemoryNamespace
from agentrl_fast.seeds import derive_seed
from agentrl_fast.harness.tool_calls import ToolCall, parse_tool_calls
from agentrl_fast.harness.tools import ToolResult, tool

VAULT_NAMES = ("amber", "birch", "cedar", "delta", "ember", "frost", "grove", "haven", "iris",
               "jade", "kite", "lotus", "maple", "noble", "onyx", "pearl", "quartz", "raven",
               "sage", "tulip", "umber", "violet", "willow", "yarrow", "zephyr", "aspen", "basil",
               "coral", "dune", "elm")
CODE_WORDS = ("falcon", "tiger", "otter", "heron", "lynx", "bison", "crane", "eagle", "gecko",
              "hyena", "ibis", "jackal", "koala", "lemur", "moose", "newt", "ocelot", "panda",
              "quail", "robin", "seal", "tapir", "viper", "walrus", "yak", "zebra")
SYSTEM_PROMPT = ("You open vaults to collect their codes. A vault shows its code once: save "
                 "each code with memory_write as soon as you see it; your context may be reset. "
                 "A jammed vault opens on a second try. When every vault is open, read each "
                 "code back with memory_read and hand it in with submit_code, in the task's "
                 "order, then say Done.")
LOST_CODE = "none"  # what is submitted for a code the agent no longer has
DONE = "Done."  # the expert's final answer
MEMORY_TOOLS = ("memory_write", "memory_read")
_TASK_PATTERN = re.compile(r"Collect the codes of vaults ([a-z ,]+?)\.")


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


def score(submitted: Mapping[str, str], vaults: Sequence[str], codes: Sequence[str]) -> float:
    """Fraction of the task's vaults whose right code was submitted (``submitted``: vault ->
    code handed in)."""
    if not vaults:
        return 0.0
    return sum(submitted.get(v) == c for v, c in zip(vaults, codes)) / len(vaults)


@dataclass
class VaultEpisode:
    world: VaultWorld
    memory: MemoryNamespace
    system_prompt: str = SYSTEM_PROMPT
    error_penalty: float = 0.0
    reward: float = 0.0
    opened: dict = field(default_factory=dict)
    submitted: dict = field(default_factory=dict)
    jams: int = field(default=0, init=False)  # jammed openings since the last after_tools

    def __post_init__(self):
        self.prompt = task_prompt(self.world.vaults)
        codes = dict(zip(self.world.vaults, self.world.codes))

        @tool(inline=True)
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
                self.jams += 1
                raise RuntimeError(f"vault {name} is jammed; open it again")
            if self.opened[name] > 1 + jammed:  # its one showing is past
                raise RuntimeError(f"vault {name} is empty; it showed its code once")
            return f"vault {name}: code {codes[name]}"

        @tool(inline=True)
        def submit_code(vault: str, code: str) -> str:
            """Hand in a vault's code (once per vault, after every vault has been opened).

            Args:
                vault: The vault's name.
                code: Its code.
            """
            if vault not in codes:
                raise ValueError(f"no vault named {json.dumps(vault)}")
            closed = [v for v in self.world.vaults if v not in self.opened]
            if closed:
                raise RuntimeError(f"open every vault first: {closed[0]} is not opened yet")
            if vault in self.submitted:
                raise RuntimeError(f"vault {vault}: a code was already submitted")
            self.submitted[vault] = code
            left = [v for v in self.world.vaults if v not in self.submitted]
            return f"submitted; left: {', '.join(left) if left else 'none'}"

        memory_tools = [t for t in self.memory.tools() if t.name in MEMORY_TOOLS]
        self.tools = [open_vault, *memory_tools, submit_code]

    def after_tools(self, calls: Sequence[ToolCall], results: Sequence[ToolResult]) -> float:
        """``-error_penalty`` for each failed call of the turn that was the agent's mistake
        (anything but a jammed vault's first opening): a bad call, an unknown or emptied vault,
        a read of a key never written, an early or repeated submission."""
        mistakes = sum(not result.ok for result in results) - self.jams
        self.jams = 0
        return -self.error_penalty * mistakes

    def finish(self, answer: str | None) -> float:
        self.reward = score(self.submitted, self.world.vaults, self.world.codes)
        return self.reward

    @property
    def success(self) -> bool:
        return self.reward == 1.0


class VaultEnvironment:
    """The built-in environment (see the module doc). ``min_vaults``/``max_vaults`` per task,
    ``jam_probability`` per vault, ``train_size``/``eval_size`` tasks per split."""

    name = "vault"

    def __init__(self, min_vaults: int = 2, max_vaults: int = 3, jam_probability: float = 0.3,
                 train_size: int = 10_000, eval_size: int = 200, error_penalty: float = 0.0):
        if not 1 <= min_vaults <= max_vaults <= len(VAULT_NAMES):
            raise ValueError(f"VaultEnvironment: need 1 <= min_vaults <= max_vaults <= "
                             f"{len(VAULT_NAMES)}, got {min_vaults}, {max_vaults}")
        if not 0.0 <= jam_probability <= 1.0:
            raise ValueError(f"VaultEnvironment: jam_probability must be in [0, 1], "
                             f"got {jam_probability}")
        if train_size < 1 or eval_size < 1:
            raise ValueError("VaultEnvironment: train_size and eval_size must be >= 1")
        if not 0.0 <= error_penalty <= 1.0:
            raise ValueError(f"VaultEnvironment: error_penalty must be in [0, 1], "
                             f"got {error_penalty}")
        self.error_penalty = error_penalty
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
        return VaultEpisode(task.data["world"], memory, error_penalty=self.error_penalty)

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
            lines.append(f"vault {name}: a code was already submitted. open every vault first: "
                         f"{name} is not opened yet")
            for code in CODE_WORDS + (LOST_CODE,):
                lines.append(_call_text("memory_write", {"key": name, "value": code}))
                lines.append(_call_text("submit_code", {"vault": name, "code": code}))
        lines.append(f"submitted; left: {', '.join(VAULT_NAMES[:3])}. submitted; left: none. {DONE}")
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


def _chooses(vaults: Sequence[str], vault: str, what: str, probability: float,
             careless_vaults: float = 1.0) -> bool:
    """The careless expert's fixed choice to do ``what`` for ``vault`` in this task. Careless
    only about a ``careless_vaults`` share of vault names (a habit tied to the name, which a
    policy can imitate; 1: every vault), the choice per task drawn with ``probability``."""
    if probability >= 1.0:
        return True
    if careless_vaults < 1.0 and derive_seed(what, "habit", vault) / 2 ** 63 >= careless_vaults:
        return True
    return derive_seed(what, ",".join(vaults), vault) / 2 ** 63 < probability


def expert_action(context: str, save_probability: float = 1.0,
                  read_probability: float = 1.0, retry_probability: float = 1.0,
                  careless_vaults: float = 1.0) -> str:
    """The next assistant output for the vault task, read from the context text alone: save a
    code seen but not saved; open the next vault (again if it was jammed); once every vault is
    open, for each vault in the task's order read its code back and submit it (``none`` for a
    lost code); then ``Done.``.

    A careless expert (fixed choices per task and vault): ``save_probability`` < 1 saves each
    code with that probability (a code not saved is lost once compaction drops it from view);
    ``read_probability`` < 1 reads each code back with that probability before submitting it
    (else it submits the code if it is still in view, ``none`` if not); ``retry_probability``
    < 1 opens a jammed vault again with that probability, else gives it up (moves on, submits
    ``none`` for it). ``careless_vaults`` < 1: careless about that share of vault names only
    (the same names in every task), careful about the rest."""
    vaults = _current_task_vaults(context)
    known: dict[str, str] = {}
    saved: set[str] = set()
    submitted: set[str] = set()
    emptied = set(re.findall(r"vault ([a-z]+) is empty", context))
    jammed = set(re.findall(r"vault ([a-z]+) is jammed", context))
    # The compaction summary lists saved keys and may repeat recent tool results.
    for listed in re.findall(r"Saved in memory: ([a-z, ]+)\.", context):
        saved.update(k.strip() for k in listed.split(",") if k.strip())
    for name, code in re.findall(r"vault ([a-z]+): code ([a-z]+)", context):
        known[name] = code
    submitted.update(re.findall(r"vault ([a-z]+): a code was already submitted", context))
    submitted.update(re.findall(r'- submit_code \{"vault": "([a-z]+)"[^\n]*\}: submitted;', context))
    for name, code in re.findall(r'- memory_read \{"key": "([a-z]+)"\}: ([a-z]+)\b', context):
        known[name] = code
    # Pair each call with its response, in order; remember a read that was the last result
    # (in the summary, or in a turn).
    summary_lines = re.findall(r"^- (.*)$", context, flags=re.M)
    found = re.match(r'memory_read \{"key": "([a-z]+)"\}: [a-z]+(?:' + re.escape(IM_END) + ")?$",
                     summary_lines[-1]) if summary_lines else None
    summary_read = found.group(1) if found else None
    last_read = summary_read
    turns = context.split(f"{IM_START}assistant\n")[1:]
    for turn in turns:
        calls = [c for c in parse_tool_calls(turn) if c.ok]
        responses = re.findall(r"<tool_response>\n(.*?)\n" + re.escape(TOOL_RESPONSE_CLOSE),
                               turn, flags=re.S)
        for call, response in zip(calls, responses):
            last_read = None
            if response.startswith("Error"):
                continue
            if call.name == "memory_write":
                saved.add(call.arguments.get("key"))
            elif call.name == "submit_code":
                submitted.add(call.arguments.get("vault"))
            elif call.name == "memory_read":
                known[call.arguments.get("key")] = response.strip()
                last_read = call.arguments.get("key")
    # Codes are submitted in the task's order: all before the last one seen submitted are too
    # (the compaction summary shows only the latest results).
    done = [i for i, v in enumerate(vaults) if v in submitted]
    if summary_read in vaults:  # the summary's last result reads the next one
        done.append(vaults.index(summary_read) - 1)
    submitted.update(vaults[:max(done, default=-1) + 1])
    for vault in vaults:
        if vault in known and vault not in saved and vault not in submitted \
                and _chooses(vaults, vault, "save", save_probability, careless_vaults):
            return _call_text("memory_write", {"key": vault, "value": known[vault]})
    # Vaults are opened in the task's order: one before a vault already seen was opened (its
    # code, if neither saved nor in view, is lost).
    tried = [i for i, v in enumerate(vaults)
             if v in known or v in saved or v in emptied or v in jammed or v in submitted]
    for i, vault in enumerate(vaults):
        if vault not in known and vault not in saved and vault not in emptied \
                and vault not in submitted and not (tried and i < max(tried)):
            if vault in jammed and not _chooses(vaults, vault, "retry", retry_probability,
                                                careless_vaults):
                continue  # given up: the next vault is opened, this code is lost
            return _call_text("open_vault", {"name": vault})
    for vault in vaults:
        if vault in submitted:
            continue
        if last_read == vault or vault not in saved or not _chooses(
                vaults, vault, "read", read_probability, careless_vaults):
            return _call_text("submit_code", {"vault": vault,
                                              "code": known.get(vault, LOST_CODE)})
        return _call_text("memory_read", {"key": vault})
    return DONE
