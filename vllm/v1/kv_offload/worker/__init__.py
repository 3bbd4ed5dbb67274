"""Worker side of KV-cache offloading: transfer handlers and KV-cache page views."""
