"""The baselines ``bench_moe_paging.py`` compares paged experts with at equal bytes: round-to-nearest, HQQ
(half-quadratic optimisation of each group's zero point) and GPTQ, each in a few lines of torch, per expert matrix
with fp16 scale and minimum per group like the pages; and the experts' calibration Hessians GPTQ uses."""

from __future__ import annotations

import torch

from lightning_superpipe.moe.layouts import find_moe_layers


def _minmax_quantize(weight: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Round-to-nearest, group-wise asymmetric min-max on ``[out, in]`` (fp16 metadata, like the pages)."""
    grouped = weight.float().unflatten(-1, (-1, group_size))
    low = grouped.amin(-1, keepdim=True).half().float()
    scale = ((grouped.amax(-1, keepdim=True) - low) / (2**bits - 1)).half().float()
    codes = ((grouped - low) / torch.where(scale > 0, scale, 1.0)).round_().clamp_(0, 2**bits - 1)
    return (low + codes * scale).flatten(-2)


def hqq_quantize(
    weight: torch.Tensor, bits: int, group_size: int, iterations: int = 20, p: float = 0.7, beta: float = 10.0,
    kappa: float = 1.01,
) -> torch.Tensor:
    """HQQ (Badri & Shaji 2023) on ``[out, in]``: min-max scale, zero point by half-quadratic optimisation.

    The zero point of each group minimises an l_p (p < 1) norm of the rounding error, alternating a
    generalised soft-thresholding of the error (the sparse outliers it may keep) with the zero point
    that fits the rest in closed form, as ``hqq``'s ``optimize_weights_proximal``; scale and zero in
    fp16 like the pages. Calibration-free.
    """
    grouped = weight.float().unflatten(-1, (-1, group_size))
    levels = 2**bits - 1
    low, high = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
    inverse = (levels / (high - low).clamp_min(1e-8)).half().float()  # HQQ's scale: codes per unit
    zero = (-low * inverse).half().float()
    best_zero, best_error = zero, float("inf")
    for _ in range(iterations):
        codes = (grouped * inverse + zero).round_().clamp_(0, levels)
        rebuilt = (codes - zero) / inverse
        error = grouped - rebuilt
        mean_error = error.abs().mean().item()
        if mean_error >= best_error:
            break
        best_zero, best_error = zero, mean_error  # the zero point that gave this error
        shrunk = error.sign() * torch.relu(error.abs() - (error.abs() + 1e-8).pow(p - 1) / beta)
        zero = (codes - (grouped - shrunk) * inverse).mean(-1, keepdim=True).half().float()
        beta *= kappa
    codes = (grouped * inverse + best_zero).round_().clamp_(0, levels)
    return ((codes - best_zero) / inverse).flatten(-2)


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """GPTQ (Frantar et al. 2022) of one ``[out, in]`` matrix with its input Hessian ``X^T X``.

    Columns are quantized in order; each column's rounding error is spread over the columns not yet
    quantized through the inverse Hessian's Cholesky factor. Group parameters are taken (min-max)
    when a group starts, from the columns as updated so far (GPTQ's default, non-static groups).
    """
    w = weight.float().clone()
    h = hessian.double().clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h.diagonal().add_(0.01 * h.diagonal().mean())  # GPTQ's 1% dampening
    h_inv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    quantized = torch.empty_like(w)
    levels = 2**bits - 1
    for column in range(w.shape[1]):
        if column % group_size == 0:
            group = w[:, column : column + group_size]
            low = group.amin(1).half().float()
            scale = ((group.amax(1) - low) / levels).half().float()
            step = torch.where(scale > 0, scale, 1.0)
        q = low + ((w[:, column] - low) / step).round_().clamp_(0, levels) * scale
        quantized[:, column] = q
        error = (w[:, column] - q) / h_inv[column, column]
        w[:, column:] -= error.unsqueeze(1) * h_inv[column, column:].unsqueeze(0)
    return quantized


def expert_hessians(
    model: torch.nn.Module, calibration: list[torch.Tensor]
) -> dict[tuple[int, int, int], torch.Tensor]:
    """``X^T X`` of every routed expert's projection inputs on the calibration batches.

    Keyed by ``(layer, proj, expert)``; the inputs are the tokens routed to that expert (``proj`` 0)
    and their gated hidden states (``proj`` 1), computed with the original weights (eager order).
    """
    layers = find_moe_layers(model, shared_experts=False)
    sums: dict[tuple[int, int, int], torch.Tensor] = {}

    def hook(index: int):
        def capture(module, args, kwargs):
            hidden, top_k_index = args[0], args[1]
            unit = layers[index]
            gate_up, down = (unit.canonical(unit.weight(p)) for p in (0, 1))
            for expert in torch.unique(top_k_index).tolist():
                if expert >= unit.num_experts:
                    continue
                tokens = (top_k_index == expert).any(-1)
                x = hidden[tokens].float()
                h = unit.gate_fn()(x @ gate_up[expert].float().T)
                for proj, inputs in ((0, x), (1, h)):
                    key = (index, proj, expert)
                    sums[key] = sums.get(key, 0) + inputs.T.double() @ inputs.double()
        return capture

    handles = [layer.experts.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            for batch in calibration:
                model(input_ids=batch)
    finally:
        for handle in handles:
            handle.remove()
    return sums
