"""Model code (ours), the architecture registry and the checkpoint loader."""
