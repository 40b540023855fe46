"""NVFP4 linear layers for vLLM on CPU, from vLLM's own emulation code (test support).

vLLM 0.32 ships no NVFP4 GEMM for its CPU platform, so a compressed-tensors NVFP4 export fails to
load there. This general plugin (entry point ``vllm.general_plugins``, loaded by every vLLM process)
fills the gap without touching the loader or the scheme:

* W4A4: registers vLLM's ``EmulationNvFp4LinearKernel`` for the CPU platform (activations
  quantised with the layer's ``input_global_scale``, weights dequantised, one matmul), the kernel
  vLLM itself falls back to on ROCm;
* W4A16: vLLM only accepts its GPU weight-only kernels there, so the scheme's kernel factory is
  wrapped to return ``DequantW4A16Kernel``: the packed weight is dequantised once after loading
  (vLLM's ``dequantize_to_dtype``) and served as a plain matmul in the activation dtype.

NVFP4 MoE experts are out of reach: vLLM's NVFP4 MoE backends are Triton/CUDA only.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.kernels.linear import register_linear_kernel
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_w4a4_nvfp4 as scheme,
    )
    from vllm.platforms import PlatformEnum

    register_linear_kernel(EmulationNvFp4LinearKernel, PlatformEnum.CPU, "nvfp4")
    if getattr(scheme.init_nvfp4_linear_kernel, "_prodrl_cpu", False):
        return  # registered already in this process
    original = scheme.init_nvfp4_linear_kernel

    def init_nvfp4_linear_kernel(use_a16: bool = False):
        if use_a16:
            from prodrl_vllm_cpu_nvfp4.w4a16 import DequantW4A16Kernel, layer_config

            return DequantW4A16Kernel(layer_config())
        return original(use_a16=use_a16)

    init_nvfp4_linear_kernel._prodrl_cpu = True
    scheme.init_nvfp4_linear_kernel = init_nvfp4_linear_kernel
