"""Train draft heads for any Hugging Face causal LM by self-distillation, on the frozen model:

    python -m mtpflow.train_heads                                # the default model -> <cache>/heads/smollm2
    python -m mtpflow.train_heads model=hf model.name=ID out=DIR data.samples=512
    python -m mtpflow.train_heads "kinds=[]"                     # only the training text

    python -m mtpflow.train_heads model.quantize=int8 out=DIR        # heads for the int8 model, on its own text
    python -m mtpflow.train_heads time_limit_minutes=20              # stop after 20 min; the same command continues

The base model writes its own training text (``mtpflow.tools.head_data``) through the engine's backend (the
float32 model's forwards, or the int8 model's with ``model.quantize=int8``), then Medusa heads, the EAGLE layer and
(``"kinds=[eagle3]"``) the EAGLE-3 layer learn to predict the model's own greedy choices; each kind is saved to
``out/<kind>/`` and loaded with
``strategy=medusa strategy.propose.heads=out/medusa`` (or ``model.heads=out``). ``export=vllm out=DIR`` trains
nothing: it writes the EAGLE heads of ``model.heads`` (default: the shipped ones) as a vLLM draft checkpoint
(``mtpflow.tools.export_vllm``).

The run is resumable: the text is written in shards, and each kind's training state (weights, optimiser, learning
rate schedule, the batch sampler's generator, the best held-out checkpoint) goes to ``out/<kind>/train_state.pt``
every ``checkpoint_every`` steps. A run killed or stopped by ``time_limit_minutes`` continues where its state
stopped when the same command runs again, and ends with the same weights as an uninterrupted run (the same batches
in the same order from the same state). ``resume=false`` starts over.
"""
from __future__ import annotations

import hashlib
import json
import random
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from mtpflow.errors import ConfigError, UserError, check_int, check_range, writable_folder
from mtpflow.model import model_slug
from mtpflow.strategies.head_modules import (
    CONFIG_NAME, Eagle3Drafter, EagleDrafter, MedusaHeads, default_attention_heads, draft_index, fingerprint,
    save_heads, unroll,
)
from mtpflow.tools.head_data import Deadline, Paused

_lock = threading.Lock()


def compose(overrides: list[str]) -> DictConfig:
    """``mtpflow/conf/train_heads.yaml`` composed with overrides (Hydra compose API: no outputs/ folder)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from mtpflow.conf import conf_dir

    with _lock:
        GlobalHydra.instance().clear()
        try:
            with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
                return hydra_compose(config_name="train_heads", overrides=list(overrides))
        except (HydraException, OmegaConfBaseException) as exc:
            raise UserError(f"bad configuration: {' '.join(str(exc).split())[:300]}") from None
        finally:
            GlobalHydra.instance().clear()


def pick_draft_vocab(records: list[dict], size: int, vocab: int) -> torch.Tensor:
    """The ``size`` target choices seen most often in the generated text (EAGLE-3's draft vocabulary; the whole
    vocabulary if 0), most frequent first (ties by id): the first N of them are the N most frequent, so a decoder
    may use fewer (``strategy.propose.vocab_size``)."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for r in records:
        # from the prompt's last input on, every position has a choice (no -1: ``sample_batch``)
        counts += torch.bincount(r["greedy"][r["prompt_len"] - 1:].long(), minlength=vocab)
    order = torch.argsort(counts, descending=True, stable=True)
    return order if size <= 0 or size >= vocab else order[:size]


def split_by_prompt(records: list[dict], fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(held_out, train): the sequences of about ``fraction`` of the distinct prompts are held out, so the
    held-out accuracy measures prompts the heads never saw (each prompt is sampled several times, and a
    split by sequence let the heads score on text they had memorised). With a single prompt, both are all
    records."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault(tuple(r["tokens"][: r["prompt_len"]].tolist()), []).append(r)
    keys = list(groups)
    random.Random(seed).shuffle(keys)
    if len(keys) < 2:
        return records, records
    n_held = max(1, round(len(keys) * fraction))
    held = [r for k in keys[:n_held] for r in groups[k]]
    train = [r for k in keys[n_held:] for r in groups[k]]
    random.Random(seed).shuffle(train)
    return held, train


def draft_labels(index: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """The model's greedy choices as draft-vocabulary labels: -100 (ignored by the loss) for tokens outside it and
    for positions without a choice (-1: before the prompt's last token)."""
    greedy = greedy.long()
    return torch.where(greedy >= 0, index[greedy.clamp(min=0)], torch.full_like(greedy, -100))


def medusa_examples(records: list[dict], num_heads: int, index: torch.Tensor):
    """(hidden [N, h] fp16, labels [N, num_heads]): head i at input j learns the model's choice after input
    j + 1 + i, i.e. the token at j + 2 + i; -100 where the sequence ends or the token is outside the draft
    vocabulary."""
    xs, ys = [], []
    for r in records:
        n, start = r["hidden"].shape[0], r["prompt_len"] - 1
        greedy = draft_labels(index, r["greedy"])
        labels = torch.full((n - start, num_heads), -100, dtype=torch.long)
        for i in range(num_heads):
            lo = start + 1 + i
            if lo < n:
                labels[: n - lo, i] = greedy[lo:]
        xs.append(r["hidden"][start:])
        ys.append(labels)
    return torch.cat(xs), torch.cat(ys)


class Checkpoint:
    """The weights with the best held-out score seen so far (early stopping: self-distilled data is small and
    the heads can memorise it, so the last step need not be the best one on unseen prompts; the held-out set
    both picks the checkpoint and reports its accuracy)."""

    def __init__(self, module: torch.nn.Module):
        self.module, self.state, self.step, self.score, self.metrics = module, None, 0, float("-inf"), []

    def offer(self, step: int, score: float, metrics: list[float]) -> None:
        if score > self.score:
            self.step, self.score, self.metrics = step, score, metrics
            self.state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def restore(self) -> None:
        if self.state is not None:
            self.module.load_state_dict(self.state)

    def state_dict(self) -> dict:
        return {"state": self.state, "step": self.step, "score": self.score, "metrics": self.metrics}

    def load_state_dict(self, saved: dict) -> None:
        self.state, self.step = saved["state"], saved["step"]
        self.score, self.metrics = saved["score"], saved["metrics"]


STATE_NAME = "train_state.pt"  # in out/<kind>/: one kind's training as it stands (``TrainState``)


class TrainState:
    """One kind's training as it stands, in ``out/<kind>/train_state.pt``: the step reached, the module, optimiser and
    schedule states, the batch sampler's generator and the best held-out checkpoint, under the key of the run's
    settings and data (a state of other settings is never resumed). Written atomically every ``every`` steps and
    when the run's time limit passes; after the last step it keeps only the result (``finished``)."""

    def __init__(self, folder: Path, key: str, module, opt, sched, generator: torch.Generator, best: Checkpoint,
                 every: int):
        self.path, self.key, self.every = (folder / STATE_NAME if folder else None), key, every
        self.module, self.opt, self.sched, self.generator, self.best = module, opt, sched, generator, best

    def read(self, resume: bool) -> dict | None:
        """The saved state of these settings, or None (none, ``resume`` false, or a finished run of other settings);
        a UserError for an unfinished run of other settings, which is not overwritten silently."""
        if not resume or not self.path.exists():
            return None
        try:
            saved = torch.load(self.path, weights_only=False)
        except Exception as exc:  # noqa: BLE001 (a state cut short by a kill before the atomic rename is impossible)
            raise UserError(f"{self.path} cannot be read ({type(exc).__name__}): pass resume=false to start "
                            "this kind over") from None
        if saved.get("key") != self.key:
            if saved.get("finished"):  # a finished run of other settings: its heads are replaced by this run's
                return None
            raise UserError(f"{self.path} is an unfinished run with other settings or data: pass resume=false to "
                            "start over, or another out=")
        return saved

    def resume(self, saved: dict) -> int:
        """Load ``saved`` (``read``) into the objects; the step to continue from."""
        self.module.load_state_dict(saved["module"])
        self.opt.load_state_dict(saved["optimizer"])
        self.sched.load_state_dict(saved["schedule"])
        self.generator.set_state(saved["generator"])
        self.best.load_state_dict(saved["best"])
        return int(saved["step"])

    def save(self, step: int, seconds: float) -> None:
        self._write({"key": self.key, "step": step, "seconds": seconds, "module": self.module.state_dict(),
                     "optimizer": self.opt.state_dict(), "schedule": self.sched.state_dict(),
                     "generator": self.generator.get_state(), "best": self.best.state_dict()})

    def finish(self, metrics: dict, seconds: float) -> None:
        self._write({"key": self.key, "finished": True, "metrics": metrics, "seconds": seconds})

    def _write(self, data: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        torch.save(data, tmp)
        tmp.replace(self.path)


class Run:
    """What every kind's training shares: where states go, the settings key, whether to resume, how often to write
    the state, the time limit."""

    def __init__(self, out: Path | None, key: dict, resume: bool, every: int, deadline: Deadline):
        self.out, self.key_parts, self.resume, self.every, self.deadline = out, key, resume, every, deadline

    def key(self, kind: str, settings) -> str:
        blob = json.dumps({**self.key_parts, "kind": kind,
                           "settings": OmegaConf.to_container(settings, resolve=True)}, sort_keys=True, default=str)
        return hashlib.sha1(blob.encode()).hexdigest()


def fit(kind: str, module: torch.nn.Module, cfg, seed: int, run: Run | None, loss_step, evaluate) -> dict:
    """Train ``module`` for ``cfg.steps`` steps (AdamW at ``cfg.lr``, one cycle), resumable (``TrainState``; with
    ``run`` None, in memory only: a script's experiment).
    ``loss_step(generator)``: one batch's (loss, progress bar figures); ``evaluate()``: (score, held-out metrics),
    run every ``cfg.eval_every`` steps. Restores the best held-out checkpoint; returns its metrics."""
    opt = torch.optim.AdamW(module.parameters(), lr=float(cfg.lr), weight_decay=float(cfg.weight_decay))
    steps = int(cfg.steps)
    sched = lr_schedule(opt, float(cfg.lr), steps)
    g = torch.Generator().manual_seed(seed)
    best = Checkpoint(module)
    run = run or Run(None, {}, False, steps + 1, Deadline(None))
    state = TrainState(run.out / kind if run.out else None, run.key(kind, cfg), module, opt, sched, g, best, run.every)
    saved = state.read(run.resume) if run.out else None
    start, seconds = (state.resume(saved), float(saved["seconds"])) if saved else (0, 0.0)
    if start:
        print(f"{kind}: continuing from step {start} of {steps} ({state.path})", file=sys.stderr)
    t0 = time.perf_counter()
    bar = tqdm(range(start, steps), initial=start, total=steps, desc=f"train {kind}", unit="step")
    for step in bar:
        loss, shown = loss_step(g)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        bar.set_postfix(**shown, best=f"{best.score:.3f}")
        done = step + 1
        if done % int(cfg.eval_every) == 0 or done == steps:
            score, metrics = evaluate()
            best.offer(done, score, metrics)
        if done < steps:
            try:
                run.deadline.check(f"{kind}: step {done} of {steps}")
            except Paused:
                state.save(done, seconds + time.perf_counter() - t0)
                raise
            if done % run.every == 0 and run.out:
                state.save(done, seconds + time.perf_counter() - t0)
    bar.close()
    best.restore()
    module.eval()
    return {"held_out_top1": best.metrics, "best_step": best.step,
            "train_seconds": round(seconds + time.perf_counter() - t0, 1), "state": state}


def lr_schedule(opt, lr: float, steps: int):
    """One cycle with a 5% warm-up; a constant rate for runs of under 40 steps, too short for a warm-up (torch's
    OneCycleLR divides by zero when its warm-up is exactly one step, e.g. 20 steps at 5%)."""
    if steps < 40:
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)


def head_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    valid = labels >= 0
    return float((logits.argmax(-1) == labels)[valid].float().mean()) if bool(valid.any()) else 0.0


def train_medusa(cfg, records, held_out, lm, index, hidden, seed, run: Run | None = None) -> tuple[MedusaHeads, dict]:
    torch.manual_seed(seed)
    k = int(cfg.num_heads)
    heads = MedusaHeads(hidden, k)
    x, y = medusa_examples(records, k, index)
    xv, yv = medusa_examples(held_out, k, index)
    batch = int(cfg.batch_tokens)
    weights = torch.tensor([float(cfg.head_decay) ** i for i in range(k)])

    def loss_step(g):
        pick = torch.randint(0, x.shape[0], (batch,), generator=g)
        feats = heads(x[pick].float())  # [k, B, h]
        loss = sum(weights[i] * F.cross_entropy(lm(feats[i]), y[pick, i], ignore_index=-100) for i in range(k))
        return loss, {"loss": f"{loss.item():.3f}"}

    @torch.no_grad()
    def evaluate():
        heads.eval()
        feats = heads(xv[:4096].float())
        heads.train()
        acc = [round(head_accuracy(lm(feats[i]), yv[:4096, i]), 4) for i in range(k)]
        return sum(w * a for w, a in zip(weights.tolist(), acc)) / float(weights.sum()), acc

    metrics = fit("medusa", heads, cfg, seed, run, loss_step, evaluate)
    return heads, {"train_examples": int(x.shape[0]), **metrics}


def eagle_batch(records, length, g, embed, index, noise):
    """Random crops of ``length`` inputs: features f_j, embeddings of x_{j+1}, targets f_{j+1} and labels
    (the model's choice after input j + 1), with a loss mask over the generated part."""
    feats, embs, target, labels, mask, pos = [], [], [], [], [], []
    for _ in range(len(records)):
        r = records[int(torch.randint(0, len(records), (1,), generator=g))]
        n = r["hidden"].shape[0]  # inputs 0 .. n-1 (token n is the last sampled one)
        usable = n - 1  # input j needs f_{j+1}
        if usable < 2:
            continue
        t = min(length, usable)
        lo = int(torch.randint(0, usable - t + 1, (1,), generator=g))
        j = torch.arange(lo, lo + t)
        f = r["hidden"][j].float()
        if noise:
            f = f + (torch.rand(f.shape, generator=g) * 2 - 1) * noise
        pad = length - t
        feats.append(F.pad(f, (0, 0, 0, pad)))
        embs.append(F.pad(embed(r["tokens"][j + 1].long()).float(), (0, 0, 0, pad)))
        target.append(F.pad(r["hidden"][j + 1].float(), (0, 0, 0, pad)))
        labels.append(F.pad(draft_labels(index, r["greedy"][j + 1]), (0, pad), value=-100))
        mask.append(F.pad((j >= r["prompt_len"] - 1).float(), (0, pad)))
        pos.append(F.pad(j, (0, pad)))
    return (torch.stack(feats), torch.stack(embs), torch.stack(target), torch.stack(labels), torch.stack(mask),
            torch.stack(pos))


def train_eagle(cfg, records, held_out, lm, index, embed, hidden, seed,
                run: Run | None = None) -> tuple[EagleDrafter, dict, dict]:
    torch.manual_seed(seed)
    heads = int(cfg.attention_heads) or default_attention_heads(hidden)
    layer_cfg = {"attention_heads": heads, "intermediate_size": int(cfg.intermediate_size), "window": int(cfg.window)}
    drafter = EagleDrafter(hidden, heads, int(cfg.intermediate_size), int(cfg.window))
    held = eagle_batch(held_out[:64], int(cfg.sequence_length), torch.Generator().manual_seed(seed + 1), embed, index, 0.0)

    def loss_step(g):
        sample = [records[int(torch.randint(0, len(records), (1,), generator=g))] for _ in range(int(cfg.batch_sequences))]
        f, e, tgt, lab, m, pos = eagle_batch(sample, int(cfg.sequence_length), g, embed, index, float(cfg.noise))
        out = drafter(f, e, pos)
        lab = torch.where(m > 0, lab, torch.full_like(lab, -100))
        ce = F.cross_entropy(lm(out).flatten(0, 1), lab.flatten(), ignore_index=-100)
        reg = (F.smooth_l1_loss(out, tgt, reduction="none").mean(-1) * m).sum() / m.sum().clamp(min=1)
        return ce + float(cfg.feature_weight) * reg, {"ce": f"{ce.item():.3f}", "feat": f"{reg.item():.3f}"}

    @torch.no_grad()
    def evaluate():
        f, e, _, lab, m, pos = held
        drafter.eval()
        logits = lm(drafter(f, e, pos))
        drafter.train()
        acc = round(head_accuracy(logits, torch.where(m > 0, lab, torch.full_like(lab, -100))), 4)
        return acc, [acc]

    metrics = fit("eagle", drafter, cfg, seed, run, loss_step, evaluate)
    return drafter, metrics, layer_cfg


def drafter_crops(records, length, g, embed, index, key):
    """Random crops of ``length`` inputs for unrolled drafting: the drafter's target features at input j
    (``r[key]``: "hidden" for EAGLE, "taps" for EAGLE-3), embeddings of x_{j+1}, labels (the model's choice after
    input j + 1, -100 past the end) and a mask of the inputs at or after the last prompt token (the anchors
    whose drafts count)."""
    feats, embs, labels, mask, pos = [], [], [], [], []
    for r in records:
        n = r[key].shape[0]
        usable = n - 1  # input j's label is the choice after input j + 1
        if usable < 2:
            continue
        t = min(length, usable)
        lo = int(torch.randint(0, usable - t + 1, (1,), generator=g))
        j = torch.arange(lo, lo + t)
        pad = length - t
        feats.append(F.pad(r[key][j].float(), (0, 0, 0, pad)))
        embs.append(F.pad(embed(r["tokens"][j + 1].long()).float(), (0, 0, 0, pad)))
        labels.append(F.pad(draft_labels(index, r["greedy"][j + 1]), (0, pad), value=-100))
        mask.append(F.pad(j >= r["prompt_len"] - 1, (0, pad)))
        pos.append(F.pad(j, (0, pad)))
    return torch.stack(feats), torch.stack(embs), torch.stack(labels), torch.stack(mask), torch.stack(pos)


def step_labels(labels: torch.Tensor, mask: torch.Tensor, step: int) -> torch.Tensor:
    """Labels of draft step ``step`` (1-based) in an unrolled crop: position p drafts from anchor p - step + 1,
    which must exist in the crop and lie in the generated text; -100 elsewhere."""
    anchor_ok = F.pad(mask[:, : mask.shape[1] - (step - 1)], (step - 1, 0), value=False)
    return torch.where(anchor_ok, labels, torch.full_like(labels, -100))


@torch.no_grad()
def unrolled_accuracy(drafter: EagleDrafter, crops, lm, steps: int) -> list[float]:
    """Held-out top-1 accuracy of draft steps 1..steps, each drafted from the drafter's own earlier outputs
    (what tree drafting does; the earlier tokens are the model's own, i.e. the accuracy given an accepted
    prefix)."""
    f, e, lab, m, pos = crops
    was_training = drafter.training
    drafter.eval()
    outs = unroll(drafter, drafter.input_features(f), e, pos, steps)
    drafter.train(was_training)
    return [round(head_accuracy(lm(drafter.head_features(o)), step_labels(lab, m, s + 1)), 4)
            for s, o in enumerate(outs)]


def train_eagle3(cfg, records, held_out, lm, index, embed, hidden, taps, seed,
                 run: Run | None = None) -> tuple[Eagle3Drafter, dict, dict]:
    """EAGLE-3: token loss only, on every step of a ``train_steps``-deep unrolled draft (training-time test)."""
    torch.manual_seed(seed)
    heads = int(cfg.attention_heads) or default_attention_heads(hidden)
    layer_cfg = {"attention_heads": heads, "intermediate_size": int(cfg.intermediate_size), "window": int(cfg.window),
                 "taps": list(taps)}
    drafter = Eagle3Drafter(hidden, heads, int(cfg.intermediate_size), int(cfg.window), len(taps))
    depth = int(cfg.train_steps)
    weights = [float(cfg.step_decay) ** s for s in range(depth)]
    held = drafter_crops(held_out[:64], int(cfg.sequence_length), torch.Generator().manual_seed(seed + 1), embed,
                         index, "taps")
    eval_steps = max(depth, 3)

    def loss_step(g):
        sample = [records[int(torch.randint(0, len(records), (1,), generator=g))] for _ in range(int(cfg.batch_sequences))]
        f, e, lab, m, pos = drafter_crops(sample, int(cfg.sequence_length), g, embed, index, "taps")
        outs = unroll(drafter, drafter.input_features(f), e, pos, depth)
        losses = [F.cross_entropy(lm(drafter.head_features(o)).flatten(0, 1), step_labels(lab, m, s + 1).flatten(),
                                  ignore_index=-100) for s, o in enumerate(outs)]
        loss = sum(w * x for w, x in zip(weights, losses)) / sum(weights)
        return loss, {"ce": " ".join(f"{x.item():.2f}" for x in losses)}

    def evaluate():
        acc = unrolled_accuracy(drafter, held, lm, eval_steps)
        # the checkpoint score: expected accepted drafts of a chain (acc1 + acc1 acc2 + ...), what MAL grows with
        score, chain = 0.0, 1.0
        for a in acc:
            chain *= a
            score += chain
        return score, acc

    metrics = fit("eagle3", drafter, cfg, seed, run, loss_step, evaluate)
    return drafter, metrics, layer_cfg


def data_folder(cfg: DictConfig, model_id: str, int8: bool = False) -> tuple[Path, dict]:
    """(shard folder, data settings): ``data.folder`` if set, else one folder per model (float or ``int8``) and data
    settings under the cache, so a rerun with the same settings resumes and reuses the text."""
    from mtpflow.tools.head_data import settings_key
    from mtpflow.machine import cache_dir

    settings = OmegaConf.to_container(cfg.data, resolve=True)
    settings.pop("folder", None)
    if cfg.data.folder:
        return Path(cfg.data.folder).expanduser(), settings
    key = settings_key(model_id, {**settings, "chat": bool(cfg.chat), **({"target": "int8"} if int8 else {})})
    return cache_dir() / "head_data" / f"{model_slug(cfg.model.name)}{'-int8' if int8 else ''}-{key}", settings


def check_settings(cfg: DictConfig) -> list[str]:
    """Every training setting checked before the model loads (one line naming the setting, not a traceback
    from deep in the optimiser half an hour later); returns the kinds to train."""
    from omegaconf import ListConfig

    if not isinstance(cfg.kinds, ListConfig):
        raise ConfigError(f"kinds must be a list such as [medusa, eagle] or [], got {cfg.kinds!r}")
    kinds = list(cfg.kinds)
    for kind in kinds:
        if kind not in ("medusa", "eagle", "eagle3"):
            raise ConfigError(f"kinds: unknown head kind {kind!r} (medusa, eagle, eagle3)")
    if "eagle3" in kinds and not cfg.data.get("taps"):
        raise ConfigError("kinds: eagle3 heads train on the target's tapped layers: set data.taps (e.g. eagle3)")
    whole = {"data.samples": 1, "data.batch_size": 1, "data.bucket": 1, "data.max_new_tokens": 2, "draft_vocab": 0,
             "threads": 0, "seed": 0, "data.seed": 0, "checkpoint_every": 1,
             "medusa.num_heads": 1, "medusa.steps": 1, "medusa.batch_tokens": 1, "medusa.eval_every": 1,
             "eagle.window": 1, "eagle.intermediate_size": 1, "eagle.attention_heads": 0, "eagle.steps": 1,
             "eagle.batch_sequences": 1, "eagle.sequence_length": 1, "eagle.eval_every": 1,
             "eagle3.window": 1, "eagle3.intermediate_size": 1, "eagle3.attention_heads": 0, "eagle3.steps": 1,
             "eagle3.batch_sequences": 1, "eagle3.sequence_length": 2, "eagle3.eval_every": 1,
             "eagle3.train_steps": 1}
    for name, low in whole.items():
        check_int(name, OmegaConf.select(cfg, name), low)
    for kind in ("medusa", "eagle", "eagle3"):
        check_range(f"{kind}.lr", cfg[kind].lr, 0, None, low_inclusive=False)
        check_range(f"{kind}.weight_decay", cfg[kind].weight_decay, 0, None)
    check_range("medusa.head_decay", cfg.medusa.head_decay, 0, 1, low_inclusive=False)
    check_range("eagle.feature_weight", cfg.eagle.feature_weight, 0, None)
    check_range("eagle.noise", cfg.eagle.noise, 0, None)
    check_range("eagle3.step_decay", cfg.eagle3.step_decay, 0, 1, low_inclusive=False)
    if cfg.time_limit_minutes is not None:
        check_range("time_limit_minutes", cfg.time_limit_minutes, 0, None, low_inclusive=False)
    if not isinstance(cfg.resume, bool):
        raise ConfigError(f"resume must be true or false, got {cfg.resume!r}")
    if not isinstance(cfg.data.temperatures, ListConfig):
        raise ConfigError(f"data.temperatures must be a list such as [0.0, 0.5], got {cfg.data.temperatures!r}")
    for t in cfg.data.temperatures:
        check_range("data.temperatures", t, 0, None)
    return kinds


def run(cfg: DictConfig, loaded=None) -> Path:
    """Generate (or reuse) the data, train each kind in ``cfg.kinds``, save to ``cfg.out`` and return it (with
    ``kinds=[]``: only the data, and return its folder); ``loaded`` hands in a model already in memory (tests).
    Raises ``Paused`` when ``time_limit_minutes`` passed first (its state saved: the same call continues)."""
    from mtpflow import backends
    from mtpflow.backends import ExecutionSpec
    from mtpflow.machine import cache_dir
    from mtpflow.model import load_configured
    from mtpflow.request import encode_prompt
    from mtpflow.tools.head_data import data_seconds, generate_data, generated_tokens, load_shards

    if cfg.get("export"):  # export=vllm: write the EAGLE heads (model.heads) as a vLLM draft checkpoint instead
        from mtpflow.tools.export_vllm import export_from_config

        return export_from_config(cfg)
    kinds = check_settings(cfg)
    if int(cfg.threads) > 0:
        torch.set_num_threads(int(cfg.threads))
    deadline = Deadline(cfg.time_limit_minutes)
    t0 = time.perf_counter()
    m = cfg.model
    spec = ExecutionSpec.from_config({"model": m})
    loaded = loaded or load_configured(m, spec)
    model = loaded.model
    for p in model.parameters():
        p.requires_grad_(False)
    slug = model_slug(m.name) + ("-int8" if loaded.int8 is not None else "")  # the int8 model writes its own text
    out = Path(cfg.out).expanduser() if cfg.out else cache_dir() / "heads" / slug
    folder, data_settings = data_folder(cfg, loaded.model_id, loaded.int8 is not None)
    for path in (folder, out) if kinds else (folder,):  # before the model writes half an hour of text
        writable_folder(path)
    print(f"training data: {folder}", file=sys.stderr)

    def encode(prompt):
        return encode_prompt(loaded.tokenizer, prompt, bool(cfg.chat))

    # the model's own text, through the forwards decoding runs (the int8 model's, for model.quantize=int8)
    backend = backends.create(model, spec, int8=loaded.int8)
    shards = generate_data(loaded, cfg.data, folder, encode, backend, deadline)
    records = load_shards(shards)
    generated = generated_tokens(records)
    t_data = data_seconds(folder)
    if not kinds:  # kinds=[]: only write (or complete) the training text
        print(f"training data ready ({t_data / 60:.1f} min of writing): {len(records)} sequences, {generated} tokens "
              f"-> {folder}", file=sys.stderr)
        return folder
    held_out, train = split_by_prompt(records, 0.1, int(cfg.seed))
    lm_weight = model.get_output_embeddings().weight.detach().float().cpu()
    vocab, hidden = int(lm_weight.shape[0]), int(model.config.hidden_size)
    draft_ids = pick_draft_vocab(train, int(cfg.draft_vocab), vocab)
    index = draft_index(draft_ids, vocab)
    draft_weight = lm_weight[draft_ids]

    def lm(features):
        return features @ draft_weight.T

    embed_weight = model.get_input_embeddings().weight.detach().float().cpu()

    def embed(ids):
        return embed_weight[ids]

    target = "int8" if loaded.int8 is not None else str(loaded.dtype).replace("torch.", "")
    base = {"model_id": loaded.model_id, "model_name": str(m.name), "target": target, "hidden_size": hidden,
            "vocab_size": vocab, "fingerprint": fingerprint(model, draft_ids), "draft_vocab_order": "frequency"}
    training = {"sequences": len(records), "held_out_sequences": len(held_out) if held_out is not train else 0,
                "generated_tokens": generated, "data_seconds": t_data, "data": data_settings}
    # a training state resumes only for the same model, text, split and draft vocabulary
    run_state = Run(out, {"model_id": loaded.model_id, "target": target, "data": str(folder), "shards": len(shards),
                          "seed": int(cfg.seed), "draft_ids": hashlib.sha1(draft_ids.numpy().tobytes()).hexdigest()},
                    bool(cfg.resume), int(cfg.checkpoint_every), deadline)
    summary = {"target": target, "data_seconds": t_data, "out": str(out)}
    for kind in kinds:
        finished = TrainState(out / kind, run_state.key(kind, cfg[kind]), None, None, None, None, None, 0)
        saved = finished.read(run_state.resume)
        if saved and saved.get("finished") and (out / kind / CONFIG_NAME).exists():
            print(f"{kind}: trained already ({finished.path}); resume=false trains it again", file=sys.stderr)
            summary[kind] = saved["metrics"]
            continue
        if kind == "medusa":
            module, metrics = train_medusa(cfg.medusa, train, held_out, lm, index, hidden, int(cfg.seed), run_state)
            config = {**base, "kind": "medusa", "num_heads": int(cfg.medusa.num_heads)}
        elif kind == "eagle":
            module, metrics, layer_cfg = train_eagle(cfg.eagle, train, held_out, lm, index, embed, hidden,
                                                     int(cfg.seed), run_state)
            if "taps" in records[0]:  # the same per-step measure as eagle3's, for comparison
                crops = drafter_crops(held_out[:64], int(cfg.eagle3.sequence_length),
                                      torch.Generator().manual_seed(int(cfg.seed) + 1), embed, index, "hidden")
                metrics["held_out_top1_per_step"] = unrolled_accuracy(module, crops, lm, 3)
            config = {**base, "kind": "eagle", "num_heads": 1, **layer_cfg}
        else:
            from mtpflow.types import hidden_taps

            if "taps" not in records[0]:
                raise UserError(f"the training text in {folder} has no tapped layers: set data.taps")
            taps = hidden_taps(model, OmegaConf.to_container(cfg.data.taps) if OmegaConf.is_config(cfg.data.taps)
                               else cfg.data.taps)
            module, metrics, layer_cfg = train_eagle3(cfg.eagle3, train, held_out, lm, index, embed, hidden, taps,
                                                      int(cfg.seed), run_state)
            config = {**base, "kind": "eagle3", "num_heads": 1, "taps_spec": OmegaConf.to_container(cfg.data.taps)
                      if OmegaConf.is_config(cfg.data.taps) else cfg.data.taps, **layer_cfg}
        state = metrics.pop("state")
        config["training"] = {**training, **metrics, "settings": OmegaConf.to_container(cfg[kind], resolve=True)}
        save_heads(out / kind, module, draft_ids, config)
        state.finish(metrics, metrics["train_seconds"])
        summary[kind] = metrics
        print(f"{kind}: held-out top-1 {metrics['held_out_top1']} -> {out / kind}", file=sys.stderr)
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print(f"done ({(time.perf_counter() - t0) / 60:.1f} min this run): {out}", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        run(compose(argv))
    except UserError as exc:
        print(f"mtpflow.train_heads: error: {exc}", file=sys.stderr)
        return 2
    except Paused as where:
        print(f"mtpflow.train_heads: time limit reached ({where}); saved: run the same command again to continue",
              file=sys.stderr)
        return PAUSED
    return 0


PAUSED = 3  # the exit status of a run stopped by time_limit_minutes (its work saved; the same command continues)


if __name__ == "__main__":
    sys.exit(main())
