"""Log statements (print, logger calls, stdout writes and flushes, plain-file writes, calls of
a function that only writes to stdout: `log_only`) and whether a rank test gates them.

A plain-file write is a statement that only writes a file the script opens for writing
(a literal mode with w, a, x or +): `open(p, "w").write(...)`, `json.dump(x, open(p, "w"))`,
`np.save(p, a)` (savetxt, savez), or a `with open(p, "a") as f:` whose body only writes to
`f` (`f.write`, `print(..., file=f)`, `json.dump(x, f)`). It is not one when its
path mentions a rank (each rank its own file) or when the script reads a file at a path
written the same way (`np.load(p)`, `open(p)`): gated on rank 0, the other ranks could
read it before it exists.

A figure or image file (`plt.savefig(p)`, `fig.savefig(p)`, `torchvision.utils.save_image(t, p)`)
is a plain-file write too. So is a writer object and every use of it (`writer` in `writer`
groups): `w = SummaryWriter(d)` (tensorboard), `f = open(p, "w")` kept open, `w = csv.writer(f)`
(or DictWriter) of such a handle or of an `open(...)`, each bound once and used only by
statements that call a method of it (`w.writerow(row)`, `w.add_scalar(...)`, `f.close()`) or
make a csv writer of it: the construction and the uses go to rank 0 together. A writer used
otherwise (handed to a function, stored, returned) is left on every rank, with the reason
(`unsafe_writers`)."""
from __future__ import annotations

import builtins
from bisect import bisect_right
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import libcst as cst

from .site_analysis import Scope, SiteAnalysis
from fsdp2_retrofit.syntax.memo import per_node
from fsdp2_retrofit.syntax.names import Resolver, code, root_name
from fsdp2_retrofit.syntax.rank import mentions_rank, rank_zero_side
from fsdp2_retrofit.syntax.torch_api import SUMMARY_WRITERS


LOG_CALLS = {"print"}
WRITE_CALLS = {"sys.stdout.write", "sys.stderr.write", "tqdm.tqdm.write", "tqdm.auto.tqdm.write",
               "sys.stdout.flush", "sys.stderr.flush"}  # a hand-written progress bar: write, then flush
PATH_SAVES = {"numpy.save", "numpy.savetxt", "numpy.savez", "numpy.savez_compressed"}  # (path, ...)
OBJECT_DUMPS = {"json.dump", "pickle.dump"}  # (value, file object)
PATH_LOADS = {"numpy.load", "numpy.loadtxt"}
HANDLE_WRITES = {"write", "writelines", "flush"}
CSV_METHODS = {"writerow", "writerows", "writeheader"}
# figures and image files: (qualified name, index of the path among the positional arguments, its keyword)
FIGURE_SAVES = {"matplotlib.pyplot.savefig": (0, "fname"), "torchvision.utils.save_image": (1, "fp")}
CSV_WRITERS = {"csv.writer", "csv.DictWriter"}
LOGGER_METHODS = {"debug", "info", "warning", "warn", "error", "critical", "exception", "log"}


@dataclass
class LogSite:
    stmt: cst.SimpleStatementLine
    scope: Scope
    gated: bool
    file_write: bool = False
    writer: Optional[str] = None  # a writer object's group (its first binding's `name:line`): gated all or none


class LogAnalysis(SiteAnalysis):
    """Finds the log statements."""

    def _logs(self, stmts, rank_name) -> List[LogSite]:
        out = []
        read_paths = self._read_paths()
        groups, self.unsafe_writers = self._writers(read_paths)
        withs = [w for w in self.r.nodes(cst.With) if self._writing_with(w, read_paths)]
        stmts = sorted(list(stmts) + withs, key=self.r.order)
        inside = {id(s) for w in withs for s in w.body.body}
        for stmt in stmts:
            if id(stmt) in inside:
                continue  # a print to the file of a gated `with open(...)`: gated with it
            writes = type(stmt) is cst.With
            group = groups.get(id(stmt))
            if group is not None:
                writes = True
            elif not writes:
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
                    writer=group,
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
        """`open(p, "w").write(...)`, `json.dump(x, open(p, "w"))`, `np.save(p, a)`,
        `csv.writer(open(p, "w")).writerow(row)`, a figure or image file (`_figure_path`)."""
        if type(node) is not cst.Call:
            return False
        f = node.func
        if type(f) is cst.Attribute and f.attr.value in HANDLE_WRITES:
            return self._opened_for_writing(f.value, read_paths)
        if type(f) is cst.Attribute and f.attr.value in CSV_METHODS:  # csv.writer(open(p, "w")).writerow(row)
            return self.r.is_call_to(f.value, CSV_WRITERS) and bool(f.value.args) and \
                self._opened_for_writing(f.value.args[0].value, read_paths)
        if self.r.is_call_to(node, OBJECT_DUMPS):
            return len(node.args) >= 2 and self._opened_for_writing(node.args[1].value, read_paths)
        if self.r.is_call_to(node, PATH_SAVES) and node.args and node.args[0].keyword is None:
            path = node.args[0].value
            return not mentions_rank(path) and code(path) not in read_paths
        path = self._figure_path(node)
        return path is not None and not mentions_rank(path) and code(path) not in read_paths

    def _figure_path(self, call: cst.Call) -> Optional[cst.BaseExpression]:
        """The path of `plt.savefig(p)`, `fig.savefig(p)` (any object's savefig: a Figure),
        `torchvision.utils.save_image(t, p)`; None for other calls."""
        spec = next((FIGURE_SAVES[q] for q in self.r.qnames(call) if q in FIGURE_SAVES), None)
        if spec is None and type(call.func) is cst.Attribute and call.func.attr.value == "savefig":
            spec = FIGURE_SAVES["matplotlib.pyplot.savefig"]
        if spec is None:
            return None
        index, keyword = spec
        for arg in call.args:
            if arg.keyword is not None and arg.keyword.value == keyword:
                return arg.value
        positional = [a for a in call.args if a.keyword is None and not a.star]
        return positional[index].value if len(positional) > index else None

    def _writers(self, read_paths) -> Tuple[Dict[int, str], List[tuple]]:
        """({id(statement): its writer group} for the writer objects whose construction and every
        use can go to rank 0 together; [(construction, node, why)] for those that cannot (see the
        module's doc)).

        A group is a handle and the csv writers made of it (or a SummaryWriter, or a csv writer of
        an `open(...)`), each name bound once in the module by a one-target assignment."""
        makers = {}  # name -> (its assignment's statement, the name of the writer it is made of or None)
        unsafe = self._unfollowed_writers(read_paths)
        for line in self.r.nodes(cst.SimpleStatementLine):
            if len(line.body) != 1 or type(line.body[0]) is not cst.Assign or len(line.body[0].targets) != 1:
                continue
            target, value = line.body[0].targets[0].target, line.body[0].value
            if type(target) is not cst.Name or type(value) is not cst.Call:
                continue
            if self.r.is_call_to(value, SUMMARY_WRITERS) or self._opened_for_writing(value, read_paths):
                makers[target.value] = (line, None)
            elif self.r.is_call_to(value, CSV_WRITERS) and value.args:
                first = value.args[0].value
                if self._opened_for_writing(first, read_paths):
                    makers[target.value] = (line, None)
                elif type(first) is cst.Name:
                    makers[target.value] = (line, first.value)
        if not makers:
            return {}, unsafe
        bound: Dict[str, int] = {}
        for kind in (cst.AssignTarget, cst.AugAssign, cst.AnnAssign, cst.For, cst.AsName, cst.Param):
            for node in self.r.nodes(kind):
                target = node.name if kind in (cst.AsName, cst.Param) else node.target
                for n in self.r.descendants(target, cst.Name) if type(target) is not cst.Name else [target]:
                    if n.value in makers:
                        bound[n.value] = bound.get(n.value, 0) + 1
        root = {}
        for name, (line, source) in makers.items():
            seen = {name}
            while source is not None and source in makers and source not in seen:
                seen.add(source)
                source = makers[source][1]
            root[name] = source if source is not None else name
        uses: Dict[str, list] = {}
        for node in self.r.nodes(cst.Name):
            if node.value not in makers:
                continue
            parent = self.r.parent(node)
            if (type(parent) is cst.Attribute and parent.attr is node) or (type(parent) is cst.Arg and
                                                                          parent.keyword is node):
                continue
            uses.setdefault(node.value, []).append(node)
        groups: Dict[str, list] = {}
        problems: Dict[str, Tuple[cst.CSTNode, str]] = {}
        for name, (line, source) in makers.items():
            key = root[name]
            if key not in makers:  # csv.writer(f) of an `f` that is no handle of ours
                continue
            group = groups.setdefault(key, [])
            group.append(line)
            if bound.get(name, 0) != 1:
                problems.setdefault(key, (line, f"`{name}` is bound {bound.get(name, 0)} times: the rewrite "
                                                 "cannot tell which writer each use writes to"))
            for node in uses.get(name, []):
                stmt = self.r.statement_of(node)
                if stmt is line:
                    continue
                if self._writer_use(stmt, node, makers):
                    group.append(stmt)
                else:
                    problems.setdefault(key, (node, f"`{name}` is used here otherwise than by a call of one of "
                                                    f"its methods (`{code(stmt).strip().splitlines()[0]}`)"))
        out: Dict[int, str] = {}
        for key, stmts in groups.items():
            first = makers[key][0]
            if key in problems:
                node, why = problems[key]
                unsafe.append((first, node, why))
                continue
            label = f"{key}:{self.r.line(first)}"
            for stmt in stmts:
                out[id(stmt)] = label
        return out, unsafe

    def _unfollowed_writers(self, read_paths) -> List[tuple]:
        """[(statement, node, why)] for the writers made where `_writers` does not follow them, outside
        a rank test and outside module classes: one bound to an attribute (`self.w = SummaryWriter(d)`),
        a `with open(p, "w") as f:` around more than writes to `f` (the training itself)."""
        out = []
        for assign in self.r.nodes(cst.Assign):
            value = assign.value
            if not any(type(t.target) is not cst.Name for t in assign.targets) or type(value) is not cst.Call:
                continue
            if self.r.is_call_to(value, SUMMARY_WRITERS) or self._opened_for_writing(value, read_paths) or (
                    self.r.is_call_to(value, CSV_WRITERS) and value.args
                    and self._opened_for_writing(value.args[0].value, read_paths)):
                stmt = self.r.statement_of(assign)
                if self._reportable(stmt):
                    out.append((stmt, assign, f"it is bound to `{code(assign.targets[0].target)}`, and the rewrite "
                                              "follows the uses of a writer bound to a plain name only"))
        for stmt in self.r.nodes(cst.With):
            if self._writing_with(stmt, read_paths) or not self._reportable(stmt):
                continue
            item = next((i for i in stmt.items if self._opened_for_writing(i.item, read_paths)), None)
            if item is not None:
                out.append((stmt, stmt, "the file is opened around more than writes to it (a `with` block whose "
                                        "body also computes), so the block cannot go to rank 0 whole"))
        return out

    def _reportable(self, stmt) -> bool:
        cls = self.r.enclosing_class(stmt)
        if cls is not None and (self.classes.is_module_class(cls.name.value) or self.r.enclosing_function(stmt) is None):
            return False
        return not self._is_rank_gated(stmt)

    def _writer_use(self, stmt, node: cst.Name, makers) -> bool:
        """`stmt` only calls a method of the writer `node` names (`w.writerow(row)`), or makes a csv
        writer of it (an assignment of `makers`)."""
        if type(stmt) is not cst.SimpleStatementLine or len(stmt.body) != 1:
            return False
        small = stmt.body[0]
        if type(small) is cst.Assign and len(small.targets) == 1 and type(small.targets[0].target) is cst.Name \
                and small.targets[0].target.value in makers and makers[small.targets[0].target.value][1] == node.value:
            return small.value.args[0].value is node
        if type(small) is not cst.Expr or type(small.value) is not cst.Call:
            return False
        func = small.value.func
        return type(func) is cst.Attribute and func.value is node and not any(
            n is node for a in small.value.args for n in self.r.descendants(a, cst.Name))

    def _writing_with(self, stmt: cst.With, read_paths) -> bool:
        """`with open(p, "a") as f:` whose body only writes to `f` (or to a csv writer of it:
        `w = csv.writer(f)`, `w.writerow(row)`, `csv.writer(f).writerow(row)`)."""
        if len(stmt.items) != 1 or stmt.asynchronous is not None:
            return False
        item = stmt.items[0]
        if not self._opened_for_writing(item.item, read_paths) or item.asname is None \
                or type(item.asname.name) is not cst.Name or type(stmt.body) is not cst.IndentedBlock:
            return False
        handles = {item.asname.name.value}
        for line in stmt.body.body:
            if type(line) is not cst.SimpleStatementLine:
                return False
            for small in line.body:
                made = self._csv_writer_of(small, handles)
                if made is not None:
                    handles.add(made)
                elif type(small) is not cst.Expr or not any(self._writes_to(small.value, h) for h in handles):
                    return False
        return True

    def _csv_writer_of(self, small, handles) -> Optional[str]:
        """`w = csv.writer(f)` (DictWriter) of one of `handles`: the name it binds."""
        if type(small) is not cst.Assign or len(small.targets) != 1 or type(small.targets[0].target) is not cst.Name:
            return None
        value = small.value
        if self.r.is_call_to(value, CSV_WRITERS) and value.args and type(value.args[0].value) is cst.Name \
                and value.args[0].value.value in handles:
            return small.targets[0].target.value
        return None

    def _writes_to(self, node, handle: str) -> bool:
        if type(node) is not cst.Call:
            return False
        f = node.func
        if type(f) is cst.Attribute and f.attr.value in CSV_METHODS:
            if self.r.is_call_to(f.value, CSV_WRITERS) and f.value.args:  # csv.writer(f).writerow(row)
                target = f.value.args[0].value
                return type(target) is cst.Name and target.value == handle
            return type(f.value) is cst.Name and f.value.value == handle
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
            if isinstance(anc, (cst.If,)) and (mentions_rank(anc.test) or self._rank_by_value(anc)):
                return True
            if isinstance(anc, cst.FunctionDef):
                return False
        return False

    def _rank_by_value(self, gate: cst.If) -> bool:
        """`if self.device_index == 0:` where the attribute holds a rank by its value (rank_values)."""
        from .rank_values import aliases_of

        aliases = aliases_of(self.r).at(gate)
        return bool(aliases) and rank_zero_side(gate.test, aliases) is not None


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
