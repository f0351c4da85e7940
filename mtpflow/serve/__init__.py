"""The OpenAI-compatible server: ``python -m mtpflow.serve`` (FastAPI + uvicorn on the batching engine).

``create_app(engine, ...)`` builds the app (``mtpflow.serve.app``); ``protocol`` checks request bodies and
builds OpenAI response objects; ``generation`` runs one request on the engine; ``metrics`` is ``/metrics``.
"""
from mtpflow.serve.app import create_app

__all__ = ["create_app"]
