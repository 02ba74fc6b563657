"""Checkpoints on disk, below both the runtime and the engine: neither imports the other for them.

- files.py: configs and weight files read and written safely (no code run from a checkpoint).
- streaming.py: safetensors checkpoints read and written one tensor at a time; any checkpoint the
  reference runtime runs loaded as a float model (one device or a device map).
- dequant.py: the weight formats an engine ships (FP8, NVFP4, MXFP4) dequantized in plain torch.
- placement.py: where a loaded model lives (`home_device`, the devices a device map spreads it over).
- quiet.py: transformers' load and save chatter kept off the CLI's output.

Nothing here imports dflash_trt.runtime or dflash_trt.engine.
"""
