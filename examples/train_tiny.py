"""Train the tiny default policy on the built-in vault environment: a supervised warm-start on
expert demonstrations, then a few steps of PPO (a critic, GAE bootstrapped across compacted
sub-traces) and, from the same warm-start, of GRPO (the baseline); export both for HF tools.

    python examples/train_tiny.py --steps 3
"""

import argparse
import copy

from agentrl_fast.harness import ChatFormat
from agentrl_fast.config import RolloutConfig, SamplingParams
from agentrl_fast.envs import VaultEnvironment, build_tokenizer, expert_action
from agentrl_fast.models.tiny import tiny_qwen3
from agentrl_fast.train import TrainConfig, Trainer
from agentrl_fast.train.sft import demonstrations, sft

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--demos", type=int, default=48)
parser.add_argument("--out", default="runs/example")
args = parser.parse_args()

env = VaultEnvironment()
chat = ChatFormat(build_tokenizer(env.corpus(), words=env.words()))
rollout = RolloutConfig(samples_per_task=4, context_budget=200, max_turns=24, summary_chars=200,
                        sampling=SamplingParams(temperature=1.0, max_new_tokens=24))
warm = tiny_qwen3(len(chat.tokenizer), seed=0)
demos = demonstrations(expert_action, chat, env, env.tasks("train")[:args.demos], rollout)
losses = sft(warm, [s for d in demos for s in d.sub_traces], steps=40)
print(f"warm-start: {len(demos)} expert rollouts, NLL {losses[0]:.2f} -> {losses[-1]:.2f}")
for algo in ("ppo", "grpo"):
    config = TrainConfig(algo=algo, steps=args.steps, tasks_per_step=2, micro_batch_tokens=1024,
                         rollout=rollout, seed=1)
    trainer = Trainer(copy.deepcopy(warm), chat, env, config)
    for m in trainer.train():
        print(f"{algo} step {m['step']}: reward {m['reward']:.3f} success {m['success']:.2f} "
              f"sub-traces {m['sub_traces']:.2f} kl {m['approx_kl']:.2e} clip {m['clipfrac']:.3f}")
    print(f"{algo}: exported to {trainer.export(f'{args.out}/{algo}')}")
