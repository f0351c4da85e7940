"""The loop the two decode scripts of this page share: pipelines over the bench's prompts, alternating per prompt."""
import time

import mtpflow
from mtpflow.tools.specbench import load_prompt_suite


def pipelines(settings: dict[str, tuple[str, list[str]]]) -> dict:
    """{label: pipeline} over the int8 model, 128 new tokens, no traces, each warmed up once."""
    pipes = {label: mtpflow.pipeline(name, overrides=["max_new_tokens=128", "model.quantize=int8", "trace=off",
                                                        *overrides])
             for label, (name, overrides) in settings.items()}
    for pipe in pipes.values():
        pipe(prompt_ids=pipe.encode("Hello there, how are you?"))
    return pipes


def alternate(pipes: dict, lo: int, hi: int, before=None) -> dict[str, list]:
    """The bench's prompts ``lo``..``hi - 1`` through every pipeline, the order reversed every other prompt, each a
    first-time request (the shared caches cleared but for the trained heads). ``before(label)`` runs just before
    each request. Returns {label: [seconds, tokens, steps]}."""
    acc = {label: [0.0, 0, 0] for label in pipes}
    for i, item in enumerate(load_prompt_suite()[lo:hi]):
        for label in list(pipes) if i % 2 == 0 else list(pipes)[::-1]:
            pipe = pipes[label]
            ids = pipe.encode(item["prompt"])
            pipe.shared.clear(keep=lambda key: key.startswith("heads:"))
            if before is not None:
                before(label)
            t0 = time.perf_counter()
            result = pipe(prompt_ids=ids)
            acc[label][0] += time.perf_counter() - t0
            acc[label][1] += len(result.token_ids)
            acc[label][2] += len(result.steps)
    return acc
