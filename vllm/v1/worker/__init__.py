"""Worker-side code: KV-cache allocation and views."""
