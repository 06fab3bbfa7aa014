"""The refusal catalogue, read from the blocker families (rewrite/blockers/): every construct
`rewrite` refuses to convert, with a stable code. `fsdp2-retrofit rules FSR101` shows one.
"""
from __future__ import annotations

from typing import Dict, List, Optional

from .blockers import STAGES, RefusalRule, all_blockers

__all__ = ["CATALOGUE", "STAGES", "RefusalRule", "all_refusals", "refusal_by_code"]

_RULES = [blocker.rule() for blocker in all_blockers()]

CATALOGUE: Dict[str, RefusalRule] = {r.code: r for r in _RULES}


def all_refusals() -> List[RefusalRule]:
    return list(_RULES)


def refusal_by_code(code: str) -> Optional[RefusalRule]:
    return CATALOGUE.get(code.upper())
