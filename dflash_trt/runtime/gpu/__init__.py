"""What the batched runtime adds on a GPU: few kernels a step, captured shapes, one sync a step.

- ``compiled_layers``: the target's and the drafter's layers through torch.compile;
- ``cuda_graphs``: static-shape passes captured at start-up and replayed per step (eager elsewhere);
- ``host_transfers``: the step's small tables down through pinned memory, one read back, counted.

Which passes are captured, by shape key, is the batched runtime's (runtime/batched/graphed_passes.py,
runtime/batched/step_shapes.py); this folder holds the mechanisms, not the step.
"""
