"""Tools around the inference path, kept apart from it: the benchmarks (``bench``, ``bench_batch``,
``bench_serve``, ``trace_overhead``), head training and its data (``train_heads``, ``head_data``) and the
domain classifier's training and prompts (``train_domain``, ``domain_prompts``).

The engine, the loop, the API, the CLI, the server and every built-in stage never import this package
(tests/unit/test_layout.py checks it). The commands keep their short names: ``python -m mtpflow.bench``,
``python -m mtpflow.train_heads`` and ``python -m mtpflow.train_domain`` are one-line entry points into here.
"""
