"""Training: configuration, the loop, and how it is spread over processes.

One room per step: ``args``/``spec`` (the configuration), ``trainer`` (``LLMTrainer``, the
public entry point, re-exported by ``llmtrain``), ``launch`` (one fit in this process),
``run`` (the loop), ``precision`` (dtypes, autocast, loss scaling), ``modeling`` (loading
and preparing the model), ``strategies`` (single, DDP, FSDP2, DeepSpeed), ``checkpoint``,
``callbacks`` (observers of a run) and ``model`` (the trained model component).

Nothing is re-exported here: the submodules import each other directly, never through
this package, so it cannot close an import cycle.
"""
