"""Pictures of the state machine, drawn by ``transitions``' GraphMachine from the one table.

Owns: turning ``machine.TRANSITIONS`` (with ``machine.GUARD_LABELS``) into mermaid or DOT source
and, through Graphviz's ``dot``, SVG or PNG; and drawing a run's path (from ``history.py``) on the
same picture: visited states and edges highlighted, each edge's count, the last state marked.

Must not: keep its own copy of states, edges or labels (a picture that can disagree with the code
teaches the wrong lesson); trigger the drawing machine (it has no model behind its callbacks);
choose exit codes (it raises ``UsageError``, ``cli.py`` maps it).

The graph engine is always passed explicitly, and the ``graphviz`` package is imported here
first: ``GraphMachine`` quietly falls back to mermaid when it cannot import its engine, and a
``--format dot`` that prints mermaid would be a silent lie.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from ..errors import UsageError, importing
from ..engine.machine import FINAL, GUARD_LABELS, INITIAL, STATES
from .history import RunPath, guards, table_edges

TITLE = "trainjob"
ENGINE = {"mermaid": "mermaid", "dot": "graphviz", "svg": "graphviz", "png": "graphviz"}
SUFFIX_FORMAT = {".mmd": "mermaid", ".dot": "dot", ".gv": "dot", ".svg": "svg", ".png": "png"}
BINARY = {"png"}
# How a label wraps the guards under the trigger: DOT's escape; a stateDiagram label is one line.
LABEL_NEWLINE = {"graphviz": r"\n", "mermaid": " "}

# How each kind of node and edge looks, per engine. A state's look combines its tags: "final"
# for a terminal state and, on a run's picture, one of "visited", "last" or "unvisited".
LOOK: dict[str, dict[str, dict[str, str]]] = {
    "graphviz": {
        "graph": {"labelloc": "t", "fontsize": "18", "fontname": "Helvetica", "nodesep": "0.4"},
        "node": {"shape": "rectangle", "style": "rounded,filled", "fillcolor": "white", "color": "black",
                 "fontname": "Helvetica"},
        "edge": {"color": "black", "fontname": "Helvetica", "fontsize": "11"},
        "run_edge": {"color": "gray60", "fontcolor": "gray50"},
        "taken_edge": {"color": "blue", "fontcolor": "blue", "penwidth": "2"},
        "final": {"peripheries": "2"},
        "unvisited": {"color": "gray60", "fontcolor": "gray50"},
        "visited": {"color": "blue", "fillcolor": "azure", "penwidth": "2"},
        "last": {"color": "red", "fillcolor": "mistyrose", "penwidth": "3"},
    },
    "mermaid": {  # classDef properties; stateDiagram edges cannot be styled, their labels carry counts
        "node": {"fill": "white", "stroke": "black"},
        "final": {"stroke-width": "3px"},
        "unvisited": {"color": "gray", "stroke": "gray"},
        "visited": {"fill": "azure", "stroke": "blue"},
        "last": {"fill": "mistyrose", "stroke": "red"},
    },
}


def format_for(requested: str | None, output: Path | None) -> str:
    """The format asked for, else the one the output file's suffix names, else mermaid."""
    if requested:
        return requested
    return SUFFIX_FORMAT.get(output.suffix.lower() if output else "", "mermaid")


def guard_label(row: dict[str, Any], newline: str = " ") -> str:
    """``trigger [decision & decision]``: the trigger and the decisions its guards stand for."""
    must, must_not = guards(row)
    decisions = [GUARD_LABELS.get(g, (g, f"!{g}"))[0] for g in must]
    decisions += [GUARD_LABELS.get(g, (g, f"!{g}"))[1] for g in must_not]
    return f"{row['trigger']}{newline}[{f'{newline}& '.join(decisions)}]" if decisions else row["trigger"]


def _labelled_transitions(engine: str, run: RunPath | None) -> list[dict[str, Any]]:
    """The table, one transition per source state, labelled; on a run, with each edge's count."""
    taken = run.taken() if run else {}
    newline = LABEL_NEWLINE[engine]
    rows = [dict(trigger=row["trigger"], source=source, dest=row["dest"], label=guard_label(row, newline))
            for source, row in table_edges()]
    # Rows sharing an edge are drawn as one; the count goes once, on the edge's last row.
    last_of_edge = {(t["source"], t["dest"]): t for t in rows}
    for (source, dest), row in last_of_edge.items():
        if taken.get((source, dest)):
            row["label"] += f"{newline}×{taken[source, dest]}"
    return rows


def _tags(state: str, run: RunPath | None) -> list[str]:
    tags = ["final"] if state in FINAL else []
    if run is not None:
        if state == run.last_state:
            tags.append("last")
        else:
            tags.append("visited" if state in run.visited() else "unvisited")
    return tags


def _styles(engine: str, run: RunPath | None) -> dict[str, dict[str, dict[str, str]]]:
    """GraphMachine's style table for this picture: one node style per combination of tags."""
    look = LOOK[engine]
    nodes = {"default": look["node"]}
    for state in STATES:
        tags = _tags(state, run)
        if tags:
            nodes["_".join(tags)] = {k: v for tag in tags for k, v in look[tag].items()}
    edges = {"default": {**look.get("edge", {}), **(look.get("run_edge", {}) if run else {})},
             "previous": look.get("taken_edge", {})}
    return {"node": nodes, "edge": edges, "graph": {"default": look.get("graph", {})}}


def _require_engine(fmt: str) -> None:
    if ENGINE[fmt] != "graphviz":
        return
    try:
        with importing("graphviz"):
            import graphviz  # noqa: F401  (imported only to fail here, not fall back to mermaid)
    except ImportError:
        raise UsageError(
            f"--format {fmt} needs the graphviz Python package: pip install 'trainjob[diagrams]'"
        ) from None
    if fmt != "dot" and shutil.which("dot") is None:
        raise UsageError(
            f"--format {fmt} needs Graphviz's dot program, which is not on PATH: "
            "install it (apt-get install graphviz) or use --format dot or mermaid"
        )


def _graph(engine: str, run: RunPath | None, title: str) -> Any:
    # Imported here: the diagram extension pulls in asyncio and more, which no other command needs.
    with importing("transitions' diagrams"):
        from transitions.extensions import GraphMachine

    machine = GraphMachine(
        states=[dict(name=s, final=s in FINAL) for s in STATES],
        transitions=_labelled_transitions(engine, run),
        initial=INITIAL,
        auto_transitions=False,
        graph_engine=engine,
        title=title,
    )
    machine.machine_attributes = {"directed": "true", "strict": "false", "rankdir": "TB"}
    machine.style_attributes = _styles(engine, run)
    graph = machine.model_graphs[id(machine)]
    graph.reset_styling()  # GraphMachine marks the model's current state (pending) as active
    for source, dest in (run.taken() if run else {}):
        graph.set_previous_transition(source, dest)  # the edge style "previous": taken
    for state in STATES:
        if tags := _tags(state, run):
            graph.set_node_style(state, "_".join(tags))
    # The mermaid engine writes the title as a bare front-matter line; mermaid reads the YAML
    # `title:` key, and a JSON string is a YAML string that may hold a colon.
    return graph.get_graph(title=f"title: {json.dumps(title)}" if engine == "mermaid" else title)


def _mermaid(run: RunPath | None, title: str) -> str:
    lines = [line.rstrip() for line in _graph("mermaid", run, title).source.splitlines()]
    # This engine marks nothing terminal: draw each final state's edge to mermaid's end [*].
    lines += [f"  {state} --> [*]" for state in FINAL]
    return "\n".join(lines) + "\n"


def run_title(run: RunPath) -> str:
    return f"trainjob: the path in {run.log.name}, last state {run.last_state}"


def render(fmt: str, run: RunPath | None = None, title: str = TITLE) -> bytes:
    """The machine (with ``run``'s path highlighted, if given) in ``fmt``."""
    _require_engine(fmt)
    if fmt == "mermaid":
        return _mermaid(run, title).encode()
    graph = _graph("graphviz", run, title)
    dot = graph.source
    if fmt == "dot":
        return dot.encode()
    drawn = graph.draw(None, format=fmt, prog="dot")
    return _stamp_svg(drawn, dot) if fmt == "svg" else drawn


def _stamp_svg(svg: bytes, dot: str) -> bytes:
    """Record in the SVG which DOT source it was drawn from, so a stale picture can be caught
    without comparing bytes that vary with the Graphviz version."""
    stamp = f"<!-- trainjob: drawn from DOT sha256={hashlib.sha256(dot.encode()).hexdigest()} -->\n".encode()
    at = svg.find(b"<svg")
    return svg[:at] + stamp + svg[at:]
