"""More self-distilled data: the target's SAMPLED answers to the train prompts (a GPU job).

The greedy answers give one sequence per prompt, and the project's prompts are a few thousand.
Sampling K answers per prompt at a moderate temperature gives K different contexts per prompt,
every one of them written by the target itself, and the DFlash objective then teaches the
drafter the target's most likely continuation of each (at temperature <= 1 most sampled tokens
are the greedy one). Eval prompts are never used.

    python -m dflash_trt.train.sampled TARGET_DIR OUT.pt --samples 8 --temperature 0.7 --device cuda

is ``dflash-trt train-data`` with these defaults (samples 8, temperature 0.7, device cuda); the
answers come from :func:`dflash_trt.train.answers.generate_answers`, rows with ids
``<prompt id>#s<j>``. Pass the file to ``dflash-trt train-draft --extra-data OUT.pt``.
Resumable: the prompts already answered in OUT.pt are skipped. All rows are drawn in one
sampling call per step from the job's seed: the same seed and --batch-prompts give the same
answers. (Seeding every answer on its own made them independent of the batch too, but cost one
sampling call per row per step: with 1024 rows on an H100 that took longer than the target's
forward.)
"""

from __future__ import annotations

SAMPLED_DEFAULTS = {"samples": 8, "temperature": 0.7, "device": "cuda"}

if __name__ == "__main__":
    from dflash_trt.train.cli import train_data

    train_data.main(prog_name="python -m dflash_trt.train.sampled", default_map=SAMPLED_DEFAULTS)
