"""Kernels for the hot parts of the decode loop, each beside its pure-torch reference."""
from mtpflow.kernels.tree_verify import children_lists, greedy_tree_verify_reference

greedy_tree_verify = greedy_tree_verify_reference

__all__ = ["children_lists", "greedy_tree_verify", "greedy_tree_verify_reference"]
