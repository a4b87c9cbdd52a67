"""Pure-PyTorch twin of the FP8 activation quantization (ext/csrc/quant.cu), also its implementation off CUDA."""
from __future__ import annotations

import torch
import torch.nn.functional as F

GROUP = 128  # columns per scale: torch._scaled_mm's 1x128 blockwise scaling
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


def quantize_fp8_blockwise(x: torch.Tensor, padded_rows: int, amax_floor: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] (cols % 128 == 0) -> (q [padded_rows, cols] float8_e4m3fn, scale_t [cols / 128, padded_rows]
    fp32): each row's 128-column group scaled so its largest magnitude maps to 448 (a zero group, such as the
    padding rows, gets amax_floor / 448), x ~= q * scale group by group. Scales come transposed (contiguous), so
    scale_t.t() is the outer-dim-major [padded_rows, cols / 128] that torch._scaled_mm takes."""
    rows, cols = x.shape
    padded = F.pad(x.float(), (0, 0, 0, padded_rows - rows))  # [padded_rows, cols]
    groups = padded.view(padded_rows, cols // GROUP, GROUP)
    scale = groups.abs().amax(dim=-1).clamp(min=amax_floor) / FP8_MAX  # [padded_rows, cols / 128]
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(padded_rows, cols), scale.t().contiguous()
