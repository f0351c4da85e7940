"""The stable import path for plugins: ``from mtpflow.hookspecs import hookimpl`` keeps working for every plugin
written against it (the docs said so until the machinery moved into ``mtpflow.plugins``). The hooks themselves
live in ``mtpflow.plugins.hookspecs``; new code writes ``from mtpflow.plugins import hookimpl``."""
from mtpflow.plugins import PROJECT, hookimpl, hookspec

__all__ = ["PROJECT", "hookimpl", "hookspec"]
