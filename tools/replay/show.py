"""``bin/replay inspect``: recorded trajectories as text (terminal or plain) or as one HTML page.

Design: every trajectory becomes a ``View`` first (header fields, the decoded prompt, the response
cut into maximal runs of equal mask, the tool calls the parser finds in each model run), and three
small renderers draw views: ``rich`` colours on a terminal, explicit ``[model]...[/model]`` /
``[tool]...[/tool]`` markers otherwise (pipes, ``--no-color``: grep-able, and unambiguous where a
colour would be lost), and a self-contained HTML page (inline CSS, every text escaped). Decoding
uses the run's own tokenizer with special tokens kept, so ``<|im_end|>`` and the chat template's
headers are visible where the model or the template put them. A run is decoded on its own, so a
multi-byte character split across a mask boundary shows as a replacement character.
"""

from __future__ import annotations

import html
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO, cast

from rollout_service.agents.parsers import PARSERS
from rollout_service.agents.rendering import ChatRenderer
from tools.replay import locate

KINDS = ("prompt", "model", "tool")
LEGEND = {
    "prompt": "prompt (the context the response was generated from)",
    "model": "model-sampled tokens (mask 1: trained on)",
    "tool": "tool output and other context (mask 0: not trained on)",
}
RICH_STYLES = {"prompt": "dim", "model": "bold green", "tool": "blue"}
DEFAULT_TERMINAL_LIMIT = 20


@dataclass
class Piece:
    kind: str  # one of KINDS
    text: str


@dataclass
class View:
    trajectory_id: str
    header: list[tuple[str, str]]
    prompt: str
    response: list[Piece]
    tool_calls: list[str] = field(default_factory=list)


def mask_runs(mask: Any) -> list[tuple[int, int, int]]:
    """Maximal runs of equal mask values as (start, end, value)."""
    out: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, int(mask[start])))
            start = i
    return out


def make_view(t: Any, meta: Any, renderer: Any, parser: Any) -> View:
    resp, mask = t.response_ids.tolist(), t.response_mask.tolist()
    pieces, calls = [], []
    for start, end, value in mask_runs(mask):
        ids = resp[start:end]
        pieces.append(Piece("model" if value else "tool", renderer.decode(ids)))
        if value and parser is not None:
            parsed = parser.parse(renderer.turn_text(ids))
            calls += [
                f"{c.name}({json.dumps(c.arguments, ensure_ascii=False)})" for c in parsed.calls
            ]
            calls += [f"malformed call: {e}" for e in parsed.errors]
    sampled = t.versions[t.response_mask == 1]
    model_tokens = int(sum(mask))
    header = [
        ("group", t.group_uid),
        ("server", t.source_server or meta.server_id),
        ("agent", t.agent_type or "-"),
        ("data source", t.data_source or "-"),
        ("reward", f"{t.reward:g}"),
        (
            "reward extras",
            json.dumps(t.reward_extras, sort_keys=True, ensure_ascii=False)
            if t.reward_extras
            else "-",
        ),
        ("termination", t.termination),
        ("turns", str(t.num_turns)),
        ("segment", f"{t.snapshot_index} ({'snapshot' if t.is_snapshot else 'final'})"),
        (
            "policy versions",
            f"{int(sampled.min())}..{int(sampled.max())}"
            if len(sampled)
            else "- (no sampled tokens)",
        ),
        (
            "tokens",
            f"prompt {len(t.prompt_ids)}, response {len(resp)} (model {model_tokens}, "
            f"tool/context {len(resp) - model_tokens})",
        ),
        ("batch", f"{meta.path.name} (wire seq {meta.seq})"),
    ]
    return View(t.trajectory_id, header, renderer.decode(t.prompt_ids.tolist()), pieces, calls)


# -- renderers -----------------------------------------------------------------------------------------


def render_plain(views: list[View], out: TextIO) -> None:
    out.write("legend: " + "; ".join(f"[{k}]...[/{k}] {v}" for k, v in LEGEND.items()) + "\n")
    for v in views:
        out.write("=" * 100 + f"\ntrajectory {v.trajectory_id}\n")
        for key, value in v.header:
            out.write(f"  {key:<16}{value}\n")
        out.write(f"  {'tool calls':<16}{'; '.join(v.tool_calls) if v.tool_calls else '-'}\n")
        out.write(f"--- prompt\n[prompt]{v.prompt}[/prompt]\n--- response\n")
        out.write("".join(f"[{p.kind}]{p.text}[/{p.kind}]" for p in v.response) + "\n")


def render_rich(views: list[View], out: TextIO) -> None:
    from rich.console import Console
    from rich.rule import Rule
    from rich.text import Text

    console = Console(file=out, highlight=False, force_terminal=True)
    legend = Text("legend: ")
    for kind, what in LEGEND.items():
        legend.append(f" {kind} ", style=RICH_STYLES[kind] + " reverse")
        legend.append(f" {what}  ")
    console.print(legend)
    for v in views:
        console.print(Rule(Text(f"trajectory {v.trajectory_id}", style="bold")))
        for key, value in [
            *v.header,
            ("tool calls", "; ".join(v.tool_calls) if v.tool_calls else "-"),
        ]:
            console.print(Text.assemble((f"  {key:<16}", "bold"), value))
        console.print(Text("prompt", style="bold underline"))
        console.print(Text(v.prompt, style=RICH_STYLES["prompt"]))
        console.print(Text("response", style="bold underline"))
        text = Text()
        for p in v.response:
            text.append(p.text, style=RICH_STYLES[p.kind])
        console.print(text)


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
pre { white-space: pre-wrap; word-break: break-word; font-family: ui-monospace, monospace; font-size: 13px;
      border: 1px solid #ddd; padding: .6em; background: #fcfcfc; }
table.header td { padding: 1px 10px 1px 0; vertical-align: top; font-size: 14px; }
table.header td:first-child { font-weight: 600; white-space: nowrap; }
section { margin-bottom: 2.5em; border-top: 2px solid #888; padding-top: .5em; }
.prompt { color: #888; }
.model { color: #0a5c1f; background: #dcf5e3; }
.tool { color: #163f8c; background: #e3ebfb; }
.legend span { padding: 0 .4em; margin-right: .3em; }
"""


def render_html(views: list[View], title: str) -> str:
    e = html.escape
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{e(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{e(title)}</h1>",
        '<p class="legend">'
        + " ".join(f'<span class="{k}">{e(k)}</span>{e(v)}' for k, v in LEGEND.items())
        + "</p>",
        "<ol>",
    ]
    parts += [f'<li><a href="#t{i}">{e(v.trajectory_id)}</a></li>' for i, v in enumerate(views)]
    parts.append("</ol>")
    for i, v in enumerate(views):
        rows = "".join(
            f"<tr><td>{e(k)}</td><td>{e(val)}</td></tr>"
            for k, val in [
                *v.header,
                ("tool calls", "; ".join(v.tool_calls) if v.tool_calls else "-"),
            ]
        )
        response = "".join(f'<span class="{p.kind}">{e(p.text)}</span>' for p in v.response)
        parts += [
            f'<section id="t{i}"><h2>trajectory {e(v.trajectory_id)}</h2>',
            f'<table class="header">{rows}</table>',
            "<h3>prompt</h3>",
            f'<pre class="prompt">{e(v.prompt)}</pre>',
            "<h3>response</h3>",
            f"<pre>{response}</pre>",
            "</section>",
        ]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


# -- the command -------------------------------------------------------------------------------------------


def _matches(t: Any, trajectory: str | None, group: str | None) -> bool:
    # An episode id (or any id prefix ending before a dash) selects all its segments.
    if trajectory is not None and not (
        t.trajectory_id == trajectory or t.trajectory_id.startswith(trajectory + "-")
    ):
        return False
    return group is None or t.group_uid == group


def run(
    path: str,
    *,
    trajectory: str | None = None,
    group: str | None = None,
    limit: int | None = None,
    html_out: str | None = None,
    model: str | None = None,
    config: str | None = None,
    color: bool | None = None,
    out: TextIO | None = None,
    verify: bool = True,
) -> int:
    """Show (or write as HTML) the matching trajectories; exit status (1: nothing matched)."""
    from transformers import AutoTokenizer

    out = out or cast(TextIO, sys.stdout)  # typeshed: stdout may be None (pythonw)
    if limit is None and html_out is None:
        limit = DEFAULT_TERMINAL_LIMIT
    recordings = locate.find(path, verify=verify)
    renderers: dict[Path, Any] = {}
    parser = PARSERS.get("hermes")()
    views: list[View] = []
    matched = 0
    for rec in recordings:
        mdir = locate.model_dir(rec, model=model, config=config).resolve()
        if mdir not in renderers:
            renderers[mdir] = ChatRenderer(AutoTokenizer.from_pretrained(str(mdir)))
        for meta, trajectories in rec.batches():
            for t in trajectories:
                if not _matches(t, trajectory, group):
                    continue
                matched += 1
                if limit is None or len(views) < limit:
                    views.append(make_view(t, meta, renderers[mdir], parser))
    if not matched:
        what = " and ".join(
            x
            for x in (trajectory and f"trajectory {trajectory!r}", group and f"group {group!r}")
            if x
        )
        print(
            f"replay inspect: no trajectory{' matches ' + what if what else ''} in {path}",
            file=sys.stderr,
        )
        return 1
    if html_out is not None:
        Path(html_out).write_text(render_html(views, f"replay: {path}"), encoding="utf-8")
        print(f"wrote {len(views)} trajectories to {html_out}", file=out)
    elif color if color is not None else out.isatty():
        render_rich(views, out)
    else:
        render_plain(views, out)
    if matched > len(views):
        print(
            f"({matched - len(views)} more matching trajectories not shown: --limit N, --trajectory ID, "
            "--group UID)",
            file=out,
        )
    return 0
