"""Serving an engine directory on the real Triton Inference Server, and its clients.

Modules, one job each:
- ``repository``            write a Triton model repository from the ``triton_repo/`` template (its
                            ``model.py`` runs in tritonserver's Python backend)
- ``backends``              BackendSettings and load_backend: which backend serves an engine
- ``protocol``              what model.py hands a backend and gets back: GenerateRequest (with
                            SamplingParams), Generation (chunks), ChunkStats, ServerBusy
- ``pytorch_backend``       dflash-trt's runtime behind the protocol (one scheduler thread)
- ``tensorrt_llm_backend``  TensorRT-LLM's LLM API behind the protocol (GPU nodes)
- ``detokenizer``           token ids -> streamed text, stop strings, never retracted
- ``metrics``               what model.py publishes on Triton's metrics port (custom metrics)
- ``tritonserver``          which tritonserver, what its Python backend needs here, its process
- ``triton_install``        tritonserver from PyPI's nvidia-pytriton wheel where no container has one
- ``openai_front``          the OpenAI-compatible API, a tritonclient gRPC client of Triton
- ``serve``                 `dflash-trt serve`: tritonserver and the front, ready file, signals
- ``client`` / ``openai_client``  `dflash-trt client` over Triton gRPC / OpenAI HTTP
"""
