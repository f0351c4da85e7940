"""Kernels for the hot parts of the decode loop, each beside its pure-torch reference, with dispatchers that
pick the Triton kernel (CUDA + triton) or the reference; ``kernels=auto|torch|triton`` in the config forces
one (see ``mtpflow.kernels.dispatch``). Triton modules are imported only when the Triton backend is used."""
from mtpflow.kernels.dispatch import (
    BACKENDS, check_backend, requested_backend, resolve_backend, set_default_backend, use_backend,
)
from mtpflow.kernels.ngram import ngram_continuation, ngram_continuation_reference
from mtpflow.kernels.pfs import pfs_prune, pfs_prune_reference
from mtpflow.kernels.speculative import speculative_accept, speculative_accept_reference
from mtpflow.kernels.tree_attention import tree_attention, tree_attention_reference
from mtpflow.kernels.tree_verify import (
    children_lists, greedy_tree_verify, greedy_tree_verify_reference,
)

__all__ = [
    "BACKENDS", "check_backend", "children_lists", "greedy_tree_verify",
    "greedy_tree_verify_reference", "ngram_continuation", "ngram_continuation_reference", "pfs_prune",
    "pfs_prune_reference", "requested_backend", "resolve_backend",
    "set_default_backend", "speculative_accept", "speculative_accept_reference", "tree_attention",
    "tree_attention_reference", "use_backend",
]
