"""Pure-PyTorch twins of the weight-quantization ops (ext/csrc/quant.cu): FP8 activation quantization and the
W4A16 GEMM with the int4 unpacking it rests on; also their implementation off CUDA."""
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


def unpack_int4(packed: torch.Tensor, num_cols: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, num_cols] int8 in -8..7: compressed-tensors pack-quantized, value i of a row
    at bits 4i..4i+3 of the row's little-endian words, stored as q + 8."""
    nibbles = packed.contiguous().view(torch.uint8)  # little-endian bytes: low nibble first
    values = torch.stack([nibbles & 0xF, nibbles >> 4], dim=-1).reshape(packed.shape[0], -1)
    return (values[:, :num_cols].to(torch.int16) - 8).to(torch.int8)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, num_cols: int, group_size: int) -> torch.Tensor:
    """packed [rows, words] int32 + scale [rows, ceil(num_cols / group_size)] -> [rows, num_cols] fp32, q * scale."""
    q = unpack_int4(packed, num_cols).float()
    return q * scale.float().repeat_interleave(group_size, 1)[:, :num_cols]


def w4a16_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [rows, 8 * words] @ dequantize_int4(packed, scale)^T in fp32 -> [rows, out] in x's dtype."""
    weight = dequantize_int4(packed, scale, x.shape[1], group_size)  # [out, in] fp32
    return (x.float() @ weight.t()).to(x.dtype)


def int4_dequantize(packed: torch.Tensor, scale: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """dequantize_int4 over every packed column, rounded to `dtype` (ext.ops.int4_dequantize's twin)."""
    return dequantize_int4(packed, scale, packed.shape[1] * 8, group_size).to(dtype)
