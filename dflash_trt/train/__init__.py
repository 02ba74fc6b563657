"""Training DFlash drafters: the target's own answers, its features, the DFlash block objective.

Modules, in the order a run uses them:

- ``config``: :class:`TrainConfig`, every knob of a run;
- ``answers``: the target's answers to the train prompts, greedy or sampled (ONE function);
- ``data``: answer files on disk, the target's features of them, the resumable data job;
- ``dataset``: the sequences a run trains on and the batches each step draws;
- ``drafter``: the drafter's shape, its mask token, its initial weights (``--init-from``);
- ``objective``: the DFlash block loss;
- ``step``: the frozen head, the optimiser and its schedule, one optimiser step;
- ``trainer``: :func:`train_draft`, the run from config to saved drafter;
- ``export``: MANIFEST.json and the atomic save in z-lab format;
- ``cli``: the commands (``train-draft``, ``train-data``, ``draft-vocab``, ``setup-default``).
"""

from __future__ import annotations

import sys


def log(msg: str) -> None:
    """One progress line of a training run on stderr."""
    print(f"[train-draft] {msg}", file=sys.stderr, flush=True)
