"""``deepspeed.ops.adam``: ``FusedAdam`` and ``DeepSpeedCPUAdam`` as torch's Adam/AdamW.

    pytest tests/unit/test_deepspeed_module.py -k ops

DeepSpeed's two Adam kernels take the same arguments and defaults; with ``adam_w_mode=True``
(their default) the weight decay is decoupled, which is torch's ``AdamW``, else torch's ``Adam``.
Their default weight decay is 0 (torch's AdamW's is 0.01), and both apply bias correction
always (``bias_correction=False`` is refused). torch's fused kernels exist for both on CUDA and
on the CPU, so the result asks for them (``fused=True``).
"""

from __future__ import annotations

import torch

from zerorun.errors import RuntimeConfigError


def _adam(name, model_params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay, amsgrad):
    if not bias_correction:
        raise RuntimeConfigError(f"{name}(bias_correction=False): torch's Adam and AdamW always apply bias "
                                 "correction", hint="remove bias_correction or set it to True")
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    return cls(model_params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
               fused=True)


def FusedAdam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
              weight_decay=0.0, amsgrad=False, set_grad_none=True) -> torch.optim.Optimizer:
    """DeepSpeed's FusedAdam signature -> torch.optim.AdamW (or Adam when ``adam_w_mode=False``)."""
    return _adam("FusedAdam", params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay, amsgrad)


def DeepSpeedCPUAdam(model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                     weight_decay=0.0, amsgrad=False, adamw_mode=True, fp32_optimizer_states=True
                     ) -> torch.optim.Optimizer:
    """DeepSpeed's CPU Adam signature -> torch.optim.AdamW (or Adam when ``adamw_mode=False``)."""
    return _adam("DeepSpeedCPUAdam", model_params, lr, bias_correction, betas, eps, adamw_mode, weight_decay,
                 amsgrad)
