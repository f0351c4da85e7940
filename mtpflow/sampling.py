"""The target distribution: temperature, top-k and top-p applied to logits, in the order HF applies them,
and the samplers the gates and the re-scorer share. Probabilities stay on the logits' device; a draw runs
where its generator lives (each run's ``rng`` is a CPU generator), so a seed picks the same tokens whether
the model runs on the CPU or on a GPU."""
from __future__ import annotations

import torch

from mtpflow.types import SamplingParams


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., vocab] logits -> [..., vocab] probabilities of the target distribution (one-hot when greedy)."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float32)
    scores = logits.float() / params.temperature
    if params.top_k and params.top_k > 0:
        k = min(params.top_k, scores.shape[-1])
        kth = torch.topk(scores, k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False, dim=-1)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        remove_sorted = cumulative <= (1 - params.top_p)
        remove_sorted[..., -1:] = False  # keep at least one token
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from a [vocab] distribution (on ``generator``'s device: multinomial refuses a
    generator of another device, and a CPU draw keeps a seed's tokens the same on every device)."""
    if generator is not None and probs.device != generator.device:
        probs = probs.to(generator.device)
    return int(torch.multinomial(probs, 1, generator=generator))


def choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The target's own token from one row of logits: argmax when greedy, else a sample."""
    if params.greedy:
        return int(logits.argmax())
    return sample(target_probs(logits, params), generator)
