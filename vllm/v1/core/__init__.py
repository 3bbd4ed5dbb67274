"""KV-cache planning: model layouts → layer specs → groups and tensors."""
