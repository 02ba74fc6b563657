"""The reference loop: one sequence, the oracle every faster path is tested against.

- ``generate``: :func:`dflash_generate` (draft, verify, commit, roll back) and plain
  :func:`autoregressive_generate`;
- ``serial``: the same loop behind the batched runtime's interface (add, step, cancel), for the
  pairs the batched runtime cannot run; runtime/opener.py opens it in its place.
"""
