"""MLA (multi-head latent attention) backends: cache shapes only."""
