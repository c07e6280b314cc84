"""Training: the loop, precision, model loading, strategies, checkpoints and the trained model.

Nothing is re-exported here, so this package cannot close an import cycle.
"""
