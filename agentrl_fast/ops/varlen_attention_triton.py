"""The ``"triton"`` backend of ``varlen_attention``: launches the kernels of
``agentrl_fast.kernels.varlen_attention`` (``agentrl_fast/kernels/varlen_attention.py``).

``BACKEND`` is ``Backend("triton", "op", ...)``, which ``varlen_attention`` registers. Its
``forward`` and ``backward`` write into the preallocated outputs they are given (``out[T, Hq, D]``,
``lse[Hq, T]`` float32; ``dq``, ``dk``, ``dv``) and allocate only scratch: the tile table and,
in the backward, ``delta[Hq, T]`` float32, (not ``deterministic``) the float32 ``dq``
accumulator ``[T, Hq, D]`` and (prefix-shared mode, split) the splits' float32 dk/dv sums.

Scheduling (no host sync): ``tile_table`` turns ``cu_seqlens`` into the list of real
(sequence, block) tiles on the device, sorted so the longest work comes first: under a causal
mask a forward tile's work is the number of keys it visits, ``min((block + 1) * BLOCK_M, L)``
(the last blocks of the longest sequences first), without one it is ``L``; the backward's
dk/dv tiles are ordered by ``L`` (a key tile's work, ``L - block * BLOCK`` under a causal mask,
is not in the table), its dq tiles (deterministic mode) as the forward's. The tables are built
once per ``cu_seqlens`` tensor (``cached_tile_table``): the layers of one forward share them.
The grid needs a size known on the host
without reading ``cu_seqlens``: ``sum_b ceil(L_b / BLOCK) <= T // BLOCK + B`` (each sequence
wastes less than one block), and at most ``T`` (each tile holds a token). The slots past the
real count (at most ``B``) are marked ``-1`` and their programs exit at once: a tail of cheap
programs, instead of a grid of ``B * ceil(max_seqlen / BLOCK)`` with early exits, or a host sync.

Heads: the grid is 1-D, ``slots * heads`` programs, head fastest (program ``p``: tile
``p // heads``, head ``p % heads``). Putting heads inside the flat index rather than on a second
grid axis keeps the longest-first order across heads (the GPU starts programs in index order),
puts the query heads of one KV head side by side (their K/V stay in L2) and avoids the 65535
limit of the second axis. The backward's dk/dv kernel runs one program per (key tile, KV
head) and loops over the group's query heads inside it, so ``dk``/``dv`` are summed in
registers; ``dq`` is added by float32 atomics into a zeroed buffer (then scaled and cast into
``dq``), whose summation order varies run to run, unless ``deterministic``: then a second kernel
per (query tile, query head) computes it, and the backward is bitwise reproducible.

``cu_seqlens`` is sanitized on the device (clamped to ``[0, T]``, made non-decreasing) and
framed by the gaps before its first and after its last entry, treated as sequences of their
own: with validated ``cu_seqlens`` these are empty; with unvalidated garbage every token is
still written (finite values, never a crash or an out-of-range access).

Prefix-shared mode (``prefix_forward`` / ``prefix_backward``, ``prefix_of``; the kernels of
``agentrl_fast/kernels/varlen_attention_prefix.py``, at the plain kernels' configurations): a
suffix's query tile runs over its prefix's keys, then its own causally. The tables, built on
the device per (``cu_seqlens``, ``prefix_of``) pair of tensors: the sanitized prefix of each
sequence (a bad entry reads as -1), tiles ordered with the prefix's keys (forward, dq) or the
suffixes' queries (dk/dv) counted as work, and the CSR of each prefix's suffix query blocks that
its dk/dv tiles walk in a fixed order (dk/dv summed in registers, no atomics; dq by atomics or,
``deterministic``, by its own kernel, as the plain backward). A prefix's key tile sees all its
suffixes' queries: when the prefixes' tiles are too few to fill the device its list is split
over several programs (``prefix_dkdv_splits``) whose float32 sums ``_add_splits`` adds in a
fixed order. The dk/dv table makes one host sync (the prefixes' row and tile counts, which
size those sums), once per pair of tensors.

With ``TRITON_INTERPRET=1`` set when this module is imported, the kernels run on CPU tensors
(how the tests run them); otherwise the backend needs a CUDA device (sm_80 or newer).
"""

from __future__ import annotations

import contextlib
import os

import torch

from agentrl_fast.ops._attention_backends import MAX_HEAD_DIM, Backend
from agentrl_fast.ops._tensor_memo import PairMemo, TensorMemo

try:
    import triton
    from agentrl_fast.kernels import varlen_attention as kernels
    from agentrl_fast.kernels import varlen_attention_prefix as prefix_kernels
    _IMPORT_ERROR = None
except Exception as error:  # noqa: BLE001 - a broken triton must not break the package
    triton = kernels = prefix_kernels = None
    _IMPORT_ERROR = f"{type(error).__name__}: {error}"

# triton reads TRITON_INTERPRET when a kernel is defined, i.e. when agentrl_fast/kernels/ was imported.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _unavailable(device: torch.device) -> str | None:
    if _IMPORT_ERROR is not None:
        return f"triton could not be imported ({_IMPORT_ERROR})"
    if device.type == "cpu":
        if INTERPRETED:
            return None
        return ("the Triton kernels run on CPU tensors only under the interpreter "
                "(TRITON_INTERPRET=1 set before agentrl_fast is imported)")
    if device.type != "cuda":
        return f"the Triton kernels run on CUDA, got device {device}"
    if INTERPRETED:
        return "the kernels were defined under TRITON_INTERPRET=1 (CPU tensors only)"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"the Triton kernels need sm_80 or newer, got compute capability {major}.x"
    return None


# The largest padded head dim whose backward a GPU has shown right. On an H200 (triton 3.6) the
# backward at 128 and 256 gave a wrong dq while 64 and below were right (docs/experiments.md,
# "The first GPU run"): those launches stored dS^T with a 64-byte swizzle, which their new
# launches avoid (default_backward_config), not yet run on a GPU. Refused on a GPU when a
# gradient is needed, so `auto` falls back to torch's flash kernels, until a GPU run shows them
# right (bench/attention_backward_probe.py, run beside bench/gpu_suite.sh's stages). The forward
# alone is right there and stays.
GPU_CHECKED_BACKWARD_HEAD_DIM = 64


def _unsupported(q: torch.Tensor, k: torch.Tensor) -> str | None:
    if q.dtype not in _DTYPE_NAMES:
        return f"dtype must be float16, bfloat16 or float32, got {q.dtype}"
    if q.shape[2] > MAX_HEAD_DIM:
        return f"head_dim must be <= {MAX_HEAD_DIM}, got {q.shape[2]}"
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k))
    if (q.is_cuda and needs_grad
            and kernels.padded_head_dim(q.shape[2]) > GPU_CHECKED_BACKWARD_HEAD_DIM):
        return (f"its backward at head_dim {q.shape[2]} (above "
                f"{GPU_CHECKED_BACKWARD_HEAD_DIM}) gave a wrong dq on an H200 and is disabled on "
                "GPUs until fixed; use backend='torch' or 'flash_attn' to train at this head dim "
                "(the forward alone, without gradients, still runs)")
    return None


def tile_slots(num_tokens: int, num_sequences: int, block: int) -> int:
    """An upper bound, known on the host, of the number of (sequence, block) tiles: each
    sequence wastes less than one block (``+ num_sequences``, here ``B + 2`` with the gaps),
    and each tile holds at least one token."""
    return min(num_tokens // block + num_sequences, num_tokens)


def sequence_bounds(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``bounds[B+3]`` int64: ``cu_seqlens`` clamped to ``[0, T]``, made non-decreasing and
    framed by ``0`` and ``T`` (the gaps around it are sequences of their own)."""
    inner = torch.cummax(cu_seqlens.to(torch.int64).clamp(0, num_tokens), dim=0).values
    edge = inner.new_zeros(1)
    return torch.cat([edge, inner, edge + num_tokens])


def tile_table(cu_seqlens: torch.Tensor, num_tokens: int, block: int, causal: bool,
               by_length: bool = False, extra_work: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The real (sequence, block) tiles of ``block`` tokens, longest work first, built on the
    device without a host sync.

    Returns ``(bounds[B+3] int32, tile_sequence[S] int32, tile_block[S] int32, S)``: ``bounds``
    is the sanitized ``cu_seqlens`` framed by ``0`` and ``T`` (sequence ``i`` spans
    ``bounds[i]:bounds[i+1]``; the first and last are the gaps around ``cu_seqlens``), ``S`` is
    the host bound ``tile_slots``; slots past the real tiles hold sequence ``-1``. Work per tile:
    ``L`` when ``by_length`` or not ``causal``, else ``min((block + 1) * BLOCK, L)``, plus
    ``extra_work[i]`` ([B+2], per sequence of ``bounds``: the prefix mode's other keys or
    queries) when given.
    """
    device = cu_seqlens.device
    bounds = sequence_bounds(cu_seqlens, num_tokens)
    lengths = bounds[1:] - bounds[:-1]                                     # [B + 2]
    num_blocks = (lengths + block - 1) // block
    ends = torch.cumsum(num_blocks, 0)
    slots = tile_slots(num_tokens, lengths.numel(), block)
    slot = torch.arange(slots, device=device, dtype=torch.int64)
    sequence = torch.searchsorted(ends, slot, right=True).clamp_(max=lengths.numel() - 1)
    block_index = slot - (ends[sequence] - num_blocks[sequence])
    length = lengths[sequence]
    if causal and not by_length:
        work = torch.minimum((block_index + 1) * block, length)
    else:
        work = length
    if extra_work is not None:
        work = work + extra_work[sequence]
    valid = slot < ends[-1]
    work = torch.where(valid, work, -1)
    order = torch.argsort(work, descending=True, stable=True)
    tile_sequence = torch.where(valid, sequence, -1)[order].to(torch.int32)
    tile_block = block_index[order].to(torch.int32)
    return bounds.to(torch.int32), tile_sequence, tile_block, slots


# The tile tables of a cu_seqlens tensor: built once, shared by the layers of a forward (and
# of its backward), forgotten when the tensor is freed or modified in place.
_TABLES = TensorMemo()


def cached_tile_table(cu_seqlens: torch.Tensor, num_tokens: int, block: int, causal: bool,
                      by_length: bool = False):
    """:func:`tile_table`, computed once per ``cu_seqlens`` tensor and arguments."""
    fact = ("tile_table", num_tokens, block, bool(causal), by_length)
    table = _TABLES.get(cu_seqlens, fact)
    if table is None:
        table = tile_table(cu_seqlens, num_tokens, block, causal, by_length)
        _TABLES.put(cu_seqlens, fact, table)
    return table


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The kernels take any token/head strides but a unit stride on the head dimension."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _device_guard(x: torch.Tensor):
    return torch.cuda.device(x.device) if x.device.type == "cuda" else _NoGuard()


class _NoGuard:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _forward(q, k, v, cu_seqlens, max_seqlen, causal, scale, deterministic, out, lse):
    """Fill ``out[T, Hq, D]`` and ``lse[Hq, T]`` (float32)."""
    num_tokens, num_heads_q, head_dim = q.shape
    if num_tokens == 0:
        return
    q, k, v = (_rows_contiguous(x) for x in (q, k, v))
    target = (out if out.stride(-1) == 1
              else torch.empty_like(out, memory_format=torch.contiguous_format))
    if lse.stride(-1) != 1:
        raise ValueError("lse must have a unit stride along its token dimension")
    dtype = _DTYPE_NAMES[q.dtype]
    padded = kernels.padded_head_dim(head_dim)
    config = kernels.forward_config(dtype, head_dim)
    bounds, tile_sequence, tile_block, slots = cached_tile_table(cu_seqlens, num_tokens,
                                                                 config["BLOCK_M"], causal)
    grid = (slots * num_heads_q,)
    with _device_guard(q):
        kernels.varlen_attention_forward_kernel[grid](
            q, k, v, target, lse, bounds, tile_sequence, tile_block,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            target.stride(0), target.stride(1), lse.stride(0),
            num_heads_q, num_heads_q // k.shape[1], head_dim, float(scale), int(bool(causal)),
            HEAD_DIM=padded, EVEN_D=padded == head_dim, BLOCK_M=config["BLOCK_M"],
            BLOCK_N=config["BLOCK_N"], IEEE=dtype == "fp32",
            num_warps=config["num_warps"], num_stages=config["num_stages"])
    if target is not out:
        out.copy_(target)


def _backward(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, scale, deterministic,
              dq, dk, dv):
    """Fill ``dq``, ``dk``, ``dv``. One program per (key tile, KV head) sums dk/dv over the
    group's query heads in registers; dq is added by float32 atomics from those programs
    (FlashAttention-2's 5 products per block pair), or, ``deterministic``, computed by a second
    kernel per (query tile, query head) (3 more products, bitwise reproducible)."""
    num_tokens, num_heads_q, head_dim = q.shape
    num_heads_k = k.shape[1]
    if num_tokens == 0:
        return
    dout, q, k, v, out = (_rows_contiguous(x) for x in (dout, q, k, v, out))
    lse = lse if lse.stride(-1) == 1 else lse.contiguous()
    targets = [g if g.stride(-1) == 1
               else torch.empty_like(g, memory_format=torch.contiguous_format)
               for g in (dq, dk, dv)]
    dtype = _DTYPE_NAMES[q.dtype]
    padded = kernels.padded_head_dim(head_dim)
    groups = num_heads_q // num_heads_k
    config = kernels.backward_config(dtype, head_dim)
    delta = torch.empty(num_heads_q, num_tokens, dtype=torch.float32, device=q.device)
    if lse.stride(0) != delta.stride(0):
        lse = lse.contiguous()
    dq_t, dk_t, dv_t = targets
    # The atomic dq accumulates in float32 (zeros first; every token is then written by the
    # conversion, padding and gaps included).
    dq_acc = (None if deterministic else
              torch.zeros(num_tokens, num_heads_q, head_dim, dtype=torch.float32, device=q.device))
    # Deterministic: the dk/dv kernel never touches DQ; a float32 stand-in with zero strides
    # keeps the launch's specialisation that of the compiles in tests/triton_aot.py.
    dq_arg, dq_strides = ((delta, (0, 0)) if dq_acc is None
                          else (dq_acc, (dq_acc.stride(0), dq_acc.stride(1))))
    bounds, tile_sequence, tile_block, slots = cached_tile_table(
        cu_seqlens, num_tokens, config["BLOCK"], causal, by_length=True)
    common = dict(HEAD_DIM=padded, EVEN_D=padded == head_dim, IEEE=dtype == "fp32")
    with _device_guard(q):
        block_t = kernels.PREPROCESS_BLOCK_T
        preprocess_grid = (triton.cdiv(num_tokens, block_t), num_heads_q)
        kernels.varlen_attention_backward_preprocess_kernel[preprocess_grid](
            out, dout, delta, out.stride(0), out.stride(1), dout.stride(0), dout.stride(1),
            delta.stride(0), num_tokens, head_dim, BLOCK_T=block_t,
            BLOCK_D=kernels.PREPROCESS_BLOCK_D, num_warps=4, num_stages=1)
        kernels.varlen_attention_backward_dkdv_kernel[(slots * num_heads_k,)](
            q, k, v, dout, lse, delta, dq_arg, dk_t, dv_t, bounds, tile_sequence, tile_block,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            dout.stride(0), dout.stride(1), *dq_strides, dk_t.stride(0),
            dk_t.stride(1), dv_t.stride(0), dv_t.stride(1), delta.stride(0),
            num_heads_k, groups, head_dim, float(scale), int(bool(causal)),
            BLOCK=config["BLOCK"], STEP=config["STEP"], ATOMIC_DQ=dq_acc is not None,
            num_warps=config["num_warps"], num_stages=config["num_stages"], **common)
        if dq_acc is not None:
            dq_t.copy_(dq_acc.mul_(scale))
        else:
            dq_config = kernels.backward_dq_config(dtype, head_dim)
            bounds, tile_sequence, tile_block, slots = cached_tile_table(
                cu_seqlens, num_tokens, dq_config["BLOCK_M"], causal)
            kernels.varlen_attention_backward_dq_kernel[(slots * num_heads_q,)](
                q, k, v, dout, lse, delta, dq_t, bounds, tile_sequence, tile_block,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                dout.stride(0), dout.stride(1), dq_t.stride(0), dq_t.stride(1), delta.stride(0),
                num_heads_q, groups, head_dim, float(scale), int(bool(causal)),
                BLOCK_M=dq_config["BLOCK_M"], BLOCK_N=dq_config["BLOCK_N"],
                num_warps=dq_config["num_warps"], num_stages=dq_config["num_stages"], **common)
    for target, grad in zip(targets, (dq, dk, dv)):
        if target is not grad:
            grad.copy_(target)


# ---------------------------------------------------------------------------------------------
# Prefix-shared mode (``prefix_of``): agentrl_fast/kernels/varlen_attention_prefix.py.

def prefix_sequences(cu_seqlens: torch.Tensor, prefix_of: torch.Tensor) -> torch.Tensor:
    """``prefix[B+2]`` int64, indexed like ``sequence_bounds``: sequence ``b + 1``'s prefix
    sequence ``prefix_of[b] + 1``, or -1 (no prefix, and the gaps). An entry out of range
    (``prefix_of[b] < 0``, ``>= b``, or naming a segment that has a prefix itself) reads as -1,
    so unvalidated garbage never sends a kernel out of bounds."""
    num_segments = cu_seqlens.numel() - 1
    parent = prefix_of.reshape(-1)[:num_segments].to(torch.int64)
    if parent.numel() < num_segments:  # (the op layer checks the shape; stay in range anyway)
        parent = torch.cat([parent, parent.new_full((num_segments - parent.numel(),), -1)])
    segment = torch.arange(num_segments, device=parent.device)
    root = parent[parent.clamp(0, max(num_segments - 1, 0))] == -1
    valid = (parent >= 0) & (parent < segment) & root
    edge = parent.new_full((1,), -1)
    return torch.cat([edge, torch.where(valid, parent + 1, -1), edge])


def prefix_tile_table(cu_seqlens: torch.Tensor, prefix_of: torch.Tensor, num_tokens: int,
                      block: int):
    """The forward's (and the deterministic dq's) tiles: ``(bounds[B+3], prefix[B+2] int32,
    tile_sequence, tile_block, slots)``, a tile's work being its causal keys plus its prefix's
    length."""
    bounds = sequence_bounds(cu_seqlens, num_tokens)
    prefix = prefix_sequences(cu_seqlens, prefix_of)
    lengths = bounds[1:] - bounds[:-1]
    prefix_length = torch.where(prefix >= 0, lengths[prefix.clamp(min=0)], 0)
    _, tile_sequence, tile_block, slots = tile_table(cu_seqlens, num_tokens, block, True,
                                                     extra_work=prefix_length)
    return bounds.to(torch.int32), prefix.to(torch.int32), tile_sequence, tile_block, slots


def suffix_query_blocks(bounds: torch.Tensor, prefix: torch.Tensor, num_tokens: int, step: int):
    """The CSR of each prefix's suffix query blocks (``step`` rows), built on the device:
    ``(query_ptr[B+3], query_row[E], query_count[E], suffix_tokens[B+2] int64)``: the blocks of
    prefix sequence ``i`` are ``query_ptr[i]:query_ptr[i+1]`` (suffixes in segment order), each
    its first token and its number of rows; ``E = tile_slots`` (the entries past the real ones
    are never read); ``suffix_tokens[i]``: the queries of all of ``i``'s suffixes."""
    lengths = bounds[1:] - bounds[:-1]
    count = lengths.numel()
    is_suffix = prefix >= 0
    blocks = torch.where(is_suffix, (lengths + step - 1) // step, 0)
    index = torch.arange(count, device=bounds.device)
    order = torch.argsort(torch.where(is_suffix, prefix * count + index, count * count))
    ends = torch.cumsum(blocks[order], 0)
    slots = max(tile_slots(num_tokens, count, step), 1)
    slot = torch.arange(slots, device=bounds.device)
    position = torch.searchsorted(ends, slot, right=True).clamp_(max=count - 1)
    sequence = order[position]
    first = (slot - (ends[position] - blocks[sequence])) * step
    valid = slot < ends[-1]
    query_row = torch.where(valid, bounds[sequence] + first, 0).to(torch.int32)
    query_count = torch.where(valid, (lengths[sequence] - first).clamp(0, step), 0)
    owner = prefix.clamp(min=0)
    per_prefix = torch.zeros_like(lengths).index_add_(0, owner, blocks)
    query_ptr = torch.cat([per_prefix.new_zeros(1), torch.cumsum(per_prefix, 0)])
    suffix_tokens = torch.zeros_like(lengths).index_add_(0, owner,
                                                          torch.where(is_suffix, lengths, 0))
    return (query_ptr.to(torch.int32), query_row, query_count.to(torch.int32), suffix_tokens)


def prefix_dkdv_table(cu_seqlens: torch.Tensor, prefix_of: torch.Tensor, num_tokens: int,
                      block: int, step: int):
    """The dk/dv kernel's tiles, ordered by the queries that see them (own and suffixes'):
    ``(bounds[B+3], tile_sequence, tile_block, slots, query_ptr, query_row, query_count,
    part_row[B+2] int32, part_tokens[R] int64, split_tile[prefix tiles] int32, facts)``: the
    prefixes' rows packed one after another for the split sums (``part_row``: each prefix's
    first; ``part_tokens``: each packed row's token), the prefixes' tiles' slots in the tile
    table, and ``facts`` on the host, ``(R, prefix tiles, most suffix blocks of a prefix)``:
    the table's one host sync, once per (``cu_seqlens``, ``prefix_of``) pair."""
    bounds = sequence_bounds(cu_seqlens, num_tokens)
    prefix = prefix_sequences(cu_seqlens, prefix_of)
    query_ptr, query_row, query_count, suffix_tokens = suffix_query_blocks(bounds, prefix,
                                                                           num_tokens, step)
    _, tile_sequence, tile_block, slots = tile_table(cu_seqlens, num_tokens, block, True,
                                                     by_length=True, extra_work=suffix_tokens)
    lengths = bounds[1:] - bounds[:-1]
    suffix_blocks = (query_ptr[1:] - query_ptr[:-1]).to(torch.int64)
    prefix_rows = torch.where(suffix_blocks > 0, lengths, 0)
    part_row = torch.cumsum(prefix_rows, 0) - prefix_rows
    facts = tuple(torch.stack([prefix_rows.sum(), ((prefix_rows + block - 1) // block).sum(),
                               suffix_blocks.max()]).tolist())
    sequence = torch.repeat_interleave(torch.arange(lengths.numel(), device=bounds.device),
                                       prefix_rows, output_size=facts[0])
    part_tokens = (bounds[sequence] + torch.arange(facts[0], device=bounds.device)
                   - part_row[sequence])
    of_prefix = (tile_sequence >= 0) & (prefix_rows[tile_sequence.clamp(min=0).long()] > 0)
    split_tile = torch.argsort((~of_prefix).to(torch.int8), stable=True)[:facts[1]]
    return (bounds.to(torch.int32), tile_sequence, tile_block, slots, query_ptr, query_row,
            query_count, part_row.to(torch.int32), part_tokens, split_tile.to(torch.int32),
            facts)


# A prefix tile's query list is split until the prefixes' tiles give this many programs per
# processor, into at most MAX_SPLITS chunks of at least MIN_SPLIT_ENTRIES (head, block)
# entries of the longest list: past that a chunk's fixed cost (its key tile's loads, the
# float32 sums' traffic) outweighs the balance.
PROGRAMS_PER_PROCESSOR = 2
MAX_SPLITS = 8
MIN_SPLIT_ENTRIES = 4


_HELD_SPLITS: list[int] = []  # dkdv_splits_held's counts, innermost last


@contextlib.contextmanager
def dkdv_splits_held(splits: int):
    """Within it every prefix dk/dv launch splits each prefix tile over ``splits`` programs,
    whatever ``prefix_dkdv_splits`` would pick: for benchmarks and the sanitizer, which time
    and check counts the launcher does not choose on their shapes."""
    if not isinstance(splits, int) or splits < 1:
        raise ValueError(f"splits must be a positive int, got {splits!r}")
    _HELD_SPLITS.append(splits)
    try:
        yield
    finally:
        _HELD_SPLITS.pop()


def prefix_dkdv_splits(facts: tuple, num_heads_k: int, groups: int, device: torch.device) -> int:
    """How many programs share each prefix tile's dk/dv on ``device`` (1: no split, no float32
    sums): ``split_count`` with its processor count (8 off CUDA: the interpreter's splits
    still run), or the count ``dkdv_splits_held`` holds. The split count (so the dk/dv bits)
    depends on the device's processor count."""
    if _HELD_SPLITS:
        return _HELD_SPLITS[-1]
    processors = (torch.cuda.get_device_properties(device).multi_processor_count
                  if device.type == "cuda" else 8)
    return split_count(facts, num_heads_k, groups, processors)


def split_count(facts: tuple, num_heads_k: int, groups: int, processors: int) -> int:
    """The programs per prefix tile that give ``PROGRAMS_PER_PROCESSOR`` programs a processor
    over the prefixes' tiles, within ``MAX_SPLITS`` and ``MIN_SPLIT_ENTRIES``. They hold
    ``2 x splits x R x Hk`` rows of D floats, above 1 split only while the prefixes' tiles are
    too few to fill the device: at most about ``2 x 4 x processors x BLOCK`` rows."""
    _, prefix_tiles, suffix_blocks = facts
    if prefix_tiles == 0:
        return 1
    wanted = -(-PROGRAMS_PER_PROCESSOR * processors // (prefix_tiles * num_heads_k))
    return max(1, min(wanted, MAX_SPLITS, suffix_blocks * groups // MIN_SPLIT_ENTRIES))


def chosen_dkdv_splits(q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor,
                       prefix_of: torch.Tensor) -> int:
    """The split count the prefix backward runs with for ``q [T, Hq, D]``, ``k [T, Hk, D]``
    on this layout, from the table it builds (the benchmarks print it)."""
    config = kernels.backward_config(_DTYPE_NAMES[q.dtype], q.shape[2])
    facts = cached_prefix_table(cu_seqlens, prefix_of, q.shape[0], config["BLOCK"],
                                config["STEP"])[-1]
    return prefix_dkdv_splits(facts, k.shape[1], q.shape[1] // k.shape[1], q.device)


# The tables of a (prefix_of, cu_seqlens) pair: built once per pair of tensors, like _TABLES.
_PREFIX_TABLES = PairMemo()


def cached_prefix_table(cu_seqlens: torch.Tensor, prefix_of: torch.Tensor, num_tokens: int,
                        block: int, step: int | None = None):
    """``prefix_tile_table`` (``step`` None) or ``prefix_dkdv_table``, computed once per
    (``cu_seqlens``, ``prefix_of``) tensors and arguments."""
    def build():
        if step is None:
            return prefix_tile_table(cu_seqlens, prefix_of, num_tokens, block)
        return prefix_dkdv_table(cu_seqlens, prefix_of, num_tokens, block, step)

    return _PREFIX_TABLES.get_or_build(prefix_of, cu_seqlens, (num_tokens, block, step), build)


def _prefix_forward(q, k, v, cu_seqlens, prefix_of, max_seqlen, scale, deterministic, out, lse):
    """Fill ``out[T, Hq, D]`` and ``lse[Hq, T]`` (float32): a suffix's queries over its
    prefix's keys, then causally over their own."""
    num_tokens, num_heads_q, head_dim = q.shape
    if num_tokens == 0:
        return
    q, k, v = (_rows_contiguous(x) for x in (q, k, v))
    target = (out if out.stride(-1) == 1
              else torch.empty_like(out, memory_format=torch.contiguous_format))
    if lse.stride(-1) != 1:
        raise ValueError("lse must have a unit stride along its token dimension")
    dtype = _DTYPE_NAMES[q.dtype]
    padded = kernels.padded_head_dim(head_dim)
    config = kernels.forward_config(dtype, head_dim)
    bounds, prefix, tile_sequence, tile_block, slots = cached_prefix_table(
        cu_seqlens, prefix_of, num_tokens, config["BLOCK_M"])
    with _device_guard(q):
        prefix_kernels.varlen_attention_prefix_forward_kernel[(slots * num_heads_q,)](
            q, k, v, target, lse, bounds, prefix, tile_sequence, tile_block,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            target.stride(0), target.stride(1), lse.stride(0),
            num_heads_q, num_heads_q // k.shape[1], head_dim, float(scale),
            HEAD_DIM=padded, EVEN_D=padded == head_dim, BLOCK_M=config["BLOCK_M"],
            BLOCK_N=config["BLOCK_N"], IEEE=dtype == "fp32",
            num_warps=config["num_warps"], num_stages=config["num_stages"])
    if target is not out:
        out.copy_(target)


def _prefix_backward(dout, q, k, v, out, lse, cu_seqlens, prefix_of, max_seqlen, scale,
                     deterministic, dq, dk, dv):
    """Fill ``dq``, ``dk``, ``dv`` as ``_backward`` does; a prefix key tile's dk/dv sums its
    own queries' and all its suffixes' shares in a fixed order (no atomics on dk/dv)."""
    num_tokens, num_heads_q, head_dim = q.shape
    num_heads_k = k.shape[1]
    if num_tokens == 0:
        return
    dout, q, k, v, out = (_rows_contiguous(x) for x in (dout, q, k, v, out))
    lse = lse if lse.stride(-1) == 1 else lse.contiguous()
    targets = [g if g.stride(-1) == 1
               else torch.empty_like(g, memory_format=torch.contiguous_format)
               for g in (dq, dk, dv)]
    dtype = _DTYPE_NAMES[q.dtype]
    padded = kernels.padded_head_dim(head_dim)
    groups = num_heads_q // num_heads_k
    config = kernels.backward_config(dtype, head_dim)
    delta = torch.empty(num_heads_q, num_tokens, dtype=torch.float32, device=q.device)
    if lse.stride(0) != delta.stride(0):
        lse = lse.contiguous()
    dq_t, dk_t, dv_t = targets
    dq_acc = (None if deterministic else
              torch.zeros(num_tokens, num_heads_q, head_dim, dtype=torch.float32, device=q.device))
    dq_arg, dq_strides = ((delta, (0, 0)) if dq_acc is None
                          else (dq_acc, (dq_acc.stride(0), dq_acc.stride(1))))
    (bounds, tile_sequence, tile_block, slots, query_ptr, query_row, query_count, part_row,
     part_tokens, split_tile, facts) = cached_prefix_table(cu_seqlens, prefix_of, num_tokens,
                                                           config["BLOCK"], config["STEP"])
    splits = prefix_dkdv_splits(facts, num_heads_k, groups, q.device)
    extra = splits * facts[1] * num_heads_k if splits > 1 else 0  # the prefix tiles' splits
    part = torch.empty(2, splits, facts[0] if splits > 1 else 0, num_heads_k, head_dim,
                       dtype=torch.float32, device=q.device)  # the splits' dk, dv sums
    common = dict(HEAD_DIM=padded, EVEN_D=padded == head_dim, IEEE=dtype == "fp32")
    with _device_guard(q):
        block_t = kernels.PREPROCESS_BLOCK_T
        kernels.varlen_attention_backward_preprocess_kernel[
            (triton.cdiv(num_tokens, block_t), num_heads_q)](
            out, dout, delta, out.stride(0), out.stride(1), dout.stride(0), dout.stride(1),
            delta.stride(0), num_tokens, head_dim, BLOCK_T=block_t,
            BLOCK_D=kernels.PREPROCESS_BLOCK_D, num_warps=4, num_stages=1)
        prefix_kernels.varlen_attention_prefix_backward_dkdv_kernel[
            (extra + slots * num_heads_k,)](
            q, k, v, dout, lse, delta, dq_arg, dk_t, dv_t, part[0], part[1], bounds,
            tile_sequence, tile_block, query_ptr, query_row, query_count, part_row, split_tile,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            dout.stride(0), dout.stride(1), *dq_strides, dk_t.stride(0),
            dk_t.stride(1), dv_t.stride(0), dv_t.stride(1), delta.stride(0),
            part.stride(1), part.stride(2), part.stride(3),
            num_heads_k, groups, splits, extra, head_dim, float(scale),
            BLOCK=config["BLOCK"], STEP=config["STEP"], ATOMIC_DQ=dq_acc is not None,
            num_warps=config["num_warps"], num_stages=config["num_stages"], **common)
        if splits > 1:
            _add_splits(part, part_tokens, scale, dk_t, dv_t)
        if dq_acc is not None:
            dq_t.copy_(dq_acc.mul_(scale))
        else:
            dq_config = kernels.backward_dq_config(dtype, head_dim)
            bounds, prefix, tile_sequence, tile_block, slots = cached_prefix_table(
                cu_seqlens, prefix_of, num_tokens, dq_config["BLOCK_M"])
            prefix_kernels.varlen_attention_prefix_backward_dq_kernel[(slots * num_heads_q,)](
                q, k, v, dout, lse, delta, dq_t, bounds, prefix, tile_sequence, tile_block,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                dout.stride(0), dout.stride(1), dq_t.stride(0), dq_t.stride(1), delta.stride(0),
                num_heads_q, groups, head_dim, float(scale),
                BLOCK_M=dq_config["BLOCK_M"], BLOCK_N=dq_config["BLOCK_N"],
                num_warps=dq_config["num_warps"], num_stages=dq_config["num_stages"], **common)
    for target, grad in zip(targets, (dq, dk, dv)):
        if target is not grad:
            grad.copy_(target)


def _add_splits(part: torch.Tensor, part_tokens: torch.Tensor, scale: float, dk: torch.Tensor,
                dv: torch.Tensor) -> None:
    """The prefixes' rows of ``dk``, ``dv`` ([T, Hk, D], unit stride along D): the splits'
    float32 sums (``part[2, splits, R, Hk, D]``) added in split order (the same bits every
    run), dk scaled, written at ``part_tokens[R]`` (R > 0: a split needs a prefix tile); one
    launch."""
    _, splits, rows, num_heads_k, head_dim = part.shape
    padded = kernels.padded_head_dim(head_dim)
    block_r = prefix_kernels.add_splits_rows(padded)
    prefix_kernels.varlen_attention_prefix_add_splits_kernel[(triton.cdiv(rows, block_r),
                                                               num_heads_k)](
        part[0], part[1], part_tokens, dk, dv, part.stride(1), part.stride(2), part.stride(3),
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), rows, splits, head_dim,
        float(scale), HEAD_DIM=padded, EVEN_D=padded == head_dim, BLOCK_R=block_r,
        **prefix_kernels.ADD_SPLITS_LAUNCH)


BACKEND = Backend("triton", "op", _unavailable, forward=_forward, backward=_backward,
                  unsupported=_unsupported, prefix_forward=_prefix_forward,
                  prefix_backward=_prefix_backward)
