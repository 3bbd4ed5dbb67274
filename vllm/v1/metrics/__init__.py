"""Cache statistics (upstream's ``vllm.v1.metrics``)."""
