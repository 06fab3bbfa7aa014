"""What an analysis computes once per syntax tree or node: libcst never changes a tree in place (an
edit makes new nodes), so a node's identity keys its facts while the table keeps the node alive (its
id cannot be reused meanwhile)."""
from __future__ import annotations

from typing import Callable, Dict, Tuple, TypeVar

T = TypeVar("T")


def per_node(table: Dict[int, Tuple[object, T]], node: object, compute: Callable[[], T], limit: int = 4096) -> T:
    """compute(), once for `node` in `table` (emptied when it grows past `limit` entries)."""
    known = table.get(id(node))
    if known is None or known[0] is not node:
        if len(table) > limit:
            table.clear()
        known = table[id(node)] = (node, compute())
    return known[1]
