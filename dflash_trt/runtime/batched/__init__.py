"""The batched runtime: continuous batching, many sequences sharing each draft and verify pass.

- ``runtime``: :class:`BatchedRuntime`, one step over the running rows (its docstring draws it);
- ``scheduling``: requests, the rows that run, their slots and the step's row table;
- ``slot_caches``: the preallocated, position-indexed KV caches (rollback is resetting a length);
- ``prefix_cache``: a prompt's longest cached prefix copied in, not prefilled;
- ``dflash_proposer``, ``dflash2_proposer``: the drafter pass over the batch, one proposer a family;
- ``target_passes``: the target's prefill and verification;
- ``step_shapes``, ``graphed_passes``: the shapes a step runs in, and the two passes by shape key
  (captured on a GPU by runtime/gpu/cuda_graphs.py);
- ``policy``, ``policy_calibration``, ``shadow_drafts``: how many drafts to verify per step, its
  cost table measured before serving, and acceptance learned without verifying.
"""
