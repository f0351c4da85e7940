"""The Gradio playground: two strategies side by side on one shared model, every token colored by what
happened to it (accepted draft, recovered, bonus, plain), stats, plots and a history tab over the trace store.

    python -m mtpflow.playground --port 7860 [hydra overrides, e.g. trace.db=/tmp/t.db]
"""
