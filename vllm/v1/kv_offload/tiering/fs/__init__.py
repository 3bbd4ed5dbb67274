"""The file-system secondary tier: one file per offloaded block."""
