"""The drafters: what a DFlash drafter is, in which formats it comes, and how it drafts.

- ``families``: the registry, the ONE place a checkpoint's family (DFlash v1, DFlash2) and format
  (z-lab, speculators) are told apart; it sits below the families it lists;
- ``config``: type and range of every config.json field the runtime reads;
- ``speculators_format``: the speculators layout read as z-lab's (every loader reads through it);
- ``dflash``: the DFlash drafter (v1): its layers, the K/V injection of the target's features, its
  settings and proposals; DFlash2 subclasses it;
- ``dflash2``: DFlash2: the grouped dynamic convolution and the candidate selector's walk;
- ``draft_vocab``: a frequency-ranked draft vocabulary (v1);
- ``loading``: :func:`load_drafter`, the one call that loads a drafter directory;
- ``convert``: a drafter written in the other format (``dflash-trt convert-draft``);
- ``validate``: checks that a drafter fits a target, before any heavy work.

The batched runtime drafts through one proposer per family (runtime/batched/dflash_proposer.py,
runtime/batched/dflash2_proposer.py), which reads the runtime's row table and slot caches; it is
there, as vLLM keeps its proposers with its runtime (v1/spec_decode) apart from its models.
"""
