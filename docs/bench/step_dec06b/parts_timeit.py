"""Microseconds per call of the step's small parts this stop rewrote, in one process: the modules of BEFORE_TREE
(loaded from its files) against the working tree's, alternating 5 rounds of 3,000 calls (the fastest round is
printed), and whether both give the same result:

- ``verify_rows`` + ``call_members`` of a one-token step and of a 12-node tree (no rotary tables, 30 layers; the
  before module's imports resolve in the working tree, so both sides call the same ``tree_allowed``: this line is
  the rows' own change);
- ``tree_allowed`` of the 12-node tree;
- ``AdjacencyTable.expand`` of the default 24-node depth-5 template over a random [49152, 8] table;
- ``graft_tree`` twice (a recycling tree and a suffix tree into a 24-node heads tree), before, against one
  ``GraftedTree`` with both trees after;
- ``pld.longest_ngram_match`` for n = 4..2 over a 400-token history of random tokens (no match: every n searched).

    python docs/bench/step_dec06b/parts_timeit.py BEFORE_TREE
"""
import importlib.util
import random
import sys
import time
from types import SimpleNamespace

import torch

from mtpflow.backends import base
from mtpflow.backends.native import rows
from mtpflow.strategies import graft, token_recycling
from mtpflow.types import Draft


def old(tree: str, name: str):
    path = f"{tree}/{name.replace('.', '/')}.py"
    spec = importlib.util.spec_from_file_location("before_" + name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def fastest(f, calls=3000, rounds=5) -> float:
    f()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def same(a, b) -> bool:
    if isinstance(a, Draft):
        return all(same(getattr(a, k), getattr(b, k)) for k in ("tokens", "parents", "probs", "dists", "source")) and \
            list(a.scores) == list(b.scores) and all(torch.equal(a.scores[k], b.scores[k]) for k in a.scores)
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if hasattr(a, "__dataclass_fields__"):
        return all(same(getattr(a, k), getattr(b, k)) for k in a.__dataclass_fields__)
    return list(a) == list(b) if isinstance(a, (list, range)) else a == b


def main(before: str) -> None:
    old_rows, old_base = old(before, "mtpflow.backends.native.rows"), old(before, "mtpflow.backends.base")
    old_recycling, old_graft = old(before, "mtpflow.strategies.token_recycling"), old(before, "mtpflow.strategies.graft")
    old_ngram = old(before, "mtpflow.kernels.ngram")
    target = SimpleNamespace(position_shift=0, kv=SimpleNamespace(length=300, slot=0))
    tree = Draft(torch.tensor([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]),
                 torch.tensor([-1, 0, 0, 1, 1, 2, 3, 4, -1, 8, 9, 5]))
    cases = []
    for name, draft in (("one-token step", Draft.empty()), ("12-node tree", tree)):
        def call(module, draft=draft):
            return module.call_members(module.verify_rows([target], [42], [draft], [300]), {}, [None] * 30, (),
                                       torch.empty(1, 576))

        def result(module, draft=draft):
            return module.verify_rows([target], [42], [draft], [300])
        cases.append((f"verify_rows + call_members, {name}", lambda c=call: c(old_rows), lambda c=call: c(rows), result))
    table = torch.randint(-1, 49152, (49152, 8), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    tables = []
    for module in (old_recycling, token_recycling):
        t = module.AdjacencyTable(49152, 8, module.TreeTemplate(24, 5, 8))
        t.table.copy_(table)
        tables.append(t)
    roots = iter(range(10**9))
    rng = random.Random(0)
    heads = Draft(torch.tensor([rng.randrange(100) for _ in range(24)]),
                  torch.tensor([rng.randrange(-1, i) if i else -1 for i in range(24)]), probs=torch.rand(24),
                  scores={"pfs": torch.rand(24), "entropy": torch.rand(24)})
    recycled = ([rng.randrange(100) for _ in range(20)], [rng.randrange(-1, i) if i else -1 for i in range(20)],
                [rng.random() for _ in range(20)])
    suffix = ([rng.randrange(100) for _ in range(8)], list(range(-1, 7)), [0.9 ** (i + 1) for i in range(8)])

    def graft_before():
        d = old_graft.graft_tree(heads, *recycled, "recycled", extra={"recycling_node": [1.0] * 20})
        return old_graft.graft_tree(d, *suffix, "suffix")

    def graft_after():
        merged = graft.GraftedTree.of_draft(heads)
        merged.add(*recycled, "recycled", extra={"recycling_node": [1.0] * 20})
        merged.add(*suffix, "suffix")
        return merged.draft()

    print(f"{'part':58s} {'before us':>10s} {'after us':>10s}  same")
    for label, f_before, f_after, result in cases:
        print(f"{label:58s} {fastest(f_before):10.1f} {fastest(f_after):10.1f}  {same(result(old_rows), result(rows))}")
    print(f"{'tree_allowed, 12-node tree':58s} {fastest(lambda: old_base.tree_allowed(tree.parents)):10.1f} "
          f"{fastest(lambda: base.tree_allowed(tree.parents)):10.1f}  "
          f"{same(old_base.tree_allowed(tree.parents), base.tree_allowed(tree.parents))}")
    print(f"{'AdjacencyTable.expand, 24-node depth-5 template':58s} "
          f"{fastest(lambda: tables[0].expand(next(roots) % 49152, 5)):10.1f} "
          f"{fastest(lambda: tables[1].expand(next(roots) % 49152, 5)):10.1f}  "
          f"{all(tables[0].expand(r, 5) == tables[1].expand(r, 5) for r in range(0, 49152, 97))}")
    print(f"{'graft: recycling + suffix trees into a 24-node heads tree':58s} {fastest(graft_before):10.1f} "
          f"{fastest(graft_after):10.1f}  {same(graft_before(), graft_after())}")
    history = torch.tensor([rng.randrange(5000) for _ in range(400)], dtype=torch.long)

    def lookup_before():  # pld.longest_ngram_match as it was: the torch loop per n
        for n in range(4, 1, -1):
            follow = old_ngram.ngram_continuation_reference(history, n, n, 10)
            if follow.numel():
                return n, follow
        return None, history.new_zeros(0)

    from mtpflow.kernels import ngram_match as longest_ngram_match  # what pld.longest_ngram_match called (removed since)
    after = longest_ngram_match(history, 2, 4, 10)
    print(f"{'pld.longest_ngram_match, n = 4..2, 400 tokens, no match':58s} {fastest(lookup_before):10.1f} "
          f"{fastest(lambda: longest_ngram_match(history, 2, 4, 10)):10.1f}  "
          f"{lookup_before()[0] == after[0] and torch.equal(lookup_before()[1], after[1])}")


if __name__ == "__main__":
    main(sys.argv[1])
