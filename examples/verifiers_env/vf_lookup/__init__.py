"""A verifiers 0.4 environment built from a local dataset: ``tasks.jsonl`` beside this package
(no hub, nothing downloaded). Each task asks for a vault's code; the ``lookup`` tool (a shared
:class:`~vf_lookup.tools.LookupTools` MCP server) reads the codes; the reward grades the final
answer. Its taskset id is ``vf-lookup`` (verifiers imports the module ``vf_lookup``).

    python agentrl_fast/integrations/verifiers_runner.py --env-id vf-lookup \\
        --env-path examples/verifiers_env --proxy http://127.0.0.1:PORT ...
"""

import json
from collections.abc import Iterator
from pathlib import Path

import verifiers.v1 as vf

from vf_lookup.tools import CODES, LookupTools

DATA = Path(__file__).resolve().parent.parent / "tasks.jsonl"
SYSTEM_PROMPT = "Find the code with the lookup tool, then answer with the code alone."


class LookupData(vf.TaskData):
    vault: str
    answer: str


class LookupTask(vf.Task[LookupData]):
    """The rubric: the exact code, plus a small weight on a short answer (a graded signal,
    so samples of one task differ even before any is right)."""

    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.answer)

    @vf.reward(weight=0.2)
    async def concise(self, trace: vf.Trace) -> float:
        return 1.0 / (1.0 + len(trace.last_reply) / 50)


class LookupTasksetConfig(vf.TasksetConfig):
    path: Path = DATA
    """A JSON-lines file of {"id", "vault"} rows."""


class LookupTaskset(vf.Taskset[LookupTask, LookupTasksetConfig]):
    def load(self) -> Iterator[LookupTask]:
        for line in self.config.path.read_text().splitlines():
            row = json.loads(line)
            data = LookupData(id=row["id"], vault=row["vault"], answer=CODES[row["vault"]],
                              system_prompt=SYSTEM_PROMPT,
                              prompt=f"What is the code of vault {row['vault']}?")
            yield LookupTask(data, self.config.task)

    @classmethod
    def toolsets(cls, config: LookupTasksetConfig) -> list[vf.Toolset]:
        return [LookupTools(vf.SharedToolsetConfig())]


__all__ = ["LookupTaskset"]
