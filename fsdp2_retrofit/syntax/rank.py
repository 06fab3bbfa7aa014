"""Rank tests and rank values: the one classifier `rewrite` and `check` share.

"Does this `if` run its body on rank 0 only?" (a save to move out, a collective that
deadlocks), "does this value hold the process's rank?" (`rank = dist.get_rank()`) and
"does this condition think about ranks at all?" (a log the script gates itself) are
answered here, from one word list and these shapes:

    rank == 0      0 == args.local_rank      dist.get_rank() == 0      int(os.environ["RANK"]) == 0
    args.local_rank in (-1, 0)      not rank      master_process      is_main_process()
    step % N == 0 and rank == 0     (body on rank 0)      rank != 0, rank > 0      (else branch on rank 0)

A rank name is one whose last word is `rank` (`rank`, `local_rank`, `get_rank`,
`os.environ["RANK"]`), so `args.rank_loss` is not one; a main-process flag is a name
holding one of MAIN_WORDS (`master_process`, `accelerator.is_main_process`, `is_rank0()`).
"""
from __future__ import annotations

from typing import FrozenSet, List, Optional, Tuple

import libcst as cst

from .names import code
from .torch_api import COLLECTIVES, DCP_CALLS, DESTROY_PROCESS_GROUP, GET_RANK, GET_WORLD_SIZE

RANK_WORD = "rank"
Aliases = FrozenSet[str]  # names and attributes known by their value to hold a rank (analysis/rank_values.py)
# words of a name that is true on the main process (rank 0) only
MAIN_WORDS = ("master", "is_main", "main_process", "rank_zero", "rank0", "is_primary", "is_chief")
# text a file must hold to contain a rank test (a lint prefilter; the text test is case-sensitive)
TEXT_TRIGGERS = tuple(dict.fromkeys(w for word in (RANK_WORD, *MAIN_WORDS) for w in (word, word.upper())))

# Shapes of a few expressions, tested by hand: libcst.matchers costs most of the
# tool's start-up to import.


def _is_zero(expr) -> bool:
    """The literal `0`."""
    return isinstance(expr, cst.Integer) and expr.value == "0"


def _is_int_of(expr, exactly_one: bool = False) -> bool:
    """`int(...)` with at least one argument (exactly one with `exactly_one`)."""
    return (
        isinstance(expr, cst.Call)
        and isinstance(expr.func, cst.Name)
        and expr.func.value == "int"
        and (len(expr.args) == 1 if exactly_one else len(expr.args) >= 1)
    )


def _is_get_key(expr) -> bool:
    """`<anything>.get("KEY", ...)`."""
    return (
        isinstance(expr, cst.Call)
        and isinstance(expr.func, cst.Attribute)
        and expr.func.attr.value == "get"
        and len(expr.args) >= 1
        and isinstance(expr.args[0].value, cst.SimpleString)
    )


def _is_string_key(expr) -> bool:
    """`<anything>["KEY"]`."""
    return (
        isinstance(expr, cst.Subscript)
        and len(expr.slice) == 1
        and isinstance(expr.slice[0].slice, cst.Index)
        and isinstance(expr.slice[0].slice.value, cst.SimpleString)
    )


_FLAG_SHAPES = (cst.Name, cst.Attribute, cst.Call, cst.Subscript)


def name_of(expr: cst.BaseExpression) -> str:
    """The lower-case name a value is known by: `local_rank` for `args.local_rank`,
    `get_rank` for `dist.get_rank()`, `rank` for `int(os.environ["RANK"])` and
    `os.environ.get("RANK", 0)`; "" for anything else."""
    while isinstance(expr, cst.Call):
        if _is_int_of(expr):
            expr = expr.args[0].value
        elif _is_get_key(expr):
            return expr.args[0].value.evaluated_value.lower()
        else:
            expr = expr.func
    if _is_string_key(expr):
        return expr.slice[0].slice.value.evaluated_value.lower()
    if isinstance(expr, cst.Attribute):
        return expr.attr.value.lower()
    return expr.value.lower() if isinstance(expr, cst.Name) else ""


def is_rank_name(expr: cst.BaseExpression, aliases: Aliases = frozenset()) -> bool:
    """`rank`, `args.local_rank`, `dist.get_rank()`, `int(os.environ["LOCAL_RANK"])`; with
    `aliases` (analysis/rank_values.py), also the names read by value to hold a rank
    (`self.gpu_id = int(os.environ["LOCAL_RANK"])`)."""
    if aliases and isinstance(expr, (cst.Name, cst.Attribute)) and code(expr) in aliases:
        return True
    return name_of(expr).endswith(RANK_WORD)


def is_main_flag(expr: cst.BaseExpression) -> bool:
    """`master_process`, `accelerator.is_main_process`, `is_main_process()`, `args.is_master`."""
    return isinstance(expr, _FLAG_SHAPES) and any(word in name_of(expr) for word in MAIN_WORDS)


def rank_zero_side(test: cst.BaseExpression, aliases: Aliases = frozenset()) -> Optional[str]:
    """"body" when an `if` with this test runs its body on rank 0 only, "else" when it
    runs its else branch on rank 0 only, None otherwise."""
    if isinstance(test, cst.BooleanOperation):
        sides = (rank_zero_side(test.left, aliases), rank_zero_side(test.right, aliases))
        if isinstance(test.operator, cst.And):
            return "body" if "body" in sides else None
        return "else" if "else" in sides else None
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        if not is_main_flag(test.expression) and isinstance(test.expression, _FLAG_SHAPES) and is_rank_name(
            test.expression, aliases
        ):
            return "body"  # `if not rank:` / `if not dist.get_rank():` is rank 0
        return {"body": "else", "else": "body"}.get(rank_zero_side(test.expression, aliases))
    if isinstance(test, cst.Comparison) and len(test.comparisons) == 1:
        return _compared_side(test.left, test.comparisons[0].operator, test.comparisons[0].comparator, aliases)
    if is_main_flag(test):
        return "body"
    return None


def _compared_side(left, op, right, aliases: Aliases = frozenset()) -> Optional[str]:
    zero_left, zero_right = _is_zero(left), _is_zero(right)
    if zero_left and is_rank_name(right, aliases):
        left, right, zero_left, zero_right = right, left, False, True
        op = {cst.LessThan: cst.GreaterThan(), cst.GreaterThan: cst.LessThan()}.get(type(op), op)
    if not is_rank_name(left, aliases):
        return None
    if zero_right and isinstance(op, (cst.Equal, cst.Is)):
        return "body"
    if zero_right and isinstance(op, (cst.NotEqual, cst.IsNot, cst.GreaterThan)):
        return "else"
    if isinstance(op, cst.In) and isinstance(right, (cst.List, cst.Tuple, cst.Set)):
        return "body" if any(_is_zero(e.value) for e in right.elements) else None
    return None


def is_rank_test(expr: cst.BaseExpression, aliases: Aliases = frozenset()) -> bool:
    """One condition (not an `and`/`or`) true on rank 0 only: `rank == 0`,
    `args.local_rank in (-1, 0)`, `not rank`, `master_process`, `is_main_process()`."""
    return not isinstance(expr, cst.BooleanOperation) and rank_zero_side(expr, aliases) == "body"


def mentions_rank_test(expr: cst.BaseExpression, aliases: Aliases = frozenset()) -> bool:
    """A rank test anywhere in `expr` (`step % N == 0 and master_process`, `a or rank == 0`)."""
    finder = _FindRankTest()
    finder.aliases = aliases
    expr.visit(finder)
    return finder.found


class _FindRankTest(cst.CSTVisitor):
    """Stops at the first rank test (one class, not one made per call: making a class is slow)."""

    found = False
    aliases: "Aliases" = frozenset()

    def on_visit(self, node) -> bool:
        if not self.found and isinstance(node, cst.BaseExpression) and is_rank_test(node, self.aliases):
            self.found = True
        return not self.found


def split_rank_test(
    test: cst.BaseExpression, aliases: Aliases = frozenset()
) -> Tuple[List[cst.BaseExpression], List[cst.BaseExpression]]:
    """(rank conjuncts, other conjuncts) of an `a and b and ...` test; ([], []) when a
    rank test sits under `or`/`not`, where no split keeps the meaning."""
    parts: List[cst.BaseExpression] = []

    def flatten(e):
        if isinstance(e, cst.BooleanOperation) and isinstance(e.operator, cst.And) and not e.lpar:
            flatten(e.left)
            flatten(e.right)
        else:
            parts.append(e)

    flatten(test)
    rank = [p for p in parts if is_rank_test(p, aliases)]
    other = [p for p in parts if not is_rank_test(p, aliases)]
    if any(isinstance(p, (cst.BooleanOperation, cst.UnaryOperation)) for p in rank):
        return [], []
    return rank, other


def mentions_rank(expr: cst.CSTNode) -> bool:
    """The text names a rank or the main process at all (`if rank != 0 and verbose`,
    `seed + rank`): the script already thinks about ranks there."""
    text = code(expr).lower()
    return any(word in text for word in (RANK_WORD, *MAIN_WORDS))


def is_local_rank_value(value) -> bool:
    """`int(os.environ["LOCAL_RANK"])`, `int(os.getenv("LOCAL_RANK", 0))`."""
    return _env_int(value, "LOCAL_RANK")


def is_rank_value(value, resolver) -> bool:
    """`dist.get_rank()`, `int(os.environ["RANK"])`, `int(os.getenv("RANK", 0))`."""
    return resolver.is_call_to(value, GET_RANK) or _env_int(value, "RANK")


def is_world_size_value(value, resolver) -> bool:
    return resolver.is_call_to(value, GET_WORLD_SIZE) or _env_int(value, "WORLD_SIZE")


def _env_int(value, key: str) -> bool:
    """`int(<something reading the environment variable key>)`."""
    if not _is_int_of(value, exactly_one=True):
        return False
    text = code(value.args[0].value)
    quoted = f'"{key}"' in text or f"'{key}'" in text
    return quoted and ("environ" in text or "getenv" in text)


_EVERY_RANK_CALLS = COLLECTIVES | DCP_CALLS | DESTROY_PROCESS_GROUP | {"torch.autograd.backward"}


def every_rank_call(call: cst.Call, resolver) -> bool:
    """A call every rank must make once the model is sharded, so never under a rank-0
    `if`: a backward (its gradient reduce-scatter), `.full_tensor()`, a torch.distributed
    collective, a DCP save or load, destroy_process_group."""
    func = call.func
    if isinstance(func, cst.Attribute) and func.attr.value in ("backward", "full_tensor"):
        return True
    return resolver.is_call_to(call, _EVERY_RANK_CALLS)
