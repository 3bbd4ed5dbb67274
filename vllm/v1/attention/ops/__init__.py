"""Attention ops under upstream vLLM's import path (``vllm.v1.attention.ops``): the Triton cache
writer (:mod:`.triton_reshape_and_cache_flash`) and the Triton attention kernels. Modules holding
Triton kernels define ``triton_compile_cases()`` (:mod:`vllm.triton_utils.aot`)."""
