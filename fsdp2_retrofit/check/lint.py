"""Lint one source: prefilter, parse, analyse once, run the rules, honour noqa, apply fixes.

Cheap first: a file whose text contains none of the selected rules' triggers is only
compiled by Python (to report a syntax error, as ruff does), not parsed by libcst; the scope and qualified-name metadata are computed only for files
that pass. Nothing here imports torch or runs the user's code.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Sequence, Set, Tuple, Type

from fsdp2_retrofit.report import InputError
from .rules import Finding, Fix, Rule

_NOQA = re.compile(r"#\s*noqa(?::[\s]?(?P<codes>[A-Z]+[0-9]+(?:[,\s]+[A-Z]+[0-9]+)*))?", re.IGNORECASE)
_FILE_NOQA = re.compile(
    r"^#\s*(?:fsdp2-retrofit|flake8)\s*:\s*noqa(?::\s?(?P<codes>[A-Z]+[0-9]+(?:[,\s]+[A-Z]+[0-9]+)*))?\s*$",
    re.IGNORECASE | re.MULTILINE,
)
_MAX_FIX_ROUNDS = 10


@dataclass
class LintResult:
    path: str
    findings: List[Finding]  # what remains (after fixes, when fixing)
    fixed: Optional[bytes] = None  # the new source when fixes were applied
    applied: int = 0  # how many fixes were applied
    bare_noqa: int = 0  # lines suppressed by a bare `# noqa`
    error: Optional[InputError] = None
    original: bytes = b""
    # when fixes were applied: the findings of the source as given (its lines, its messages)
    initial: List[Finding] = field(default_factory=list)
    # sharded modules it hands to classes and functions of other project modules (analysis.sharding.Handed)
    handed: list = field(default_factory=list)


class LintContext:
    """What a rule sees: the tree and the script's analysis, the one the rewrite's analyses are
    built on (analysis/data.py's DataAnalysis on analysis/site_analysis.py's base: resolver,
    functions, value flow, class registry, sharding facts), computed once."""

    def __init__(self, module, path: str, origins=None, received=()):
        """`origins`: for a rewritten tree, the user's lines (syntax.names.Origins); `received`:
        the sharded modules other files of the run hand this one (analysis.sharding.Handed)."""
        import libcst as cst

        from fsdp2_retrofit.analysis.data import DataAnalysis
        from fsdp2_retrofit.syntax.names import Resolver

        self.module = module
        self.path = path
        self.analysis = DataAnalysis(module, Resolver(module, origins), path=path if path != "-" else None)
        self.analysis.received = received
        self.resolver = self.analysis.r
        self._classes = None
        if any(isinstance(imp.names, cst.ImportStar) for imp in self.resolver.nodes(cst.ImportFrom)):
            self.classes()  # `from models import *`: the names it binds join the resolver first
        self.shards = self.analysis.shards

    def nodes(self, kind):
        return self.resolver.nodes(kind)

    def training_loaders(self):
        """DataLoaders a training loop iterates (the rewriter's own finding of them)."""
        return self.analysis.training_loaders()

    def classes(self):
        """The model classes of the script and its sibling modules (parsed on first use)."""
        if self._classes is None:
            from fsdp2_retrofit.analysis.model_classes import build_registry

            self._classes = self.analysis.classes = build_registry(self.module, self.resolver, self.analysis.path)
        return self._classes

    def root_class(self, site):
        """The script class (or a sibling module's) a shard site's root is built from:
        `model = Net(...)`, `Net(...).to(device)`, followed through the script's imports
        to the class (ClassRegistry, as the rewrite does); None when not known."""
        import libcst as cst

        if "." in site.root:
            return None
        values = self.shards.bound_values(site.root, site.call)
        if values and values[-1] is site.call:  # `model = shard_model(model, mesh)`, `model = fully_shard(Net())`
            handed = [a.value for a in site.call.args if a.keyword is None][:1]
            values = self.shards.bound_values(site.root, self.resolver.parent(site.call)) + handed
        for value in reversed(values):
            call = value
            while isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute) and isinstance(call.func.value, cst.Call):
                call = call.func.value  # `Net(...)` of `Net(...).to(device).cuda()`
            if not isinstance(call, cst.Call):
                continue
            registry = self.classes()
            return next(filter(None, map(registry.get, sorted(self.resolver.qnames(call.func)))), None)
        return None


    def root_classes(self, site):
        """Every class a shard site's root may be: those chosen at run time (`A(...) if c else B(...)`,
        an if/else, a function of the script returning one of several), followed by value as the
        rewrite reads them (model_builds.BuildClasses.chosen_classes), else root_class's one."""
        import libcst as cst

        from fsdp2_retrofit.analysis.model_builds import BuildClasses

        registry = self.classes()
        call = site.call if isinstance(site.call, cst.Call) else None  # a site may be an assignment
        handed = [a.value for a in call.args if a.keyword is None][:1] if call is not None else []
        if "." not in site.root and handed and type(handed[0]) in (cst.Name, cst.Call):
            chosen = [registry.get(c) for c in BuildClasses(self.analysis).chosen_classes(handed[0], site.call)]
            if len(chosen) > 1 and all(chosen):
                return chosen
        return [info for info in [self.root_class(site)] if info is not None]


def applicable(data: bytes, rules: Sequence[Type[Rule]], path: Optional[str] = None) -> List[Type[Rule]]:
    """The prefilter: the selected rules that can possibly fire in this text (the file at
    `path`, whose project imports may shard: see sharded_elsewhere)."""
    elsewhere = sharded_elsewhere(data, path, rules)
    return [r for r in rules if r.may_apply(data, elsewhere)]


def sharded_elsewhere(data: bytes, path: Optional[str], rules: Sequence[Type[Rule]], names=None) -> bool:
    """A file that names no sharding API itself, but imports a project module that does
    (`from parallel import shard_model`): only asked when a selected rule needs sharding.
    `names`: those the file's compiled code uses, which decide whether it names a sharding API
    itself (a comment or docstring that mentions `fully_shard` does not); without them, its text."""
    from .rules import SHARDING_TRIGGERS

    if not path or not any(r.NEEDS_SHARDING for r in rules):
        return False
    if names is not None:
        if names & set(SHARDING_TRIGGERS):
            return False
    elif any(t.encode() in data for t in SHARDING_TRIGGERS):
        return False
    from fsdp2_retrofit.analysis.project_imports import imports_sharding
    from fsdp2_retrofit.analysis.record_fields import calls_a_field

    return imports_sharding(path, data) or calls_a_field(path, data)


def lint_source(
    data: bytes, path: str, rules: Sequence[Type[Rule]], fix: bool = False, unsafe_fixes: bool = False,
    received=(),
) -> LintResult:
    """Findings for one source; with `fix`, also the fixed source and what remains. `received`:
    the sharded modules other files of the run hand this one (its classes and functions)."""
    result = LintResult(path, [], original=data)
    try:
        rules = _rules_that_apply(data, path, rules, received)
    except InputError as exc:
        result.error = exc
        return result
    if not rules:
        return result
    try:
        findings, resolver = _findings(data, path, rules, received, result.handed)
    except InputError as exc:
        result.error = exc
        return result
    if fix:
        initial = _suppress(findings, data)[0]
        current = data
        for _ in range(_MAX_FIX_ROUNDS):
            chosen = [f for f in findings if f.fix is not None and (f.fix.safe or unsafe_fixes)]
            if not chosen:
                break
            new, count = apply_fixes(resolver, chosen)
            if count == 0 or new == current:
                break
            try:
                compile(new, path, "exec", dont_inherit=True)
                new_findings, new_resolver = _findings(new, path, rules, received)
            except (SyntaxError, ValueError, InputError):
                break  # a fix must never leave a file that does not parse: keep the last good one
            if len(new_findings) >= len(findings):
                break  # the fix did not remove its finding: keep the last good source
            current, findings, resolver = new, new_findings, new_resolver
            result.applied += count
        if current != data:
            result.fixed = current
            result.initial = initial
    findings, result.bare_noqa = _suppress(findings, result.fixed or data)
    result.findings = findings
    return result


def _rules_that_apply(data: bytes, path: str, rules: Sequence[Type[Rule]], received=()) -> List[Type[Rule]]:
    """The rules that may fire in a source, by its text, then by the names its compiled code
    uses; InputError when it does not compile (also where no rule applies: a syntax error is
    reported, as ruff does)."""
    code = compiled(data, path)
    names = code_names(code) if code is not None else None  # None: newer syntax than this Python's
    elsewhere = bool(received) or sharded_elsewhere(data, path, rules, names)
    rules = [r for r in rules if r.may_apply(data, elsewhere)]
    if rules and names is not None:  # else the text prefilter alone decides
        rules = [r for r in rules if r.may_apply_to_names(names, elsewhere)]
    return rules


def handed_out(data: bytes, path: str, rules: Sequence[Type[Rule]]) -> list:
    """The sharded modules a source hands other project files (LintResult.handed), as its lint
    in a run finds them (the same prefilter and analysis; the rules are not run): what
    check/importers.py asks of a file outside the run."""
    try:
        if not _rules_that_apply(data, path, rules):
            return []
        handed: list = []
        _analysed(data, path, handed=handed)
    except InputError:
        return []
    return handed


def compiled(data: bytes, path: str):
    """The source compiled by Python itself (about a tenth of libcst's parse): InputError, one
    line, when it cannot run. Bytes that do not decode get the message `rewrite` gives
    (files.check_encoding); Python's compile() would accept them in a comment. None for a
    source this interpreter cannot compile but libcst parses: syntax of a newer Python (a
    3.12 f-string under 3.11), not an error of the file."""
    from fsdp2_retrofit.files import check_encoding

    check_encoding(data)
    try:
        return compile(data, path, "exec", dont_inherit=True)
    except SyntaxError as exc:
        if _parses_as_newer_python(data):
            return None
        raise InputError(f"syntax error: {exc.msg}", exc.lineno or 0, exc.offset or 0) from None
    except ValueError as exc:  # NUL bytes and friends
        raise InputError(f"cannot compile: {exc}") from None


def _parses_as_newer_python(data: bytes) -> bool:
    import libcst as cst

    try:
        cst.parse_module(data)
    except Exception:
        return False
    return True


def code_names(top) -> Set[str]:
    """Every name the compiled code `top` uses (globals, attributes, imports, locals), from
    Python's own compiler: a mention in a comment or a docstring does not count."""
    names: Set[str] = set()
    stack = [top]
    while stack:
        co = stack.pop()
        names.update(co.co_names)
        names.update(co.co_varnames)
        stack.extend(c for c in co.co_consts if hasattr(c, "co_names"))
    return names


def _analysed(data: bytes, path: str, received=(), handed: Optional[list] = None) -> LintContext:
    """The source parsed and analysed (InputError, one line, when libcst cannot parse it); what
    it hands other project files appended to `handed`."""
    import libcst as cst

    try:
        module = cst.parse_module(data)
    except cst.ParserSyntaxError as exc:
        line, col, message = exc.raw_line, exc.raw_column + 1, exc.message
        try:  # Python's own parser names the line people expect
            compile(data, path, "exec", dont_inherit=True)
        except SyntaxError as py:
            line, col, message = py.lineno or line, py.offset or 0, py.msg
        except ValueError:
            pass
        raise InputError(f"syntax error: {message}", line, col) from None
    except (UnicodeDecodeError, LookupError) as exc:
        raise InputError(f"cannot decode: {exc}") from None
    ctx = LintContext(module, path, received=received)
    if handed is not None:
        handed.extend(ctx.shards.handed_out)
    return ctx


def _findings(data: bytes, path: str, rules: Sequence[Type[Rule]], received=(), handed: Optional[list] = None):
    ctx = _analysed(data, path, received, handed)
    out: List[Finding] = []
    seen: Set[Tuple[str, int]] = set()
    for rule_cls in rules:
        rule = rule_cls()
        for node, fields, fix in rule.check(ctx):
            pos = ctx.resolver.position(node)
            key = (rule.CODE, id(node))
            if pos is None or key in seen:
                continue
            seen.add(key)
            out.append(
                Finding(
                    code=rule.CODE,
                    name=rule.NAME,
                    message=rule.MESSAGE.format(**fields),
                    path=path,
                    line=pos.start.line,
                    col=pos.start.column + 1,
                    end_line=pos.end.line,
                    end_col=pos.end.column + 1,
                    fix=fix,
                    node=node,
                    fix_record=None if fix is None else _fix_record(ctx.module, ctx.resolver, fix),
                )
            )
    out.sort(key=lambda f: (f.line, f.col, f.code))
    return out, ctx.resolver


def _fix_record(module, resolver, fix: Fix) -> dict:
    """A fix as text edits on the source it was found in (for JSON output)."""
    lines = module.code.splitlines()
    edits = []
    for e in fix.edits:
        pos = resolver.position(e.node)
        if pos is None:
            continue
        if e.kind == "replace":
            start = {"row": pos.start.line, "column": pos.start.column + 1}
            end = {"row": pos.end.line, "column": pos.end.column + 1}
            edits.append({"content": module.code_for_node(e.new).strip(), "location": start, "end_location": end})
        else:
            line = lines[pos.start.line - 1] if pos.start.line <= len(lines) else ""
            indent = line[: len(line) - len(line.lstrip())]
            content = "".join(indent + module.code_for_node(s).strip() + "\n" for s in e.new)
            row = pos.start.line if e.kind == "before" else pos.end.line + 1
            at = {"row": row, "column": 1}
            edits.append({"content": content, "location": at, "end_location": dict(at)})
    return {"applicability": "safe" if fix.safe else "unsafe", "message": fix.message, "edits": edits}


def _suppress(findings: List[Finding], data: bytes) -> Tuple[List[Finding], int]:
    """Drop findings silenced by `# noqa[: CODES]` on their line or a file-level
    `# fsdp2-retrofit: noqa[: CODES]`; count the bare `# noqa` ones."""
    if b"noqa" not in data.lower():
        return findings, 0
    text = data.decode("utf-8", errors="replace")
    lines = text.splitlines()
    file_codes: Optional[Set[str]] = None
    for m in _FILE_NOQA.finditer(text):
        if not _is_comment_line(text, m.start()):
            continue  # the words inside a string, not a comment
        if not m.group("codes"):
            return [], 0
        file_codes = (file_codes or set()) | set(re.split(r"[,\s]+", m.group("codes").upper()))
    kept, bare = [], 0
    for f in findings:
        if file_codes and any(f.code.startswith(c) for c in file_codes):
            continue
        line = lines[f.line - 1] if 0 < f.line <= len(lines) else ""
        m = _NOQA.search(line[line.find("#"):]) if "#" in line else None
        if m is not None:
            codes = m.group("codes")
            if not codes:
                bare += 1
                continue
            if any(f.code.startswith(c) for c in re.split(r"[,\s]+", codes.upper())):
                continue
        kept.append(f)
    return kept, bare


def _is_comment_line(text: str, offset: int) -> bool:
    """Whether the line at `offset` is a real comment (tokenize decides), not string content."""
    import io
    import tokenize

    line = text.count("\n", 0, offset) + 1
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.start[0] > line:
                return False
            if tok.type == tokenize.COMMENT and tok.start[0] == line:
                return True
    except (tokenize.TokenError, SyntaxError):
        return False
    return False


def apply_fixes(resolver, findings: Iterable[Finding]) -> Tuple[bytes, int]:
    """Apply the fixes of `findings` whose edits do not overlap; (new source, count).

    `resolver`: the Resolver of the tree the findings were made on. The edits go through
    the rewrite's StatementEditor (keyed by the original nodes); a fix whose node lies
    inside, or holds, a node an earlier fix edits waits for the next round (the caller
    re-analyses the fixed source). A statement insertion must be keyed on a statement of
    a block: one keyed elsewhere (a small statement of `a = f(); g(a)`, the body of a
    one-line `if c: f()`) has no line of its own to go before or after, and is not applied.
    """
    from fsdp2_retrofit.rewrite.imports import add_imports
    from fsdp2_retrofit.rewrite.editor import StatementEditor

    editor = StatementEditor()
    editor.resolver = resolver  # descend only into the nodes the fixes edit
    touched: Set = set()  # the nodes the chosen fixes edit
    holding: Set = set()  # and every ancestor of theirs
    imports: List[tuple] = []
    applied: List[Fix] = []
    for f in findings:
        fix = f.fix
        if any(_same_fix(fix, done) for done in applied):
            continue  # two findings sharing one fix (two reads of one local norm)
        nodes = [e.node for e in fix.edits]
        if any(n in touched or n in holding or any(a in touched for a in resolver.ancestors(n)) for n in nodes):
            continue  # the next round applies it on the re-analysed tree
        if any(e.kind != "replace" and resolver.block_of(e.node) is None for e in fix.edits):
            continue
        for e in fix.edits:
            if e.kind == "replace":
                editor.replace_expression(e.node, e.new)
            elif e.kind == "before":
                editor.insert_before(e.node, e.new)
            else:
                editor.insert_after(e.node, e.new)
            touched.add(e.node)
            holding.update(resolver.ancestors(e.node))
        imports.extend(fix.imports)
        applied.append(fix)
    new = resolver.module.visit(editor) if applied else resolver.module
    if imports:
        new = add_imports(new, imports)
    return new.bytes, len(applied)


def _same_fix(a: Fix, b: Fix) -> bool:
    return len(a.edits) == len(b.edits) and all(
        x.node is y.node and x.kind == y.kind for x, y in zip(a.edits, b.edits)
    )
