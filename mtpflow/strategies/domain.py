"""Domain-aware K (stage ``select_k``): a trained text classifier reads the request once at run start, names
its domain (finance, education, healthcare, code, general), and the domain's K drafts every step (optionally
as the start of an adaptive K). The domain, its confidence and the K go into the run's stats.

Why this classifier: a logistic regression over the mean of all-MiniLM-L6-v2's *input token embeddings*
(PCA to 128 dimensions, int8), trained by ``python -m mtpflow.train_domain``. Measured on the held-out split
(docs/domain_classifier.md) on two splits of the data: TF-IDF n-grams 0.83 / 0.91 (with a few hundred
examples per domain a held-out "Tylenol" is just an unknown word), these static embeddings 0.94 / 0.92 for an
embedding lookup and a mean, the full MiniLM forward ~0.96 (first split) but a transformer forward of CPU per
prompt (timings: docs/bench/code-figures.md#domain-module-docstring). The artifact
(``mtpflow/data/domain_classifier.npz``) is plain arrays plus the WordPiece tokenizer's JSON; inference is
numpy and ``tokenizers`` only, so it does not depend on the scikit-learn or transformers version.
"""
from __future__ import annotations

import functools
import json
import re
import time
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from mtpflow.errors import ConfigError, UserError, check_k
from mtpflow.plugins import hookimpl
from mtpflow.strategies.k_selectors import AdaptiveK
from mtpflow.types import DecodeState, StepRecord

ARTIFACT = "domain_classifier.npz"
CHARS_PER_TOKEN_BOUND = 8  # WordPiece tokens of English text average ~4 characters; 8 leaves margin
DEFAULT_K_MAP = {"finance": 2, "education": 4, "healthcare": 1, "code": 6, "general": 3}
# The user turn of a chat-templated prompt (ChatML, Llama 3), for prompts handed in as token ids.
CHAT_USER_TURN = (
    re.compile(r"<\|im_start\|>user\n(.*?)(?:<\|im_end\|>|$)", re.S),
    re.compile(r"<\|start_header_id\|>user<\|end_header_id\|>\n\n(.*?)(?:<\|eot_id\|>|$)", re.S),
)


def request_text(prompt: str) -> str:
    """The user's request: the last user turn when ``prompt`` is chat-template text, else the prompt."""
    for pattern in CHAT_USER_TURN:
        turns = pattern.findall(prompt)
        if turns:
            return turns[-1].strip()
    return prompt


class DomainClassifier:
    """Numpy inference for the shipped domain model: tokenize, mean-pool static token vectors, softmax."""

    def __init__(self, path: str | Path | None = None):
        from tokenizers import Tokenizer

        self.path = Path(path) if path else Path(str(resources.files("mtpflow.data").joinpath(ARTIFACT)))
        try:
            with np.load(self.path, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
            self.meta = json.loads(str(arrays["meta"]))
            self.tokenizer = Tokenizer.from_str(str(arrays["tokenizer_json"]))
        except (OSError, ValueError, KeyError) as exc:
            raise UserError(f"cannot read the domain classifier {self.path}: {exc}; "
                            f"rebuild it with `python -m mtpflow.train_domain`") from None
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.classes: tuple[str, ...] = tuple(self.meta["classes"])
        self.max_tokens = int(self.meta["max_tokens"])
        # [vocab, dim] token vectors, stored int8 with a per-row scale
        self.table = arrays["token_vectors"].astype(np.float32) * arrays["token_scales"][:, None]
        self.coef = arrays["coef"].astype(np.float64)  # [n_classes, dim]
        self.intercept = arrays["intercept"].astype(np.float64)  # [n_classes]

    def features(self, text: str) -> np.ndarray:
        """[dim] the L2-normalised mean of the text's token vectors (no special tokens)."""
        # Cut the text before tokenizing, so a pasted document costs no more than a long request.
        text = text[: CHARS_PER_TOKEN_BOUND * self.max_tokens]
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids[: self.max_tokens]
        if not ids:
            return np.zeros(self.table.shape[1])
        v = self.table[ids].mean(0).astype(np.float64)
        norm = np.linalg.norm(v)
        return v / norm if norm > 0 else v

    def predict_proba(self, text: str) -> np.ndarray:
        """[n_classes] class probabilities for one text."""
        logits = self.coef @ self.features(text) + self.intercept
        e = np.exp(logits - logits.max())
        return e / e.sum()

    def predict(self, text: str) -> tuple[str, float]:
        """(domain, confidence) for one text."""
        p = self.predict_proba(text)
        best = int(p.argmax())
        return self.classes[best], float(p[best])


@functools.lru_cache(maxsize=4)
def load_classifier(path: str | None = None) -> DomainClassifier:
    """The classifier, read once per process and path (runs build fresh stage objects every time)."""
    return DomainClassifier(path)


class DomainAwareK:
    """K from the request's domain, decided once in ``on_run_start``.

    ``k_map`` maps domain -> K (missing domains keep the defaults). With ``adaptive`` the domain's K is only
    the start and AdaptiveK's rule moves it within [k_min, k_max]. ``k`` (the ``k=`` shortcut) fixes K for
    every domain while the domain is still reported.
    """

    def __init__(self, k_map: dict[str, int] | None = None, adaptive: bool = False, k_min: int | None = None,
                 k_max: int | None = None, increase: int = 2, decrease: int = 1, k: int | None = None,
                 classifier: str | None = None):
        self.classifier_path = classifier
        classes = load_classifier(classifier).classes
        unknown = set(k_map or {}) - set(classes)
        if unknown:
            raise ConfigError(f"strategy.select_k.k_map: unknown domain(s) {', '.join(sorted(unknown))}; "
                              f"the classifier knows {', '.join(classes)}")
        merged = {**DEFAULT_K_MAP, **(k_map or {})}
        self.k_map = {d: check_k(f"strategy.select_k.k_map.{d}", merged.get(d, DEFAULT_K_MAP["general"]))
                      for d in classes}
        if not isinstance(adaptive, bool):
            raise ConfigError(f"strategy.select_k.adaptive must be true or false, got {adaptive!r}")
        self.adaptive = adaptive
        self.k_min = None if k_min is None else check_k("strategy.select_k.k_min", k_min)
        self.k_max = None if k_max is None else check_k("strategy.select_k.k_max", k_max)
        if self.k_min is not None and self.k_max is not None and self.k_min > self.k_max:
            raise ConfigError(f"strategy.select_k.k_min ({k_min}) must not exceed k_max ({k_max})")
        self.increase = check_k("strategy.select_k.increase", increase)
        self.decrease = check_k("strategy.select_k.decrease", decrease)
        self.fixed_k = None if k is None else check_k("strategy.select_k.k", k)
        self.domain: str | None = None
        self.k = self._clamp(self.k_map.get("general", 3))
        self._adaptive_k: AdaptiveK | None = None

    def _clamp(self, k: int) -> int:
        if self.k_min is not None:
            k = max(k, self.k_min)
        if self.k_max is not None:
            k = min(k, self.k_max)
        return k

    @hookimpl
    def on_run_start(self, context) -> dict[str, Any]:
        t0 = time.perf_counter()
        domain, confidence = load_classifier(self.classifier_path).predict(request_text(context.prompt))
        seconds = time.perf_counter() - t0
        self.domain = domain
        self.k = self._clamp(self.k_map[domain] if self.fixed_k is None else self.fixed_k)
        if self.adaptive:
            self._adaptive_k = AdaptiveK(
                k=self.k, k_min=min(1, self.k) if self.k_min is None else self.k_min,
                k_max=max(self.k, 16) if self.k_max is None else self.k_max,
                increase=self.increase, decrease=self.decrease,
            )
        return {"domain": domain, "domain_confidence": round(confidence, 4), "domain_k": self.k,
                "domain_classifier_ms": round(1000 * seconds, 3)}

    @hookimpl
    def select_k(self, state: DecodeState) -> int:
        return self._adaptive_k.k if self._adaptive_k is not None else self.k

    @hookimpl
    def on_step_end(self, record: StepRecord) -> None:
        if self._adaptive_k is not None:
            self._adaptive_k.on_step_end(record)
