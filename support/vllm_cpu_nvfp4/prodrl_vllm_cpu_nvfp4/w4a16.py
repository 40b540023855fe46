"""W4A16 on CPU: the NVFP4 weight dequantised once after loading, then a plain matmul."""

from __future__ import annotations

import torch
from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearKernel, NvFp4LinearLayerConfig
from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import dequantize_to_dtype


def layer_config() -> NvFp4LinearLayerConfig:
    return NvFp4LinearLayerConfig()


class DequantW4A16Kernel(NvFp4LinearKernel):
    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        return True, None

    @classmethod
    def can_implement(cls, config: NvFp4LinearLayerConfig) -> tuple[bool, str | None]:
        return True, None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # The scheme has already inverted the stored global scale (compressed-tensors keeps 1/scale).
        dense = dequantize_to_dtype(layer.weight.data.view(torch.uint8), layer.weight_scale.data,
                                    layer.weight_global_scale.data, layer.params_dtype, 16, swizzle=False)
        layer.weight_dequantized = torch.nn.Parameter(dense, requires_grad=False)

    def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.nn.functional.linear(x, layer.weight_dequantized.to(x.dtype), bias)
