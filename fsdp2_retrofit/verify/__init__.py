"""`fsdp2-retrofit verify`: run a script and its FSDP2 retrofit, and compare them.

The original runs in one process, the retrofit under ``torchrun``; both are
instrumented by ``_site/sitecustomize.py`` (put first on the children's
PYTHONPATH; the user's files are never edited), which records per optimizer
step the loss (the sum of the micro-step losses ``backward()`` was called on)
and the gradient norm the optimizer used, stops after K steps, and writes the
final parameters. This module only starts processes and reads what they wrote:
it never imports torch. The weights are compared by a small child script
(``_site/_fsdp2_verify_compare.py``) run with the same interpreter.

Equivalence: every step's loss (single vs the mean over ranks) and gradient
norm agree within ``rel 1e-4 / abs 1e-5`` (fp32 reductions in another order
differ by ~1e-7 relative), and every element of the final weights within its
band, ``max(--tolerance, 2 spacings of its dtype)`` (max abs diff, default 1e-4,
the execution tests' bound; bfloat16 is only known to its spacing), or after
steps that all agree, within the step bound of an optimizer that normalises
its step (``bands``: round-off Adam amplified). ``RULES`` names what decided.
``--dtype float64`` makes both runs in double precision where the scripts let
them. A run past its timeout is asked where each rank is, then every process
of it is killed (``processes``).

The same engine runs the execution tests (tests/test_execution.py,
test_checkpoint.py) through its Python API: ``launch_single`` /
``launch_distributed`` with ``steps=0`` let a script run to its end (it saves
what it saves), ``compare_saved`` compares those files by key (by the same rules as
the final weights, the optimizer step bound included), ``compare_runs``
gives the verdict (per-step checks, final parameters, saved files), and
``trains`` judges a run with nothing to compare against (its loss falls). A run
that gloo aborts at teardown is retried from its folder as it was before
(``run_script``).

Beyond equivalence, the report says whether every rank of the distributed run
ended with the same weights (each rank writes what it gathered; they must agree
exactly), whether every rank recorded the same loss at every step (the ranks
read the same data: nothing was split), and whether the distributed losses
stay within the single run's noise (``within_noise``: for scripts whose random
draws cannot be made equal, e.g. a GAN's noise, where step-wise equality is not
expected).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from fsdp2_retrofit.verify import bands, processes

SITE_DIR = Path(__file__).resolve().parent / "_site"
COMPARE_SCRIPT = SITE_DIR / "_fsdp2_verify_compare.py"

EXIT_EQUIVALENT = 0
EXIT_DIVERGED = 1
EXIT_ERROR = 2

DEFAULT_STEPS = 10
DEFAULT_NPROC = 2
DEFAULT_WEIGHT_TOLERANCE = 1e-4
LOSS_RTOL = 1e-4
LOSS_ATOL = 1e-5
DEFAULT_TIMEOUT_S = 600
DEFAULT_NOISE_RTOL = 0.1
# --dtype: "native" runs the scripts as written; "float64" makes both runs in double precision where the
# script lets it (round-off ~1e-16: no optimizer amplifies it into a visible step)
DTYPES = ("native", "float64")

# gloo's threads can abort a rank during interpreter shutdown, after the script finished
TEARDOWN_ABORT = "terminate called without an active exception"
_ERROR_LINE = re.compile(r"^(\[rank\d+\]: )?[\w.]*(Error|Exception|Interrupt)\b.*$", re.MULTILINE)


class VerifyError(Exception):
    """Something could not run (exit 2); the message says what, ``detail`` shows the output."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.message = message
        self.detail = detail


@dataclass(frozen=True)
class VerifySettings:
    script: Path
    script_args: Tuple[str, ...] = ()
    retrofitted: Optional[Path] = None
    nproc: int = DEFAULT_NPROC
    steps: int = DEFAULT_STEPS
    tolerance: float = DEFAULT_WEIGHT_TOLERANCE
    loss_rtol: float = LOSS_RTOL
    loss_atol: float = LOSS_ATOL
    per_rank_args: Tuple[str, ...] = ()
    json_path: Optional[Path] = None
    keep_runs: Optional[Path] = None
    reuse_single: Optional[Path] = None
    python: str = sys.executable
    timeout: float = DEFAULT_TIMEOUT_S
    run_files: Optional[Path] = None  # entries linked into each run's working directory
    noise_rtol: float = DEFAULT_NOISE_RTOL
    to_end: bool = False  # after the steps, both scripts go on to their end (their epilogue is judged)
    dtype: str = "native"  # "float64": both runs made in double precision where the scripts let them (DTYPES)


# -- arguments ----------------------------------------------------------------


def single_run_args(args: Sequence[str], per_rank_args: Sequence[str], nproc: int) -> List[str]:
    """The single run's arguments: each ``--per-rank-arg NAME`` value multiplied by nproc.

    ``NAME VALUE`` and ``NAME=VALUE`` are both understood; a NAME missing from
    ``args`` or with a non-integer value is an error (the script's default is
    not known here: give it explicitly).
    """
    out = list(args)
    for name in per_rank_args:
        found = False
        for i, arg in enumerate(out):
            if arg == name and i + 1 < len(out):
                out[i + 1] = _times(name, out[i + 1], nproc)
                found = True
                break
            if arg.startswith(name + "="):
                out[i] = f"{name}={_times(name, arg[len(name) + 1:], nproc)}"
                found = True
                break
        if not found:
            raise VerifyError(
                f"--per-rank-arg {name}: not in the script arguments; pass it explicitly after `--` "
                f"(e.g. `-- {name} 32`)"
            )
    return out


def _times(name: str, value: str, nproc: int) -> str:
    try:
        return str(int(value) * nproc)
    except ValueError:
        raise VerifyError(f"--per-rank-arg {name}: value {value!r} is not an integer") from None


# -- comparison (pure: unit-tested without torch) ------------------------------


def close(a: Optional[float], b: Optional[float], rtol: float, atol: float, dtype: Optional[str] = None) -> bool:
    """a and b agree within ``atol + rtol * |a|``, widened to DTYPE_ULPS spacings of ``dtype``
    (the dtype the value was computed in: bfloat16's spacing at 11.0 is 0.0625)."""
    if a is None or b is None:
        return a is None and b is None
    if math.isnan(a) or math.isnan(b):
        return False
    return abs(a - b) <= max(atol + rtol * abs(a), bands.resolution(a, b, dtype))


def mean_over_ranks(values: Sequence[Optional[float]]) -> Optional[float]:
    if not values or any(v is None for v in values):
        return None
    return sum(values) / len(values)  # type: ignore[arg-type]


@dataclass
class StepRow:
    step: int  # 1-based optimizer step
    loss_single: Optional[float]
    loss_dist: Optional[float]
    loss_ranks: List[Optional[float]]
    grad_norm_single: Optional[float]
    grad_norm_dist: Optional[float]
    problem: str = ""  # empty when the step agrees

    @property
    def loss_diff(self) -> Optional[float]:
        if self.loss_single is None or self.loss_dist is None:
            return None
        return abs(self.loss_single - self.loss_dist)

    def as_json(self) -> dict:
        return {
            "step": self.step,
            "loss_single": self.loss_single,
            "loss_dist": self.loss_dist,
            "loss_ranks": self.loss_ranks,
            "loss_diff": self.loss_diff,
            "grad_norm_single": self.grad_norm_single,
            "grad_norm_dist": self.grad_norm_dist,
            "ok": not self.problem,
            "problem": self.problem or None,
        }


def compare_steps(single: dict, ranks: Sequence[dict], rtol: float = LOSS_RTOL, atol: float = LOSS_ATOL) -> List[StepRow]:
    """One row per optimizer step either run recorded; ``problem`` says why a step diverges.

    Losses and gradient norms are compared in the least precise dtype either run computed
    them in (``loss_dtype``, ``grad_dtype`` of the records, and ``compute_dtype``, the least
    precise a forward ran in: autocast's bfloat16 makes a float32 loss no more precise): see ``close``."""
    records = [single, *ranks]
    compute = [r.get("compute_dtype") for r in records]
    loss_dtype = bands.least_precise(*(r.get("loss_dtype") for r in records), *compute)
    grad_dtype = bands.least_precise(*(r.get("grad_dtype") for r in records), *compute)
    n = max([len(single["losses"])] + [len(r["losses"]) for r in ranks])
    rows = []
    for i in range(n):
        s_loss = _at(single["losses"], i)
        s_norm = _at(single.get("grad_norms", []), i)
        r_losses = [_at(r["losses"], i) for r in ranks]
        d_norms = [_at(r.get("grad_norms", []), i) for r in ranks]
        d_loss = mean_over_ranks(r_losses)
        d_norm = d_norms[0] if d_norms else None
        problem = ""
        if i >= len(single["losses"]):
            problem = "the single run stopped before this step"
        elif any(i >= len(r["losses"]) for r in ranks):
            problem = "the distributed run stopped before this step"
        elif not close(s_loss, d_loss, rtol, atol, loss_dtype):
            problem = f"loss {_fmt(s_loss)} (single) vs {_fmt(d_loss)} (mean over ranks)"
        elif not close(s_norm, d_norm, rtol, atol, grad_dtype):
            problem = f"gradient norm {_fmt(s_norm)} (single) vs {_fmt(d_norm)} (distributed)"
        rows.append(StepRow(i + 1, s_loss, d_loss, r_losses, s_norm, d_norm, problem))
    return rows


def _at(values: Sequence, i: int):
    return values[i] if i < len(values) else None


def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.6g}"


@dataclass
class WeightsResult:
    ok: bool
    max_abs_diff: Optional[float]
    worst_index: Optional[int]
    count_single: int
    count_dist: int
    problem: str = ""
    worst_name: Optional[str] = None  # the saved files' key, else the parameter's qualified name
    rule: str = "tolerance"  # what decided: see RULES
    rule_detail: str = ""  # the rule at work, in words (the parameter it spared, its bound)
    first_over: Optional[dict] = None  # the first element of the failing tensor outside its band
    # compare_saved's: what the compare script measured and the tolerance, for compare_runs to judge again
    # with the runs' round-off context (the optimizer step bound)
    summary: Optional[dict] = field(default=None, repr=False, compare=False)
    tolerance: Optional[float] = field(default=None, repr=False, compare=False)

    def as_json(self, tolerance: float) -> dict:
        return {
            "ok": self.ok,
            "max_abs_diff": self.max_abs_diff,
            "worst_index": self.worst_index,
            "worst_name": self.worst_name,
            "tensors": [self.count_single, self.count_dist],
            "tolerance": tolerance,
            "rule": self.rule,
            "rule_detail": self.rule_detail or None,
            "first_over": self.first_over,
            "problem": self.problem or None,
        }


# which rule judged the weights: every element within --tolerance; within DTYPE_ULPS spacings of its dtype
# (bfloat16, float16); or off by at most the optimizer's step bound after steps that all agree (round-off
# a normalising optimizer such as Adam turned into steps of up to its learning rate)
RULES = ("tolerance", "dtype resolution", "optimizer step bound")


@dataclass
class RoundOff:
    """What the weights' comparison may use to tell round-off from divergence: each parameter's
    record (name, optimizer, learning rates, dtype; the instrumentation's ``params``), both runs'
    records (their per-parameter gradient norms) and whether every step agreed."""

    params: Sequence[dict] = ()
    single: Optional[dict] = None
    dist: Optional[dict] = None
    steps_agree: bool = False


def _within_band(row: dict, tolerance: float) -> bool:
    if "over" in row:  # the compare script measured each element against max(tolerance, ulps * spacing)
        return row["over"] == 0
    return row["max_abs_diff"] <= tolerance and not math.isnan(row["max_abs_diff"])


def _spared_by_the_optimizer(row: dict, context: Optional[RoundOff]) -> Optional[str]:
    """Why a tensor outside its band is round-off an optimizer amplified (None: it is not).

    The same rule for the instrumentation's weights and the files the scripts saved: the tensor is
    a parameter (``bands.param_indices``; a saved key several models' parameters share must pass for
    each of them), every step agreed, its gradient never departed, and it is off by at most its
    optimizer's step bound."""
    diff = row["max_abs_diff"]
    if context is None or not context.steps_agree or math.isnan(diff):
        return None
    candidates = bands.param_indices(row, context.params)
    if not candidates:
        return None
    bounds = [(bands.step_bound(context.params[i]), i) for i in candidates]
    if any(bound is None for bound, _ in bounds):
        return None
    bound, index = min(bounds)
    if diff > bound:
        return None
    if context.single is not None and context.dist is not None and any(
            bands.gradient_departure(i, context.single, context.dist) is not None for i in candidates):
        return None
    return f"{bands.param_name(row, context.params)} off by {diff:.3e}: {bands.describe_bound(context.params[index])}"


def _weights_problem(row: dict, tolerance: float, context: Optional[RoundOff], failing: int) -> str:
    params = context.params if context else ()
    diff, over = row["max_abs_diff"], row.get("first_over")
    allowed = over["allowed"] if over else tolerance
    dtype = f", {row['dtype']}" if row.get("dtype") and row["dtype"] != "float32" else ""
    text = (f"final weights differ by {diff:.3e} > {allowed:g} ({bands.param_name(row, params)}, "
            f"shape {tuple(row['shape_single'])}{dtype})")
    if over:
        text += (f"; first element off the band at {list(over['index'])}: {over['single']:.6g} (single) vs "
                 f"{over['dist']:.6g} (distributed), {row['over']} element(s) off")
    candidates = bands.param_indices(row, params)
    if context is not None and context.single is not None and context.dist is not None and len(candidates) == 1:
        index = candidates[0]
        departure = bands.gradient_departure(index, context.single, context.dist)
        if departure:
            text += f"; its gradient first differed at {departure}"
        elif context.steps_agree and bands.step_bound(params[index]) is not None:
            text += f"; beyond the optimizer's step bound ({bands.describe_bound(params[index])})"
    if failing > 1:
        text += f"; {failing} tensors off in all"
    return text


def compare_weights(summary: dict, tolerance: float, context: Optional[RoundOff] = None) -> WeightsResult:
    """Judge the compare script's output: same tensors, same shapes, every element within its band
    (``max(tolerance, DTYPE_ULPS spacings of its dtype)`` where the compare script measured bands,
    else max abs diff within tolerance), or with ``context``, off by at most the optimizer's step
    bound after steps that all agree (``bands.step_bound``).

    Rows with a ``name`` (the saved files, compared by key) are named by it, the
    instrumentation's weight lists by the parameters' qualified names (``context``), else index."""
    if "error" in summary:
        return WeightsResult(False, None, None, 0, 0, f"the saved weights: {summary['error']}")
    n_single, n_dist = summary["count"]
    rows = summary["tensors"]
    only_single, only_dist = summary.get("only_single", []), summary.get("only_dist", [])
    if only_single or only_dist:
        return WeightsResult(False, None, None, n_single, n_dist,
                             f"the saved state dicts differ in keys: only in the single run {only_single[:5]}, "
                             f"only in the distributed run {only_dist[:5]}")
    if n_single != n_dist:
        return WeightsResult(False, None, None, n_single, n_dist,
                             f"the optimizers hold {n_single} tensors in the single run, {n_dist} in the distributed run")
    params = context.params if context else ()

    def name_of(row: dict) -> Optional[str]:
        label = bands.param_name(row, params)
        return label[1:-1] if label.startswith("'") else None

    for row in rows:
        if row["max_abs_diff"] is None:
            return WeightsResult(False, None, row["index"], n_single, n_dist,
                                 f"{bands.param_name(row, params)}: shape {tuple(row['shape_single'])} (single) vs "
                                 f"{tuple(row['shape_dist'])} (distributed)", name_of(row))
    if not rows:
        return WeightsResult(True, 0.0, None, n_single, n_dist)
    worst = max(rows, key=lambda r: (math.isnan(r["max_abs_diff"]), r["max_abs_diff"]))
    outside = [r for r in rows if not _within_band(r, tolerance)]
    spared = {id(r): _spared_by_the_optimizer(r, context) for r in outside}
    failing = [r for r in outside if spared[id(r)] is None]
    if failing:
        bad = max(failing, key=lambda r: (math.isnan(r["max_abs_diff"]), r["max_abs_diff"]))
        return WeightsResult(False, bad["max_abs_diff"], bad["index"], n_single, n_dist,
                             _weights_problem(bad, tolerance, context, len(failing)), name_of(bad),
                             rule="optimizer step bound" if any(spared.values()) else "tolerance",
                             first_over=bad.get("first_over"))
    if outside:
        spared_rows = sorted(outside, key=lambda r: -r["max_abs_diff"])
        rule, detail = "optimizer step bound", "; ".join(spared[id(r)] for r in spared_rows[:3])
        if len(spared_rows) > 3:
            detail += f"; {len(spared_rows) - 3} more"
    elif worst["max_abs_diff"] > tolerance:
        rule = "dtype resolution"
        detail = (f"{bands.param_name(worst, params)} ({worst.get('dtype')}) off by {worst['max_abs_diff']:.3e}, "
                  f"{worst.get('max_ulps', 0):.3g} spacings of its dtype (at most {bands.DTYPE_ULPS} allowed)")
    else:
        rule, detail = "tolerance", ""
    return WeightsResult(True, worst["max_abs_diff"], worst["index"], n_single, n_dist, "", name_of(worst),
                         rule=rule, rule_detail=detail)


def compare_rank_weights(summaries: Sequence[Tuple[int, dict]]) -> WeightsResult:
    """Rank r's gathered weights against rank 0's (``(r, compare summary)`` pairs): they must agree exactly.

    Every rank gathers the full parameters at the end; sharded parameters are
    all-gathered (the same bytes everywhere) and replicated ones are kept equal
    by the gradient reduction, so any difference means the ranks train
    different models.
    """
    worst: Optional[WeightsResult] = None
    for rank, summary in summaries:
        result = compare_weights(summary, 0.0)
        if not result.ok:
            problem = result.problem.replace("the single run", "rank 0").replace("the distributed run", f"rank {rank}")
            problem = problem.replace("(single)", "(rank 0)").replace("(distributed)", f"(rank {rank})")
            problem = problem.replace("final weights differ", f"rank {rank}'s final weights differ from rank 0's")
            return WeightsResult(False, result.max_abs_diff, result.worst_index, result.count_single,
                                 result.count_dist, problem)
        if worst is None or (result.max_abs_diff or 0.0) > (worst.max_abs_diff or 0.0):
            worst = result
    return worst or WeightsResult(True, 0.0, None, 0, 0)


def global_batch_problem(single: dict, ranks: Sequence[dict]) -> Optional[str]:
    """Where the runs did not read the same number of samples for a step (the single run's
    batch against the ranks' batches summed), the first such step in words; else None.

    Counted from the DataLoader batches each process drew between optimizer steps (the
    first dimension of a batch's first tensor); steps where either side counted nothing
    (data that does not come through a DataLoader) are not judged.
    """
    mine = single.get("samples") or []
    theirs = [r.get("samples") or [] for r in ranks]
    n = min([len(mine)] + [len(t) for t in theirs]) if theirs else 0
    for i in range(n):
        together = sum(t[i] for t in theirs)
        if mine[i] and together and mine[i] != together:
            per_rank = " + ".join(str(t[i]) for t in theirs)
            return (f"step {i + 1}: the single run read {mine[i]} samples, the {len(theirs)} ranks together "
                    f"{together} ({per_rank}): the runs do not train on the same global batch, so their steps "
                    f"cannot be compared (a batch size the retrofit did not divide, or one the command line sets "
                    f"for one run only)")
    return None


def ranks_read_the_same_data(ranks: Sequence[dict]) -> bool:
    """True when there are 2+ ranks, 2+ steps, and every rank recorded exactly the same loss at every step.

    Ranks that hold the same model and read different samples record different
    losses; identical ones mean every rank trained on the same batches (no
    sampler, or one that does not split), so the global batch is not what the
    single run used.
    """
    if len(ranks) < 2:
        return False
    losses = [r.get("losses") or [] for r in ranks]
    n = min(len(x) for x in losses)
    if n < 2 or any(len(x) != len(losses[0]) for x in losses):
        return False
    return all(x == losses[0] and all(v is not None for v in x) for x in losses)


def within_noise(rows: Sequence[StepRow], rtol: float = DEFAULT_NOISE_RTOL, min_steps: int = 3) -> Tuple[bool, str]:
    """Whether the distributed losses stay within the single run's noise; (ok, why not).

    For scripts whose random draws differ between the runs (a GAN's noise,
    dropout masks, random crops), step-wise equality is not expected. Then:
    at least ``min_steps`` steps in both runs, every loss finite, and the mean
    |single - distributed| loss at most ``max(rtol * mean |single|, 2 * the
    standard deviation of the single run's step-to-step changes)``.
    """
    pairs = [(r.loss_single, r.loss_dist) for r in rows]
    if len(pairs) < min_steps or any(s is None or d is None for s, d in pairs):
        return False, f"fewer than {min_steps} steps recorded by both runs"
    if not all(math.isfinite(s) and math.isfinite(d) for s, d in pairs):
        return False, "a loss is not finite"
    single = [s for s, _ in pairs]
    mean_diff = sum(abs(s - d) for s, d in pairs) / len(pairs)
    scale = sum(abs(s) for s in single) / len(single)
    changes = [b - a for a, b in zip(single, single[1:])]
    mean_change = sum(changes) / len(changes)
    spread = (sum((c - mean_change) ** 2 for c in changes) / len(changes)) ** 0.5
    bound = max(rtol * scale, 2 * spread)
    if mean_diff > bound:
        return False, f"mean |loss difference| {mean_diff:.4g} exceeds the noise bound {bound:.4g}"
    return True, f"mean |loss difference| {mean_diff:.4g} within the noise bound {bound:.4g}"


@dataclass
class Verdict:
    rows: List[StepRow]
    weights: Optional[WeightsResult]  # the instrumentation's final parameters
    single: dict
    ranks: List[dict]
    notes: List[str] = field(default_factory=list)
    saved: Optional[WeightsResult] = None  # the files the scripts saved themselves, by key
    judge_steps: bool = True  # False: the rows are shown, not judged (a reference without records)
    rank_weights: Optional[WeightsResult] = None  # rank r vs rank 0 of the distributed run
    initial: Optional[WeightsResult] = None  # the weights each optimizer started from, single vs distributed
    global_batch: Optional[str] = None  # the runs read different numbers of samples per step: not comparable
    epilogue: Optional[str] = None  # to_end: the retrofit failed or hung after the steps, the original did not

    @property
    def start_apart(self) -> bool:
        return self.initial is not None and not self.initial.ok

    @property
    def same_data_on_every_rank(self) -> bool:
        return ranks_read_the_same_data(self.ranks)

    @property
    def ranks_disagree(self) -> bool:
        return self.rank_weights is not None and not self.rank_weights.ok

    @property
    def first_divergence(self) -> Optional[StepRow]:
        if not self.judge_steps:
            return None
        return next((r for r in self.rows if r.problem), None)

    @property
    def weight_results(self) -> List[WeightsResult]:
        return [w for w in (self.weights, self.saved) if w is not None]

    @property
    def equivalent(self) -> bool:
        results = self.weight_results
        return (self.first_divergence is None and bool(results) and all(w.ok for w in results)
                and not self.ranks_disagree and not self.start_apart and self.global_batch is None
                and self.epilogue is None)

    @property
    def exit_code(self) -> int:
        if self.equivalent:
            return EXIT_EQUIVALENT
        if self.global_batch is not None and not self.ranks_disagree and not self.start_apart:
            return EXIT_ERROR  # not a training defect: the two runs trained on different batches
        if self.epilogue is not None:
            return EXIT_DIVERGED
        if self.first_divergence is None and not self.weight_results:
            return EXIT_ERROR  # nothing diverged, but the weights could not be compared
        return EXIT_DIVERGED

    def summary(self) -> str:
        if self.start_apart:
            return f"diverged before the first step: {self.initial.problem}"  # type: ignore[union-attr]
        if self.global_batch is not None and not self.ranks_disagree:
            return f"not comparable: the global batch differs at {self.global_batch}"
        first = self.first_divergence
        if first is not None:
            return f"diverged at step {first.step}: {first.problem}{self._weights_hint()}"
        if self.epilogue is not None:
            return f"the retrofit failed after training: {self.epilogue}"
        if not self.weight_results:
            return "error: the final weights were not recorded by both runs; cannot judge"
        failed = next((w for w in self.weight_results if not w.ok), None)
        if failed is not None:
            return f"diverged: {failed.problem}"
        if self.ranks_disagree:
            return f"diverged: {self.rank_weights.problem}"  # type: ignore[union-attr]
        steps = f"{len(self.rows)} steps agree" if self.judge_steps else "steps not compared"
        within = ", ".join(f"{label} within {w.max_abs_diff:.3e} (rule: {w.rule})" for label, w in
                           (("final weights", self.weights), ("saved weights", self.saved)) if w is not None)
        return f"equivalent: {steps}, {within}"

    def _weights_hint(self) -> str:
        """After a diverging step: where the final weights ended furthest apart, by name."""
        w = self.weights
        if w is None or w.ok or w.max_abs_diff is None or w.worst_name is None:
            return ""
        return f"; the final weights differ most in {w.worst_name!r} (by {w.max_abs_diff:.3e})"


# -- the terminal chart ----------------------------------------------------------


def loss_chart(single: Sequence[Optional[float]], dist: Sequence[Optional[float]], height: int = 8,
               width: int = 60) -> List[str]:
    """A small text plot of two loss curves: `s` single, `d` distributed, `*` both."""
    values = [v for v in list(single) + list(dist) if v is not None and math.isfinite(v)]
    n = max(len(single), len(dist))
    if not values or n == 0:
        return []
    lo, hi = min(values), max(values)
    span = hi - lo or 1.0
    col_w = max(1, min(4, width // n))
    grid = [[" "] * (n * col_w) for _ in range(height)]

    def row_of(v: float) -> int:
        return height - 1 - int(round((v - lo) / span * (height - 1)))

    for series, mark in ((single, "s"), (dist, "d")):
        for i, v in enumerate(series):
            if v is None or not math.isfinite(v):
                continue
            r, c = row_of(v), i * col_w
            grid[r][c] = "*" if grid[r][c] not in (" ", mark) else mark
    label_w = max(len(f"{hi:.4f}"), len(f"{lo:.4f}"))
    lines = []
    for r, cells in enumerate(grid):
        label = f"{hi:.4f}" if r == 0 else f"{lo:.4f}" if r == height - 1 else ""
        lines.append(f"{label:>{label_w}} |{''.join(cells).rstrip()}")
    lines.append(" " * label_w + " +" + "-" * (n * col_w))
    lines.append(" " * label_w + "  steps 1.." + str(n) + "   s single  d distributed (mean over ranks)  * both")
    return lines


def _bytes(n: Optional[int]) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n}"


# -- running the children -----------------------------------------------------


@dataclass
class Run:
    """One finished run: its folder (the script's working directory, with its
    records and logs), one record a rank (none when it ran uninstrumented),
    and the instrumentation's final weights."""

    directory: Path
    ranks: List[dict]
    weights: Optional[Path]
    attempts: int = 1  # > 1: retried after gloo's teardown abort
    epilogue: Optional[str] = None  # to_end: how what ran after the recorded steps failed (None: it ended cleanly)

    @property
    def stdout(self) -> str:
        """What the script printed (torchrun: every rank's lines)."""
        return (self.directory / "stdout.log").read_text(errors="replace")


TEARDOWN_RETRIES = 2


def _child_env(record_dir: Path, steps: int, mode: str, extra_path: Sequence[str] = (),
               instrument: bool = True, sampler: Optional[bool] = None, epochs: Sequence[int] = (),
               to_end: bool = False, timing: bool = False, dtype: str = "native") -> dict:
    """The child's environment. ``mode``: "single" (one process) or "dist" (torchrun:
    only the workers record). ``sampler`` defaults to on for "single"; a run with
    neither instrumentation nor sampler gets no verify variable at all. ``epochs``: the
    epoch of each shuffled pass, in order, for the single run's sampler (the values the
    distributed run's DistributedSamplers were set to). ``to_end``: after the steps the
    script goes on to its end. ``timing``: records made to time steps (no gradient norms,
    no weights; see _site/sitecustomize.py)."""
    env = dict(os.environ)
    for key in list(env):
        if key.startswith("FSDP2_RETROFIT_VERIFY_"):
            del env[key]
    if sampler is None:
        sampler = mode == "single"
    if instrument:
        env["FSDP2_RETROFIT_VERIFY_DIR"] = str(record_dir)
        env["FSDP2_RETROFIT_VERIFY_STEPS"] = str(steps)
        env["FSDP2_RETROFIT_VERIFY_MODE"] = mode
        if to_end:
            env["FSDP2_RETROFIT_VERIFY_TO_END"] = "1"
        if timing:
            env["FSDP2_RETROFIT_VERIFY_TIMING"] = "1"
        if dtype != "native":
            env["FSDP2_RETROFIT_VERIFY_DTYPE"] = dtype
    if sampler:
        env["FSDP2_RETROFIT_VERIFY_SAMPLER"] = "1"
        if epochs:
            env["FSDP2_RETROFIT_VERIFY_EPOCHS"] = ",".join(str(int(e)) for e in epochs)
    env.setdefault("OMP_NUM_THREADS", "1")
    site = [str(SITE_DIR)] if instrument or sampler else []
    env["PYTHONPATH"] = os.pathsep.join([*site, *extra_path, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    return env


def _launch(cmd: List[str], env: dict, cwd: Path, timeout: float, what: str) -> Tuple[int, str]:
    """Run cmd in its own session, its processes marked (processes.MARK); stdout passes through to a
    log file; returns (exit code, stderr text). On a timeout, each rank is asked where it is before
    every process of the run is killed (torchrun's workers run in sessions of their own); no process
    of the run outlives this call, however it ends."""
    env, tag = processes.marked(env)
    with open(cwd / "stdout.log", "wb") as out, open(cwd / "stderr.log", "wb") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            places = processes.where_ranks_are(cwd, processes.run_processes(proc.pid, tag))
            processes.kill_run(proc.pid, tag)
            proc.wait()
            diagnosis = processes.timeout_diagnosis(places)
            raise VerifyError(f"the {what} did not finish within {timeout:.0f} s and was killed: {diagnosis}",
                              _tail((cwd / "stderr.log").read_text(errors="replace"))) from None
        finally:
            processes.kill_run(proc.pid, tag)  # a rank its launcher left behind, or an interrupted wait
            if proc.poll() is None:
                proc.wait()
    return rc, (cwd / "stderr.log").read_text(errors="replace")


def _tail(text: str, lines: int = 25) -> str:
    errors = list(dict.fromkeys(m.group(0) for m in _ERROR_LINE.finditer(text)))
    tail = "\n".join(text.rstrip().splitlines()[-lines:])
    head = ("exceptions:\n  " + "\n  ".join(errors[:6]) + "\n") if errors else ""
    return f"{head}last lines of stderr:\n{tail}" if tail else head


def _read_ranks(directory: Path, nproc: int, what: str, stderr: str) -> List[dict]:
    ranks = []
    for r in range(nproc):
        path = directory / f"rank{r}.json"
        if not path.is_file():
            raise VerifyError(f"the {what} left no record for rank {r} (did the instrumentation load?)", _tail(stderr))
        ranks.append(json.loads(path.read_text(encoding="utf-8")))
    for rec in ranks:
        if rec.get("failed"):
            raise VerifyError(f"the {what} failed on rank {rec['rank']}: {rec['failed']}", _tail(stderr))
    return ranks


# --run-files up to this size are copied into each run's directory, larger ones linked: a run
# that writes into its inputs (a resumed script saving its checkpoint where it loaded it from)
# must not hand the other run what it wrote.
RUN_FILES_COPY_LIMIT = 64 * 2**20


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def link_run_files(run_files: Optional[Path], directory: Path) -> None:
    """Put each entry of ``run_files`` into a run's working directory (relative input paths
    resolve there): copies while they are small (RUN_FILES_COPY_LIMIT in all), so each run has
    its own, else links."""
    if run_files is None:
        return
    if not run_files.is_dir():
        raise VerifyError(f"--run-files {run_files}: not a directory")
    directory.mkdir(parents=True, exist_ok=True)
    entries = sorted(run_files.iterdir())
    copy = sum(_size(e) for e in entries) <= RUN_FILES_COPY_LIMIT
    for entry in entries:
        target = directory / entry.name
        if target.exists() or target.is_symlink():
            continue
        if not copy:
            target.symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
        elif entry.is_dir():
            shutil.copytree(entry, target)
        else:
            shutil.copy2(entry, target)


def _restore(directory: Path, snapshot: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    shutil.copytree(snapshot, directory)


def _ended_cleanly(directory: Path, nproc: int) -> bool:
    """Every rank's own code ran to its end: its exit record (written by the instrumentation's
    last exit handler) says no exception ended it and it gave sys.exit no failure status."""
    for r in range(nproc):
        path = directory / f"exit_rank{r}.json"
        try:
            if not json.loads(path.read_text(encoding="utf-8")).get("clean"):
                return False
        except (OSError, ValueError):
            return False
    return True


def _epilogue_failure(directory: Path, nproc: int, stderr: str) -> str:
    """What ended a run after its recorded steps: each failed rank's uncaught exception, or
    the last error line of its output."""
    said = []
    for r in range(nproc):
        try:
            record = json.loads((directory / f"exit_rank{r}.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            said.append(f"rank {r} did not reach its end")
            continue
        if not record.get("clean"):
            said.append(f"rank {r}: {record.get('uncaught') or 'exit status ' + str(record.get('status'))}")
    if not said:
        errors = [line for line in stderr.splitlines() if "Error" in line or "error:" in line]
        said.append(errors[-1].strip() if errors else "failed (no exception recorded)")
    return "; ".join(dict.fromkeys(said))


def run_script(cmd: List[str], directory: Path, env: dict, nproc: int, timeout: float, what: str,
               steps: int = DEFAULT_STEPS, instrument: bool = True, retries: int = TEARDOWN_RETRIES,
               launch=_launch, to_end: bool = False) -> Run:
    """Run ``cmd`` in ``directory`` and read its records.

    gloo's worker threads can abort a rank while the interpreter shuts down,
    after the script finished (std::terminate, exit -6: TEARDOWN_ABORT in
    stderr; the instrumentation makes it rare, see EXIT_GRACE_S there). A run
    that dies that way is judged on its records when every rank wrote them
    first: stopped after ``steps`` steps, or (``steps`` 0) run to the end with
    every rank's code finished cleanly (its exit record: no uncaught exception,
    no non-zero sys.exit). Any other run that dies that way is retried
    (``retries`` times) from a copy of ``directory`` as it was before the first
    attempt: an attempt that resumed from a checkpoint and saved a later one
    must not hand that to the retry. Any other failure, or the same abort every
    time, is a VerifyError. With ``to_end``, a failure or a timeout after every rank
    recorded its ``steps`` steps is the Run's ``epilogue`` instead: what the script
    does after training failed or hung; the records are the result.
    """
    directory.mkdir(parents=True, exist_ok=True)
    if instrument:  # a record left by an earlier run in this folder must not stand for this one's
        for stale in [*directory.glob("rank*.json"), *directory.glob("exit_rank*.json"),
                      *directory.glob("pid_rank*.json"), *directory.glob("progress_rank*.json"),
                      *directory.glob("stack_*.txt")]:
            stale.unlink()
    with tempfile.TemporaryDirectory(prefix="fsdp2-verify-before-") as tmp:
        snapshot = Path(tmp) / "before"
        shutil.copytree(directory, snapshot)
        epilogue = None
        for attempt in range(1, retries + 2):
            try:
                rc, stderr = launch(cmd, env, directory, timeout, what)
            except VerifyError as exc:
                if not (to_end and instrument and _recorded_steps(directory, nproc)):
                    raise
                epilogue = f"it did not end within {timeout:.0f} s after the {steps} recorded steps: " + \
                    exc.message.split(" and was killed: ", 1)[-1]
                rc, stderr = 0, exc.detail
                break
            if rc == 0:
                break
            aborted = TEARDOWN_ABORT in stderr
            complete = instrument and all((directory / f"rank{r}.json").is_file() for r in range(nproc))
            if aborted and complete and (steps or _ended_cleanly(directory, nproc)):
                break  # the records were written before the abort: they are the result
            if to_end and instrument and _recorded_steps(directory, nproc) and not aborted:
                epilogue = f"it failed after the {steps} recorded steps (exit code {rc}): " + \
                    _epilogue_failure(directory, nproc, stderr)
                break
            if not aborted or attempt > retries:
                raise VerifyError(f"the {what} failed (exit code {rc})", _tail(stderr))
            _restore(directory, snapshot)
    if not instrument:
        return Run(directory, [], None, attempt)
    ranks = _read_ranks(directory, nproc, what, stderr)
    if any(r.get("world_size", 1) != nproc for r in ranks):
        raise VerifyError(f"the {what} ran with world size {ranks[0].get('world_size')}, expected {nproc}")
    if not ranks[0]["steps"]:
        raise VerifyError(f"the {what} made no optimizer step (nothing to compare)", _tail(stderr))
    weights = directory / "weights.pt"
    return Run(directory, ranks, weights if weights.is_file() else None, attempt, epilogue)


def _recorded_steps(directory: Path, nproc: int) -> bool:
    """Every rank wrote its record after the requested steps (to_end: then it went on)."""
    for r in range(nproc):
        try:
            if json.loads((directory / f"rank{r}.json").read_text(encoding="utf-8")).get("reason") != "steps":
                return False
        except (OSError, ValueError):
            return False
    return True


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _single_meta(settings: VerifySettings, args: List[str], epochs: Sequence[int] = ()) -> dict:
    return {"script": str(settings.script.resolve()), "sha256": _sha256(settings.script), "args": args,
            "steps": settings.steps, "python": settings.python, "epochs": list(epochs), "to_end": settings.to_end}


def run_single(settings: VerifySettings, args: List[str], directory: Path, epochs: Sequence[int] = ()) -> Run:
    link_run_files(settings.run_files, directory)
    run = launch_single(settings.script, args, directory, steps=settings.steps, python=settings.python,
                        timeout=settings.timeout, epochs=epochs, to_end=settings.to_end, dtype=settings.dtype)
    (directory / "meta.json").write_text(json.dumps(_single_meta(settings, args, epochs)), encoding="utf-8")
    return run


def sampler_epochs(run: Run) -> List[int]:
    """The epoch of each shuffled DistributedSampler pass of a distributed run (rank 0's
    record), -1 for a shuffled pass the retrofit left to a RandomSampler (a loader it did not
    split); empty where they are 0, 1, 2, ... (what the single run's sampler does anyway)."""
    epochs = [int(e) for e in (run.ranks[0].get("sampler_epochs") or [])] if run.ranks else []
    return [] if epochs == list(range(len(epochs))) else epochs


def reuse_single(settings: VerifySettings, args: List[str], epochs: Sequence[int] = ()) -> Run:
    directory = settings.reuse_single
    assert directory is not None
    meta_path = directory / "meta.json"
    if not meta_path.is_file():
        raise VerifyError(f"--reuse-single {directory}: no recorded single run there (meta.json missing)")
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    expected = _single_meta(settings, args, epochs)
    meta.setdefault("epochs", [])  # recorded before the epochs were
    meta.setdefault("to_end", False)
    for key in ("sha256", "args", "steps", "epochs", "to_end"):
        if meta.get(key) != expected[key]:
            raise VerifyError(f"--reuse-single {directory}: recorded with another {key} "
                              f"({meta.get(key)!r}, now {expected[key]!r})")
    ranks = _read_ranks(directory, 1, "recorded single run", "")
    weights = directory / "weights.pt"
    return Run(directory, ranks, weights if weights.is_file() else None)


def run_distributed(settings: VerifySettings, script: Path, directory: Path, import_root: Sequence[str] = ()) -> Run:
    link_run_files(settings.run_files, directory)
    return launch_distributed(
        script, settings.script_args, directory, nproc=settings.nproc, steps=settings.steps, python=settings.python,
        timeout=settings.timeout, extra_path=[*import_root, str(settings.script.resolve().parent)],
        what=f"distributed run of {settings.retrofitted or 'the retrofit'} (torchrun, {settings.nproc} ranks)",
        to_end=settings.to_end, dtype=settings.dtype)


# -- the engine's API: one run of each kind, then compare --------------------
#
# `verify` uses these with steps=K; the execution tests (tests/test_execution.py,
# test_checkpoint.py) use them with steps=0: the script runs to its end, saves
# what it saves, and the saved files are compared by key (compare_saved).


def launch_single(script: Path, args: Sequence[str], directory: Path, *, steps: int = 0, python: str = sys.executable,
                  timeout: float = DEFAULT_TIMEOUT_S, instrument: bool = True, sampler: bool = True,
                  what: str = "", epochs: Sequence[int] = (), to_end: bool = False, timing: bool = False,
                  dtype: str = "native") -> Run:
    """Run ``script`` with ``python`` in one process, in ``directory``.

    ``steps`` 0: to the end of the script, else stop after that many optimizer
    steps. ``sampler``: shuffled DataLoaders visit samples in DistributedSampler's
    order. ``instrument`` False: no records (a script that starts its own worker
    processes, e.g. with mp.spawn; then ``sampler`` should be False too). ``epochs``:
    the epochs of the shuffled passes, in order (sampler_epochs of the distributed
    run's record); by default each sampler counts its passes from 0. ``timing``: the
    records time each step and hold no gradient norms or weights (benchmarks/gpu).
    """
    env = _child_env(directory, steps, "single", instrument=instrument, sampler=sampler, epochs=epochs,
                     to_end=to_end, timing=timing, dtype=dtype)
    cmd = [python, str(Path(script).resolve()), *args]
    return run_script(cmd, directory, env, 1, timeout, what or f"single-process run of {script}", steps=steps,
                      instrument=instrument, to_end=to_end)


def launch_distributed(script: Path, args: Sequence[str], directory: Path, *, nproc: int = DEFAULT_NPROC,
                       steps: int = 0, python: str = sys.executable, timeout: float = DEFAULT_TIMEOUT_S,
                       extra_path: Sequence[str] = (), what: str = "", to_end: bool = False,
                       timing: bool = False, dtype: str = "native") -> Run:
    """Run ``script`` under ``torchrun --standalone --nproc_per_node nproc`` (the
    entry point of ``python``, so the workers use its torch), in ``directory``;
    ``steps`` as for launch_single."""
    env = _child_env(directory, steps, "dist", extra_path, to_end=to_end, timing=timing, dtype=dtype)
    cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(Path(script).resolve()), *args]
    return run_script(cmd, directory, env, nproc, timeout, what or f"distributed run of {script} ({nproc} ranks)",
                      steps=steps, to_end=to_end)


def reference_record(run: Run) -> dict:
    """The reference's record as compare_steps wants it: a single run's own, or for a
    reference that ran under torchrun (a DDP original) the mean loss over its ranks
    and rank 0's gradient norm (DDP's gradients are the same on every rank)."""
    if len(run.ranks) == 1:
        return run.ranks[0]
    first = run.ranks[0]
    n = min(len(r["losses"]) for r in run.ranks)
    return {**first, "losses": [mean_over_ranks([r["losses"][i] for r in run.ranks]) for i in range(n)],
            "grad_norms": first.get("grad_norms", [])[:n], "steps": n}


def compare_saved(single: Path, dist: Path, keys: Sequence[str] = (), tolerance: float = DEFAULT_WEIGHT_TOLERANCE,
                  single_prefix: str = "", python: str = sys.executable,
                  runs: Optional[Tuple["Run", "Run"]] = None) -> WeightsResult:
    """Compare the files the two runs saved (``torch.save`` files or DCP directories),
    tensor by tensor under the same names. ``keys``: empty when the file is a state
    dict; else the entries holding state dicts (several: each compared, names
    prefixed ``key.``). ``single_prefix`` is dropped from the single run's names
    (torch.compile's ``_orig_mod.``).

    Judged as the final weights are (``compare_weights``): with ``runs`` (the single and the
    distributed run that saved them), a saved parameter off by at most its optimizer's step
    bound after steps that all agree is round-off; without, compare_runs judges the result
    again with its runs when it is handed it as ``saved``."""
    for path in (single, dist):
        if not Path(path).exists():
            return WeightsResult(False, None, None, 0, 0, f"the saved weights: {path} does not exist")
    spec = {"single": str(single), "dist": str(dist), "keys": list(keys), "single_prefix": single_prefix,
            "band": _band(tolerance)}
    proc = subprocess.run([python, str(COMPARE_SCRIPT), "--saved", json.dumps(spec)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise VerifyError(f"comparing the saved weights {single} and {dist} failed", _tail(proc.stderr))
    summary = json.loads(proc.stdout)
    result = compare_weights(summary, tolerance, round_off(*runs) if runs is not None else None)
    result.summary, result.tolerance = summary, tolerance
    return result


def compare_runs(single: Run, dist: Run, *, tolerance: float = DEFAULT_WEIGHT_TOLERANCE,
                 loss_rtol: float = LOSS_RTOL, loss_atol: float = LOSS_ATOL, saved: Optional[WeightsResult] = None,
                 judge_steps: bool = True, python: str = sys.executable) -> Verdict:
    """The verdict on two finished runs: every step's loss and gradient norm (when
    both were instrumented and ``judge_steps``), the instrumentation's final weights
    (when both recorded them) and ``saved`` (compare_saved's result) if given."""
    notes = []
    record = reference_record(single) if single.ranks else {"losses": [], "grad_norms": []}
    if not single.ranks:
        judge_steps = False
        notes.append("the reference ran without instrumentation: its steps are not compared")
    rows = compare_steps(record, dist.ranks, loss_rtol, loss_atol)
    context = _round_off(record, dist, rows, judge_steps)
    if saved is not None and saved.summary is not None:  # the saved files, by the same rules as the weights
        summary, saved_tolerance = saved.summary, saved.tolerance
        saved = compare_weights(summary, saved_tolerance if saved_tolerance is not None else tolerance, context)
        saved.summary, saved.tolerance = summary, saved_tolerance
    weights = None
    if single.weights is not None and dist.weights is not None:
        weights = compare_weight_files(python, single.weights, dist.weights, tolerance, context)
    elif saved is None:
        missing = "single" if single.weights is None else "distributed"
        notes.append(f"the {missing} run recorded no final weights (it ended without the ranks together)")
    return Verdict(rows, weights, record, dist.ranks, notes, saved=saved, judge_steps=judge_steps)


def _round_off(record: dict, dist: "Run", rows: Sequence[StepRow], judge_steps: bool) -> RoundOff:
    other = dist.ranks[0] if dist.ranks else {}
    return RoundOff(merged_params(record, other), record, other,
                    steps_agree=judge_steps and bool(rows) and not any(r.problem for r in rows))


def round_off(single: "Run", dist: "Run", loss_rtol: float = LOSS_RTOL, loss_atol: float = LOSS_ATOL) -> RoundOff:
    """What tells round-off from divergence in two finished runs' weights (compare_runs' context):
    their parameters' records and whether every step agreed (never, for an uninstrumented reference)."""
    if not single.ranks:
        return RoundOff()
    record = reference_record(single)
    return _round_off(record, dist, compare_steps(record, dist.ranks, loss_rtol, loss_atol), True)


def merged_params(single: dict, dist: dict) -> List[dict]:
    """The single run's record of each parameter, named by the distributed run where it had no name."""
    mine, theirs = single.get("params") or [], dist.get("params") or []
    if len(mine) != len(theirs):
        return list(mine)
    return [{**a, "name": a.get("name") or b.get("name")} for a, b in zip(mine, theirs)]


@dataclass
class TrainsResult:
    ok: bool
    losses: List[Optional[float]]
    problem: str = ""


def loss_falls(losses: Sequence[Optional[float]], min_drop: float) -> TrainsResult:
    """The verdict for a run with nothing to compare against (new random initial
    weights, bf16 parameters): it learns. Every step's loss is finite and the
    last is below the first by ``min_drop`` of it."""
    losses = list(losses)
    if len(losses) < 2:
        return TrainsResult(False, losses, f"need at least two steps' losses, found {losses}")
    if not all(v is not None and math.isfinite(v) for v in losses):
        return TrainsResult(False, losses, f"non-finite loss: {losses}")
    first, last = losses[0], losses[-1]
    if not last < first * (1 - min_drop):  # type: ignore[operator]
        return TrainsResult(False, losses, f"loss did not fall by {min_drop:.0%}: first {first:.4f}, "
                            f"last {last:.4f} (all: {[round(v, 4) for v in losses]})")  # type: ignore[arg-type]
    return TrainsResult(True, losses)


def trains(run: Run, min_drop: float) -> TrainsResult:
    """loss_falls on a run's per-step losses, the mean over its ranks."""
    return loss_falls(reference_record(run)["losses"], min_drop)


def _band(tolerance: float) -> dict:
    return {"tolerance": tolerance, "ulps": bands.DTYPE_ULPS if tolerance > 0 else 0}


def _weight_summary(python: str, single: Path, dist: Path, tolerance: float) -> dict:
    band = json.dumps(_band(tolerance))
    proc = subprocess.run([python, str(COMPARE_SCRIPT), str(single), str(dist), band], capture_output=True, text=True)
    if proc.returncode != 0:
        raise VerifyError("comparing the final weights failed", _tail(proc.stderr))
    return json.loads(proc.stdout)


def compare_weight_files(python: str, single: Path, dist: Path, tolerance: float,
                         context: Optional[RoundOff] = None) -> WeightsResult:
    return compare_weights(_weight_summary(python, single, dist, tolerance), tolerance, context)


def compare_initial_weights(python: str, single: Run, dist: Run, tolerance: float) -> Optional[WeightsResult]:
    """The parameters each optimizer held before its first update (``initial.pt``),
    single run against the distributed run's gathered ones; None when either run
    did not write them. Runs whose steps cannot be compared (random draws differ)
    must still start from the same model: ranks that each built their own weights
    and sharded a mix of them show here."""
    files = [run.directory / "initial.pt" for run in (single, dist)]
    if not all(path.is_file() for path in files):
        return None
    record = reference_record(single) if single.ranks else {}
    context = RoundOff(params=merged_params(record, dist.ranks[0] if dist.ranks else {}))
    result = compare_weights(_weight_summary(python, *files, tolerance), tolerance, context)
    if not result.ok:
        result.problem = result.problem.replace("final weights differ", "the weights before the first step differ")
    return result


def compare_rank_weight_files(python: str, dist: Run, nproc: int) -> Optional[WeightsResult]:
    """Each rank's own gathered weights (``weights_rank{r}.pt``, r > 0) against rank 0's; None when not written."""
    if dist.weights is None:
        return None
    files = [(r, dist.directory / f"weights_rank{r}.pt") for r in range(1, nproc)]
    if not files or not all(path.is_file() for _, path in files):
        return None
    return compare_rank_weights([(r, _weight_summary(python, dist.weights, path, 0.0)) for r, path in files])


# -- the retrofit -------------------------------------------------------------


def retrofit_in_memory(script: Path, into: Path) -> Path:
    """Retrofit `script` with keep_global_batch into `into/<same name>`; refusals are errors."""
    from fsdp2_retrofit.options import RetrofitOptions
    from fsdp2_retrofit.pipeline import rewrite_source
    from fsdp2_retrofit.report import InputError

    try:
        source = script.read_bytes()
    except OSError as exc:
        raise VerifyError(f"{script}: cannot read: {exc.strerror}") from None
    try:
        result = rewrite_source(source, str(script), RetrofitOptions(keep_global_batch=True))
    except InputError as exc:
        where = f"{script}:{exc.line}" if exc.line else str(script)
        raise VerifyError(f"{where}: {exc.message}") from None
    if result.refusals:
        first = result.refusals[0]
        raise VerifyError(f"{script}:{first.line}: cannot retrofit: {first.code} {first.what}: {first.why}")
    # the script's items, then those of the modules it edits (a loader built there)
    items = [*result.attention, *(a for sibling in result.siblings for a in sibling.attention)]
    kept = next((a for a in items if a.differs and a.what.startswith("--keep-global-batch:")), None)
    if kept is not None:  # the runs would train on different global batches: nothing fair to compare
        raise VerifyError(f"{kept.path or script}:{kept.line}: cannot keep the global batch: {kept.what}",
                          "divide it yourself and pass the result with --retrofitted FILE (or a retrofit that keeps "
                          "the per-rank batch with --per-rank-arg NAME)")
    into.mkdir(parents=True, exist_ok=True)
    folder = script.resolve().parent
    base = Path(os.path.commonpath([folder, *(Path(s.path).resolve().parent for s in result.siblings)]))
    if base != folder:  # a module of the project's own package (`mingpt/trainer.py` above `projects/chargpt/`)
        _copy_python_files(base, into)
    target = into / script.resolve().relative_to(base)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(result.code)
    for sibling in result.siblings:  # the modules it edits, where the script's imports find them first
        rel = Path(sibling.path).resolve().relative_to(base)
        (into / rel).parent.mkdir(parents=True, exist_ok=True)
        (into / rel).write_bytes(sibling.code)
    return target


def retrofit_import_root(target: Path, into: Path) -> List[str]:
    """Where the retrofit's imports of the project's package must look first: the copy of the
    project when the retrofit edits modules above the script's folder (its script then sits below
    `into`), else nowhere more."""
    return [str(into.resolve())] if target.resolve().parent != into.resolve() else []


_NOT_COPIED = {"__pycache__", "site-packages", "node_modules"}


def _copy_python_files(base: Path, into: Path) -> None:
    """The project's Python files under `base`, at their places below `into` (a package the
    script imports is read from the copy, whole, with its edited modules; data stays where it is)."""
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(base)
        if any(part.startswith(".") or part in _NOT_COPIED for part in rel.parts[:-1]):
            continue
        (into / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, into / rel)


# -- the whole command ------------------------------------------------------------


def verify(settings: VerifySettings, console=None) -> int:
    """Run, compare, report (on `console`, a rich Console); return the exit code."""
    from rich.console import Console

    console = console or Console(highlight=False)
    root, cleanup = None, False
    previous = _exit_on_sigterm()
    try:
        try:
            _needs_torch(settings.python)
            root, cleanup = _work_root(settings)
            verdict = _run_and_compare(settings, root)
        except VerifyError as exc:
            import click

            click.echo(f"error: {exc.message}", err=True)
            if exc.detail:
                click.echo(exc.detail, err=True)
            if settings.json_path:
                _write_json(settings.json_path, {"exit_code": EXIT_ERROR, "error": exc.message, "detail": exc.detail})
            return EXIT_ERROR
        render(verdict, settings, console)
        if settings.json_path:
            _write_json(settings.json_path, report_json(verdict, settings))
        return verdict.exit_code
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if cleanup and root is not None:
            shutil.rmtree(root, ignore_errors=True)


def _exit_on_sigterm():
    """A SIGTERM (a harness's timeout) ends verify as an exception would, so the run it is waiting for
    is killed whole on the way out (_launch); returns the handler it replaced (None: not the main thread)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def leave(signum, frame):
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, leave)


def _needs_torch(python: str) -> None:
    """Both runs import torch (and the instrumentation does, at start-up): without it in
    `python` nothing else verify could say helps, so it is said first."""
    from fsdp2_retrofit.torch_env import install_hint, missing_torch

    missing = missing_torch("verify", python)
    if missing:
        raise VerifyError(missing, install_hint(python))


RUN_FOLDERS = ("single", "dist", "retrofitted", "single-epochs")  # what verify writes in its work directory


def _work_root(settings: VerifySettings) -> Tuple[Path, bool]:
    if settings.keep_runs is None:
        return Path(tempfile.mkdtemp(prefix="fsdp2-verify-")), True
    root = settings.keep_runs.resolve()
    if root.exists() and not root.is_dir():
        raise VerifyError(f"--keep-runs {root}: not a directory")
    # Other entries may be there: inputs a script reads at ../data from its run folder
    earlier = [name for name in RUN_FOLDERS if (root / name).exists()]
    if earlier:
        raise VerifyError(f"--keep-runs {root}: holds {', '.join(earlier)} of an earlier run (use a new directory)")
    root.mkdir(parents=True, exist_ok=True)
    return root, False


# torchrun's summary of a worker the kernel killed (the OOM killer's SIGKILL leaves no Python traceback)
_SIGKILLED = re.compile(r"exitcode\s*:\s*-9\b|Signal 9 \(SIGKILL\)")


def float64_failure(exc: VerifyError) -> VerifyError:
    """A run that failed under --dtype float64, said with its likely cause: a process killed by
    SIGKILL is out of memory (float64 doubles it), anything else a script that may not run in float64."""
    if _SIGKILLED.search(exc.detail or ""):
        return VerifyError(f"{exc.message}; with --dtype float64: a process was killed by SIGKILL without a Python "
                           f"error, most likely out of memory (float64 doubles the memory of the parameters, "
                           f"gradients, optimizer state and activations); run without --dtype float64 or with "
                           f"smaller sizes", exc.detail)
    return VerifyError(f"{exc.message}; with --dtype float64: the script may not run in float64 "
                       f"(verify casts the default dtype, .float() and each module's inputs, parameters and "
                       f"buffers, not every tensor the script makes in float32 itself); run without --dtype "
                       f"float64 to compare it as written", exc.detail)


def _run_and_compare(settings: VerifySettings, root: Path) -> Verdict:
    try:
        verdict = _run_and_compare_runs(settings, root)
    except VerifyError as exc:
        if settings.dtype != "float64" or "did not finish within" in exc.message:
            raise
        raise float64_failure(exc) from None
    if settings.dtype == "float64":
        verdict.notes.extend(float64_notes(verdict.single, verdict.ranks))
    return verdict


def float64_notes(single: dict, ranks: Sequence[dict]) -> List[str]:
    """Under --dtype float64, what stayed in a lower precision (the script set its dtype itself):
    those parameters, losses and gradients are judged at their own dtype's resolution."""
    notes = []
    for label, record in (("the single run", single), ("the distributed run", ranks[0] if ranks else {})):
        params = record.get("params") or []
        lower = [p for p in params if p.get("dtype") not in (None, "float64")]
        if lower:
            names = ", ".join(f"{p.get('name') or '?'} ({p.get('dtype')})" for p in lower[:3])
            notes.append(f"--dtype float64: {len(lower)} of {len(params)} parameters of {label} stayed in a lower "
                         f"precision ({names}{', ...' if len(lower) > 3 else ''}): judged at their dtype")
        for what in ("loss", "grad"):
            dtype = record.get(f"{what}_dtype")
            if dtype not in (None, "float64"):
                notes.append(f"--dtype float64: {label} computed its {'loss' if what == 'loss' else 'gradients'} "
                             f"in {dtype}")
    return notes


def _run_and_compare_runs(settings: VerifySettings, root: Path) -> Verdict:
    if not settings.script.is_file():
        raise VerifyError(f"{settings.script}: no such file")
    if settings.retrofitted is not None and not settings.retrofitted.is_file():
        raise VerifyError(f"{settings.retrofitted}: no such file")
    args = single_run_args(settings.script_args, settings.per_rank_args, settings.nproc)
    if settings.retrofitted is None:
        dist_script = retrofit_in_memory(settings.script, root / "retrofitted")
        import_root = retrofit_import_root(dist_script, root / "retrofitted")
    else:
        dist_script, import_root = settings.retrofitted.resolve(), []

    # The single run first, then the retrofit (a retrofit may write into inputs both runs read:
    # a DCP save over a checkpoint file of --run-files). Where the retrofit's samplers were set
    # to other epochs than 0, 1, 2, ... (a script counting epochs from 1), the single run runs
    # again, its sampler drawing those epochs' permutations.
    if settings.reuse_single is not None:
        single = reuse_single(settings, args)
    else:
        _progress(f"running {settings.script} in one process ({settings.steps} steps at most)...")
        single = run_single(settings, args, root / "single")
    _progress(f"running {dist_script.name} under torchrun --nproc_per_node {settings.nproc}...")
    dist = run_distributed(settings, dist_script, root / "dist", import_root)
    epochs = sampler_epochs(dist)
    if epochs:
        if settings.reuse_single is not None:
            single = reuse_single(settings, args, epochs)
        else:
            _progress(f"running {settings.script} in one process again, at the epochs the retrofit's samplers "
                      f"were set to ({', '.join(map(str, epochs[:4]))}{', ...' if len(epochs) > 4 else ''})...")
            single = run_single(settings, args, root / "single-epochs", epochs)

    verdict = compare_runs(single, dist, tolerance=settings.tolerance, loss_rtol=settings.loss_rtol,
                           loss_atol=settings.loss_atol, python=settings.python)
    verdict.rank_weights = compare_rank_weight_files(settings.python, dist, settings.nproc)
    verdict.initial = compare_initial_weights(settings.python, single, dist, settings.tolerance)
    if single.ranks:
        verdict.global_batch = global_batch_problem(reference_record(single), dist.ranks)
    if single.epilogue is not None:
        verdict.notes.append(f"the original itself failed after training ({single.epilogue}): not the retrofit's doing")
    elif dist.epilogue is not None:
        verdict.epilogue = dist.epilogue
    elif settings.to_end:
        verdict.notes.append("both scripts ran to their end after the recorded steps")
    if verdict.same_data_on_every_rank:
        verdict.notes.append("every rank recorded the same loss at every step: the ranks read the same data")
    return verdict


def _progress(message: str) -> None:
    import click

    click.echo(message, err=True)


def report_json(verdict: Verdict, settings: VerifySettings) -> dict:
    first = verdict.first_divergence
    return {
        "exit_code": verdict.exit_code,
        "equivalent": verdict.equivalent,
        "summary": verdict.summary(),
        "script": str(settings.script),
        "retrofitted": str(settings.retrofitted) if settings.retrofitted else None,
        "nproc": settings.nproc,
        "steps_requested": settings.steps,
        "dtype": settings.dtype,
        "tolerance": {"weights_max_abs": settings.tolerance, "loss_rtol": settings.loss_rtol,
                      "loss_atol": settings.loss_atol},
        "first_diverging_step": first.step if first else None,
        "max_loss_diff": max((r.loss_diff for r in verdict.rows if r.loss_diff is not None), default=None),
        "first_divergence": first.problem if first else None,
        "steps": [r.as_json() for r in verdict.rows],
        "weights": verdict.weights.as_json(settings.tolerance) if verdict.weights else None,
        "saved_weights": verdict.saved.as_json(settings.tolerance) if verdict.saved else None,
        "memory": {
            "single": {"kind": verdict.single.get("memory_kind"), "peak_bytes": verdict.single.get("peak_memory_bytes")},
            "ranks": [{"rank": r["rank"], "kind": r.get("memory_kind"), "peak_bytes": r.get("peak_memory_bytes")}
                      for r in verdict.ranks],
        },
        "rank_weights": ({"ok": verdict.rank_weights.ok, "max_abs_diff": verdict.rank_weights.max_abs_diff,
                          "problem": verdict.rank_weights.problem or None} if verdict.rank_weights else None),
        "initial_weights": verdict.initial.as_json(settings.tolerance) if verdict.initial else None,
        "same_data_on_every_rank": verdict.same_data_on_every_rank,
        "global_batch": verdict.global_batch,
        "epilogue": verdict.epilogue,
        "to_end": settings.to_end,
        "sampler_epochs": [int(e) for e in (verdict.ranks[0].get("sampler_epochs") or [])] if verdict.ranks else [],
        "within_noise": _noise_json(verdict, settings),
        "notes": verdict.notes,
    }


def _noise_json(verdict: Verdict, settings: VerifySettings) -> dict:
    ok, why = within_noise(verdict.rows, settings.noise_rtol)
    return {"ok": ok, "why": why, "rtol": settings.noise_rtol}


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def render(verdict: Verdict, settings: VerifySettings, console) -> None:
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"{settings.script.name}: 1 process vs {settings.nproc} ranks", title_justify="left")
    table.add_column("step", justify="right")
    table.add_column("loss single", justify="right")
    table.add_column(f"loss dist (mean of {len(verdict.ranks)})", justify="right")
    table.add_column("difference", justify="right")
    table.add_column("grad norm single", justify="right")
    table.add_column("grad norm dist", justify="right")
    table.add_column("")
    for row in verdict.rows:
        diff = row.loss_diff
        table.add_row(str(row.step), _fmt(row.loss_single), _fmt(row.loss_dist),
                      "-" if diff is None else f"{diff:.2e}", _fmt(row.grad_norm_single), _fmt(row.grad_norm_dist),
                      Text("ok", style="green") if not row.problem else Text("DIVERGED", style="bold red"))
    console.print(table)
    chart = loss_chart([r.loss_single for r in verdict.rows], [r.loss_dist for r in verdict.rows])
    if chart:
        console.print("\n".join(chart), markup=False, highlight=False)

    memory = Table(title="peak memory", title_justify="left")
    memory.add_column("run")
    memory.add_column("peak", justify="right")
    memory.add_column("vs single", justify="right")
    memory.add_column("measured as")
    base = verdict.single.get("peak_memory_bytes")
    memory.add_row("single process", _bytes(base), "1.00x", _memory_kind(verdict.single))
    for rec in verdict.ranks:
        peak = rec.get("peak_memory_bytes")
        ratio = f"{peak / base:.2f}x" if peak and base else "-"
        memory.add_row(f"rank {rec['rank']}", _bytes(peak), ratio, _memory_kind(rec))
    console.print(memory)

    if verdict.weights is not None:
        w = verdict.weights
        value = "-" if w.max_abs_diff is None else f"{w.max_abs_diff:.3e}"
        console.print(f"final weights: {w.count_single} tensors, max |single - distributed| = {value} "
                      f"(tolerance {settings.tolerance:g}, or {bands.DTYPE_ULPS} spacings of the dtype; "
                      f"rule: {w.rule})", markup=False)
        if w.rule_detail:
            console.print(f"  {w.rule}: {w.rule_detail}", markup=False)
        if not w.ok and w.problem:
            console.print(f"  {w.problem}", markup=False)
    if verdict.saved is not None and verdict.saved.max_abs_diff is not None:
        console.print(f"saved weights: {verdict.saved.count_single} tensors, max |single - distributed| = "
                      f"{verdict.saved.max_abs_diff:.3e} (tolerance {settings.tolerance:g})", markup=False)
    if verdict.initial is not None:
        i = verdict.initial
        console.print("start: the distributed run started from the single run's weights" if i.ok
                      else f"start: {i.problem}", markup=False)
    if verdict.rank_weights is not None:
        r = verdict.rank_weights
        console.print("ranks: every rank ended with the same weights" if r.ok else f"ranks: {r.problem}", markup=False)
    if verdict.global_batch is not None:
        console.print(f"global batch: differs at {verdict.global_batch}", markup=False)
    for note in verdict.notes:
        console.print(f"note: {note}", markup=False)
    style = "bold green" if verdict.equivalent else "bold red"
    console.print(Text(verdict.summary(), style=style))


def _memory_kind(rec: dict) -> str:
    return {"cuda": "torch.cuda.max_memory_allocated", "rss": "max RSS (ru_maxrss)"}.get(rec.get("memory_kind"), "-")
