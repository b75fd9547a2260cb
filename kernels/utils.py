"""Helpers shared by the Triton kernels (triton only; no torch import).

Varlen kernels walk the packed layout through ``cu_seqlens`` (int32 ``[B+1]``); these helpers
turn a program id into the (sequence, block) tile it owns, so that a grid covers only real tiles.
"""

import triton
import triton.language as tl


@triton.jit
def sequence_bounds(cu_seqlens_ptr, sequence):
    """Start and end (exclusive) token of ``sequence`` in the packed batch."""
    start = tl.load(cu_seqlens_ptr + sequence).to(tl.int64)
    end = tl.load(cu_seqlens_ptr + sequence + 1).to(tl.int64)
    return start, end


@triton.jit
def tile_of_program(tile_sequence_ptr, tile_block_ptr, program):
    """The (sequence, block) pair a program handles, from a tile table built from cu_seqlens."""
    sequence = tl.load(tile_sequence_ptr + program)
    block = tl.load(tile_block_ptr + program)
    return sequence, block


def cdiv(a: int, b: int) -> int:
    """Ceiling division for grid sizes computed on the host."""
    return -(-a // b)
