"""mtpflow: several tokens per forward pass from any Hugging Face causal LM, without retraining it.

The loop is ``mtpflow.loop.DecodeLoop``; the stage hooks are in ``mtpflow.hookspecs``; built-in stages live
in ``mtpflow.strategies``; strategies are YAML files in ``mtpflow/conf/strategy``.
"""
__version__ = "0.1.0"


def pipeline(*args, **kwargs):
    from mtpflow.api import pipeline as _pipeline

    return _pipeline(*args, **kwargs)


__all__ = ["pipeline", "__version__"]
