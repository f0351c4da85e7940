"""Turn ``SideView``s into what the page shows: colored token HTML with a tooltip per token, rejected drafts
inline, the stats table, the speedup line, the per-step table and the plots.

Pure functions of their inputs, so the live comparison and the history tab share them and tests can call them
without a browser.
"""
from __future__ import annotations

import html

from mtpflow.types import ACCEPTED, BONUS, PLAIN, RECOVERED

from mtpflow.playground.views import SideView, TokenView, acceptance_by_position

KIND_LABELS = {
    ACCEPTED: "accepted draft",
    RECOVERED: "recovered",
    BONUS: "bonus",
    PLAIN: "plain autoregressive",
}

CSS = """
.mtp-pane { white-space: pre-wrap; font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 14px;
            line-height: 1.7; min-height: 8em; max-height: 28em; overflow-y: auto; padding: 8px;
            border: 1px solid var(--border-color-primary); border-radius: 6px; }
.mtp-pane .tok { border-radius: 3px; padding: 1px 0; cursor: help; }
.mtp-pane .tok-accepted, .mtp-legend .tok-accepted { background: #bbf7d0; color: #14532d; }
.mtp-pane .tok-recovered, .mtp-legend .tok-recovered { background: #fed7aa; color: #7c2d12; }
.mtp-pane .tok-bonus, .mtp-legend .tok-bonus { background: #bfdbfe; color: #1e3a8a; }
.mtp-pane .tok-plain, .mtp-legend .tok-plain { background: #e5e7eb; color: #111827; }
.mtp-pane .rej, .mtp-legend .rej { color: #b91c1c; text-decoration: line-through; font-size: 11px;
            vertical-align: super; opacity: 0.8; }
.mtp-pane .mtp-error, .mtp-status-error { color: #b91c1c; font-weight: 600; }
.mtp-legend span { padding: 1px 6px; margin-right: 6px; border-radius: 3px; font-size: 13px; }
.mtp-pane .mtp-waiting { color: #6b7280; font-style: italic; }
"""


def _fmt(value, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def token_tooltip(t: TokenView) -> str:
    where = "prefill" if t.step < 0 else f"step {t.step}"
    depth = f", draft depth {t.depth}" if t.depth is not None else ""
    lines = [f"{KIND_LABELS.get(t.kind, t.kind)} ({where}{depth}), token id {t.token_id}",
             f"draft p = {_fmt(t.draft_prob)}   target p = {_fmt(t.target_prob)}",
             f"PFS = {_fmt(t.pfs)}   gate score = {_fmt(t.gate_score)}"]
    if t.origin:
        lines.append(f"drafted by {t.origin}")
    return "\n".join(lines)


def legend_html() -> str:
    items = "".join(f'<span class="tok-{kind}">{label}</span>' for kind, label in KIND_LABELS.items())
    return (f'<div class="mtp-legend">{items}<span class="rej">rejected draft</span> '
            "(hover a token for its scores)</div>")


def pane_html(side: SideView | None, show_rejected: bool = True, elem: str = "") -> str:
    """The colored token stream of one side (``elem`` tags the div for tests)."""
    attr = f' data-side="{elem}"' if elem else ""
    if side is None:
        return f'<div class="mtp-pane"{attr}><span class="mtp-waiting">waiting…</span></div>'
    rejected_by_step = {s.step: s.rejected for s in side.steps} if show_rejected else {}
    parts = []
    for t in side.tokens:
        if t.kind != ACCEPTED and t.step in rejected_by_step:
            # the refused drafts sit where they were offered: after the accepted prefix, before the
            # target's own (recovered or bonus) token
            parts.append(_rejected_html(rejected_by_step[t.step]))
        parts.append(f'<span class="tok tok-{t.kind}" title="{html.escape(token_tooltip(t))}">'
                     f"{html.escape(t.text) if t.text else '&#8203;'}</span>")
    if not side.tokens and not side.error:
        parts.append('<span class="mtp-waiting">waiting for the first token…</span>')
    if side.error:
        parts.append(f'<div class="mtp-error">{html.escape(side.strategy)} failed: {html.escape(side.error)}</div>')
    return f'<div class="mtp-pane"{attr}>{"".join(parts)}</div>'


def _rejected_html(rejected) -> str:
    """The refused draft tokens of one step, shortest depth first, as struck-through superscript."""
    if not rejected:
        return ""
    shown = sorted(rejected, key=lambda r: r.depth)[:8]
    text = "".join(r.text for r in shown) + ("…" if len(rejected) > len(shown) else "")
    title = "\n".join(f"rejected at depth {r.depth}: {r.text!r} ({r.status}) draft p = {_fmt(r.draft_prob)}, "
                      f"target p = {_fmt(r.target_prob)}, PFS = {_fmt(r.pfs)}, gate = {_fmt(r.gate_score)}"
                      for r in shown)
    return f'<span class="rej" title="{html.escape(title)}">{html.escape(text)}</span>'


STAT_ROWS = (
    ("tokens", "new_tokens"),
    ("tokens/s", "tokens_per_second"),
    ("MAL (tokens / verify forward)", "mal"),
    ("hit rate", "mtp_hit_rate"),
    ("acceptance rate", "acceptance_rate"),
    ("avg K", "mtp_avg_k_used"),
    ("forward passes", "forward_passes"),
    ("error propagation rate", "mtp_error_propagation_rate"),
    ("time to first token (s, in the decode)", "time_to_first_token"),
    ("total time (s)", "total_seconds"),
    ("stop reason", "stop_reason"),
)
_HIDDEN_STATS = {key for _, key in STAT_ROWS} | {
    "verify_forwards", "prefill_seconds", "draft_tokens", "proposed_tokens", "accepted_tokens",
    "forward_passes_per_token", "compression_rate", "strategy", "trace_run_id",
}


def stats_markdown(side: SideView | None) -> str:
    if side is None:
        return ""
    title = f"**{side.strategy}**" + (f" · run {side.run_id}" if side.run_id is not None else "")
    if side.error and not side.stats:
        return f"{title}\n\n<span class='mtp-status-error'>failed: {html.escape(side.error)}</span>"
    if not side.done:
        return f"{title}\n\nrunning… {len(side.tokens)} tokens so far"
    rows = [(label, side.stats.get(key)) for label, key in STAT_ROWS if key in side.stats]
    # strategy-specific facts (e.g. domain and K of domain-aware K selection) arrive as extra scalar stats
    rows += [(key, value) for key, value in side.stats.items()
             if key not in _HIDDEN_STATS and isinstance(value, (int, float, str, bool))]
    if side.first_token_seconds is not None:
        rows.append(("first token after (s, from request)", round(side.first_token_seconds, 3)))
    table = "\n".join(f"| {label} | {value} |" for label, value in rows)
    return f"{title}\n\n| stat | value |\n|---|---|\n{table}"


def speedup_markdown(a: SideView | None, b: SideView | None) -> str:
    if not (a and b and a.done and b.done and a.stats and b.stats):
        return ""
    ta, tb = a.stats.get("tokens_per_second") or 0.0, b.stats.get("tokens_per_second") or 0.0
    if not tb:
        return ""
    same = "same text" if a.text == b.text else "different text"
    return (f"**Speedup of A ({a.strategy}) over B ({b.strategy}): {ta / tb:.2f}×** "
            f"({ta:.1f} vs {tb:.1f} tokens/s; {same}). Both sides share one model and run one after the other, "
            f"so each side's timing is its own.")


STEP_HEADERS = ["step", "K", "drafted", "kept", "accepted", "emitted", "emitted text", "rejected drafts"]


def steps_table(side: SideView | None) -> list[list]:
    """One row per verify step: K, draft sizes, accepted length, the emitted text and the refused drafts."""
    if side is None:
        return []
    text_by_step: dict[int, str] = {}
    for t in side.tokens:
        text_by_step[t.step] = text_by_step.get(t.step, "") + t.text
    rows = []
    for s in side.steps:
        rejected = " | ".join(f"d{r.depth}:{r.text!r}" for r in sorted(s.rejected, key=lambda r: r.depth)[:8])
        rows.append([s.step, s.k, s.proposed, s.kept, s.accepted, s.emitted, text_by_step.get(s.step, ""), rejected])
    return rows


def comparison_figure(a: SideView | None, b: SideView | None):
    """Accepted length per step, K per step and acceptance rate by draft position, A and B overlaid."""
    from matplotlib.figure import Figure

    # a bare Figure, not pyplot: pyplot's global state is not safe across the server's worker threads
    fig = Figure(figsize=(13, 3.2))
    axes = fig.subplots(1, 3)
    for side, color, name in ((a, "tab:green", "A"), (b, "tab:blue", "B")):
        if side is None or not side.steps:
            continue
        label = f"{name}: {side.strategy}"
        steps = [s.step for s in side.steps]
        axes[0].plot(steps, [s.accepted for s in side.steps], color=color, label=label, drawstyle="steps-mid")
        axes[1].plot(steps, [s.k for s in side.steps], color=color, label=label, drawstyle="steps-mid")
        rows = acceptance_by_position(side.steps)
        if rows:
            axes[2].plot([r[0] for r in rows], [r[2] / r[1] if r[1] else 0.0 for r in rows], "o-", color=color,
                         label=label)
    for ax, title, xlabel in ((axes[0], "accepted draft tokens per step", "step"),
                              (axes[1], "K per step", "step"),
                              (axes[2], "acceptance rate by draft position", "draft position")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    axes[2].set_ylim(-0.05, 1.05)
    fig.tight_layout()
    return fig


def status_html(message: str, error: bool = False) -> str:
    cls = "mtp-status-error" if error else "mtp-status"
    return f'<div class="{cls}" data-error="{str(error).lower()}">{html.escape(message)}</div>'
