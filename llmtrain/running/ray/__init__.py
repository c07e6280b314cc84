"""Training on Ray: ``LLMTrainer(..., ray_config=RayConfig(...))`` then ``fit()``.

Ray Train's ``TorchTrainer`` starts the workers; each runs the same FitRun as a local rank
(DDP inside the Ray worker group). The database stays with the driver, which streams each
worker its rows (:mod:`llmtrain.running.ray.bridge`); checkpoints go through Ray Train into
``ray_config.storage`` and are recorded by the driver (:mod:`llmtrain.running.ray.driver`).
Nothing here is imported unless a trainer has a ``ray_config``.
"""
