"""fused_moe with float8 experts at W8's decode sizes, for an A/B of two trees on one machine:
    python3 benchmarks/moe_fp8_ab.py <root>   (root: . or .base, whose kernels/ is timed)"""

import sys

import torch

sys.path.insert(0, sys.argv[1])
from benchmarks.moe_layer import _quantize_experts, time_us  # noqa: E402
from kernels import moe, reference_moe  # noqa: E402

torch.manual_seed(0)
e, h, i, k, dev = 128, 2048, 768, 8, "cuda"
w_gu = (torch.randn(e, 2 * i, h, device=dev) * h**-0.5).bfloat16()
w_d = (torch.randn(e, h, i, device=dev) * i**-0.5).bfloat16()
router = (torch.randn(e, h, device=dev) * h**-0.5).bfloat16()
(q_gu, s_gu), (q_d, s_d) = _quantize_experts(w_gu), _quantize_experts(w_d)
for t in (64, 128, 256, 1024):
    x = torch.randn(t, h, device=dev).bfloat16()
    weights, ids = reference_moe.route_topk(torch.nn.functional.linear(x, router), k, True, x.dtype)
    cfg = moe.MoeConfig(16, 64, 256, 4, 3) if t <= 256 else moe.MoeConfig(64, 64, 128, 4, 3)
    us = time_us(lambda: moe.fused_moe(x, q_gu, q_d, weights, ids, config=cfg, w_gate_up_scale=s_gu,  # noqa: B023
                                       w_down_scale=s_d), iters=20)
    print(f"{sys.argv[1]:6s} T {t:5d}: {us:7.1f} us")
