"""Kernels for the hot parts of the decode loop, each beside its pure-torch reference, with dispatchers that
pick the Triton kernel (CUDA + triton) or the reference; ``kernels=auto|torch|triton`` in the config forces
one, the ops' implementation ("impl", see ``mtpflow.kernels.dispatch``). Triton modules are imported only when the
Triton implementation is used."""
from mtpflow.kernels.dispatch import (
    IMPLS, check_impl, requested_impl, resolve_impl, set_default_impl, use_impl,
)
from mtpflow.kernels.ngram import (
    ngram_continuation, ngram_continuation_reference, ngram_match, ngram_match_reference,
)
from mtpflow.kernels.pfs import pfs_prune, pfs_prune_reference
from mtpflow.kernels.speculative import speculative_accept, speculative_accept_reference
from mtpflow.kernels.tree_attention import tree_attention, tree_attention_reference
from mtpflow.kernels.tree_verify import (
    children_lists, greedy_tree_verify, greedy_tree_verify_reference,
)

__all__ = [
    "IMPLS", "check_impl", "children_lists", "greedy_tree_verify",
    "greedy_tree_verify_reference", "ngram_continuation", "ngram_continuation_reference", "ngram_match",
    "ngram_match_reference", "pfs_prune",
    "pfs_prune_reference", "requested_impl", "resolve_impl",
    "set_default_impl", "speculative_accept", "speculative_accept_reference", "tree_attention",
    "tree_attention_reference", "use_impl",
]
