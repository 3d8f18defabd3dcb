"""Kernel launches in the CUDA graphs MLX writes when ``MLX_SAVE_CUDA_GRAPHS_DOT_FILE`` is set.

MLX's CUDA backend calls ``cudaGraphDebugDotPrint(graph, "<prefix>_<n>.dot", 0)`` after each
graph it launches (``mlx/backend/cuda/device.cpp``). With flags 0 every node's label is its
index and then its payload on the next line: a kernel's symbol, or, for a node drawn as a
rectangle, the name of a child graph (cuBLAS and cuDNN calls are captured into child graphs,
each drawn as its own ``subgraph cluster``). The verbose form (other flags) starts a node's
label with its type (``{KERNEL | {ID | 0 (topoId: 3) | symbol<<<...>>>} ...``). Both are read:
a launch is a leaf node that does work (a kernel, a copy, a fill: not an empty or event node),
reached from a graph no other graph includes, counted once for every path to it (a child
graph included twice runs twice).

Plain Python: no MLX, so it reads dumps copied off the GPU machine too.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

_NODE = re.compile(r'"(graph_\d+)_node_(\d+)"\s*\[([^\]]*?label="((?:[^"\\]|\\.)*)"[^\]]*)\]')
_SHAPE = re.compile(r'shape="([^"]*)"')
_TYPES = ("KERNEL", "MEMSET", "MEMCPY", "HOST", "GRAPH", "EMPTY", "WAIT_EVENT", "EVENT_RECORD",
          "MEM_ALLOC", "MEM_FREE", "BATCH_MEM_OP", "CONDITIONAL")
#: node types that do work on the device (the rest order or nest it)
WORK = ("KERNEL", "MEMSET", "MEMCPY")


@dataclass
class Node:
    kind: str  # one of _TYPES, or KERNEL for a flags-0 leaf
    payload: str  # a kernel's symbol, a child graph's name, or ""


@dataclass
class Dump:
    graphs: dict[str, list[Node]] = field(default_factory=dict)

    def roots(self) -> list[str]:
        included = {n.payload for nodes in self.graphs.values() for n in nodes
                    if n.kind == "GRAPH"}
        return sorted(name for name in self.graphs if name not in included)

    def launches(self) -> Counter[str]:
        """Each work node's name, counted once per path from a root graph."""
        counts: Counter[str] = Counter()
        for root in self.roots():
            self._walk(root, counts, set())
        return counts

    def _walk(self, name: str, counts: Counter[str], open_graphs: set[str]) -> None:
        if name in open_graphs:  # a malformed dump: stop rather than recurse forever
            return
        open_graphs.add(name)
        for node in self.graphs.get(name, ()):
            if node.kind == "GRAPH":
                self._walk(node.payload, counts, open_graphs)
            elif node.kind in WORK:
                counts[node.payload if node.kind == "KERNEL" else node.kind] += 1
        open_graphs.discard(name)


def _lines(label: str) -> list[str]:
    return [part.strip() for part in re.split(r"\\n|\n", label) if part.strip()]


def _symbol(text: str) -> str:
    """A kernel's name without its launch shape (``\\<\\<\\<1,256,0\\>\\>\\>``)."""
    return re.split(r"\\?<\\?<\\?<", text, maxsplit=1)[0].strip()[:120]


def parse(text: str) -> Dump:
    dump = Dump()
    for graph, _index, attributes, label in _NODE.findall(text):
        shape_found = _SHAPE.search(attributes)
        shape = shape_found.group(1) if shape_found else ""
        body = label.strip().lstrip("{").strip()
        kind = next((t for t in _TYPES if body.startswith(t)), None)
        if kind is not None:  # the verbose form
            payload = ""
            if kind == "KERNEL":
                found = re.search(r"\|\s*\{\s*ID\s*\|[^|]*\|\s*([^}]*)\}", body)
                payload = _symbol(found.group(1)) if found else "?"
            elif kind == "GRAPH":
                found = re.search(r"\b(graph_\d+)\b", body[len("GRAPH"):])
                payload = found.group(1) if found else ""
            node = Node(kind, payload)
        else:  # flags 0: index, then the payload (a node that is no kernel: its type)
            lines = _lines(label)
            payload = lines[1] if len(lines) > 1 else (lines[0] if lines else "?")
            if shape == "rectangle" and re.fullmatch(r"graph_\d+", payload):
                node = Node("GRAPH", payload)
            elif payload.upper() in _TYPES:
                node = Node(payload.upper(), "")
            else:
                node = Node("KERNEL", _symbol(payload))
        dump.graphs.setdefault(graph, []).append(node)
    return dump


def kernels(launches: Counter[str]) -> int:
    """The kernels among :meth:`Dump.launches` (not the copies and fills)."""
    return sum(n for name, n in launches.items() if name not in WORK)


def count_launches(paths: Iterable[Path]) -> Counter[str]:
    """The work nodes of every dump in ``paths`` (one file per graph MLX launched)."""
    total: Counter[str] = Counter()
    for path in paths:
        total.update(parse(path.read_text(errors="replace")).launches())
    return total
