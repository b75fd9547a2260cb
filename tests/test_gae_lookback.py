"""The CUDA GAE kernel's carry exchange (csrc/gae_lookback.h), run on the host: tiles taken right
to left by up to 8 real threads holding up to 64 tiles each in flight, finished in random order
with random delays, the warp-wide look-back emulated lane by lane
(``torch.ops.agentrl_fast._gae_lookback_emulation``), against the CPU kernel on 10^6+ tokens over
thousands of tiles. A tile that never publishes makes the emulation raise at its deadline."""

import math
import time

import pytest
import torch

from agentrl_fast.ops import gae

emulate = torch.ops.agentrl_fast._gae_lookback_emulation

MIXES = {
    # many short sequences: most tiles hold a sequence end, so look-back is one lane
    "many-short": lambda gen: torch.randint(0, 257, (8192,), generator=gen).tolist(),
    # a long tail with empty and length-1 sequences
    "long-tail": lambda gen: (torch.randint(0, 600, (1500,), generator=gen).tolist()
                              + [200_000, 1, 0, 150_001, 99_999, 0, 513, 512, 250_000]),
    # one sequence of a million tokens: every tile chains through the look-back
    "one-long": lambda gen: [5, 1, 1_000_003, 0, 2, 7],
}


def run(batch, gamma, lam, *, tile_size, threads=8, tiles_per_thread=64, max_delay_us=40,
        seed=0, deadline_seconds=60.0, drop_tile=-1):
    return emulate(batch.rewards, batch.values, batch.cu_seqlens, batch.action_mask,
                   batch.bootstrap_values, gamma, lam, tile_size, threads, tiles_per_thread,
                   max_delay_us, seed, deadline_seconds, drop_tile)


@pytest.mark.parametrize("mix", list(MIXES))
def test_emulated_look_back_matches_the_cpu_kernel(packed_batch, assert_gae_close, mix):
    gen = torch.Generator().manual_seed(7)
    batch = packed_batch(3, MIXES[mix](gen), mask_styles="random" if mix == "one-long"
                         else "agentic", reward_style="dense", with_mask=True,
                         with_bootstrap=True)
    assert batch.num_tokens >= 10 ** 6
    tile_size = 256  # thousands of tiles
    for dtype, (gamma, lam), seed in ((torch.float64, (0.99, 0.95), 1),
                                      (torch.float32, (1.0, 1.0), 2)):
        rounded = batch.cast(dtype, dtype, dtype)
        as64 = rounded.cast(torch.float64, torch.float64, torch.float64)
        reference = gae(as64.rewards, as64.values, as64.cu_seqlens, **as64.kwargs(),
                        gamma=gamma, lam=lam)  # the CPU kernel, float64 throughout
        advantages, returns, stats = run(rounded, gamma, lam, tile_size=tile_size, seed=seed)
        assert advantages.dtype == returns.dtype == dtype
        chain = math.ceil(batch.max_seqlen / tile_size) + 2
        assert_gae_close(advantages, returns, reference, rounded, chain_steps=chain)
        multi_lane, windows, lanes, _ = stats.tolist()
        if mix == "one-long":
            # The look-back did real work: windows of several tiles and more than one window
            # (tiles finished in random order, each thread's held ones right of it still only
            # aggregates). Polls of tiles not yet published depend on timing; the deadline test
            # below exercises them.
            assert multi_lane > 0 and lanes > 1 and windows > 1, stats


def test_a_tile_that_never_publishes_ends_in_a_deadline_error(packed_batch):
    batch = packed_batch(4, [20_000], with_mask=False, with_bootstrap=False)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="deadline"):
        run(batch, 1.0, 1.0, tile_size=64, threads=4, max_delay_us=0,
            deadline_seconds=1.0, drop_tile=200)
    assert time.monotonic() - start < 10


def test_bad_arguments_are_named(packed_batch):
    batch = packed_batch(5, [10, 3])
    with pytest.raises(ValueError, match="threads must be in"):
        run(batch, 1.0, 1.0, tile_size=4, threads=9)
    with pytest.raises(ValueError, match="tile_size"):
        run(batch, 1.0, 1.0, tile_size=0)
