"""The physical limit beside the measurement (gpt-fast style: every figure next to its ceiling).

Decoding one token at batch 1 reads every weight once, so on a GPU it is bound by HBM bandwidth:

    plain ceiling (tokens/s per user) = HBM bandwidth / bytes read per step
    DFlash ceiling                     = tau * plain ceiling      (free drafting, verify = 1 step)

and the measured speedup can be at most tau (the Leviathan bound). Splitting the gap:

    step_cost_ratio = DFlash step time / plain step time     (DFlash step = tau * DFlash TPOT)
    speedup         = tau / step_cost_ratio                  (exactly, from the same TPOTs)

A ratio near 1 with a low tau blames the drafter; a high ratio blames drafting/verify kernels or
the host loop; a plain TPOT far above the bandwidth bound blames the kernels themselves.
"""

from __future__ import annotations

from typing import Any

from dflash_trt.engine.hardware import GPUS, QUANT_TO_FORMAT, WEIGHT_FORMATS


def detect_gpu(device: str) -> str | None:
    """The hardware-table key of the CUDA device the pair runs on (None on CPU or an unknown GPU)."""
    if not device.startswith("cuda"):
        return None
    import torch

    name = torch.cuda.get_device_name(torch.device(device)).lower()
    return next((key for key in GPUS if key != "cpu" and key in name), None)


def bytes_per_step(model: Any, weights: str = "none") -> dict[str, Any]:
    """Weight bytes one decode step reads: as loaded (this run) and in the deployed format.

    Every parameter is read once per step, except an UNTIED input embedding, of which a step
    gathers one row only. Deployed: decoder-layer linear weights in the build's format
    (`weights` = none/fp8/nvfp4 as in the engine manifest), everything else in bf16.
    """
    from torch import nn

    fmt = WEIGHT_FORMATS[QUANT_TO_FORMAT.get(weights, "bf16")]
    bf16 = WEIGHT_FORMATS["bf16"]
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embed
    linear = {id(m.weight) for name, m in model.named_modules()
              if isinstance(m, nn.Linear) and m is not head and ".layers." in f".{name}."}
    params = loaded = deployed = 0
    for p in model.parameters():  # parameters() yields a tied weight once
        params += p.numel()
        if p is embed and not tied:
            continue
        loaded += p.numel() * p.element_size()
        deployed += p.numel() * (fmt.bytes_per_param if id(p) in linear else bf16.bytes_per_param)
    return {"target_params": params, "weight_format": fmt.name, "bytes_per_step_loaded": loaded,
            "bytes_per_step_deployed": deployed}


def ceiling(sizes: dict[str, Any] | None, gpu: str | None, tau: float, dflash_tpot_s: float,
            plain_tpot_s: float | None) -> dict[str, Any]:
    """Ceiling figures for one (C=1) measurement; None where this run cannot know them."""
    out: dict[str, Any] = {"gpu": gpu, "tau_bound_speedup": tau, **(sizes or {})}
    spec = GPUS.get(gpu) if gpu else None
    bw = spec.bandwidth_tb_s if spec else None
    out["hbm_bandwidth_tb_s"] = bw
    out["bandwidth_bound_tokens_per_s"] = (bw * 1e12 / sizes["bytes_per_step_deployed"]) if bw and sizes else None
    out["bandwidth_bound_dflash_tokens_per_s"] = (tau * out["bandwidth_bound_tokens_per_s"]
                                                 if out["bandwidth_bound_tokens_per_s"] else None)
    out["dflash_step_s"] = tau * dflash_tpot_s  # one draft + verify step
    out["plain_step_s"] = plain_tpot_s
    if plain_tpot_s:
        out["measured_speedup"] = plain_tpot_s / dflash_tpot_s if dflash_tpot_s else None
        out["step_cost_ratio"] = out["dflash_step_s"] / plain_tpot_s
        out["speedup_over_bound"] = out["measured_speedup"] / tau if out["measured_speedup"] and tau else None
        # what this run's memory system delivered on plain decoding (the roofline's y-axis)
        out["achieved_gb_s"] = sizes["bytes_per_step_loaded"] / plain_tpot_s / 1e9 if sizes else None
    else:
        out.update(measured_speedup=None, step_cost_ratio=None, speedup_over_bound=None, achieved_gb_s=None)
    return out
