"""Training: the loop, strategies, checkpoints and the trained model (nothing re-exported
here, so this package cannot close an import cycle)."""
