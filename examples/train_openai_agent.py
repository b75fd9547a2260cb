"""Train an agent written against the OpenAI API, unchanged, through the proxy: a plain
``openai`` tool-calling loop on the vault tasks (or, with ``--harness agents-sdk``, an OpenAI
Agents SDK agent on its default Responses model) points its ``base_url`` at the trainer's
proxy; each run is a session, recorded token for token; the finished sessions are a batch for
PPO (a critic, GAE across the harness's own compactions), and the proxy then serves the new
weights.

    pip install -e '.[serve]' openai openai-agents
    python examples/train_openai_agent.py --steps 3 [--harness agents-sdk]
"""

import argparse
import asyncio
import json

import openai

from agentrl_fast.harness import ChatFormat, MemoryStore
from agentrl_fast.config import RolloutConfig, SamplingParams
from agentrl_fast.envs import VaultEnvironment, build_tokenizer, expert_action
from agentrl_fast.proxy import Proxy, ProxyServer
from agentrl_fast.train.proxy_driver import proxy_for, train
from agentrl_fast.models.tiny import tiny_qwen3
from agentrl_fast.train import TrainConfig, Trainer
from agentrl_fast.train.sft import demonstrations, sft


def openai_agent(base_url: str, system: str, task: str, tools: list[dict], run_tool,
                 max_turns: int = 8) -> str | None:
    """Any OpenAI-API agent: call tools until a plain answer (nothing here knows the trainer)."""
    client = openai.OpenAI(base_url=base_url, api_key="unused")
    messages = [{"role": "system", "content": system}, {"role": "user", "content": task}]
    for _ in range(max_turns):
        try:
            reply = client.chat.completions.create(model="policy", messages=messages, tools=tools)
        except openai.BadRequestError:  # e.g. over the context budget: the episode ends here
            return None
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            if "<tool_call>" not in (message.content or ""):
                return message.content
            messages.append({"role": "user", "content": "Your tool call was malformed."})
        for call in message.tool_calls or []:
            result = run_tool(call.function.name, json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None


def agents_sdk_agent(base_url: str, system: str, task: str, tools: list[dict], run_tool,
                     max_turns: int = 8) -> str | None:
    """The same episode as an OpenAI Agents SDK agent (the episode's tools as its function
    tools), on the SDK's default model: the Responses API."""
    import agents  # pip install openai-agents

    agents.set_tracing_disabled(True)

    def function_tool(schema: dict) -> agents.FunctionTool:
        function = schema["function"]

        async def invoke(context, arguments: str) -> str:
            return run_tool(function["name"], json.loads(arguments or "{}"))
        return agents.FunctionTool(name=function["name"], description=function["description"],
                                   params_json_schema=function["parameters"],
                                   on_invoke_tool=invoke, strict_json_schema=False)

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused")
    agent = agents.Agent(name="vaults", instructions=system,
                         tools=[function_tool(t) for t in tools],
                         model=agents.OpenAIResponsesModel(model="policy", openai_client=client))
    try:
        result = asyncio.run(agents.Runner.run(agent, task, max_turns=max_turns))
    except (agents.MaxTurnsExceeded, openai.BadRequestError):  # the episode ends unanswered
        return None
    return result.final_output


HARNESSES = {"openai": openai_agent, "agents-sdk": agents_sdk_agent}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--demos", type=int, default=16)
    parser.add_argument("--warmstart-steps", type=int, default=40)
    parser.add_argument("--tasks-per-step", type=int, default=4)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--harness", choices=sorted(HARNESSES), default="openai")
    args = parser.parse_args()

    env = VaultEnvironment()
    chat = ChatFormat(build_tokenizer(env.corpus(), words=env.words()))
    rollout = RolloutConfig(samples_per_task=args.samples, context_budget=1024, max_turns=8,
                            sampling=SamplingParams(temperature=1.0, max_new_tokens=32))
    policy = tiny_qwen3(len(chat.tokenizer), seed=0)
    expert = RolloutConfig(context_budget=400, max_turns=24, sampling=rollout.sampling)
    demos = demonstrations(expert_action, chat, env, env.tasks("train")[:args.demos], expert)
    losses = sft(policy, [s for d in demos for s in d.sub_traces], steps=args.warmstart_steps,
                 batch_sequences=8)
    print(f"warm-start: {len(demos)} expert rollouts, NLL {losses[0]:.2f} -> {losses[-1]:.2f}")
    config = TrainConfig(algo="ppo", steps=args.steps, tasks_per_step=args.tasks_per_step,
                         mini_batches=2, micro_batch_tokens=2048, rollout=rollout, seed=1)
    trainer = Trainer(policy, chat, env, config, log=lambda *a: None)

    def agent(base_url: str, task) -> float:
        """One episode: the OpenAI agent with the task's tools as plain functions; the
        environment grades the answer."""
        with MemoryStore() as store:
            episode = env.start(task, store.namespace(task.id), seed=0)
            by_name = {t.name: t for t in episode.tools}

            def run_tool(name, arguments):
                try:
                    return str(by_name[name](**arguments))
                except Exception as error:  # noqa: BLE001 - the model reads what went wrong
                    return f"Error: {error}"
            answer = HARNESSES[args.harness](base_url, episode.system_prompt, episode.prompt,
                                             [t.schema for t in episode.tools], run_tool)
            return episode.finish(answer)

    proxy = proxy_for(trainer)
    with ProxyServer(proxy) as server:
        print(f"proxy on {server.url}")
        for m in train(trainer, server, agent, args.steps, workers=args.workers):
            print(f"ppo step {m['step']}: reward {m['reward']:.3f} turns {m['turns']:.1f} "
                  f"sub-traces {m['sub_traces']:.2f} kl {m['approx_kl']:.2e} "
                  f"mismatch {m['logprob_mismatch_max']:.1e} "
                  f"value loss {m['value_loss']:.3f}")
    proxy.close()


if __name__ == "__main__":
    main()
