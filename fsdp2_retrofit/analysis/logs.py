"""Log statements (print, logger calls, stdout writes and flushes, plain-file writes, calls of
a function that only writes to stdout: `log_only`) and whether a rank test gates them.

A plain-file write is a statement that only writes a file the script opens for writing
(a literal mode with w, a, x or +): `open(p, "w").write(...)`, `json.dump(x, open(p, "w"))`,
`np.save(p, a)` (savetxt, savez), or a `with open(p, "a") as f:` whose body only writes to
`f` (`f.write`, `print(..., file=f)`, `json.dump(x, f)`). It is not one when its
path mentions a rank (each rank its own file) or when the script reads a file at a path
written the same way (`np.load(p)`, `open(p)`): gated on rank 0, the other ranks could
read it before it exists."""
from __future__ import annotations

import builtins
from bisect import bisect_right
from dataclasses import dataclass
from typing import Dict, List

import libcst as cst

from .site_analysis import Scope, SiteAnalysis
from fsdp2_retrofit.syntax.memo import per_node
from fsdp2_retrofit.syntax.names import Resolver, code, root_name
from fsdp2_retrofit.syntax.rank import mentions_rank


LOG_CALLS = {"print"}
WRITE_CALLS = {"sys.stdout.write", "sys.stderr.write", "tqdm.tqdm.write", "tqdm.auto.tqdm.write",
               "sys.stdout.flush", "sys.stderr.flush"}  # a hand-written progress bar: write, then flush
PATH_SAVES = {"numpy.save", "numpy.savetxt", "numpy.savez", "numpy.savez_compressed"}  # (path, ...)
OBJECT_DUMPS = {"json.dump", "pickle.dump"}  # (value, file object)
PATH_LOADS = {"numpy.load", "numpy.loadtxt"}
HANDLE_WRITES = {"write", "writelines", "flush"}
LOGGER_METHODS = {"debug", "info", "warning", "warn", "error", "critical", "exception", "log"}


@dataclass
class LogSite:
    stmt: cst.SimpleStatementLine
    scope: Scope
    gated: bool
    file_write: bool = False


class LogAnalysis(SiteAnalysis):
    """Finds the log statements."""

    def _logs(self, stmts, rank_name) -> List[LogSite]:
        out = []
        read_paths = self._read_paths()
        withs = [w for w in self.r.nodes(cst.With) if self._writing_with(w, read_paths)]
        stmts = sorted(list(stmts) + withs, key=self.r.order)
        inside = {id(s) for w in withs for s in w.body.body}
        for stmt in stmts:
            if id(stmt) in inside:
                continue  # a print to the file of a gated `with open(...)`: gated with it
            writes = type(stmt) is cst.With
            if not writes:
                if not all(type(s) is cst.Expr and (self._is_log_call(s.value) or self._calls_log_only(s.value))
                           for s in stmt.body):
                    if not all(type(s) is cst.Expr and (self._is_log_call(s.value) or
                                                        self._writes_file(s.value, read_paths)) for s in stmt.body):
                        continue
                    writes = True
            cls = self.r.enclosing_class(stmt)
            if cls is not None and (self.classes.is_module_class(cls.name.value)
                                    or self.r.enclosing_function(stmt) is None):
                continue  # a module's own prints, a class body: left to the script (a trainer's methods are not)
            out.append(
                LogSite(
                    stmt=stmt,
                    scope=self.r.enclosing_function(stmt) or self.module,
                    gated=self._is_rank_gated(stmt),
                    file_write=writes,
                )
            )
        return out

    def _is_log_call(self, node) -> bool:
        if not isinstance(node, cst.Call):
            return False
        if isinstance(node.func, cst.Name) and node.func.value in LOG_CALLS:
            return True
        if self.r.qnames(node) & WRITE_CALLS:
            return True
        if isinstance(node.func, cst.Attribute) and node.func.attr.value in LOGGER_METHODS:
            base = node.func.value
            if any(q.startswith("logging") for q in self.r.qnames(base)):
                return True
            base_name = root_name(base)
            return bool(base_name) and ("log" in base_name.lower())
        return False

    def _calls_log_only(self, node) -> bool:
        """A call of a top-level function of the script or of a sibling module that only writes to
        stdout (a hand-written progress bar: `progress_bar(i, len(loader), msg)`)."""
        if type(node) is not cst.Call or any(a.star for a in node.args):
            return False
        found = None
        if type(node.func) is cst.Name:
            found = next(((f, self.r) for f in self.module.body
                          if type(f) is cst.FunctionDef and f.name.value == node.func.value), None)
        if found is None and self.classes is not None:
            for qname in sorted(self.r.qnames(node.func)):
                namespace, _, name = qname.rpartition(".")
                fn = self.classes.top_level_functions.get(namespace, {}).get(name) if namespace else None
                if fn is not None:
                    found = (fn, self.classes.top_level[namespace][1].resolver)
                    break
        return found is not None and log_only(*found)

    def _read_paths(self) -> set:
        """The path expressions (as written) of the files the script reads."""
        found = set()
        for call in self.r.nodes(cst.Call):
            if self.r.is_call_to(call, PATH_LOADS) and call.args:
                found.add(code(call.args[0].value))
            elif _is_open(call) and call.args and not _writing_mode(call):
                found.add(code(call.args[0].value))
        return found

    def _opened_for_writing(self, node, read_paths) -> bool:
        """`open(p, "w")` (a, x, +) of a path every rank shares that the script never reads."""
        return (_is_open(node) and _writing_mode(node) and bool(node.args)
                and not mentions_rank(node.args[0].value) and code(node.args[0].value) not in read_paths)

    def _writes_file(self, node, read_paths) -> bool:
        """`open(p, "w").write(...)`, `json.dump(x, open(p, "w"))`, `np.save(p, a)`."""
        if type(node) is not cst.Call:
            return False
        f = node.func
        if type(f) is cst.Attribute and f.attr.value in HANDLE_WRITES:
            return self._opened_for_writing(f.value, read_paths)
        if self.r.is_call_to(node, OBJECT_DUMPS):
            return len(node.args) >= 2 and self._opened_for_writing(node.args[1].value, read_paths)
        if self.r.is_call_to(node, PATH_SAVES) and node.args and node.args[0].keyword is None:
            path = node.args[0].value
            return not mentions_rank(path) and code(path) not in read_paths
        return False

    def _writing_with(self, stmt: cst.With, read_paths) -> bool:
        """`with open(p, "a") as f:` whose body only writes to `f`."""
        if len(stmt.items) != 1 or stmt.asynchronous is not None:
            return False
        item = stmt.items[0]
        if not self._opened_for_writing(item.item, read_paths) or item.asname is None \
                or type(item.asname.name) is not cst.Name or type(stmt.body) is not cst.IndentedBlock:
            return False
        handle = item.asname.name.value
        for line in stmt.body.body:
            if type(line) is not cst.SimpleStatementLine:
                return False
            for small in line.body:
                if type(small) is not cst.Expr or not self._writes_to(small.value, handle):
                    return False
        return True

    def _writes_to(self, node, handle: str) -> bool:
        if type(node) is not cst.Call:
            return False
        f = node.func
        if type(f) is cst.Attribute and f.attr.value in HANDLE_WRITES:
            return type(f.value) is cst.Name and f.value.value == handle
        if self.r.is_call_to(node, OBJECT_DUMPS) or self.r.is_call_to(node, PATH_SAVES):
            target = node.args[1].value if self.r.is_call_to(node, OBJECT_DUMPS) and len(node.args) > 1 else \
                node.args[0].value if node.args else None
            return type(target) is cst.Name and target.value == handle
        if type(f) is cst.Name and f.value == "print":
            return any(a.keyword is not None and a.keyword.value == "file" and type(a.value) is cst.Name
                       and a.value.value == handle for a in node.args)
        return False

    def _is_rank_gated(self, node) -> bool:
        for anc in self.r.ancestors(node):
            if isinstance(anc, (cst.If,)) and mentions_rank(anc.test):
                return True
            if isinstance(anc, cst.FunctionDef):
                return False
        return False


def log_only(fn: cst.FunctionDef, r: Resolver, depth: int = 0) -> bool:
    """`fn` writes to stdout (print, sys.stdout.write) and does nothing a rank must join: each
    call it makes is of a builtin, of a name imported from outside torch, of a method of a
    string literal or of a local built from neither a module-level value nor a parameter
    (`L = []`), or of a function of its module that is itself such (depth <= 2, may return
    its text); never of a parameter (a model handed to it) or of a module-level value (the
    script's `net`, its optimizer). No value returned (the caller reads nothing), and no
    global it sets read anywhere else in its module (a bar's own clock, `global last_time`, may be)."""
    calls = r.descendants(fn, cst.Call)
    if depth == 0 and not any((type(c.func) is cst.Name and c.func.value == "print") or r.qnames(c) & WRITE_CALLS
                              for c in calls):
        return False
    if depth == 0 and any(ret.value is not None for ret in r.descendants(fn, cst.Return)) or \
            r.descendants(fn, cst.Yield):
        return False
    own = {n.name.value for g in r.descendants(fn, cst.Global) for n in g.names}
    if own and any(_reads_outside(n, fn, r) for n in r.nodes(cst.Name) if n.value in own):
        return False
    imported, values, helpers = _module_bindings(r)
    params = {p.name.value for p in fn.params.params + fn.params.kwonly_params + fn.params.posonly_params}
    local_values = {}  # a local -> the values bound to it
    for assign in r.descendants(fn, cst.Assign):
        for target in assign.targets:
            for name in ([target.target] if type(target.target) is cst.Name else []):
                local_values.setdefault(name.value, []).append(assign.value)
    for c in calls:
        func = c.func
        while type(func) is cst.Attribute:
            func = func.value
        if type(func) in (cst.SimpleString, cst.FormattedString, cst.ConcatenatedString):
            continue  # " ".join(...), "{}".format(...)
        if type(func) is not cst.Name:
            return False  # a call of what a call returns, a subscript: not followed
        root = func.value
        if any(q.split(".")[0] == "torch" for q in r.qnames(c)) or root in params or root in own:
            return False
        if root in local_values:
            if any(n.value in params or (n.value in values and n.value not in imported)
                   for v in local_values[root] for n in r.descendants(v, cst.Name)):
                return False
            continue
        if root in helpers:
            if helpers[root] is not fn and (depth >= 2 or not log_only(helpers[root], r, depth + 1)):
                return False
            continue
        if root in imported or (root not in values and root in _BUILTINS):
            continue
        return False
    return True


_BUILTINS = frozenset(dir(builtins))


# the last modules' bindings: every log statement of a script asks for those of its one module
_BINDINGS: Dict[int, tuple] = {}


def _module_bindings(r: Resolver):
    """(names its imports bind, names its other top-level statements bind, its top-level functions),
    computed once per module (a tree is never changed in place: a stage's edits make a new one)."""
    return per_node(_BINDINGS, r.module, lambda: _bindings_of(r), limit=16)


def _bindings_of(r: Resolver):
    imported, values, helpers = set(), set(), {}
    functions = [stmt for stmt in r.module.body if type(stmt) is cst.FunctionDef]
    for fn in functions:
        helpers[fn.name.value] = fn
    spans = [r.span(fn) for fn in functions]  # in source order: the bodies whose bindings are their own
    starts = [first for first, _ in spans]

    def outside(node) -> bool:
        at = r.order(node)
        i = bisect_right(starts, at) - 1
        return i < 0 or at > spans[i][1]

    for node in filter(outside, r.nodes(cst.Import)):
        for alias in node.names:
            imported.add(alias.asname.name.value if alias.asname else code(alias.name).split(".")[0])
    for node in filter(outside, r.nodes(cst.ImportFrom)):
        for alias in () if isinstance(node.names, cst.ImportStar) else node.names:
            imported.add(alias.asname.name.value if alias.asname else code(alias.name))
    for kind in (cst.AssignTarget, cst.AnnAssign, cst.AugAssign, cst.For, cst.AsName):
        for node in filter(outside, r.nodes(kind)):
            target = node.name if kind is cst.AsName else node.target
            values.update(n.value for n in r.descendants(target, cst.Name))
    values.update(c.name.value for c in filter(outside, r.nodes(cst.ClassDef)))
    values -= imported
    return imported, values, helpers


def _reads_outside(name: cst.Name, fn: cst.FunctionDef, r: Resolver) -> bool:
    """`name` is read (not only bound, not an attribute's or a keyword's name) outside `fn`."""
    parent = r.parent(name)
    if type(parent) is cst.AssignTarget or (type(parent) is cst.Attribute and parent.attr is name) or \
            (type(parent) is cst.Arg and parent.keyword is name):
        return False
    return not any(a is fn for a in r.ancestors(name))


def _is_open(node) -> bool:
    return type(node) is cst.Call and type(node.func) is cst.Name and node.func.value == "open"


def _writing_mode(call: cst.Call) -> bool:
    """A literal mode that writes: w, a, x or +."""
    mode = next((a.value for a in call.args if a.keyword is not None and a.keyword.value == "mode"), None)
    if mode is None and len(call.args) > 1 and call.args[1].keyword is None:
        mode = call.args[1].value
    if type(mode) is not cst.SimpleString:
        return False
    return any(c in mode.evaluated_value for c in "wax+")


def log_sites(module: cst.Module, resolver: Resolver) -> List[LogSite]:
    """The statements of a script that only log (outside classes)."""
    return LogAnalysis(module, resolver)._logs(resolver.nodes(cst.SimpleStatementLine), None)
