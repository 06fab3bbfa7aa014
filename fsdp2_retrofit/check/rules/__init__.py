"""The `check` rules: one rule a file, registered here in code order.

A rule is a `Rule` subclass with a docstring in ruff's shape (What it does /
Why is this bad? / Example / Use instead / Fix safety), `CODE`, `NAME`,
`MESSAGE` (a format string), `TRIGGERS` (text that must occur in a file for
the rule to have anything to look at: the cheap prefilter) and `VALID` /
`INVALID` cases, which are both its documentation and its tests.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, Iterable, List, Optional, Sequence, Tuple, Type, Union

import libcst as cst

if TYPE_CHECKING:  # pragma: no cover
    from fsdp2_retrofit.check.lint import LintContext

from fsdp2_retrofit.analysis.project_imports import SHARDING_TRIGGERS


@dataclass(frozen=True)
class Valid:
    """Code the rule must not flag (in a file at `path`)."""

    code: str
    path: str = "case.py"


@dataclass(frozen=True)
class Invalid:
    """Code the rule flags once, on `line`; `fixed` is the code after its fix; `path`, the file's."""

    code: str
    line: int
    fixed: Optional[str] = None
    path: str = "case.py"


@dataclass
class Edit:
    """Replace `node`, or insert statements before/after the statement `node`."""

    node: cst.CSTNode
    new: Union[cst.CSTNode, Sequence[cst.BaseStatement]]
    kind: str = "replace"  # "replace" | "before" | "after"


@dataclass
class Fix:
    message: str
    edits: List[Edit]
    safe: bool = True
    # imports the edits need: (module, name or None, alias or None)
    imports: Tuple[Tuple[str, Optional[str], Optional[str]], ...] = ()


@dataclass
class Finding:
    code: str
    name: str
    message: str
    path: str
    line: int
    col: int  # 1-based, like ruff
    end_line: int
    end_col: int
    fix: Optional[Fix] = field(default=None, repr=False, compare=False)  # dropped when sent between processes
    node: Optional[cst.CSTNode] = field(default=None, repr=False, compare=False)
    # the fix as data: {"applicability": "safe"|"unsafe", "message", "edits": [{content, location, end_location}]}
    fix_record: Optional[dict] = None

    @property
    def fix_safe(self) -> Optional[bool]:
        """True: a safe fix; False: an unsafe one; None: no fix."""
        return None if self.fix_record is None else self.fix_record["applicability"] == "safe"

    def detached(self) -> "Finding":
        """This finding without its syntax-tree references (picklable, small)."""
        return Finding(self.code, self.name, self.message, self.path, self.line, self.col,
                       self.end_line, self.end_col, fix_record=self.fix_record)


class Rule:
    CODE: str = ""
    NAME: str = ""
    MESSAGE: str = ""
    TRIGGERS: Tuple[str, ...] = SHARDING_TRIGGERS  # one of these must occur in the text...
    NEEDS_SHARDING: bool = True  # ...and, unless False, one of SHARDING_TRIGGERS too
    DEFAULT: bool = True  # on unless --select asks for it (4xx rules are off by default)
    # the applicability of its fixes: "safe", "unsafe" (only with --unsafe-fixes) or
    # "mixed" (some cases each); the INVALID cases show exactly these (a test checks)
    FIX_SAFETY: str = "safe"
    VALID: Sequence[Valid] = ()
    INVALID: Sequence[Invalid] = ()

    def check(self, ctx: "LintContext") -> Iterable[Tuple[cst.CSTNode, Dict[str, str], Optional[Fix]]]:
        """Yield (node, message fields, fix or None) for each finding."""
        raise NotImplementedError

    @classmethod
    def may_apply(cls, data: bytes, sharded_elsewhere: bool = False) -> bool:
        """The prefilter: can this rule fire anywhere in this text? `sharded_elsewhere`:
        a project module the file imports shards (its functions may shard this file's
        modules), which stands for the sharding triggers."""
        if sharded_elsewhere and cls.NEEDS_SHARDING:
            return cls.TRIGGERS == SHARDING_TRIGGERS or any(t.encode() in data for t in cls.TRIGGERS)
        if cls.NEEDS_SHARDING and not any(t.encode() in data for t in SHARDING_TRIGGERS):
            return False
        return any(t.encode() in data for t in cls.TRIGGERS)

    @classmethod
    def may_apply_to_names(cls, names, sharded_elsewhere: bool = False) -> bool:
        """The second, exact prefilter: the names the compiled code uses (not its
        comments or strings) include a sharding API (or, for rules that do not need
        sharding, one of their triggers), or it imports one that shards."""
        if cls.NEEDS_SHARDING and sharded_elsewhere:
            return True
        return bool(names & set(SHARDING_TRIGGERS if cls.NEEDS_SHARDING else cls.TRIGGERS))

    @classmethod
    def summary(cls) -> str:
        doc = (cls.__doc__ or "").strip().splitlines()
        return doc[0] if doc else cls.NAME

    @classmethod
    def fix_availability(cls) -> str:
        """"always", "sometimes" or "never": from the INVALID cases that show a fix."""
        fixed = [case.fixed is not None for case in cls.INVALID]
        return "always" if fixed and all(fixed) else "sometimes" if any(fixed) else "never"


    @classmethod
    def fix_label(cls) -> str:
        """The `rules` listing's fix column: safe / unsafe / safe|unsafe, `*` when only some cases have a fix."""
        availability = cls.fix_availability()
        if availability == "never":
            return ""
        label = {"safe": "safe", "unsafe": "unsafe", "mixed": "safe|unsafe"}[cls.FIX_SAFETY]
        return label + ("*" if availability == "sometimes" else "")


def all_rules() -> List[Type[Rule]]:
    from . import (
        batch_size_shape,
        broadcast_after_shard,
        batchnorm_per_rank,
        change_after_shard,
        flattening_optimizer,
        fsdp1_api,
        fsdp1_by_design,
        gradient_sync_off,
        forward_call,
        load_into_sharded,
        local_grad_norm,
        missing_sampler,
        missing_set_device,
        missing_set_epoch,
        no_sync,
        optimizer_before_shard,
        param_tensor,
        rank_gated_collective,
        rank_zero_name,
        sampler_misuse,
        scalar_parameter,
        shard_container,
        shard_order,
        sum_reduced_loss,
        torch_save_dtensor,
        unregistered_method,
        zero_grad_after_forward,
    )

    rules = [
        forward_call.ForwardCall,
        torch_save_dtensor.TorchSaveDTensor,
        optimizer_before_shard.OptimizerBeforeShard,
        shard_order.ShardOrder,
        no_sync.NoSync,
        missing_set_device.MissingSetDevice,
        local_grad_norm.LocalGradNorm,
        missing_sampler.MissingSampler,
        shard_container.ShardContainer,
        rank_gated_collective.RankGatedCollective,
        fsdp1_api.Fsdp1Api,
        fsdp1_by_design.Fsdp1ByDesign,
        load_into_sharded.LoadIntoSharded,
        zero_grad_after_forward.ZeroGradAfterForward,
        change_after_shard.ChangeAfterShard,
        flattening_optimizer.FlatteningOptimizer,
        rank_zero_name.RankZeroName,
        param_tensor.ShardedParamTensor,
        batchnorm_per_rank.BatchNormPerRank,
        sum_reduced_loss.SumReducedLoss,
        batch_size_shape.BatchSizeShape,
        missing_set_epoch.MissingSetEpoch,
        unregistered_method.UnregisteredMethod,
        gradient_sync_off.GradientSyncOff,
        sampler_misuse.SamplerMisuse,
        broadcast_after_shard.BroadcastAfterShard,
        scalar_parameter.ScalarParameter,
    ]
    return sorted(rules, key=lambda r: r.CODE)


def rule_by_code(code: str) -> Optional[Type[Rule]]:
    code = code.upper()
    return next((r for r in all_rules() if r.CODE == code or r.NAME == code.lower()), None)


def selected(select: Sequence[str], ignore: Sequence[str], extend_select: Sequence[str] = ()) -> List[Type[Rule]]:
    """Rules chosen by codes or prefixes, ruff's way: --select replaces the default
    set, --extend-select adds to it, --ignore removes; the longest prefix wins."""
    rules = all_rules()

    def matches(rule, prefixes):
        return max((len(p) for p in prefixes if p == "ALL" or rule.CODE.startswith(p)), default=-1)

    out = []
    for rule in rules:
        chosen = matches(rule, select) if select else (0 if rule.DEFAULT else -1)
        chosen = max(chosen, matches(rule, extend_select))
        if chosen >= 0 and matches(rule, ignore) < max(chosen, 1):
            out.append(rule)
    return out


def unknown_codes(codes: Sequence[str]) -> List[str]:
    """Codes or prefixes that name no rule."""
    known = [r.CODE for r in all_rules()]
    return [c for c in codes if c != "ALL" and not any(k.startswith(c) for k in known)]
