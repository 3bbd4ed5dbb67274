"""An in-memory secondary tier: the smallest complete tier, for tests and as a template."""
