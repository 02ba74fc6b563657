"""dflash-trt: DFlash speculative decoding from checkpoints to a served TensorRT-LLM engine.

Imports are lazy so that `dflash-trt --help` starts without importing torch.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
