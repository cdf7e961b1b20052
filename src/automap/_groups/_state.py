"""Which step output is the new value of which state input (a parameter or optimizer
state leaf): the loop can only go on where a plan gives both the same layout, and a step
that donates nothing holds both (`_cost/_outputs.py`)."""

from __future__ import annotations

import re
import types
from collections.abc import Mapping

from .._graph import Graph, InputLeaf, Role

_POSITION = re.compile(r"^\[\d+\]")


def state_inputs(graph: Graph) -> Mapping[str, InputLeaf]:
    """Per output path, the parameter or optimizer-state input it is the new value of: the
    same path but for the position in the step's arguments and results (`[0]['params']`
    in, `[1]['params']` out), where that names one input. Made once per graph."""
    if "state_inputs" not in graph.memo:
        graph.memo["state_inputs"] = types.MappingProxyType(_find_state_inputs(graph))
    return graph.memo["state_inputs"]


def _find_state_inputs(graph: Graph) -> dict[str, InputLeaf]:
    state = [leaf for leaf in graph.inputs if leaf.role in (Role.PARAM, Role.OPT_STATE)]
    by_path = {leaf.path: leaf for leaf in state}
    by_tail: dict[str, list[InputLeaf]] = {}
    for leaf in state:
        by_tail.setdefault(_tail(leaf.path), []).append(leaf)
    twins = _twin_positions(graph, state)
    out = {}
    for leaf in graph.outputs:
        match = [by_path[leaf.path]] if leaf.path in by_path else by_tail.get(_tail(leaf.path), [])
        twin = twins.get(_position(leaf.path))
        if len(match) > 1 and twin is not None:
            match = [m for m in match if _position(m.path) == twin]
        if len(match) == 1:
            out[leaf.path] = match[0]
    return out


def _twin_positions(graph: Graph, state: list[InputLeaf]) -> dict[str, str]:
    """Per result position, the one argument position holding state of the same structure
    (every leaf's path past the position, shape and dtype alike): Keras's stateless step
    takes two lists (`[0][i]` variables, `[2][j]` optimizer variables) and returns them at
    `[1]` and `[3]`, where a path past the position names a leaf of either list. Positions
    of no twin, or of several, are left to the leaf-by-leaf match."""

    def signatures(leaves) -> dict[str, frozenset]:
        by: dict[str, set] = {}
        for leaf in leaves:
            x = graph.tensors[leaf.tensor]
            by.setdefault(_position(leaf.path), set()).add((_tail(leaf.path), x.shape, x.dtype))
        return {k: frozenset(v) for k, v in by.items()}

    ins = signatures(state)
    twins = {}
    for position, sig in signatures(graph.outputs).items():
        found = [p for p, s in ins.items() if s == sig]
        if len(found) == 1:
            twins[position] = found[0]
    return twins


def _position(path: str) -> str:
    """A leaf path's leading position (`[1]['params']` -> `[1]`)."""
    match = _POSITION.match(path)
    return match.group(0) if match else ""


def _tail(path: str) -> str:
    """A leaf path without its leading position (`[1]['params']` -> `['params']`)."""
    return _POSITION.sub("", path, count=1)
