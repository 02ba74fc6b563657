"""`dflash-trt bench`: DFlash against plain decoding of the same target, same prompts, same run.

Flow: prompts (project sets or a JSONL file) -> a Runner (in process on a pair / engine, or a
Triton gRPC endpoint) -> one RequestRecord per request, per mode, per concurrency level ->
summaries (dflash_trt.metrics vocabulary) beside the physical ceiling -> table, bench.json, plots.
"""
