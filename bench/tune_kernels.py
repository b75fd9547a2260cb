"""The tuning sweep: block sizes, warps and stages of the Triton attention forward and backward
and of ``token_logprobs``, each candidate checked against a trusted result, then timed on this
GPU; the fastest right configuration of each launch is written where the ops read it
(``agentrl_fast/kernels/tuned.py``: ``agentrl_fast/kernels/tuned_configs.json``, keyed by the
GPU's name; commit that file).

    python bench/tune_kernels.py [--device cuda|cpu] [--tiny] [--budget 60] [--out-dir DIR]
        [--write PATH] [--only OP[:KEY],...] [--max-candidates N] [--candidate-timeout 60]
        [--workers N]

Launches tuned (``TARGETS``): attention forward and backward in bf16 at head dims 64 and 128
(causal, GQA 32/8 query/KV heads, a long-tail mix of 65536 tokens), ``token_logprobs`` forward
+ backward (bf16 logits, 4096 rows) at a vocabulary under 16384 and at 151936. Candidates: the
default configuration and every configuration that moves one of its parameters to another value
of ``VALUES`` (a coordinate sweep: ~6 per launch, not a grid) except the moves in ``SKIPPED``,
then the launch's ``EXTRA`` configurations, which move several parameters together (pipelined
attention backwards, spill-free only with another block or warp count): 35 candidates in all;
``tests/triton_aot.py`` compiles the ``EXTRA`` ones for sm_90.

Every candidate runs in a child process first, never in this one (a spawned
``python bench/tune_kernels.py --child check``: a CUDA context of its own, so an illegal memory
access, which poisons its context for good, loses that candidate only; on the first H200 run one
such fault, in the sweep's own process, failed every later candidate and ended the sweep before
any choice was written). The check: on a small instance (attention: sequences of 1, 7, 113, 203,
0, 300 and 64 tokens, as ``bench/attention_backward_probe.py``; ``token_logprobs``: 64 rows of
the launch's vocabulary) the candidate's outputs and gradients against the float64 reference on
the same inputs (``varlen_attention_reference`` on the CPU, ``token_logprobs_reference``): right
when every tensor's ``max |got - ref| <= TOLERANCE * max |ref|`` (bf16 attention: 0.05, as the
probe; ``token_logprobs``: its float32 outputs 1e-4, its bf16 gradient 0.02). The check
instance has the timed one's heads and vocabulary, and a multiple of 16 tokens as it has, so the
kernels Triton compiles for the check (into its disk cache) serve the timed size too. Then one
launch at the timed size (a fault that shows only there shows in this child). ``--workers``
children check in parallel (on CUDA as many as the sweep compiled in before), each taking
candidates one at a time from one queue (every launch's default first, then the launches'
candidates in turn); a child that dies on a candidate (or raises: a compile error, a CUDA error)
or gives no answer within ``--candidate-timeout`` seconds is killed and the queue goes on in a
new child.

Only candidates that pass are timed, one at a time, in one more child (``--child time``, started
with the checks so its imports are done when they end): timing stays out of this process because
the timed instance is large where the check's is small, and a candidate right on the small one
can still fault at the timed size. Per launch, before any candidate runs, that child computes a
trusted result on the timed instance (attention: torch's backend, ``backend="torch"``, where it
is available, else the float64 reference where the instance is small (the dry run), else none;
``token_logprobs``: the float64 reference, in row chunks); each candidate's first launch is
checked against it, then the candidate is timed with ``triton.testing.do_bench`` (median, L2
flushed; on the CPU one launch, wall clock). The attention backward's candidates run forward +
backward with the forward's configuration, so their differences are the backward's.

Verdicts (a line each, the ``verdict`` of its row, ``tune.md``): ``ok`` (checked, timed),
``WRONG`` (a check failed: ``detail`` and ``errors`` say which tensor by how much), ``CRASH``
(the child died or raised), ``HANG`` (no answer within ``--candidate-timeout``), ``SKIPPED``
(the budget ran out first). A launch's choice is its fastest ``ok`` candidate when that beats
the default by 3 % or more, else the default (timing noise must not move it); no choice at all
when the default was not timed, and none when the default itself is ``WRONG``, ``CRASH`` or
``HANG``: that is printed as ``!!! DEFAULT ...`` and heads ``tune.md``, and the exit status is 1
(the kernels keep running that default on this GPU). Exit status 1 too when no choice is
written.

Rows (``tune.jsonl``): ``op="tune"``, ``provider`` the launch (``<op> <key>``), ``shape`` the
configuration, ``time_ms`` (None when not timed), ``ratio`` = the default's time / this one's
(> 1: faster than the default), ``verdict``, ``detail``, ``errors`` (the check's max relative
errors per tensor); ``tune.md`` the table and the choices. ``--budget`` seconds bound the wall
time (a stage of ``bench/gpu_suite.sh``): the checks get until ``CHECK_SHARE`` of it (or less:
the timing starts when they end), the timing the rest; a candidate still running then is killed
and ``SKIPPED``, as is every one not started.

``--device cpu`` (the suite's dry run): the same children and checks, the kernels under
``TRITON_INTERPRET=1`` on tiny shapes, two candidates per launch (``--max-candidates``), and the
choices go to ``<out-dir>/tuned_configs.json``, never to the repository's file (nothing is tuned
on a CPU).

Faults for tests (``tests/test_tune_kernels.py``), never set otherwise:
``AGENTRL_FAST_TUNE_FAULTS="FAULT:OP:KEY:INDEX,..."`` makes the children misbehave on candidate
``INDEX`` (0: the default) of launch ``OP KEY``: ``crash`` (the checking child exits at once,
status 86, as a fatal CUDA error ends a process), ``hang`` (it sleeps), ``wrong`` (its check sees
the candidate's last output doubled: ``dv``, ``dlogits``, the forward's ``out``), ``time-crash``
(the timing child exits at once).
"""

import argparse
import collections
import dataclasses
import json
import math
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Values tried per parameter (one parameter moved at a time from the default).
# The backward's STEP stays 64: with 16 or 32 the atomic dq's dS^T goes to shared memory with a
# narrow swizzle, which gave wrong dq and illegal accesses on the H200 (default_backward_config).
VALUES = {"BLOCK_M": (32, 64, 128), "BLOCK_N": (32, 64, 128), "BLOCK": (32, 64, 128),
          "STEP": (64,), "BLOCK_V": (1024, 2048, 4096, 8192), "num_warps": (4, 8),
          "num_stages": (1, 2, 3)}
KEEP_MARGIN = 1.03  # a candidate replaces the default only when this much faster
# Coordinate moves not timed, per launch: hopeless at compile time (triton 3.6, sm_90).
# BLOCK 32: M = 32 keys under wgmma's 64 per warpgroup; 128 keys with 4 warps spill 604 B
# (D 64), ~1.8 KB (D 128); from D 128's default 128 keys spill 140 B, 4 warps 168 B (3.8).
SKIPPED = {("varlen_attention_backward", "bf16_d64"): ({"BLOCK": 32}, {"BLOCK": 128}),
           ("varlen_attention_backward", "bf16_d128"): ({"BLOCK": 32}, {"BLOCK": 128},
                                                        {"num_warps": 4})}
# Configurations that move several parameters at once (merged into the default), timed after
# the coordinate moves: pipelined D 64 dk/dv kernels (cp.async loads of q and dO), each without
# spills in the hinted triton 3.6 compile (registers in brackets; the coordinate move to
# num_stages 2 is spill-free too: 239). D 128's default is pipelined already.
EXTRA = {
    ("varlen_attention_backward", "bf16_d64"): (
        {"num_warps": 8, "num_stages": 2},                  # 64 x 64, 2 warpgroups (213)
        {"BLOCK": 128, "num_warps": 8, "num_stages": 2}),   # 128 x 64, m64n64 mostly (243)
}

# The checks: a tensor is right when max |got - ref| <= TOLERANCE[name] * max |ref|.
TOLERANCE = {"out": 0.05, "dq": 0.05, "dk": 0.05, "dv": 0.05,  # bf16 attention (the probe's)
             "logp": 1e-4, "entropy": 1e-4,  # float32 outputs (1e-7 seen under the interpreter)
             "dlogits": 0.02}                # bf16 gradient (one rounding: ~0.005 seen)
# The check instance's sequences (bench/attention_backward_probe.py's: they caught the H200's
# wrong D 128 dq): empty, single-token and odd lengths, several blocks long; 688 tokens, a
# multiple of 16 as the timed instance's 65536 (Triton specializes integer arguments on it).
CHECK_LENGTHS = (1, 7, 113, 203, 0, 300, 64)
CHECK_LENGTHS_TINY = (1, 7, 0, 70, 146)
CHECK_ROWS = 64  # token_logprobs' check instance (8 with --tiny)
REFERENCE_TOKENS = 4096  # a timed attention instance this small is checked in float64
CHECK_SHARE = 0.6  # of the budget, at most, for the checks
CANDIDATE_TIMEOUT = 60.0  # seconds a child may spend on one candidate (compile included)
STARTUP_TIMEOUT = 180.0  # seconds a child may take to start its first candidate
FAILED = ("WRONG", "CRASH", "HANG")  # verdicts that rule a candidate out
FAULTS_ENV = "AGENTRL_FAST_TUNE_FAULTS"  # tests only (the module docstring)
FAULT_KINDS = ("crash", "hang", "wrong", "time-crash")
CRASH_STATUS = 86  # the exit status of an injected crash
PROTOCOL = "@@tune "  # the children's report lines on stdout


@dataclasses.dataclass(frozen=True)
class Target:
    op: str     # agentrl_fast/kernels/tuned.py's op name
    key: str    # its key (the aot spec's suffix)
    kind: str   # "attention_forward" | "attention_backward" | "token_logprobs"
    head_dim: int = 64
    vocab: int = 0

    @property
    def name(self) -> str:
        return f"{self.op} {self.key}"


TARGETS = (
    [Target("varlen_attention_forward", f"bf16_d{d}", "attention_forward", head_dim=d)
     for d in (64, 128)]
    + [Target("varlen_attention_backward", f"bf16_d{d}", "attention_backward", head_dim=d)
       for d in (64, 128)]
    + [Target("token_logprobs", "block1024", "token_logprobs", vocab=8192),
       Target("token_logprobs", "block4096", "token_logprobs", vocab=151936)])


def default_config(target: Target) -> dict:
    from agentrl_fast.kernels import token_logprobs, varlen_attention

    if target.kind == "attention_forward":
        return varlen_attention.default_forward_config("bf16", target.head_dim)
    if target.kind == "attention_backward":
        return varlen_attention.default_backward_config("bf16", target.head_dim)
    block_v, num_warps = next((b, w) for limit, b, w in token_logprobs.BLOCK_CONFIGS
                              if limit is None or target.vocab < limit)
    return {"BLOCK_V": block_v, "num_warps": num_warps}


def extra_configs(op: str, key: str, default: dict) -> list[dict]:
    """``EXTRA``'s configurations of a launch merged into ``default`` (those naming a parameter
    the default lacks are dropped: the kernel changed)."""
    return [{**default, **extra} for extra in EXTRA.get((op, key), ())
            if set(extra) <= set(default)]


def candidates(default: dict, limit: int | None = None,
               target: Target | None = None) -> list[dict]:
    """The default, then each configuration that moves one parameter to another value (but the
    target's ``SKIPPED`` moves), then the target's ``EXTRA`` configurations; once each."""
    where = (target.op, target.key) if target else None
    skipped = SKIPPED.get(where, ())
    out = [dict(default)]
    for name, value in default.items():
        for other in VALUES.get(name, ()):
            if other != value and {name: other} not in skipped:
                out.append({**default, name: other})
    for config in extra_configs(*where, default) if target else ():
        if config not in out:
            out.append(config)
    return out[:limit] if limit else out


def choose(results: list[dict]) -> tuple[dict | None, str]:
    """``(choice or None, why)`` from a launch's candidates' results in candidate order (the
    default first), each with ``config``, ``verdict`` and ``ms`` (None when not timed): the
    fastest ``ok`` one when it beats the default by ``KEEP_MARGIN``, else the default; None when
    the default failed its check (or crashed, or hung) or was not timed."""
    default = results[0]
    if default["verdict"] in FAILED:
        return None, f"DEFAULT {default['verdict']}: {default.get('detail', '')}"
    timed = [r for r in results if r["verdict"] == "ok" and r.get("ms") is not None]
    if default["verdict"] != "ok" or default.get("ms") is None:
        return None, f"the default was not timed ({default['verdict']})"
    best = min(timed, key=lambda r: r["ms"])
    ratio = default["ms"] / best["ms"]
    if ratio >= KEEP_MARGIN:
        return best["config"], f"{ratio:.2f}x the default"
    return default["config"], (f"the default kept: the fastest right candidate is {ratio:.2f}x "
                               f"the default, under {KEEP_MARGIN:.2f}x")


# ---------------------------------------------------------------------------------------------
# In a child: instances, runs, references, checks


def parse_faults(text: str | None) -> dict:
    """``{(op, key, index): fault}`` from ``FAULT:OP:KEY:INDEX,...``."""
    faults = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        kind, op, key, index = item.strip().split(":")
        if kind not in FAULT_KINDS:
            raise ValueError(f"{FAULTS_ENV}: unknown fault {kind!r} (one of {FAULT_KINDS})")
        faults[(op, key, int(index))] = kind
    return faults


def logprobs_vocab(target: Target, tiny: bool) -> int:
    """The vocabulary of ``target``'s instances: one of its range (its key's), small with
    ``--tiny``."""
    if not tiny:
        return target.vocab
    return 64 if target.vocab < 16384 else 16384 + 64


def make_instance(target: Target, device: str, tiny: bool, check: bool) -> dict:
    """The check instance (small) or the timed one of ``target``."""
    import torch

    dev = torch.device(device)
    if target.kind.startswith("attention"):
        import bench_varlen_attention as b

        sizes = dataclasses.replace(b.SIZES["tiny" if tiny else "cuda"], head_dim=target.head_dim)
        if check:
            lengths = list(CHECK_LENGTHS_TINY if tiny else CHECK_LENGTHS)
        else:
            lengths = b.mix_lengths("long-tail", 128 if tiny else 65536, sizes, seed=0)
        return b.make_instance("tune", lengths, sizes, dev, torch.bfloat16, True, int(check))
    import bench_token_logprobs as b

    rows = (8 if tiny else CHECK_ROWS) if check else (8 if tiny else 4096)
    return b.make_inputs(rows, logprobs_vocab(target, tiny), 0, dev, torch.bfloat16, int(check),
                         linear=False)


def run_outputs(target: Target, inst: dict, config: dict | None, backend: str = "triton") -> dict:
    """One run of ``target`` with ``config`` (None: no forced configuration): its outputs and
    gradients, ``{name: tensor}``."""
    import contextlib

    import torch

    from agentrl_fast.kernels.tuned import forced

    scope = forced(target.op, target.key, config) if config else contextlib.nullcontext()
    if target.kind.startswith("attention"):
        from agentrl_fast.ops.varlen_attention import varlen_attention

        q, k, v = inst["q"], inst["k"], inst["v"]
        with scope:
            if target.kind == "attention_forward":
                with torch.no_grad():
                    out = varlen_attention(q, k, v, inst["cu_seqlens"], inst["max_len"],
                                           causal=True, backend=backend)
                return {"out": out}
            out = varlen_attention(q, k, v, inst["cu_seqlens"], inst["max_len"], causal=True,
                                   backend=backend)
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), inst["dout"])
        return {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}
    import bench_token_logprobs as b

    (logits,), labels, (g_logp, g_entropy) = inst["tensors"], inst["labels"], inst["grads"]
    with scope:
        logp, entropy = b.ours(logits, labels)
        (dlogits,) = torch.autograd.grad((logp * g_logp).sum() + (entropy * g_entropy).sum(),
                                         (logits,))
    return {"logp": logp.detach(), "entropy": entropy.detach(), "dlogits": dlogits}


def make_runner(target: Target, inst: dict, config: dict):
    """``run()``: one launch of ``target`` with ``config`` (forward, or forward + backward), to
    time."""
    import torch

    from agentrl_fast.kernels.tuned import forced

    if target.kind.startswith("attention"):
        from agentrl_fast.ops.varlen_attention import varlen_attention

        q, k, v, cu = inst["q"], inst["k"], inst["v"], inst["cu_seqlens"]

        def run():
            with forced(target.op, target.key, config):
                if target.kind == "attention_forward":
                    with torch.no_grad():
                        varlen_attention(q, k, v, cu, inst["max_len"], causal=True,
                                         backend="triton")
                    return
                q.grad = k.grad = v.grad = None
                out = varlen_attention(q, k, v, cu, inst["max_len"], causal=True,
                                       backend="triton")
                out.backward(inst["dout"])
        return run
    import bench_token_logprobs as b

    def run():
        with forced(target.op, target.key, config):
            b.step(b.ours, inst)
    return run


def reference_outputs(target: Target, inst: dict, chunk: int = 256) -> dict:
    """The float64 reference on ``inst``'s inputs: attention on the CPU
    (``varlen_attention_reference``), ``token_logprobs`` on the inputs' device in row chunks
    (its gradient kept in float32 when large)."""
    import torch

    from agentrl_fast.ops.reference import (
        token_logprobs_reference,
        varlen_attention_reference,
    )

    if target.kind.startswith("attention"):
        leaves = [inst[n].detach().cpu().double().requires_grad_() for n in ("q", "k", "v")]
        out = varlen_attention_reference(*leaves, inst["cu_seqlens"].cpu(), causal=True)[0]
        if target.kind == "attention_forward":
            return {"out": out.detach()}
        dq, dk, dv = torch.autograd.grad(out, leaves, inst["dout"].cpu().double())
        return {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}
    import bench_token_logprobs as b

    (logits,), labels, (g_logp, g_entropy) = inst["tensors"], inst["labels"], inst["grads"]
    keep = torch.float32 if logits.numel() > 2**24 else torch.float64
    parts = {"logp": [], "entropy": [], "dlogits": []}
    for start in range(0, logits.shape[0], chunk):
        rows = slice(start, start + chunk)
        x = logits[rows].detach().double().requires_grad_()
        logp, entropy = token_logprobs_reference(x, labels[rows], temperature=b.TEMPERATURE,
                                                 return_entropy=True)
        loss = (logp * g_logp[rows].double()).sum() + (entropy * g_entropy[rows].double()).sum()
        (grad,) = torch.autograd.grad(loss, (x,))
        parts["logp"].append(logp.detach())
        parts["entropy"].append(entropy.detach())
        parts["dlogits"].append(grad.to(keep))
    return {name: torch.cat(values) for name, values in parts.items()}


def trusted_outputs(target: Target, inst: dict, device: str) -> tuple[dict | None, str]:
    """``(outputs, source)`` to check a timed instance's runs against, or ``(None, why not)``:
    attention: torch's backend where available, else the float64 reference on a small
    instance; ``token_logprobs``: the float64 reference."""
    if target.kind.startswith("attention"):
        from agentrl_fast.ops.varlen_attention import available_backends

        if device != "cpu" and "torch" in available_backends(device):
            try:
                return run_outputs(target, inst, None, backend="torch"), "torch's backend"
            except Exception as error:  # noqa: BLE001 - then no trusted result at this size
                return None, f"torch's backend failed ({type(error).__name__}: {error})"[:300]
        if inst["num_tokens"] > REFERENCE_TOKENS:
            return None, "no torch backend here, and too large for the float64 reference"
    return reference_outputs(target, inst), "the float64 reference"


def relative_errors(got: dict, ref: dict) -> dict:
    """``{name: max |got - ref| / max |ref|}`` (NaN where ``got`` holds a NaN)."""
    import torch

    errors = {}
    for name, want in ref.items():
        dtype = torch.float64 if want.dtype == torch.float64 else torch.float32
        have = got[name].detach().to(want.device, dtype)
        scale = float(want.abs().max()) if want.numel() else 0.0
        diff = float((have - want.to(dtype)).abs().max()) if want.numel() else 0.0
        errors[name] = diff / max(scale, 1e-30)
    return errors


def failures(errors: dict) -> list[str]:
    """The tensors over their tolerance, described (NaN counts as over)."""
    return [f"{name} {error:.2g} > {TOLERANCE[name]:g}" for name, error in errors.items()
            if not error <= TOLERANCE[name]]


def time_ms(run, device: str) -> float:
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(run, warmup=10, rep=40, return_mode="median"))
    start = time.perf_counter()  # the dry run: one launch, wall clock
    run()
    return (time.perf_counter() - start) * 1e3


class ChildState:
    """What a child keeps for the launch it is on (one launch at a time: the instances of the
    CUDA sizes take GiBs)."""

    def __init__(self, mode: str, device: str, tiny: bool):
        self.mode, self.device, self.tiny = mode, device, tiny
        self.target, self.data = None, {}

    def get(self, target: Target) -> dict:
        if target != self.target:
            self.target, self.data = target, {}
            if self.device == "cuda":
                import torch

                torch.cuda.empty_cache()
            if self.mode == "check":
                inst = make_instance(target, self.device, self.tiny, check=True)
                self.data = {"check": inst, "reference": reference_outputs(target, inst)}
            else:  # the trusted result before any candidate runs: its failure is no one's
                inst = make_instance(target, self.device, self.tiny, check=False)
                trusted, source = trusted_outputs(target, inst, self.device)
                self.data = {"timed": inst, "trusted": trusted, "source": source}
        return self.data

    def timed_instance(self) -> dict:
        if "timed" not in self.data:
            self.data["timed"] = make_instance(self.target, self.device, self.tiny, check=False)
        return self.data["timed"]


def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def check_candidate(state: ChildState, target: Target, config: dict, fault: str | None) -> dict:
    """The check: the candidate on the check instance against the float64 reference, then one
    launch at the timed size."""
    data = state.get(target)
    got = run_outputs(target, data["check"], config)
    sync(state.device)
    if fault == "wrong":  # the last output: a gradient where there are gradients
        last = list(got)[-1]
        got[last] = got[last] * 2
    errors = relative_errors(got, data["reference"])
    del got
    bad = failures(errors)
    if bad:
        return {"verdict": "WRONG", "errors": errors,
                "detail": "against the float64 reference: " + ", ".join(bad)}
    make_runner(target, state.timed_instance(), config)()  # compiles the timed size's kernels
    sync(state.device)
    return {"verdict": "ok", "errors": errors}


def time_candidate(state: ChildState, target: Target, config: dict) -> dict:
    """The candidate's first launch at the timed size against the trusted result, then its
    time."""
    data = state.get(target)
    got = run_outputs(target, data["timed"], config)
    sync(state.device)
    if data["trusted"] is None:
        out = {"detail": f"not checked at the timed size: {data['source']}"}
    else:
        errors = relative_errors(got, data["trusted"])
        bad = failures(errors)
        if bad:
            return {"verdict": "WRONG", "timed_errors": errors,
                    "detail": f"at the timed size against {data['source']}: " + ", ".join(bad)}
        out = {"timed_errors": errors, "detail": f"right at the timed size too (against "
                                                 f"{data['source']})"}
    del got
    ms = time_ms(make_runner(target, data["timed"], config), state.device)
    return {**out, "verdict": "ok", "ms": ms}


def emit(event: dict) -> None:
    print(PROTOCOL + json.dumps(event), flush=True)


def child_main(mode: str, device: str, tiny: bool) -> int:
    """A checking or timing child: candidates as JSON lines on stdin, a ``start`` and a ``done``
    event per candidate on stdout. It ends after a candidate that raised (a CUDA error stays for
    the rest of the process: a new child takes the next one), or when stdin ends."""
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before agentrl_fast.kernels is imported
    import bench_token_logprobs  # noqa: F401 - imported now, before the first candidate
    import bench_varlen_attention  # noqa: F401
    import torch

    torch.set_num_threads(1)  # its CPU work is small; checking children run side by side
    from agentrl_fast.kernels import varlen_attention as kernels
    from agentrl_fast.ops import varlen_attention_triton

    # Every candidate is checked here: the backward a GPU refuses above the checked head dim
    # is what the D 128 target measures.
    varlen_attention_triton.GPU_CHECKED_BACKWARD_HEAD_DIM = kernels.PADDED_HEAD_DIMS[-1]
    faults = parse_faults(os.environ.get(FAULTS_ENV))
    state = ChildState(mode, device, tiny)
    emit({"event": "ready"})
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        target = Target(**job["target"])
        emit({"id": job["id"], "event": "start"})
        fault = faults.get((target.op, target.key, job["index"]))
        if (mode, fault) in (("check", "crash"), ("time", "time-crash")):
            os._exit(CRASH_STATUS)
        if (mode, fault) == ("check", "hang"):
            time.sleep(3600)
        start = time.perf_counter()
        try:
            if mode == "check":
                result = check_candidate(state, target, job["config"], fault)
            else:
                result = time_candidate(state, target, job["config"])
        except Exception as error:  # noqa: BLE001 - reported; this process ends
            first = (str(error).strip().splitlines() or [""])[0]
            emit({"id": job["id"], "event": "done", "verdict": "CRASH",
                  "detail": f"{type(error).__name__}: {first[:300]}",
                  "seconds": time.perf_counter() - start})
            return 3
        emit({"id": job["id"], "event": "done", **result, "seconds": time.perf_counter() - start})
    return 0


# ---------------------------------------------------------------------------------------------
# In the sweep's process: children and their queue


class Child:
    """A checking or timing child process (``--child MODE``), its reports read by threads."""

    def __init__(self, mode: str, device: str, tiny: bool):
        argv = [sys.executable, str(Path(__file__).resolve()), "--child", mode,
                "--device", device] + (["--tiny"] if tiny else [])
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     bufsize=1)
        self.events: queue.Queue = queue.Queue()
        self.tail: collections.deque = collections.deque(maxlen=30)
        self.ready = False
        threading.Thread(target=self._read, args=(self.proc.stdout, True), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr, False), daemon=True).start()

    def _read(self, stream, reports: bool) -> None:
        for line in stream:
            if reports and line.startswith(PROTOCOL):
                self.events.put(json.loads(line[len(PROTOCOL):]))
            elif line.strip():
                self.tail.append(line.rstrip())
        if reports:
            self.events.put(None)  # the end of its output: it exited

    def failure(self) -> str:
        """How it ended, with the last line it wrote that says why."""
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.proc.returncode
        how = f"exit {code}" if code >= 0 else f"killed by signal {-code}"
        tail = [line for line in self.tail if line.strip()]
        why = next((line for line in reversed(tail) if "Error" in line), tail[-1] if tail else "")
        return f"{how}: {why.strip()[:300]}" if why else how

    def run(self, job: dict, timeout: float, deadline: float) -> dict:
        """``job``'s result; verdict ``NOSTART`` when this child ended or stalled before it
        started it (not the job's fault)."""
        try:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return {"verdict": "NOSTART", "detail": self.failure()}
        sent, started = time.monotonic(), None
        while True:
            if started is not None:
                limit = started + timeout
            else:  # it starts a job at once when ready; its first, after its imports
                limit = sent + (timeout if self.ready else STARTUP_TIMEOUT)
            limit, now = min(limit, deadline), time.monotonic()
            try:
                event = self.events.get(timeout=max(0.0, limit - now))
            except queue.Empty:
                self.kill()
                if time.monotonic() >= deadline - 0.05:
                    return {"verdict": "SKIPPED", "detail": "the budget ran out during it"}
                if started is None:
                    return {"verdict": "NOSTART", "detail": "the child did not start it"}
                return {"verdict": "HANG", "detail": f"no answer within {timeout:g} s"}
            if event is None:
                if started is None:
                    return {"verdict": "NOSTART", "detail": self.failure()}
                return {"verdict": "CRASH", "detail": self.failure()}
            if event.get("event") == "ready":
                self.ready = True
            elif event.get("event") == "start":
                started = time.monotonic()
            elif event.get("event") == "done":
                return event

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        """Ends it: stdin closed (it exits after its candidate), killed if it lingers."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.kill()


def run_jobs(mode: str, jobs: list[dict], args, workers: int, deadline: float,
             first: Child | None = None) -> dict:
    """``{job id: result}`` of ``jobs`` run by ``workers`` children of ``mode`` taking them in
    order from one queue; a child that crashes, raises or hangs is replaced by a new one; what
    the deadline leaves is ``SKIPPED``."""
    pending = collections.deque(jobs)
    results, lock = {}, threading.Lock()
    given = [first]  # the prestarted child, for the first worker
    broken = []  # why children cannot start (then nothing more is started)

    def take():
        with lock:
            return pending.popleft() if pending else None

    def report(job, result):
        with lock:
            results[job["id"]] = result
        print_result(mode, job, result)

    def worker():
        with lock:
            child, given[0] = given[0], None
        nostart = 0
        try:
            while (job := take()) is not None:
                while True:
                    if time.monotonic() >= deadline:
                        report(job, {"verdict": "SKIPPED", "detail": "the budget ran out"})
                        break
                    if broken:
                        report(job, {"verdict": "SKIPPED",
                                     "detail": f"no child could start: {broken[0]}"})
                        break
                    if child is None:
                        child = Child(mode, args.device, args.tiny)
                    result = child.run(job, args.candidate_timeout, deadline)
                    if result["verdict"] == "NOSTART":
                        child.kill()
                        child, nostart = None, nostart + 1
                        if nostart >= 2:
                            broken.append(result["detail"])
                            print(f"!!! {mode} children cannot start: {result['detail']}",
                                  flush=True)
                        continue
                    nostart = 0
                    report(job, result)
                    if result["verdict"] != "ok" and result["verdict"] != "WRONG":
                        child.kill()  # it died, raised (and ended), hung, or ran out of time
                        child = None
                    break
        finally:
            if child is not None:
                child.close()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, workers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if given[0] is not None:
        given[0].close()
    return results


def print_result(mode: str, job: dict, result: dict) -> None:
    target = Target(**job["target"])
    verdict = result["verdict"]
    if verdict == "ok" and mode == "time":
        text = f"{result['ms']:.3f} ms"
    elif verdict == "ok":
        text = "ok (" + " ".join(f"{k} {v:.1e}" for k, v in result["errors"].items()) + ")"
    else:
        text = f"{verdict}: {result.get('detail', '')}"
    seconds = f" [{result['seconds']:.1f} s]" if "seconds" in result else ""
    print(f"{mode:5} {target.name} #{job['index']} {job['config']}: {text}{seconds}", flush=True)


def default_workers(device: str, jobs: int) -> int:
    cpus = os.cpu_count() or 2
    most = min(14, cpus - 2) if device == "cuda" else min(4, cpus // 2)
    return max(1, min(jobs, most))


def sweep(args) -> tuple[list[dict], dict, dict]:
    """``(results, choices, notes)``: a result per candidate (``target``, ``index``,
    ``config``, ``verdict``, ``ms``, ...), the chosen configuration per launch written, and
    per launch why (or why not)."""
    start = time.monotonic()
    limit = args.max_candidates or (2 if args.tiny else None)
    targets = [t for t in TARGETS if (not args.tiny or t.head_dim == 64)
               and (not args.only or t.op in args.only or f"{t.op}:{t.key}" in args.only)]
    jobs = []
    for order, target in enumerate(targets):
        for index, config in enumerate(candidates(default_config(target), limit, target)):
            jobs.append({"id": len(jobs), "target": dataclasses.asdict(target), "index": index,
                         "config": config, "order": order})
    timer = Child("time", args.device, args.tiny)  # its imports overlap the checks
    try:
        # Every launch's default first, then the launches' candidates in turn.
        check_order = sorted(jobs, key=lambda j: (j["index"], j["order"]))
        workers = args.workers or default_workers(args.device, len(jobs))
        print(f"checking {len(jobs)} candidates of {len(targets)} launches in {workers} "
              f"children ({args.device})", flush=True)
        checks = run_jobs("check", check_order, args, workers,
                          start + CHECK_SHARE * args.budget)
        passed = [j for j in jobs if checks[j["id"]]["verdict"] == "ok"]
        bad_default = {j["order"] for j in jobs
                       if j["index"] == 0 and checks[j["id"]]["verdict"] in FAILED}
        # Launches whose default is right first (the others cannot be chosen for).
        passed.sort(key=lambda j: (j["order"] in bad_default, j["order"], j["index"]))
        print(f"timing {len(passed)} candidates that passed", flush=True)
        times = run_jobs("time", passed, args, 1, start + args.budget - 1.0, first=timer)
    finally:
        timer.kill()
    results = []
    for job in jobs:
        check = checks[job["id"]]
        timed = times.get(job["id"])
        result = {"target": Target(**job["target"]), "index": job["index"],
                  "config": job["config"], "errors": check.get("errors"), "ms": None}
        if timed is None or check["verdict"] != "ok":
            result.update(verdict=check["verdict"], detail=check.get("detail", ""))
        else:
            result.update(verdict=timed["verdict"], ms=timed.get("ms"),
                          detail=timed.get("detail", ""),
                          timed_errors=timed.get("timed_errors"))
            if timed["verdict"] != "ok":
                result["detail"] = "timing: " + result["detail"]
        results.append(result)
    choices, notes = {}, {}
    for target in targets:
        mine = [r for r in results if r["target"] == target]
        choice, why = choose(mine)
        notes[(target.op, target.key)] = why
        if choice is not None:
            choices[(target.op, target.key)] = choice
            print(f"choice {target.name}: {json.dumps(choice, sort_keys=True)} ({why})",
                  flush=True)
        elif why.startswith("DEFAULT"):
            print(f"!!! {target.name}: {why}; no choice written: the kernels keep running "
                  f"this default on this device", flush=True)
        else:
            print(f"no choice for {target.name}: {why}", flush=True)
    return results, choices, notes


def make_rows(results: list[dict], device: str) -> list:
    import common

    @dataclasses.dataclass
    class TuneRow(common.Row):
        verdict: str = "ok"
        detail: str = ""
        errors: dict | None = None

    commit, date = common.git_commit(), time.strftime("%Y-%m-%d")
    rows = []
    for result in results:
        target = result["target"]
        default = next(r for r in results if r["target"] == target and r["index"] == 0)
        ratio = (default["ms"] / result["ms"] if result["ms"] and default["ms"]
                 and default["verdict"] == "ok" else None)
        rows.append(TuneRow(op="tune", provider=target.name,
                            shape=json.dumps(result["config"], sort_keys=True),
                            dtype="bfloat16", device=device, time_ms=result["ms"], ratio=ratio,
                            commit=commit, date=date, verdict=result["verdict"],
                            detail=result.get("detail", ""),
                            errors={name: error if math.isfinite(error) else str(error)
                                    for name, error in (result.get("errors") or {}).items()}
                            or None))
    return rows


def write_markdown(path: Path, rows: list, choices: dict, notes: dict, command: str) -> None:
    lines = ["# Tuning sweep (`bench/tune_kernels.py`)", "", f"Command: `{command}`", ""]
    loud = [(launch, why) for launch, why in notes.items() if why.startswith("DEFAULT")]
    for (op, key), why in loud:
        lines.append(f"**{op} {key}: {why}. No choice written: the kernels keep running this "
                     f"default on this GPU.**")
        lines.append("")
    lines += [("Every candidate was checked against a trusted result (outputs and gradients) "
               "in a child process before it was timed; verdicts: ok, WRONG, CRASH, HANG, "
               "SKIPPED (the budget ran out)."), "",
              "| launch | configuration | verdict | ms | default / this | detail |",
              "| --- | --- | --- | ---: | ---: | --- |"]
    for row in rows:
        ms = "" if row.time_ms is None else f"{row.time_ms:.3f}"
        ratio = "" if row.ratio is None else f"{row.ratio:.2f}x"
        detail = row.detail.replace("|", "/")
        lines.append(f"| {row.provider} | `{row.shape}` | {row.verdict} | {ms} | {ratio} | "
                     f"{detail} |")
    lines += ["", "Chosen (written to the tuned configurations):", ""]
    for (op, key), config in choices.items():
        lines.append(f"- {op} {key}: `{json.dumps(config, sort_keys=True)}` "
                     f"({notes[(op, key)]})")
    missing = [(launch, why) for launch, why in notes.items() if launch not in choices]
    if missing:
        lines += ["", "No choice written:", ""]
        lines += [f"- {op} {key}: {why}" for (op, key), why in missing]
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--budget", type=float, default=60.0, help="seconds")
    parser.add_argument("--out-dir", default=None, help="default bench/results")
    parser.add_argument("--write", default=None,
                        help="tuned configurations file (default: the repository's on CUDA, "
                             "<out-dir>/tuned_configs.json on the CPU)")
    parser.add_argument("--only", default="",
                        help="comma-separated launches to sweep: OP or OP:KEY (default: all)")
    parser.add_argument("--max-candidates", type=int, default=None,
                        help="candidates per launch (default: all; 2 with --tiny)")
    parser.add_argument("--candidate-timeout", type=float, default=CANDIDATE_TIMEOUT,
                        help="seconds a child may spend on one candidate before it is a HANG")
    parser.add_argument("--workers", type=int, default=None,
                        help="checking children at once (default: by device and CPU count)")
    parser.add_argument("--child", choices=("check", "time"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child_main(args.child, args.device, args.tiny)
    args.only = {name for name in args.only.split(",") if name}
    unknown = args.only - {t.op for t in TARGETS} - {f"{t.op}:{t.key}" for t in TARGETS}
    if unknown:
        parser.error(f"--only: unknown launches {sorted(unknown)}")
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before agentrl_fast.kernels is imported
    import common

    from agentrl_fast.kernels import tuned

    out_dir = Path(args.out_dir) if args.out_dir else common.RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    results, choices, notes = sweep(args)
    if args.device == "cuda":
        import torch

        # The device's name only: no kernel ever runs in this process.
        device, target = torch.cuda.get_device_name(), Path(args.write or tuned.DEFAULT_PATH)
        row_device = device
    else:
        device, target = "cpu (dry run)", Path(args.write or out_dir / "tuned_configs.json")
        row_device = f"cpu ({os.cpu_count()} cores)"
    rows = make_rows(results, row_device)
    common.write_rows(rows, "tune", out_dir)
    for (op, key), config in choices.items():
        tuned.write(device, op, key, config, path=target)
    command = "python bench/tune_kernels.py " + " ".join(sys.argv[1:])
    write_markdown(out_dir / "tune.md", rows, choices, notes, command)
    counts = collections.Counter(r["verdict"] for r in results)
    print(f"{len(rows)} rows ({', '.join(f'{n} {v}' for v, n in sorted(counts.items()))}); "
          f"choices for {len(choices)} launches written to {target}")
    bad_defaults = [why for why in notes.values() if why.startswith("DEFAULT")]
    if bad_defaults:
        print(f"!!! {len(bad_defaults)} launch(es) whose default failed its check: tune.md")
    return 0 if choices and not bad_defaults else 1


if __name__ == "__main__":
    sys.exit(main())
