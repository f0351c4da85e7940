"""mtpflow: several tokens per forward pass from any Hugging Face causal LM, without retraining it.

Where things are: the engine (queue, continuous batching, one verify forward per step) is
``mtpflow.engine.Engine``; one step of one sequence is ``mtpflow.loop.Sequence`` and the step of the whole
batch ``mtpflow.loop.decode_step``; the stage hooks and the rest of the plugin machinery are in
``mtpflow.plugins``; built-in stages live in ``mtpflow.strategies``; strategies are YAML files in
``mtpflow/conf/strategy``; a request is ``mtpflow.request.Request``.
"""
__version__ = "0.1.0"


def pipeline(*args, **kwargs):
    from mtpflow.api import pipeline as _pipeline

    return _pipeline(*args, **kwargs)


__all__ = ["pipeline", "__version__"]
