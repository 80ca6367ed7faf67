"""Random streams defined by (seed, call, microbatch, layer), not by thread timing.

Dropout must draw the same mask in a backward stage's recompute as in the forward,
and the result must not depend on how many workers there are or which thread drew
first. So every layer call is run with its device generator seeded from
:func:`layer_seed`. A plain-PyTorch reference reproduces a rotapipe run exactly by
seeding the same way before each layer (see ``docs/concepts.md``).
"""

from __future__ import annotations

_MASK = (1 << 64) - 1


def _mix(z: int) -> int:
    # splitmix64 finaliser: consecutive inputs give unrelated outputs.
    z = (z + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def layer_seed(seed: int, call: int, microbatch: int, layer: int) -> int:
    """Seed of layer ``layer`` for microbatch ``microbatch`` of the ``call``-th
    successful ``forward_backward`` call since the pipeline was built (counting from
    0; ``RoundPipe.calls``). Evaluation calls ``pipe(x)`` use calls -1, -2, ... so
    they never shift training's streams."""
    z = _mix(seed & _MASK)
    for v in (call, microbatch, layer):
        z = _mix(z ^ (v & _MASK))
    return z & ((1 << 63) - 1)
