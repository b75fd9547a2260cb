"""Benchmark: GAE over packed trajectories (docs/design.md, "GAE over packed trajectories").

Providers, all in this process and all checked against ours before they are timed:

* ``agentrl_fast``: our native op, ``agentrl_fast.ops.gae(..., validate=False)``; one more row
  with ``validate=True`` ("agentrl_fast (validate)").
* ``verl-loop``: the reversed-time Python loop over padded ``[B, L]`` tensors that verl,
  OpenRLHF and TRL run (each sequence padded to the longest; the mask is the action mask).
* ``torch-scan``: a loop-free torch version over the packed ``[T]`` layout: a log-depth
  (Hillis-Steele) suffix scan of the 5-number affine maps of ``csrc/gae_common.h``,
  ``O(T log T)`` work.
* ``torchrl``: ``torchrl.objectives.value.functional.vec_generalized_advantage_estimate`` on the
  action tokens laid end to end, when torchrl is importable.

Mixes (``--mix``): "many-short" (4096 x 512 tokens), "long-tail" (64 sequences, lengths
log-uniform in 64..65536), "one-huge" (one sequence of 2^20 tokens); on CUDA the same shapes
scaled to 2^26 tokens. Baselines whose sequences are longer than their cap (``--max-loop-len``,
``--max-torchrl-len``) run on the same mix shrunk under the cap and their time is extrapolated
per token; the provider name says so.

Usage (from the repository root)::

    python bench/bench_gae.py [--device cpu|cuda] [--mix NAME] [--dtype float32] [--tiny]
"""

import argparse
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

import common  # noqa: E402  (bench/ is the script's folder: first on sys.path)
from agentrl_fast.ops.gae import gae  # noqa: E402
from agentrl_fast.ops.reference import gae_reference  # noqa: E402

MIXES = ("many-short", "long-tail", "one-huge")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
CUDA_TOKENS = 1 << 26
# Token-stream structure: action and observation spans alternate, lengths uniform in SPAN.
SPAN = (4, 128)
PROMPT = (16, 128)


# ---------------------------------------------------------------------------------------------
# Inputs


def mix_lengths(name: str, device: torch.device, tiny: bool, seed: int) -> list[int]:
    """Sequence lengths of a mix: CPU sizes, CUDA sizes (2^26 tokens) or tiny sizes."""
    big = device.type == "cuda" and not tiny
    if name == "many-short":
        rows = 64 if tiny else (CUDA_TOKENS // 512 if big else 4096)
        return [128 if tiny else 512] * rows
    if name == "long-tail":
        count, low, high = (16, 16, 4096) if tiny else (64, 64, (1 << 22) if big else 65536)
        gen = torch.Generator().manual_seed(seed)
        logs = torch.empty(count, dtype=torch.float64).uniform_(math.log(low), math.log(high),
                                                                 generator=gen)
        lengths = [int(x) for x in logs.exp().round().tolist()]
        return _rescale(lengths, CUDA_TOKENS) if big else lengths
    if name == "one-huge":
        return [1 << 14] if tiny else [CUDA_TOKENS if big else 1 << 20]
    raise ValueError(f"unknown mix {name!r}; choose from {MIXES}")


def _rescale(lengths: list[int], total: int) -> list[int]:
    """Scale lengths to sum to ``total`` exactly (the longest takes the rounding)."""
    factor = total / sum(lengths)
    out = [max(1, int(n * factor)) for n in lengths]
    out[out.index(max(out))] += total - sum(out)
    return out


def shrink(lengths: list[int], max_len: int) -> list[int]:
    """The same mix with every length scaled so that the longest is at most ``max_len``."""
    longest = max(lengths)
    if longest <= max_len:
        return lengths
    return [max(1, n * max_len // longest) for n in lengths]


def _action_mask(lengths: torch.Tensor, starts: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """[T] bool: each sequence opens with a prompt span, then action and observation spans
    alternate (lengths uniform in SPAN; the span stream runs across sequence boundaries)."""
    device, total = lengths.device, int(lengths.sum())
    spans = torch.empty(0, dtype=torch.long, device=device)
    while int(spans.sum()) < total:
        more = torch.randint(SPAN[0], SPAN[1] + 1, (total // SPAN[0] // 8 + 16,), generator=gen,
                             device=device)
        spans = torch.cat([spans, more])
    labels = torch.arange(spans.numel(), device=device) % 2 == 0
    mask = torch.repeat_interleave(labels, spans)[:total]
    prompt = torch.randint(PROMPT[0], PROMPT[1] + 1, lengths.shape, generator=gen, device=device)
    prompt = torch.minimum(prompt, lengths // 4)
    position = torch.arange(total, device=device) - torch.repeat_interleave(starts, lengths)
    return mask & (position >= torch.repeat_interleave(prompt, lengths))


def _rewards(mask: torch.Tensor, cu_seqlens: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """[T] float32: a small per-token reward on every action token (a KL-penalty-like term) plus
    a reward in [-1, 1] on the last action token of each turn; 0 on other tokens."""
    device, total = mask.device, mask.numel()
    seq_end = torch.zeros(total + 1, dtype=torch.bool, device=device)
    seq_end[cu_seqlens[1:].long()] = True
    turn_end = mask & ~torch.cat([mask[1:], mask.new_zeros(1)]) | (mask & seq_end[1:])
    dense = torch.randn(total, generator=gen, device=device) * 0.01
    final = torch.rand(total, generator=gen, device=device) * 2 - 1
    return torch.where(mask, dense, 0.0) + torch.where(turn_end, final, 0.0)


def make_mix(name: str, device: torch.device | str, dtype: torch.dtype = torch.float32,
             tiny: bool = False, seed: int = 0, *, lengths: list[int] | None = None,
             padded: bool = True) -> dict:
    """One benchmark instance (seeded). ``lengths`` overrides the mix's sequence lengths.

    Returns a dict: ``name``, ``lengths`` (list), ``num_tokens`` T, ``max_len``, ``shape``
    (str), packed ``rewards[T]``/``values[T]`` (``dtype``), ``action_mask[T]`` (bool),
    ``cu_seqlens[B+1]`` (int32), and with ``padded`` also ``padded`` (see ``add_padded``).
    """
    device = torch.device(device)
    lengths = list(lengths) if lengths is not None else mix_lengths(name, device, tiny, seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    length_t = torch.tensor(lengths, dtype=torch.long, device=device)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.long, device=device)
    cu[1:] = length_t.cumsum(0)
    mask = _action_mask(length_t, cu[:-1], gen)
    rewards = _rewards(mask, cu, gen)
    values = torch.randn(mask.numel(), generator=gen, device=device) * 0.5
    mix = {
        "name": name, "lengths": lengths, "num_tokens": sum(lengths), "max_len": max(lengths),
        "shape": f"{name} B={len(lengths)} T={sum(lengths)}",
        "rewards": rewards.to(dtype), "values": values.to(dtype), "action_mask": mask,
        "cu_seqlens": cu.to(torch.int32),
    }
    if padded:
        add_padded(mix)
    return mix


def add_padded(mix: dict) -> dict:
    """Adds ``mix["padded"]``: ``rewards``/``values``/``mask`` ``[B, L]`` (each sequence padded
    to the longest, L = max_len; mask = action mask) and ``valid[B, L]`` (True inside a
    sequence: ``x_padded[valid]`` is the packed ``x``)."""
    lengths = torch.tensor(mix["lengths"], device=mix["rewards"].device)
    columns = torch.arange(mix["max_len"], device=lengths.device)
    valid = columns[None, :] < lengths[:, None]

    def pad(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(valid.shape)
        out[valid] = x
        return out

    mix["padded"] = {"rewards": pad(mix["rewards"]), "values": pad(mix["values"]),
                     "mask": pad(mix["action_mask"]), "valid": valid}
    return mix


def _out_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------
# Baselines


def verl_loop(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
              lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The reversed-time loop of verl's ``compute_gae_advantage_return`` (before whitening):
    ``rewards``/``values``/``mask`` ``[B, L]`` -> ``(advantages[B, L], returns[B, L])``.
    The next value and the running advantage are carried through masked tokens."""
    dtype = _out_dtype(rewards.dtype)
    rewards, values, mask = rewards.to(dtype), values.to(dtype), mask.to(dtype)
    rows, length = rewards.shape
    next_value = rewards.new_zeros(rows)
    running = rewards.new_zeros(rows)
    columns = []
    for t in reversed(range(length)):
        keep = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * running
        next_value = values[:, t] * keep + (1 - keep) * next_value
        running = candidate * keep + (1 - keep) * running
        columns.append(running)
    advantages = torch.stack(columns[::-1], dim=1)
    return advantages, advantages + values


def _last_token_flags(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[T] bool, True on the last token of each non-empty sequence (no host sync)."""
    ends = cu_seqlens[1:].long() - 1
    non_empty = (cu_seqlens[1:] > cu_seqlens[:-1]).to(torch.int32)
    flags = torch.zeros(num_tokens, dtype=torch.int32, device=cu_seqlens.device)
    flags.index_add_(0, ends.clamp(min=0), non_empty)
    return flags > 0


def _token_maps(rewards: torch.Tensor, values: torch.Tensor, action: torch.Tensor,
                cu_seqlens: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """[5, T] maps (s, V, C, P, Q) of csrc/gae_common.h: action token -> (0, v, r - v, gamma,
    gamma * lam), other token -> identity (1, 0, 0, 0, 1); the zero bootstrap is composed into
    each sequence's last token, which makes it constant (s = P = Q = 0)."""
    a = action.to(rewards.dtype)
    maps = torch.empty((5, rewards.numel()), dtype=rewards.dtype, device=rewards.device)
    torch.mul(a, -1, out=maps[0]).add_(1)
    torch.mul(values, a, out=maps[1])
    torch.mul(rewards - values, a, out=maps[2])
    torch.mul(a, gamma, out=maps[3])
    torch.mul(a, gamma * lam - 1, out=maps[4]).add_(1)
    last = _last_token_flags(cu_seqlens, rewards.numel())
    for row in (0, 3, 4):
        maps[row].masked_fill_(last, 0)
    return maps


def _compose_shifted(x: torch.Tensor, d: int, out: torch.Tensor) -> None:
    """``out[:, t] = x[:, t] o x[:, t + d]`` (later map applied first); ``out[:, t] = x[:, t]``
    where ``t + d >= T``. ``x``, ``out``: [5, T], distinct."""
    n = x.shape[1] - d
    out[:, max(n, 0):] = x[:, max(n, 0):]
    if n <= 0:
        return
    ls, lv, lc, lp, lq = x[:, :n]
    rs, rv, rc, rp, rq = x[:, d:]
    os_, ov, oc, op, oq = out[:, :n]
    torch.mul(ls, rs, out=os_)
    torch.addcmul(lv, ls, rv, out=ov)
    torch.addcmul(lc, lp, rv, out=oc).addcmul_(lq, rc)
    torch.mul(lp, rs, out=op).addcmul_(lq, rp)
    torch.mul(lq, rq, out=oq)


def scan_gae(rewards: torch.Tensor, values: torch.Tensor, cu_seqlens: torch.Tensor,
             action_mask: torch.Tensor, max_len: int, gamma: float,
             lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Loop-free GAE over the packed layout: ``[T]`` inputs -> ``(advantages[T], returns[T])``.

    Hillis-Steele suffix scan: after ``ceil(log2(max_len))`` doubling steps every token holds
    the composition of its map with all later maps of its sequence, which is constant (the
    sequence end is), so its C is the token's advantage. Nothing crosses a sequence end, so the
    scan needs no segment flags."""
    dtype = _out_dtype(rewards.dtype)
    rewards, values = rewards.to(dtype), values.to(dtype)
    src = _token_maps(rewards, values, action_mask, cu_seqlens, gamma, lam)
    dst = torch.empty_like(src)
    d = 1
    while d < max_len:
        _compose_shifted(src, d, dst)
        src, dst = dst, src
        d *= 2
    advantages = torch.where(action_mask, src[2], 0)
    return advantages, torch.where(action_mask, src[2] + values, 0)


def torchrl_gae(vec_gae: Callable, rewards: torch.Tensor, values: torch.Tensor,
                cu_seqlens: torch.Tensor, action_mask: torch.Tensor, gamma: float,
                lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """torchrl's vectorized GAE on the action tokens laid end to end (one trajectory per
    sequence, done on its last action token, zero bootstrap); ``[T]`` -> ``[T]`` outputs."""
    dtype = _out_dtype(rewards.dtype)
    index = action_mask.nonzero().squeeze(1)
    r, v = rewards[index].to(dtype), values[index].to(dtype)
    sequence = torch.searchsorted(cu_seqlens[1:].long(), index, right=True)
    done = torch.ones_like(index, dtype=torch.bool)
    done[:-1] = sequence[1:] != sequence[:-1]
    next_v = torch.where(done, 0, torch.cat([v[1:], v.new_zeros(1)]))
    shape = (1, -1, 1)
    adv, ret = vec_gae(gamma, lam, v.view(shape), next_v.view(shape), r.view(shape),
                       done.view(shape), time_dim=-2)
    advantages = rewards.new_zeros(rewards.shape, dtype=dtype)
    returns = advantages.clone()
    advantages[index] = adv.reshape(-1)
    returns[index] = ret.reshape(-1)
    return advantages, returns


# ---------------------------------------------------------------------------------------------
# Providers: prepare(mix, gamma, lam) -> (fn, to_packed); fn() is what is timed, to_packed(fn())
# gives packed (advantages[T], returns[T]) for the check.

Prepared = tuple[Callable[[], object], Callable[[object], tuple[torch.Tensor, torch.Tensor]]]


def _same(out):
    return out


def prepare_ours(mix: dict, gamma: float, lam: float, validate: bool = False) -> Prepared:
    def fn():
        return gae(mix["rewards"], mix["values"], mix["cu_seqlens"],
                   action_mask=mix["action_mask"], gamma=gamma, lam=lam, validate=validate)
    return fn, _same


def prepare_verl(mix: dict, gamma: float, lam: float) -> Prepared:
    padded = mix["padded"] if "padded" in mix else add_padded(mix)["padded"]
    valid = padded["valid"]

    def fn():
        return verl_loop(padded["rewards"], padded["values"], padded["mask"], gamma, lam)
    return fn, lambda out: (out[0][valid], out[1][valid])


def prepare_scan(mix: dict, gamma: float, lam: float) -> Prepared:
    def fn():
        return scan_gae(mix["rewards"], mix["values"], mix["cu_seqlens"], mix["action_mask"],
                        mix["max_len"], gamma, lam)
    return fn, _same


def _torchrl_vec_gae() -> Callable | None:
    try:
        from torchrl.objectives.value.functional import vec_generalized_advantage_estimate
    except ImportError:
        return None
    return vec_generalized_advantage_estimate


def prepare_torchrl(mix: dict, gamma: float, lam: float) -> Prepared:
    vec_gae = _torchrl_vec_gae()

    def fn():
        return torchrl_gae(vec_gae, mix["rewards"], mix["values"], mix["cu_seqlens"],
                           mix["action_mask"], gamma, lam)
    return fn, _same


@dataclass
class Provider:
    name: str
    prepare: Callable[[dict, float, float], Prepared]
    max_len: int | None = None  # longer sequences: shrink the mix and extrapolate per token


def baselines(args: argparse.Namespace, device: torch.device) -> list[Provider]:
    """The providers compared with ours; torchrl only when it is importable."""
    loop_cap = args.max_loop_len or (4096 if device.type == "cuda" else 65536)
    out = [
        Provider("agentrl_fast (validate)", lambda m, g, l: prepare_ours(m, g, l, validate=True)),
        Provider("verl-loop", prepare_verl, loop_cap),
        Provider("torch-scan", prepare_scan),
    ]
    if _torchrl_vec_gae() is not None:
        out.append(Provider("torchrl", prepare_torchrl, args.max_torchrl_len))
    else:
        print("note: torchrl is not importable; skipping its vec_generalized_advantage_estimate")
    return out


# ---------------------------------------------------------------------------------------------
# Checks and timing


def _tolerance(dtype: torch.dtype) -> float:
    """Allowed max |error| relative to max(1, max |advantage|)."""
    return 1e-9 if _out_dtype(dtype) == torch.float64 else 1e-4


def max_error(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor],
              where: torch.Tensor | None) -> float:
    """Max |got - want| over advantages and returns (on ``where`` tokens), relative to
    max(1, max |want advantage|)."""
    worst, scale = 0.0, 1.0
    for g, w in zip(got, want):
        g, w = g.to(torch.float64), w.to(device=g.device, dtype=torch.float64)
        diff = (g - w).abs()
        if where is not None:
            diff = torch.where(where, diff, 0)
        worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
    if want[0].numel():
        scale = max(1.0, float(want[0].abs().max()))
    return worst / scale


def assert_close(label: str, got, want, where: torch.Tensor | None, dtype: torch.dtype) -> float:
    error = max_error(got, want, where)
    if not error <= _tolerance(dtype):  # also catches NaN
        raise AssertionError(f"{label}: max relative error {error:.3g} > {_tolerance(dtype):.0e}")
    return error


def check_small(name: str, device: torch.device, dtype: torch.dtype, args: argparse.Namespace,
                providers: list[Provider]) -> None:
    """On the tiny instance of the mix: ours against the float64 reference (every token), then
    every provider against ours (action tokens)."""
    mix = make_mix(name, device, dtype, tiny=True, seed=args.seed)
    fn, _ = prepare_ours(mix, args.gamma, args.lam)
    ours = fn()
    reference = gae_reference(mix["rewards"], mix["values"], mix["cu_seqlens"],
                              mix["action_mask"], gamma=args.gamma, lam=args.lam)
    error = assert_close(f"{name}: agentrl_fast vs float64 reference", ours, reference, None,
                         dtype)
    errors = [f"agentrl_fast vs float64 reference {error:.1e}"]
    for provider in providers:
        fn, to_packed = provider.prepare(mix, args.gamma, args.lam)
        error = assert_close(f"{name}: {provider.name}", to_packed(fn()), ours,
                             mix["action_mask"], dtype)
        errors.append(f"{provider.name} {error:.1e}")
    print(f"check {mix['shape']}: " + ", ".join(errors))


def timing_options(args: argparse.Namespace) -> dict:
    if args.tiny:
        return {"warmup": 1, "repeats": 3, "max_seconds": 1.0}
    return {"max_seconds": args.max_seconds}


def time_checked(label: str, prepared: Prepared, ours, mix: dict, device: torch.device,
                 dtype: torch.dtype, args: argparse.Namespace) -> tuple[float, float]:
    """Run once and check against ``ours`` (action tokens), then time.
    Returns (milliseconds, max relative error)."""
    fn, to_packed = prepared
    error = 0.0
    if ours is not None:
        error = assert_close(label, to_packed(fn()), ours, mix["action_mask"], dtype)
    return common.benchmark(fn, device, **timing_options(args)), error


def bytes_moved(mix: dict) -> int:
    """Bytes our op must move: read rewards, values, mask (1 byte) and cu_seqlens; write
    advantages and returns in the output dtype."""
    out_size = torch.empty((), dtype=_out_dtype(mix["rewards"].dtype)).element_size()
    per_token = mix["rewards"].element_size() + mix["values"].element_size() + 1 + 2 * out_size
    return mix["num_tokens"] * per_token + mix["cu_seqlens"].numel() * 4


def make_row(provider: str, mix: dict, device: torch.device, ms: float,
             ours_ms: float) -> common.Row:
    seconds = ms * 1e-3
    return common.Row(
        op="gae", provider=provider, shape=mix["shape"],
        dtype=str(mix["rewards"].dtype).removeprefix("torch."), device=common.device_name(device),
        time_ms=ms, tokens_per_s=mix["num_tokens"] / seconds,
        gbps=bytes_moved(mix) / seconds / 1e9, ratio=ms / ours_ms,
    )


def bench_provider(provider: Provider, mix: dict, ours_out, device: torch.device,
                   dtype: torch.dtype, args: argparse.Namespace) -> tuple[str, float, float]:
    """Times one baseline on the mix, or on the mix shrunk under the provider's cap with the
    time extrapolated per token. Returns (provider name for the row, milliseconds, error)."""
    label = f"{mix['shape']}: {provider.name}"
    if provider.max_len is None or mix["max_len"] <= provider.max_len:
        ms, error = time_checked(label, provider.prepare(mix, args.gamma, args.lam), ours_out,
                                 mix, device, dtype, args)
        return provider.name, ms, error
    small = make_mix(mix["name"], device, dtype, seed=args.seed, padded=False,
                     lengths=shrink(mix["lengths"], provider.max_len))
    small_ours = prepare_ours(small, args.gamma, args.lam)[0]()
    ms, error = time_checked(label, provider.prepare(small, args.gamma, args.lam), small_ours,
                             small, device, dtype, args)
    name = f"{provider.name} (extrapolated from {small['num_tokens']} tokens)"
    return name, ms * mix["num_tokens"] / small["num_tokens"], error


def bench_mix(name: str, device: torch.device, dtype: torch.dtype, args: argparse.Namespace,
              providers: list[Provider]) -> list[common.Row]:
    """Rows for one mix: ours first (ratio 1.0), then every baseline."""
    start = time.perf_counter()
    mix = make_mix(name, device, dtype, args.tiny, args.seed, padded=False)
    print(f"bench {mix['shape']} (max len {mix['max_len']}, "
          f"{int(mix['action_mask'].sum())} action tokens)", flush=True)
    ours_prepared = prepare_ours(mix, args.gamma, args.lam)
    ours_out = ours_prepared[0]()
    ours_ms, _ = time_checked("ours", ours_prepared, None, mix, device, dtype, args)
    rows = [make_row("agentrl_fast", mix, device, ours_ms, ours_ms)]
    print(f"  agentrl_fast: {ours_ms:.3f} ms", flush=True)
    for provider in providers:
        row_name, ms, error = bench_provider(provider, mix, ours_out, device, dtype, args)
        rows.append(make_row(row_name, mix, device, ms, ours_ms))
        print(f"  {row_name}: {ms:.3f} ms (checked: max rel error {error:.1e})", flush=True)
    mix.pop("padded", None)
    print(f"  ({time.perf_counter() - start:.1f} s)", flush=True)
    return rows


def run(args: argparse.Namespace) -> list[common.Row]:
    """Checks, times and reports every provider on the selected mixes; writes gae.jsonl."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    names = MIXES if args.mix == "all" else (args.mix,)
    providers = baselines(args, device)
    rows, path = [], None
    for name in names:
        # With --tiny the timed instance is the small one: bench_mix checks the providers on it.
        check_small(name, device, dtype, args, [] if args.tiny else providers)
        new = bench_mix(name, device, dtype, args, providers)
        path = common.write_rows(new, "gae", args.out)  # as it goes: a run cut off keeps them
        rows += new
        if device.type == "cuda":
            torch.cuda.empty_cache()
    common.print_table(rows)
    bandwidth = common.copy_bandwidth_gbps(device)
    print(f"copy bandwidth ({common.device_name(device)}): {bandwidth:.1f} GB/s")
    for row in rows:
        if row.provider == "agentrl_fast":
            print(f"  agentrl_fast {row.shape}: {row.gbps:.2f} GB/s = "
                  f"{row.gbps / bandwidth:.1%} of copy bandwidth")
    print(f"rows appended to {path}")
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--mix", choices=MIXES + ("all",), default="all")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (CI dry run)")
    parser.add_argument("--out", default=None, help="folder for gae.jsonl (default bench/results)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gamma", type=float, default=1.0)
    parser.add_argument("--lam", type=float, default=0.95)
    parser.add_argument("--max-seconds", type=float, default=10.0,
                        help="stop repeating a provider after about this many seconds")
    parser.add_argument("--max-loop-len", type=int, default=None,
                        help="longest sequence verl-loop runs on before it is extrapolated "
                             "(default 65536 on the CPU, 4096 on CUDA)")
    parser.add_argument("--max-torchrl-len", type=int, default=65536,
                        help="longest sequence torchrl runs on before it is extrapolated")
    return parser.parse_args(argv)


def main() -> None:
    start = time.perf_counter()
    run(parse_args())
    print(f"total {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
