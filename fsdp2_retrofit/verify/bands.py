"""How far apart two runs may be and still be the same training: round-off, by dtype and by optimizer.

Pure (no torch): verify's comparison reads what the instrumentation recorded.

* A value of dtype D at magnitude m is only known to D's spacing there,
  ``ulp(m, D) = eps(D) * 2**floor(log2 m)`` (bfloat16 at 11.0: 0.0625). Two runs
  that sum in another order land up to a few spacings apart, so every band is
  ``max(the absolute tolerance, ULPS * ulp)``: negligible for float32 and float64,
  what decides for bfloat16 and float16.
* An optimizer that normalises its step (Adam and its kin, Adagrad, RMSprop, Lion)
  moves an element by about its learning rate whatever the gradient's size, so a
  gradient that is zero in exact arithmetic (an attention key bias, a bias right
  before a BatchNorm) makes round-off into steps of up to lr that differ between
  the runs. Where every step agrees (loss, gradient norm, and the gradient norm of
  each parameter), a parameter off by at most ``2 * factor * sum of lr`` (each run
  at most ``factor * lr`` a step) is that round-off, not a divergence
  (``step_bound``).
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

# units of the dtype's spacing a value may differ by (the two runs' round-off)
DTYPE_ULPS = 2
EPS = {"float64": 2.0 ** -52, "float32": 2.0 ** -23, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}

# a parameter's gradient norm, single vs distributed, at one step: relative, and absolute as a share of
# the step's total gradient norm (a gradient that is zero but for round-off agrees with any other such)
PARAM_GRAD_RTOL = 1e-3
PARAM_GRAD_FLOOR = 1e-6

ADAM_LIKE = frozenset({"Adam", "AdamW", "NAdam", "RAdam", "Adamax", "SparseAdam", "FusedAdam", "DeepSpeedCPUAdam"})
SIGN_LIKE = frozenset({"Lion", "Adagrad"})


def ulp(magnitude: float, dtype: Optional[str]) -> float:
    """The spacing of ``dtype``'s values at ``magnitude`` (0 for an unknown dtype)."""
    eps = EPS.get(dtype or "")
    if eps is None or not math.isfinite(magnitude):
        return 0.0
    _, exponent = math.frexp(max(abs(magnitude), 2.0 ** -126))
    return eps * 2.0 ** (exponent - 1)


def resolution(a: float, b: float, dtype: Optional[str], ulps: float = DTYPE_ULPS) -> float:
    """``ulps`` spacings of ``dtype`` at the larger magnitude of a and b."""
    return ulps * ulp(max(abs(a), abs(b)), dtype)


def least_precise(*dtypes: Optional[str]) -> Optional[str]:
    known = [d for d in dtypes if d]
    return max(known, key=lambda d: EPS.get(d, 1.0)) if known else None


def step_factor(info: dict) -> Optional[float]:
    """The most one step of the parameter's optimizer moves an element, in units of its learning
    rate; None where the step is not normalised (SGD: its step is lr * gradient)."""
    kind = info.get("optimizer") or ""
    if kind in ADAM_LIKE:
        betas = info.get("betas") or [0.9, 0.999]
        # Kingma & Ba, section 2.1: |step| <= lr * (1 - beta1) / sqrt(1 - beta2) where that exceeds lr
        return max(1.0, (1 - betas[0]) / math.sqrt(1 - betas[1])) if betas[1] < 1 else None
    if kind in SIGN_LIKE:
        return 1.0
    if kind == "RMSprop":
        alpha = info.get("alpha", 0.99)
        return 1.0 / math.sqrt(1 - alpha) if alpha < 1 else None
    return None


# a float64 gradient's round-off (~1e-16 of the terms summed) stays far below an optimizer's eps (Adam:
# 1e-8), which then keeps the step of a zero gradient near zero: nothing is amplified to spare
FLOAT64_EPS_FLOOR = 1e-12


def step_bound(info: Optional[dict]) -> Optional[float]:
    """How far two runs' copies of a parameter may drift apart by round-off its optimizer
    amplified: each run moves it at most ``factor * lr`` a step. None for a float64 parameter
    (``--dtype float64``, or a script in float64) whose optimizer's eps is not tiny: its round-off
    is not amplified, so a difference that needs the bound is a real one (a loss that couples the
    batch's samples, split over the ranks, moves the weights by ~1e-4 while its losses agree to 1e-7)."""
    if not info:
        return None
    eps = info.get("eps", 1e-8)
    if info.get("dtype") == "float64" and isinstance(eps, (int, float)) and eps >= FLOAT64_EPS_FLOOR:
        return None
    factor = step_factor(info)
    lr_sum = info.get("lr_sum")
    if factor is None or not isinstance(lr_sum, (int, float)) or not math.isfinite(lr_sum):
        return None
    return 2 * factor * lr_sum


def describe_bound(info: dict) -> str:
    factor = step_factor(info) or 0.0
    return (f"{info.get('optimizer')} moves an element at most {factor:.3g} x lr a step; "
            f"{info.get('steps')} steps, sum of lr {info.get('lr_sum'):.3g}, two runs: bound {step_bound(info):.3g}")


def gradient_departure(index: int, single: dict, dist: dict) -> Optional[str]:
    """The first step where parameter ``index``'s gradient norm differs between the runs, in words
    (None where they agree at every step both recorded, or where they were not recorded)."""
    mine, theirs = single.get("param_grad_norms") or [], dist.get("param_grad_norms") or []
    totals = single.get("grad_norms") or []
    dtype = least_precise(*(r.get(k) for r in (single, dist) for k in ("grad_dtype", "compute_dtype")))
    rtol = max(PARAM_GRAD_RTOL, DTYPE_ULPS * EPS.get(dtype or "", 0.0))
    for step, (a_row, b_row) in enumerate(zip(mine, theirs)):
        if index >= len(a_row) or index >= len(b_row):
            return None
        a, b = a_row[index], b_row[index]
        if a is None or b is None:
            if a is not b:
                return f"step {step + 1}: a gradient in one run only"
            continue
        total = totals[step] if step < len(totals) and totals[step] is not None else 0.0
        if not abs(a - b) <= rtol * max(a, b) + PARAM_GRAD_FLOOR * total:
            return f"step {step + 1}: its gradient norm {a:.6g} (single) vs {b:.6g} (distributed)"
    return None


# the parts a wrapper adds to a name in a saved state dict (the instrumentation drops them from its names)
_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def param_indices(row: dict, params: Sequence[dict]) -> List[int]:
    """The parameter records a compared tensor may be: the instrumentation's weights by their place
    in the optimizers' param_groups (one); a saved file's tensor (a ``name``) by its key, the
    parameter's qualified name or a name ending in ``.`` + it (a state dict saved under a prefix,
    DDP's ``module.``), the wrappers' parts dropped. Several where models share names (a GAN's
    generator and discriminator); none for a buffer or an optimizer's state."""
    if "name" not in row:
        index = row.get("index")
        return [index] if index is not None and index < len(params) else []
    key = str(row["name"])
    for part in _WRAPPER_PARTS:
        key = key.replace(part, "")
    return [i for i, p in enumerate(params)
            if p.get("name") and (key == p["name"] or key.endswith("." + p["name"]))]


def param_name(row: dict, params: Sequence[dict]) -> str:
    """A tensor's name in messages: the saved file's key, else the parameter's qualified name,
    else its place in the optimizers' param_groups."""
    if "name" in row:
        return repr(row["name"])
    index = row.get("index")
    name = params[index].get("name") if params and index is not None and index < len(params) else None
    return repr(name) if name else f"parameter {index}"
