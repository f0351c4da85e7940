"""Built-in stage implementations, one module per idea. Each class implements one or more stage hooks and
is named by ``_target_`` in a strategy YAML under ``mtpflow/conf/strategy/``."""
