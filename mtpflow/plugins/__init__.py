"""mtpflow's plugin machinery in one place. A plugin (a built-in stage, a run plugin such as the trace recorder,
or a third-party package) imports its marker from here: ``from mtpflow.plugins import hookimpl``.

- ``hookspecs``: every hook, the stage hooks of one decoding step and the plugin-level hooks, with the markers.
- ``entry_points``: the third-party plugins installed under entry point group ``mtpflow`` (loading, selection
  with ``MTPFLOW_LOAD_PLUGINS``, the strategy folders they ship).
- ``manager``: each run's own ``PluginManager`` (core defaults, the strategy's stages, run plugins), and the
  guard that turns a third-party hook's exception into one line naming its plugin.
- ``defaults``: the core's stage implementations, registered last so any plugin can take a stage over.
- ``python -m mtpflow.plugins`` (``__main__``): lists the built-in and third-party plugins.

The layers, bottom up: hookspecs < entry_points < defaults < manager < __main__. This module holds only the
markers, so a stage module that imports ``hookimpl`` never imports the manager that builds it.
"""
from mtpflow.plugins.hookspecs import PROJECT, hookimpl, hookspec

__all__ = ["PROJECT", "hookimpl", "hookspec"]
