"""Upstream vLLM module path; holds only what our callers and upstream tests import."""
