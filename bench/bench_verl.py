"""Benchmark: our advantage estimator inside verl against verl's own, on verl's padded layout.

Runs in the verl side environment (verl is not a dependency of the main one)::

    bash tools/setup_test_env.sh verl
    ~/.cache/agentrl_fast/side-envs/verl/bin/python bench/bench_verl.py [--tiny]

Providers, in one process, on the same padded ``[B, L]`` tensors (float32, multi-turn response
masks: right padding plus holes where tool responses sit), each checked against verl's before
it is timed:

* ``verl``: ``core_algos.compute_gae_advantage_return`` (its reversed-time Python loop over
  ``L`` columns, then ``masked_whiten``), as ``get_adv_estimator_fn("gae")`` returns it.
* ``agentrl_gae``: ours through verl's lookup ``get_adv_estimator_fn("agentrl_gae")`` after
  ``agentrl_fast.integrations.verl.register()``: the packed GAE kernel on the rows laid end to
  end, the carry-over and whitening verl applies, all loop-free.

Mixes: "many-short" (4096 x 512) and "long-tail" (64 sequences, lengths log-uniform in
64..65536, as bench_gae.py's mix, padded to the longest as verl pads them). Rows go to
``bench/results/verl.jsonl`` (``bench/common.py`` format; ``ratio`` = verl's time / ours).
"""

import argparse

import torch

import common  # noqa: E402  (bench/ is the script's folder: first on sys.path)
from bench_gae import mix_lengths  # noqa: E402


def padded_batch(lengths: list[int], seed: int) -> dict:
    """verl's padded tensors for sequences of ``lengths``: ``[B, max(lengths)]`` float32,
    response mask 1 on ~80% of each row's tokens (holes: tool responses), reward on the last."""
    gen = torch.Generator().manual_seed(seed)
    rows, width = len(lengths), max(lengths)
    valid = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    mask = valid & (torch.rand(rows, width, generator=gen) < 0.8)
    rewards = torch.zeros(rows, width)
    last = (torch.tensor(lengths) - 1).clamp(min=0)
    mask[torch.arange(rows), last] = True
    rewards[torch.arange(rows), last] = torch.randn(rows, generator=gen)
    return {"token_level_rewards": rewards, "values": torch.randn(rows, width, generator=gen),
            "response_mask": mask.float()}


def run_mix(name: str, tiny: bool, repeats: int) -> list:
    from verl.trainer.ppo import core_algos

    lengths = mix_lengths(name, torch.device("cpu"), tiny, seed=0)
    batch = padded_batch(lengths, seed=1)
    gamma, lam = 0.99, 0.95
    verl_fn = core_algos.get_adv_estimator_fn("gae")
    ours_fn = core_algos.get_adv_estimator_fn("agentrl_gae")
    want = verl_fn(**batch, gamma=gamma, lam=lam)
    got = ours_fn(**batch, gamma=gamma, lam=lam)
    for label, x, y in zip(("advantages", "returns"), got, want):
        if not torch.allclose(x, y, rtol=1e-4, atol=1e-4):
            raise SystemExit(f"{name}: our {label} differ from verl's by "
                             f"{(x - y).abs().max():.3g}; not timing")
    device = torch.device("cpu")
    tokens = sum(lengths)
    shape = f"{name} B={len(lengths)} L={max(lengths)} T={tokens}"
    times = {
        "verl": common.benchmark(lambda: verl_fn(**batch, gamma=gamma, lam=lam), device,
                                 warmup=1, repeats=repeats, max_seconds=60),
        "agentrl_gae": common.benchmark(lambda: ours_fn(**batch, gamma=gamma, lam=lam), device,
                                        warmup=1, repeats=repeats, max_seconds=30),
    }
    return [common.Row(op="verl_adv_estimator", provider=provider, shape=shape, dtype="float32",
                       device=common.device_name(device), time_ms=ms,
                       tokens_per_s=tokens / (ms / 1e3),
                       ratio=times["verl"] / ms if provider == "agentrl_gae" else None)
            for provider, ms in times.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mix", choices=("many-short", "long-tail"), action="append")
    parser.add_argument("--tiny", action="store_true", help="small shapes (a smoke run)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="results folder (default bench/results)")
    args = parser.parse_args()
    from agentrl_fast.integrations import verl as agentrl_verl

    agentrl_verl.register()
    rows = []
    for mix in args.mix or ("many-short", "long-tail"):
        rows += run_mix(mix, args.tiny, args.repeats)
    common.print_table(rows)
    if not args.tiny:
        print(f"rows appended to {common.write_rows(rows, 'verl', args.out)}")


if __name__ == "__main__":
    main()
