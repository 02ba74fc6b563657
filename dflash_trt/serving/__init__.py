"""Serving an engine directory: Triton model repository, a Triton-protocol gRPC server, a client.

Modules, one job each:
- ``protocol``              what a frontend hands a backend and gets back: GenerateRequest (with
                            SamplingParams), Generation (chunks), ChunkStats, ServerBusy; the contract
                            model.py and any other server (HTTP/OpenAI) build on
- ``backends``              BackendSettings and load_backend: which backend serves an engine
- ``pytorch_backend``       dflash-trt's runtime behind the protocol (one scheduler thread)
- ``tensorrt_llm_backend``  TensorRT-LLM's LLM API behind the protocol (GPU nodes)
- ``detokenizer``           token ids -> streamed text, stop strings, never retracted
- ``repository``            write a Triton model repository from the ``triton_repo/`` template
- ``pb_utils``              the subset of ``triton_python_backend_utils`` that model.py uses
- ``host``                  load a repository's model.py through that interface and feed it requests
- ``server``                the KServe v2 ``inference.GRPCInferenceService`` over grpcio
- ``metrics``               Prometheus metrics (Triton's ``nv_*`` names where Triton has one)
- ``client``                a ``tritonclient.grpc`` client for the generated model
"""
