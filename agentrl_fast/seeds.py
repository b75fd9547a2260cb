"""Seeds derived from parts (a leaf: the rollout engine, the environment, the trainer and the
warm-start all derive their seeds here)."""

import hashlib


def derive_seed(*parts) -> int:
    """A 63-bit seed from any parts (``seed``, task id, sample index, turn): stable across
    processes and Python versions (blake2b, not ``hash``)."""
    digest = hashlib.blake2b("/".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
