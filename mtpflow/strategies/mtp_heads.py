"""The ``mtp_heads`` proposer: trained draft heads (Medusa, EAGLE or EAGLE-3, see ``head_modules``) on the
target's hidden states build a candidate TREE from the top-k tokens of each draft position, most probable paths
first. Every node carries its draft probability, its path probability (``scores["pfs"]``) and the entropy
of the distribution it came from, for the PFS pruner.
"""
from __future__ import annotations

import heapq
import time
from importlib import resources
from pathlib import Path

import torch

from mtpflow.backends.base import Backend
from mtpflow.errors import ConfigError, UserError, check_int, check_k
from mtpflow.plugins import hookimpl
from mtpflow.strategies.graft import GraftedTree
from mtpflow.strategies.head_drafting import DraftVocabulary, EagleDraft, MedusaDraft, draft_runner
from mtpflow.strategies.head_modules import (
    CONFIG_NAME, KINDS, check_matches, head_rows, load_heads, normalized_entropy,
)
from mtpflow.kernels import ngram_match
from mtpflow.strategies.pld import lookup_acceptance
from mtpflow.types import DecodeState, Draft, StepRecord

PRECISIONS = ("auto", "float32", "int8")


def shipped_heads(model_name: str | None, kind: str) -> Path | None:
    """The heads shipped in ``mtpflow/data/heads/<model>/<kind>`` for a model config name, if any."""
    from mtpflow.model import model_slug

    folder = Path(str(resources.files("mtpflow.data"))) / "heads" / model_slug(model_name) / kind
    return folder if (folder / CONFIG_NAME).exists() else None


def resolve_heads(explicit: str | None, model_cfg: dict, kind: str) -> Path:
    """The heads folder: the proposer's ``heads`` parameter, else ``model.heads``, else the shipped heads.
    A folder holding ``<kind>/`` (as train_heads writes) is accepted too."""
    for candidate in (explicit, model_cfg.get("heads")):
        if candidate:
            path = Path(str(candidate)).expanduser()
            if (path / kind / CONFIG_NAME).exists():
                return path / kind
            if (path / CONFIG_NAME).exists():
                return path
            raise UserError(f"no trained {kind} heads in {path}: run python -m mtpflow.train_heads out={path}")
    found = shipped_heads(model_cfg.get("name"), kind)
    if found is None:
        raise UserError(f"no trained {kind} heads for model {model_cfg.get('name')!r}: train them with "
                        f"python -m mtpflow.train_heads model.name=... out=DIR, then pass model.heads=DIR")
    return found


class PreparedHeads:
    """A heads folder made ready for one backend: its products (weights copied, packed or quantized once) and
    what a sequence's drafter needs; shared read-only by the requests of an engine."""

    def __init__(self, folder: Path, kind: str, model, taps, backend, int8: bool, vocab_size: int | None = None):
        module, draft_ids, config = load_heads(folder)
        if config.get("kind") != kind:
            raise UserError(f"{folder} holds {config.get('kind')} heads, not {kind}")
        check_matches(config, model, str(folder), taps, draft_ids)
        if vocab_size is not None and vocab_size < draft_ids.numel():
            if config.get("draft_vocab_order") != "frequency":
                raise UserError(f"strategy.propose.vocab_size: the draft vocabulary of {folder} is not stored most "
                                "frequent first (heads trained before it was): retrain them to use fewer tokens")
            draft_ids = draft_ids[:vocab_size]  # the most frequent target choices
        self.width = int(model.config.hidden_size) * (len(config["taps"]) if kind == "eagle3" else 1)

        def product(weight, bias=None):
            return backend.head_product(weight, bias, int8)

        with torch.no_grad():
            embeddings = model.get_input_embeddings()(draft_ids.to(backend.device)).float()
        self.vocab = DraftVocabulary(head_rows(model, draft_ids), draft_ids, product, embeddings)
        self.shared = draft_runner(module, self.vocab, product, backend.device)

    def drafter(self):
        """This sequence's drafter (``fresh``: Medusa's is stateless and shared, an EAGLE one holds its own cache)."""
        return self.shared.fresh()


def best_first_tree(probs: list[torch.Tensor], ids: list[torch.Tensor], max_nodes: int):
    """Tree over independent per-depth candidates, nodes in decreasing path probability (so each parent
    comes before its children). probs[d], ids[d]: [top_k_d] sorted descending. Returns (tokens, parents,
    node probs, path probs, depths) as lists."""
    probs = [p.tolist() if torch.is_tensor(p) else list(p) for p in probs]  # Python floats: no per-element
    ids = [i.tolist() if torch.is_tensor(i) else list(i) for i in ids]  # tensor indexing in the loop below
    tokens, parents, node_p, path_p, depths = [], [], [], [], []
    heap = [(-float(probs[0][0]), 0, -1, 0)]  # (-path prob, depth index, parent node, candidate rank)
    while heap and len(tokens) < max_nodes:
        neg, d, parent, rank = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(int(ids[d][rank]))
        parents.append(parent)
        node_p.append(float(probs[d][rank]))
        path_p.append(-neg)
        depths.append(d + 1)
        parent_p = 1.0 if parent < 0 else path_p[parent]
        if rank + 1 < len(probs[d]):  # the next sibling
            heapq.heappush(heap, (-parent_p * float(probs[d][rank + 1]), d, parent, rank + 1))
        if d + 1 < len(probs):  # the first child
            heapq.heappush(heap, (neg * float(probs[d + 1][0]), d + 1, node, 0))
    return tokens, parents, node_p, path_p, depths


class GraftLedger:
    """Whether a grafted drafter (token recycling, the suffix cache) pays for its own work on this host and model.

    Each step it was consulted, a graft costs its Python time (its tree, its merge, its learning) and gains the tokens
    accepted on nodes it added to the heads' tree (shared with another graft: both are credited, so a doubt keeps a
    graft on). A token is worth the step's seconds per emitted token. After ``warmup`` steps of evidence, while the
    decayed gain (tokens x seconds per token) is below the decayed cost, the graft sits out ``pause`` steps, then is
    tried again. The verify cost of its nodes is the PFS pruner's to weigh: this rule prices only the work the
    pruner never sees. Lossless either way: which nodes are drafted never changes what the target accepts. One
    ledger per graft and request: a request that repeats an earlier one gains from the suffix graft from its first
    steps, which a verdict learned on other requests (and a pause they started) would hide."""

    def __init__(self, warmup: int = 16, pause: int = 32, memory: float = 0.95):
        self.warmup, self.pause, self.memory = warmup, pause, memory
        self.seconds = self.gain = 0.0  # decayed sums per step: own seconds; tokens x seconds per token
        self.evidence = 0  # steps observed since the graft was last switched on
        self.resting = 0  # steps left of the current pause
        self.rests = 0  # pauses begun
        self.rested_steps = 0  # steps sat out (the request's run_stats)

    def active(self) -> bool:
        """Whether the graft drafts this step (one step of a rest is spent when not)."""
        if self.resting > 0:
            self.resting -= 1
            self.rested_steps += 1
            if self.resting == 0:
                self.evidence = 0
            return False
        return True

    def observe(self, seconds: float, tokens: int, seconds_per_token: float) -> None:
        """One step's cost (``seconds`` of the graft's own work) and gain (``tokens`` accepted on its nodes)."""
        m = self.memory
        self.seconds = m * self.seconds + seconds
        self.gain = m * self.gain + tokens * seconds_per_token
        self.evidence += 1
        if self.evidence >= self.warmup and self.gain < self.seconds:
            self.resting, self.rests = self.pause, self.rests + 1


def _graft_options(name: str, options) -> dict:
    if not hasattr(options, "items"):
        raise ConfigError(f"strategy.propose.{name} must be null or a mapping, got {options!r}")
    return dict(options)


class MTPHeadsProposer:
    """Drafts a tree with trained heads. ``kind``: medusa, eagle or eagle3 (the strategy then needs
    ``needs_hidden_states: eagle3``); ``top_k``: candidates per node; ``max_nodes``: tree size before pruning;
    ``branch`` (eagle, eagle3): nodes expanded per depth.

    ``lookup`` (null = off, or {min_ngram, max_ngram, max_draft}) also grafts a prompt-lookup chain (the
    continuation of the latest earlier occurrence of the last n tokens, as in ``pld``) into the tree. Heads
    predict what the model tends to say; lookup catches what it copies (summaries, edits, quotes), which
    heads trained on a small vocabulary rarely reach. Lookup nodes score acceptance ** depth, with the
    acceptance of lookup tokens per matched n-gram length estimated from the run's own verify results, so
    the PFS pruner weighs them against head nodes on one scale.

    ``adaptive_depth``: draft at most one position deeper than the deepest head node the pruner kept in the
    previous step. When the cost budget keeps short trees (a CPU, an unsure drafter) this skips EAGLE layer
    passes whose nodes would be cut anyway; the tree grows back one level per step when they survive.

    ``recycling`` (null = off, or the options of ``TokenRecyclingProposer``) grafts a token-recycling tree (the
    target's own top-k candidates from earlier verify forwards) and ``suffix`` (null = off, or the options of
    ``SuffixDrafter``) a suffix-cache tree (this request's text and earlier outputs of the engine); both mark
    their nodes calibrated with learned acceptance estimates as PFS, like the lookup chain.

    ``precision``: the draft's own products (``head_drafting``) in float32 or int8 (the W8A8 product where the
    backend has one); ``auto``: int8 over the int8 model (``model.quantize=int8``), float32 otherwise. Lossless
    either way: the target verifies every draft. ``vocab_size`` (null: all): draft over only the N most frequent
    tokens of the heads' draft vocabulary (a smaller vocabulary product, fewer reachable tokens)."""

    def __init__(self, kind: str = "medusa", heads: str | None = None, top_k: int = 4, max_nodes: int = 16,
                 branch: int = 4, temperature: float = 1.0, lookup=None, adaptive_depth: bool = True,
                 recycling=None, suffix=None, precision: str = "auto", vocab_size: int | None = None,
                 graft_costs: bool = True):
        if kind not in KINDS:
            raise ConfigError(f"strategy.propose.kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if precision not in PRECISIONS:
            raise ConfigError(f"strategy.propose.precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        self.precision = precision
        self.vocab_size = None if vocab_size is None else check_int("strategy.propose.vocab_size", vocab_size, 1)
        self.kind, self.heads_path = kind, heads
        self.top_k = check_k("strategy.propose.top_k", top_k)
        self.max_nodes = check_k("strategy.propose.max_nodes", max_nodes)
        self.branch = check_k("strategy.propose.branch", branch)
        if self.top_k < 1 or self.max_nodes < 1 or self.branch < 1:
            raise ConfigError("strategy.propose: top_k, max_nodes and branch must be >= 1")
        if not float(temperature) > 0:
            raise ConfigError(f"strategy.propose.temperature must be > 0, got {temperature!r}")
        self.temperature = float(temperature)
        if not isinstance(adaptive_depth, bool):
            raise ConfigError(f"strategy.propose.adaptive_depth must be true or false, got {adaptive_depth!r}")
        self.adaptive_depth = adaptive_depth
        self.depth_limit: int | None = None  # set from the previous step's kept tree when adaptive_depth
        self.drafter = None  # this sequence's MedusaDraft / EagleDraft (on_run_start)
        self.lookup = None
        self.lookup_acceptance = {}  # per matched n-gram length, as in pld
        if lookup is not None:
            if not hasattr(lookup, "get"):
                raise ConfigError(f"strategy.propose.lookup must be null or a mapping, got {lookup!r}")
            unknown = set(lookup) - {"min_ngram", "max_ngram", "max_draft"}
            if unknown:
                raise ConfigError(f"strategy.propose.lookup: unknown keys {sorted(unknown)} "
                                  "(allowed: min_ngram, max_ngram, max_draft)")
            lo = check_k("strategy.propose.lookup.min_ngram", lookup.get("min_ngram", 2))
            hi = check_k("strategy.propose.lookup.max_ngram", lookup.get("max_ngram", 4))
            if not 1 <= lo <= hi:
                raise ConfigError(f"strategy.propose.lookup: need 1 <= min_ngram <= max_ngram, got {lo}, {hi}")
            self.lookup = (lo, hi, check_k("strategy.propose.lookup.max_draft", lookup.get("max_draft", 8)))
            self.lookup_acceptance = lookup_acceptance(lo, hi, memory=0.9)
        self._lookup_n: int | None = None
        self.lookup_steps = self.lookup_accepted = 0
        self.recycling = self.suffix = None
        if recycling is not None:
            from mtpflow.strategies.token_recycling import TokenRecyclingProposer

            self.recycling = TokenRecyclingProposer(**_graft_options("recycling", recycling))
        if suffix is not None:
            from mtpflow.strategies.suffix import SuffixDrafter

            self.suffix = SuffixDrafter(where="strategy.propose.suffix", **_graft_options("suffix", suffix))
        if not isinstance(graft_costs, bool):
            raise ConfigError(f"strategy.propose.graft_costs must be true or false, got {graft_costs!r}")
        self.graft_costs = graft_costs
        self.ledgers: dict[str, GraftLedger] = {}  # per graft (on_run_start), when graft_costs
        self._graft_seconds: dict[str, float] = {}  # this step's own seconds of each graft consulted
        # the grafted token recycling learns from each verify row's top ids (loop.reads_top_ids)
        self.reads_top_ids = 0 if self.recycling is None else self.recycling.reads_top_ids

    def unavailable(self, model_config: dict) -> str | None:
        """Why these heads cannot draft for the model ``model_config`` (the config's ``model`` node) describes, or
        None: a strategy chosen by measurement (``mtpflow.strategy_choice``) leaves such a candidate out."""
        try:
            resolve_heads(self.heads_path, model_config or {}, self.kind)
        except UserError as exc:
            return str(exc)
        return None

    @hookimpl
    def on_run_start(self, context):
        config = context.config or {}
        folder = resolve_heads(self.heads_path, config.get("model", {}) or {}, self.kind)
        model = context.model
        taps = None
        if self.kind == "eagle3":  # the layers the strategy's forwards return must be the ones it was trained on
            from mtpflow.request import hidden_taps_of

            taps = hidden_taps_of(model, (config.get("strategy", {}) or {}).get("needs_hidden_states"))
        int8 = self.precision == "int8" or (self.precision == "auto"
                                            and (config.get("model", {}) or {}).get("quantize") == "int8")
        backend = getattr(context, "backend", None) or Backend(model)
        # the products are the same for every request of an engine: made once (weights read, packed, quantized) and
        # shared read-only; the drafting state (an EAGLE cache) is this sequence's own
        key = f"heads:{folder}:{self.kind}:{'int8' if int8 else 'float32'}:{taps}:{self.vocab_size}"

        def prepare():
            return PreparedHeads(folder, self.kind, model, taps, backend, int8, self.vocab_size)

        shared = getattr(context, "shared", None)
        prepared = prepare() if shared is None else shared.get(key, prepare)
        self.width, self.vocab, self.drafter = prepared.width, prepared.vocab, prepared.drafter()
        self.embed = model.get_input_embeddings()
        facts = {"heads": str(folder), "heads_kind": self.kind, "heads_precision": "int8" if int8 else "float32"}
        if self.recycling is not None:
            facts.update(self.recycling.on_run_start(context) or {})
        if self.suffix is not None:
            facts.update(self.suffix.start(context))
        if self.graft_costs:  # this request's own: a repeated request's suffix graft proves itself from its start
            self.ledgers = {name: GraftLedger() for name, graft in (("recycling", self.recycling), ("suffix", self.suffix))
                            if graft is not None}
        return facts

    def _distribution(self, logits: torch.Tensor) -> torch.Tensor:
        return (logits / self.temperature).softmax(-1)

    @hookimpl
    @torch.inference_mode()
    def propose(self, state: DecodeState, k: int) -> Draft:
        if self.drafter is None:
            raise UserError("the mtp_heads proposer was not started (on_run_start did not run)")
        if state.hidden is None:
            raise UserError("the mtp_heads proposer needs hidden states: set needs_hidden_states: "
                            f"{'eagle3' if self.kind == 'eagle3' else 'true'}")
        if state.hidden.shape[-1] != self.width:
            raise UserError(f"{self.kind} heads take hidden states of width {self.width}, the forward returned "
                            f"{state.hidden.shape[-1]}: set the strategy's needs_hidden_states to "
                            f"{'eagle3' if self.kind == 'eagle3' else 'true'}")
        depth = k if self.depth_limit is None else min(k, max(1, self.depth_limit))
        # the heads' tree, then the other drafters' trees grafted into it, over lists: one Draft at the end
        merged = (self._propose_medusa(state, depth) if isinstance(self.drafter, MedusaDraft)
                  else self._propose_eagle(state, depth))
        self._lookup_n = None
        if self.lookup is not None:
            lo, hi, longest = self.lookup
            n, follow = ngram_match(state.proposer_context(), lo, hi, min(longest, k))
            if n is not None:
                self._lookup_n = n
                merged.add_chain(follow.tolist(), min(self.lookup_acceptance[n].value, 0.99), "lookup")
        self._graft_seconds.clear()
        if self._grafting("recycling"):
            from mtpflow.strategies.token_recycling import MARK as RECYCLED

            t = time.perf_counter()
            tokens, parents, _, pfs, nodes = self.recycling.tree(state, k)
            merged.add(tokens, parents, pfs, "recycled", extra={RECYCLED: [j + 1.0 for j in nodes]})
            self._graft_seconds["recycling"] = time.perf_counter() - t
        if self._grafting("suffix"):
            from mtpflow.strategies.suffix import MARK as SUFFIX

            t = time.perf_counter()
            tokens, parents, _, pfs, _ = self.suffix.tree(state, k)
            merged.add(tokens, parents, pfs, SUFFIX)
            self._graft_seconds["suffix"] = time.perf_counter() - t
        return merged.draft()

    def _grafting(self, name: str) -> bool:
        """Whether graft ``name`` drafts this step: configured, and not resting (``GraftLedger``)."""
        if (self.recycling if name == "recycling" else self.suffix) is None:
            return False
        ledger = self.ledgers.get(name)
        return ledger is None or ledger.active()

    def _learn_grafts(self, record: StepRecord) -> None:
        """Each graft learns from the step (a step without drafting too: recycling reads the root row's top ids),
        unless it is resting; the ledger of each one consulted this step takes its seconds and accepted tokens."""
        consulted, self._graft_seconds = self._graft_seconds, {}
        draft = record.draft
        added = []  # accepted nodes a graft added to the heads' tree
        if consulted and draft.num_nodes:
            grafted = draft.scores.get("grafted")
            if grafted is not None:
                flags = grafted.tolist()
                added = [i for i in record.decision.accepted.tolist() if flags[i] >= 0.5]
        per_token = record.step_seconds / max(1, len(record.emitted))
        for name, graft, mark in (("recycling", self.recycling, "recycled"), ("suffix", self.suffix, "suffix")):
            ledger = self.ledgers.get(name)
            if graft is None or (ledger is not None and ledger.resting and name not in consulted):
                continue
            t = time.perf_counter()
            graft.learn(record)
            if ledger is not None and name in consulted:
                marks = draft.scores.get(mark)
                flags = marks.tolist() if marks is not None and added else []
                tokens = sum(1 for i in added if flags and flags[i] >= 0.5)
                ledger.observe(consulted[name] + time.perf_counter() - t, tokens, per_token)

    @hookimpl
    def on_step_end(self, record: StepRecord) -> None:
        """Set the next step's depth limit; learn how often grafted lookup tokens are accepted."""
        self._learn_grafts(record)
        draft = record.draft
        if self.adaptive_depth and record.num_proposed:
            grafted = draft.scores.get("grafted")
            depths = draft.depth_list()
            if grafted is not None and depths:
                depths = [d for d, g in zip(depths, grafted.tolist()) if g < 0.5]
            self.depth_limit = 1 + max(depths, default=0)
        if self._lookup_n is None:
            return
        estimate = self.lookup_acceptance[self._lookup_n]
        self._lookup_n = None
        marks = record.draft.scores.get("lookup")
        drafted = 0 if marks is None else int(marks.sum())
        if drafted == 0:  # the pruner dropped the whole chain: forget rejections slowly, to try again later
            estimate.forget_rejections()
            return
        accepted = 0
        for node in record.decision.accepted.tolist():
            if marks[node] < 0.5:
                break
            accepted += 1
        estimate.update(accepted, drafted)
        self.lookup_steps += 1
        self.lookup_accepted += accepted

    @hookimpl
    def run_stats(self):
        stats = {}
        if self.lookup is not None:
            stats.update({"lookup_steps": self.lookup_steps, "lookup_accepted": self.lookup_accepted})
        if self.recycling is not None:
            stats.update(self.recycling.run_stats())
        if self.suffix is not None:
            stats.update(self.suffix.counts)
        if self.ledgers:  # steps each graft sat out because its work cost more than its accepted tokens were worth
            stats.update({f"{name}_rested_steps": ledger.rested_steps for name, ledger in self.ledgers.items()})
        return stats or None

    @hookimpl
    def on_run_end(self, result, status) -> None:
        if self.suffix is not None:
            self.suffix.finish(result, status)

    def _draft(self, tokens, parents, node_p, path_p, entropy) -> GraftedTree:
        ids = self.vocab.id_list
        return GraftedTree([ids[t] for t in tokens], parents, node_p, {"pfs": path_p, "entropy": entropy},
                           f"mtp_heads:{self.kind}")

    def _propose_medusa(self, state: DecodeState, k: int) -> GraftedTree:
        drafter: MedusaDraft = self.drafter
        depth = min(k, drafter.num_heads)
        # the hidden state that produced the root token; head i drafts token root + 1 + i
        probs = self._distribution(drafter.logits(state.hidden[-1], depth))  # [depth, draft_vocab]
        top = probs.topk(min(self.top_k, probs.shape[-1]), dim=-1)
        ent = normalized_entropy(probs).tolist()
        tokens, parents, node_p, path_p, depths = best_first_tree(top.values.tolist(), top.indices.tolist(),
                                                                 self.max_nodes)
        return self._draft(tokens, parents, node_p, path_p, [ent[d - 1] for d in depths])

    # --- EAGLE -------------------------------------------------------------------------------------------

    def _propose_eagle(self, state: DecodeState, k: int) -> GraftedTree:
        """A tree level by level: each level expands the ``branch`` most probable nodes of the last one in ONE pass
        of the drafter (``EagleDraft.level``), and adds each one's ``top_k`` children."""
        drafter: EagleDraft = self.drafter
        drafter.sync(state.hidden, state.tokens, self.embed)
        # position of the newest committed input (the last with a target hidden state; its next token is the
        # root): a depth-d node's query sits at root_position + d, as the training crops place it
        root_position = int(state.tokens.numel()) - 2
        tokens, parents, node_p, path_p, entropy = [], [], [], [], []
        column: list[int] = []  # per node: its key's column in the drafter's tree (-1: not expanded)
        outputs: list[torch.Tensor] = []  # per expanded column: the layer's output there

        def add_children(parent_nodes: list[int], logits: torch.Tensor) -> list[int]:
            probs = self._distribution(logits)  # [len(parent_nodes), draft_vocab]
            top = probs.topk(min(self.top_k, probs.shape[-1]), dim=-1)
            ents = normalized_entropy(probs).tolist()
            made = []
            for row, (parent, values, indices) in enumerate(zip(parent_nodes, top.values.tolist(),
                                                                top.indices.tolist())):
                base = 1.0 if parent < 0 else path_p[parent]
                for p, i in zip(values, indices):
                    made.append(len(tokens))
                    tokens.append(i)
                    parents.append(parent)
                    node_p.append(p)
                    path_p.append(base * p)
                    entropy.append(ents[row])
                    column.append(-1)
            return made

        root_out, logits = drafter.first()
        frontier = add_children([-1], logits)
        for depth in range(1, k):
            frontier = sorted(frontier, key=lambda n: -path_p[n])[: self.branch]
            if not frontier:
                break
            if len(tokens) >= self.max_nodes:  # descendants of the frontier can no longer make the cut
                cut = sorted(path_p, reverse=True)[self.max_nodes - 1]
                if path_p[frontier[0]] <= cut:
                    break
            paths = []
            for n in frontier:
                path, a = [], parents[n]
                while a >= 0:
                    path.append(column[a])
                    a = parents[a]
                paths.append(path)
            parent_out = torch.cat([root_out if parents[n] < 0 else outputs[column[parents[n]]] for n in frontier])
            embeddings = self.vocab.embeddings[torch.tensor([tokens[n] for n in frontier], device=drafter.device)]
            outs, logits = drafter.level(parent_out, embeddings, root_position + depth, depth, paths)
            for j, n in enumerate(frontier):
                column[n] = len(outputs)
                outputs.append(outs[j:j + 1])
            frontier = add_children(frontier, logits)
        # keep the max_nodes most probable paths (a child is never more probable than its parent)
        order = sorted(range(len(tokens)), key=lambda n: (-path_p[n], n))[: self.max_nodes]
        keep = sorted(order)
        remap = {old: new for new, old in enumerate(keep)}
        return self._draft([tokens[n] for n in keep], [remap[parents[n]] if parents[n] >= 0 else -1 for n in keep],
                           [node_p[n] for n in keep], [path_p[n] for n in keep], [entropy[n] for n in keep])
