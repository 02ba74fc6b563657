"""Serving an engine directory: Triton model repository, a Triton-protocol gRPC server, a client.

Modules, one job each:
- ``engine_runtime``  load an engine directory and run requests: ``submit(request) -> chunks``
- ``repository``      write a Triton model repository from the ``triton_repo/`` template
- ``pb_utils``        the subset of ``triton_python_backend_utils`` that model.py uses
- ``host``            load a repository's model.py through that interface and feed it requests
- ``server``          the KServe v2 ``inference.GRPCInferenceService`` over grpcio
- ``metrics``         Prometheus metrics (Triton's ``nv_*`` names where Triton has one)
- ``client``          a ``tritonclient.grpc`` client for the generated model
"""
