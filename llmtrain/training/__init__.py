"""The loop, strategies, checkpoints, the trained model (no re-exports here: no import cycle)."""
