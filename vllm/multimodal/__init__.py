"""Multimodal input shapes read by the block manager (upstream's ``vllm.multimodal``)."""
