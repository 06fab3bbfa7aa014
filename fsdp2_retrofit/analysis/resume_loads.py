"""Where the file a checkpoint load reads comes from, and where the load stands
(codemods/resume.py rewrites the loads from these): what this script's saves write at
each path and in which format, nanoGPT's config-first resume order, and the load's place
against the training loops and the bindings of its function.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

import libcst as cst

from fsdp2_retrofit.syntax.names import assigned_names, code

from .checkpoints import LoadSite, SaveSite, calls_to, path_key, read_names, save_format, saves, target_names
from .facts import ScriptFacts

COPIES = {"shutil.copy", "shutil.copyfile", "shutil.copy2"}  # file copies: a DCP save to copy is a directory


@dataclass
class CheckpointSaves:
    """What this script's saves write, by path (checkpoints.path_key), in the format the
    checkpoint stage gives them (`--export`)."""

    dcp_paths: Dict[str, List[SaveSite]] = field(default_factory=dict)
    full_paths: Set[str] = field(default_factory=set)
    dcp_keys: Set[str] = field(default_factory=set)
    dcp_whole_kinds: Set[str] = field(default_factory=set)  # what a DCP save of a bare state dict writes
    async_saves: List[cst.CSTNode] = field(default_factory=list)  # the DCP saves' statements
    saved_values: Dict[str, cst.BaseExpression] = field(default_factory=dict)  # dict key -> the value a DCP save writes
    # path of a torch.save(model, path) -> (model, "dcp" | "full")
    whole_saves: Dict[str, tuple] = field(default_factory=dict)
    # paths rank 0 copies a checkpoint directory to: every rank reads them only after a barrier
    copy_dests: Set[str] = field(default_factory=set)

    def origin(self, site: LoadSite) -> str:
        """Where the file a load reads comes from, decided statically: "dcp" (a path this
        script saves with DCP), "full" (a single torch.save file: an --export full save
        of this script, or a file no DCP save of this script can have written: pretrained
        weights), "either" (a path the script does not save to, read in a shape one of
        its DCP saves writes: a --resume / --init-from flag may name this script's
        checkpoint directory or a single-GPU run's file)."""
        if site.path_key in self.full_paths:
            return "full"
        if site.path_key in self.dcp_paths or site.path_key in self.copy_dests:
            return "dcp"  # a path this script saves with DCP, or copies such a save to
        if not self.dcp_paths:
            return "full"
        keys = {u.key for u in site.uses if u.key is not None}
        if keys & self.dcp_keys:
            return "either"
        whole = [u for u in site.uses if u.key is None and u.kind in ("model", "optimizer")]
        if whole and {u.kind for u in whole} <= self.dcp_whole_kinds:
            return "either"
        return "full"

    def saved_before(self, site: LoadSite, facts: ScriptFacts) -> bool:
        """A DCP save of the load's path comes before it in the same function (a reload
        of what this run saved: a directory)."""
        r = facts.resolver
        function = r.enclosing_function(site.stmt)
        order = statement_order(facts)
        at = order.get(id(site.stmt), 0)
        return any(r.enclosing_function(s.stmt) is function and order.get(id(s.stmt), at) < at
                   for s in self.dcp_paths.get(site.path_key, []))

    def async_save_before(self, stmt: cst.CSTNode, facts: ScriptFacts) -> bool:
        """A DCP save comes before `stmt` in its function: with --async-checkpoint it may
        still be running when `stmt` reads what it writes."""
        function = facts.resolver.enclosing_function(stmt)
        order = statement_order(facts)
        return any(facts.resolver.enclosing_function(s) is function and order.get(id(s), 0) < order.get(id(stmt), 0)
                   for s in self.async_saves)


def checkpoint_saves(facts: ScriptFacts, export: str) -> CheckpointSaves:
    """The script's saves, by path and format (`export`: the --export option)."""
    found = CheckpointSaves()
    for site in saves(facts):
        form = save_format(site, export)
        if site.whole_model is not None and form is not None:
            found.whole_saves.setdefault(site.path_key, (site.whole_model, form))
        if form == "dcp":
            found.dcp_paths.setdefault(site.path_key, []).append(site)
            found.dcp_keys |= set(site.dict_keys)
            if isinstance(site.state, cst.Dict):
                for e in site.state.elements:
                    if isinstance(e, cst.DictElement) and isinstance(e.key, cst.SimpleString):
                        found.saved_values.setdefault(e.key.evaluated_value, e.value)
            found.async_saves.append(site.stmt)
            if not isinstance(site.state, cst.Dict):  # torch.save(model.state_dict(), path)
                found.dcp_whole_kinds |= {c.kind for c in site.state_calls} | (
                    {"model"} if site.whole_model else set())
        elif form == "full":
            found.full_paths.add(site.path_key)
    found.copy_dests = {
        path_key(call.args[1].value, facts) for call in calls_to(facts, COPIES)
        if len(call.args) == 2 and path_key(call.args[0].value, facts) in found.dcp_paths
    }
    return found


def config_first(site: LoadSite, facts: ScriptFacts) -> Optional[cst.If]:
    """nanoGPT's resume order: `if C: ckpt = torch.load(p); args = ckpt["model_args"];
    model = Net(**args); model.load_state_dict(ckpt["model"])`, then, once the
    optimizer is built, `if C: optimizer.load_state_dict(ckpt["optimizer"])`. The
    later `if C:` (the same test, in the same block) is returned when every state
    read before it is a model's load in the first `if`, whose model is built there
    after the load; None for any other shape."""
    r = facts.resolver
    block = r.block_of(site.stmt)
    first = r.parent(block) if isinstance(block, cst.IndentedBlock) else None
    if site.var is None or site.unknown_use is not None or not isinstance(first, cst.If):
        return None
    top = first  # `if A: ... elif C: <load>`: the chain's first `if` is in the block
    while isinstance(r.parent(top), cst.If) and r.parent(top).orelse is top:
        top = r.parent(top)
    outer = r.block_of(top)
    if outer is None or any(u.key is None for u in site.uses):
        return None
    body = list(outer.body)
    later = [
        s for s in body[body.index(top) + 1:]
        if isinstance(s, cst.If) and s.orelse is None and code(s.test) == code(first.test)
        and any(u.kind == "optimizer" and inside(u.stmt, s, facts) for u in site.uses)
    ]
    if len(later) != 1:
        return None
    late = later[0]
    order = statement_order(facts)
    early = [u for u in site.uses if u.kind != "value" and not inside(u.stmt, late, facts)]
    if not early or any(u.kind != "model" or r.block_of(u.stmt) is not block for u in early):
        return None
    for use in early:  # the model is built in the first `if`, after the load
        built = [st for st in block.body if use.owner in assigned_names(st)]
        if not built or order.get(id(built[0]), 0) < order.get(id(site.stmt), 0):
            return None
    # the path names the same file in both: nothing in between rebinds what it reads
    reads = read_names(site.path)
    for stmt in body[body.index(top) + 1: body.index(late)]:
        if reads & target_names(stmt):
            return None
    return late


def trained_after(site: LoadSite, facts: ScriptFacts) -> str:
    """Why loading into the live model could train it afterwards ("" when it cannot)."""
    r = facts.resolver
    function = r.enclosing_function(site.stmt)
    for anc in r.ancestors(site.stmt):
        if anc is function:
            break
        if isinstance(anc, (cst.For, cst.While)):
            return "is inside a loop"
    order = statement_order(facts)
    at = order.get(id(site.stmt), 0)
    if any(l.function is function and _last_line(l.node, order) > at for l in facts.loops):
        return "a training loop runs after it"
    return ""


def before_every_loop(stmt: cst.CSTNode, facts: ScriptFacts) -> bool:
    """`stmt`'s function has training loops, and every one of them starts after `stmt`."""
    function = facts.resolver.enclosing_function(stmt)
    order = statement_order(facts)
    at = order.get(id(stmt), 0)
    loops = [l for l in facts.loops if l.function is function]
    return bool(loops) and all(_first_line(l.node, order) > at for l in loops)


def mode_set_next(site: LoadSite, model: str, facts: ScriptFacts) -> bool:
    """The next statement of the block that reads `model` is `model.eval()` / `model.train(...)`."""
    block = facts.resolver.block_of(site.stmt)
    body = list(block.body) if block is not None else []
    for stmt in body[body.index(site.stmt) + 1:] if site.stmt in body else []:
        if model not in read_names(stmt) | assigned_names(stmt):
            continue
        small = stmt.body[0] if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 else None
        call = small.value if isinstance(small, cst.Expr) else None
        return (isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute)
                and code(call.func) in (f"{model}.eval", f"{model}.train"))
    return False


def bound_only_after(name: str, stmt: cst.CSTNode, facts: ScriptFacts) -> bool:
    """`name` is assigned in `stmt`'s function, and only after `stmt` (a load into a
    model or optimizer built later)."""
    order = statement_order(facts)
    at = order.get(id(stmt), 0)
    function = facts.resolver.enclosing_function(stmt)
    bindings = [
        order.get(id(s), 0)
        for s in facts.resolver.nodes(cst.SimpleStatementLine)
        if facts.resolver.enclosing_function(s) is function and name in assigned_names(s)
    ]
    return bool(bindings) and min(bindings) > at


def bound_before(name: str, load, facts: ScriptFacts) -> bool:
    """`name` is assigned in the load's function before the load (in the code's order)."""
    r = facts.resolver
    function = r.enclosing_function(load)
    order = statement_order(facts)
    at = order.get(id(load), 0)
    return any(r.enclosing_function(s) is function and order.get(id(s), at) < at and name in assigned_names(s)
               and isinstance(s.body[0], cst.Assign) for s in r.nodes(cst.SimpleStatementLine))


def inside(node, container, facts: ScriptFacts) -> bool:
    """`container` is an ancestor of `node`."""
    return any(a is container for a in facts.resolver.ancestors(node))


def statement_order(facts: ScriptFacts) -> Dict[int, int]:
    """id(simple statement) -> its position among the module's simple statements."""
    return {id(s): i for i, s in enumerate(facts.resolver.nodes(cst.SimpleStatementLine))}


def _statement_positions(node, order) -> list:
    """The positions of the simple statements inside `node` (0 for one `order` lacks)."""
    found = []

    class _Positions(cst.CSTVisitor):
        def visit_SimpleStatementLine(self, n) -> bool:
            found.append(order.get(id(n), 0))
            return False

    node.visit(_Positions())
    return found


def _last_line(node, order) -> int:
    """The position of the last simple statement inside `node`."""
    return max(_statement_positions(node, order), default=0)


def _first_line(node, order) -> int:
    """The position of the first simple statement inside `node`."""
    return min(_statement_positions(node, order), default=0)
