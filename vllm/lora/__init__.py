"""LoRA request shape read by the block manager (upstream's ``vllm.lora``)."""
