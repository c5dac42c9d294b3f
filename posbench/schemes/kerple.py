"""KERPLE: learned kernels of distance as a bias, logarithmic and power."""

from __future__ import annotations

import torch
import torch.nn as nn

from posbench.schemes.distance import DistanceBias


class KerpleLog(DistanceBias):
    """KERPLE, logarithmic kernel (Chi et al. 2022): bias -r1_h * log(1 + r2_h * |i-j|), with
    r1, r2 > 0 learned per head.

    Set up as the reference, chijames/KERPLE: `megatron/model/gpt2_model.py` builds one
    ParallelKerpleLog (`megatron/mpu/layers.py`) and hands that same module to every layer, so
    one (H,) pair r1, r2 serves the whole model, 2 x n_head parameters. r1 starts U(0, 2),
    r2 U(0, 1), and both are clamped to >= 0.01 in place before use while training, so a head
    at the floor can still learn its way back; evaluation clamps the values it uses.

    Options:
      per_layer  False (default): one r1, r2 pair shared by all layers, as the reference;
                 True: a pair per layer, (n_layer, H) each
    """

    description = "learned log-distance bias -r1*log(1+r2*|i-j|) per head (Chi 2022, KERPLE)"
    options = {"per_layer": False}
    eps = 1e-2  # the reference's floor for r1 and r2
    r1_init, r2_init, r2_max = 2.0, 1.0, None  # r1 ~ U(0, 2), r2 ~ U(0, 1), r2 unbounded

    def __init__(self, cfg):
        super().__init__(cfg)
        self.per_layer = self.opt["per_layer"]
        shape = (cfg.n_layer, cfg.n_head) if self.per_layer else (cfg.n_head,)
        self.r1 = nn.Parameter(torch.rand(shape) * self.r1_init)  # (H,) or (n_layer, H)
        self.r2 = nn.Parameter(torch.rand(shape) * self.r2_init)  # (H,) or (n_layer, H)

    def distance_bias(self, d, layer):
        r1, r2 = (self.r1[layer], self.r2[layer]) if self.per_layer else (self.r1, self.r2)  # (H,) views
        if self.training:  # `.data`: autograd's saved copies from earlier blocks stay valid
            r1.data.clamp_(min=self.eps)
            r2.data.clamp_(min=self.eps, max=self.r2_max)
        r1 = r1.clamp(min=self.eps)[:, None]  # (H, 1)
        r2 = r2.clamp(min=self.eps, max=self.r2_max)[:, None]
        return self.kernel(r1, r2, d.clamp(min=0))  # (H, n); the future is masked

    @staticmethod
    def kernel(r1, r2, dist):
        return -r1 * torch.log1p(r2 * dist)


class KerplePower(KerpleLog):
    """KERPLE, power kernel (Chi et al. 2022): bias -r1_h * |i-j|^r2_h with r1 > 0 and
    0 < r2 <= 2 learned per head (r2 = 1 is ALiBi with a learned slope). Reference:
    ParallelKerplePower in chijames/KERPLE `megatron/mpu/layers.py`, one module for the whole
    model as for the log kernel (`megatron/model/gpt2_model.py`), where the slope (our r1)
    starts U(0, 1) and the power (our r2) U(0, 2), clamped to [0.01, 2]. Options as KerpleLog's."""

    description = "learned power-distance bias -r1*|i-j|^r2 per head (Chi 2022, KERPLE)"
    r1_init, r2_init, r2_max = 1.0, 2.0, 2.0

    @staticmethod
    def kernel(r1, r2, dist):
        return -r1 * dist.pow(r2)  # 0^r2 = 0 on the diagonal, with a zero gradient
