"""One `check` run over many files: read, prefilter, lint (in worker processes when
there are many candidates), write fixes atomically, collect results in path order."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple, Type

from fsdp2_retrofit.report import InputError
from .rules import Rule

# Below this many files to lint (that pass the prefilter and miss the results cache),
# starting worker processes costs more than it saves.
PARALLEL_MIN_FILES = 16


@dataclass
class FileResult:
    path: str
    findings: list = field(default_factory=list)
    original: bytes = b""
    fixed: Optional[bytes] = None
    applied: int = 0
    bare_noqa: int = 0
    error: Optional[InputError] = None
    initial: list = field(default_factory=list)  # with `fixed`: the findings of `original`
    handed: list = field(default_factory=list)  # analysis.sharding.Handed: what it hands other project files


@dataclass(frozen=True)
class CheckJob:
    rules: Tuple[Type[Rule], ...]
    fix: bool = False
    unsafe_fixes: bool = False
    # the project's files outside the run that hand its files sharded modules (check/importers.py):
    # found and asked, with these excludes; their summaries cached on disk unless `cache` is False
    importers: bool = True
    exclude: Tuple[str, ...] = ()
    cache: bool = True


def read_for_check(path: str) -> bytes:
    """The bytes of a file to lint; InputError (one line) when it is not a text file."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise InputError(f"cannot read: {(exc.strerror or str(exc)).lower()}") from None
    nul = data.find(b"\0")
    if nul != -1:
        raise InputError("binary file (contains NUL bytes), not a Python file", data.count(b"\n", 0, nul) + 1)
    return data


def lint_one(job: CheckJob, path: str, data: bytes, received=()) -> FileResult:
    from .lint import lint_source

    try:
        result = lint_source(data, path, job.rules, fix=job.fix, unsafe_fixes=job.unsafe_fixes, received=received)
    except Exception as exc:  # a bug in a rule: report this file, check the others
        if os.environ.get("FSDP2_RETROFIT_TRACEBACK"):
            raise
        detail = str(exc).splitlines()[0] if str(exc) else ""
        return FileResult(path, error=InputError(
            f"internal error: {type(exc).__name__}: {detail} (set FSDP2_RETROFIT_TRACEBACK=1 for the traceback)"
        ))
    return FileResult(
        path=path,
        findings=[f.detached() for f in result.findings],
        original=data if result.fixed is not None else b"",
        fixed=result.fixed,
        applied=result.applied,
        bare_noqa=result.bare_noqa,
        error=result.error,
        initial=[f.detached() for f in result.initial],
        handed=result.handed,
    )


def _lint_path(job: CheckJob, path: str, received=(), lookup: bool = True) -> FileResult:
    """The file read and linted, through the results cache (check/results_cache.py) unless it is
    off; `lookup` False: the caller has just missed it (only the new result is kept)."""
    try:
        data = read_for_check(path)
    except InputError as exc:
        return FileResult(path, error=exc)
    from .results_cache import ResultsCache

    cache = ResultsCache.for_job(job)
    if cache is None:
        return lint_one(job, path, data, received)
    found = cache.load(path, data, received) if lookup else None
    if found is not None:
        return found
    from fsdp2_retrofit.analysis.model_classes import recording_reads

    with recording_reads() as looked_at:
        result = lint_one(job, path, data, received)
    cache.store(path, data, received, result, looked_at)
    return result


def run(
    job: CheckJob,
    paths: Sequence[str],
    workers: Optional[int] = None,
    on_result: Optional[Callable[[FileResult], None]] = None,
) -> List[FileResult]:
    """Lint every path; results in the order of `paths`. Files that no selected rule
    can apply to (the text prefilter) are only compiled by Python (a syntax error or bytes
    that do not decode are errors, exit 2), not parsed, and never sent to a worker. A file
    whose classes or functions another file of the run hands a sharded module
    (`Trainer(model, ...)` after `fully_shard(model)` in train.py) is linted (again) knowing
    it: its `self.model.forward(x)` is a forward call on a sharded module, also when train.py
    is not in the run (check/importers.py: pre-commit's batches judge it as `check .` does).
    Each pass answers from the results cache where it can (check/results_cache.py): a warm run
    of unchanged files parses nothing and starts no worker."""
    from .lint import applicable
    from .results_cache import ResultsCache

    cache = ResultsCache.for_job(job)  # a hit is neither prefiltered, parsed nor sent to a worker
    results: List[Optional[FileResult]] = [None] * len(paths)
    candidates: List[int] = []
    for i, path in enumerate(paths):
        try:
            data = read_for_check(path)
        except InputError as exc:
            results[i] = FileResult(path, error=exc)
            continue
        results[i] = cache.load(path, data) if cache is not None else None
        if results[i] is not None:
            pass
        elif applicable(data, job.rules, path):
            candidates.append(i)
        else:  # not parsed by libcst; a syntax error is still reported (compiled: lint.compiled)
            results[i] = FileResult(path, error=_compile_error(data, path))
            if cache is not None:
                cache.store(path, data, (), results[i])
        if on_result is not None and results[i] is not None:
            on_result(results[i])
    workers = workers if workers is not None else (os.cpu_count() or 1)
    if workers > 1 and len(candidates) >= PARALLEL_MIN_FILES:
        from concurrent.futures import ProcessPoolExecutor

        chunk = max(1, len(candidates) // (workers * 4))
        with ProcessPoolExecutor(max_workers=workers) as pool:
            done = pool.map(_lint_path, [job] * len(candidates), [paths[i] for i in candidates],
                            [()] * len(candidates), [False] * len(candidates), chunksize=chunk)
            for i, result in zip(candidates, done):
                results[i] = result
                if on_result is not None:
                    on_result(result)
    else:
        for i in candidates:
            results[i] = _lint_path(job, paths[i], lookup=False)
            if on_result is not None:
                on_result(results[i])
    _lint_receivers(job, paths, results, on_result)
    return [r for r in results if r is not None]


def _compile_error(data: bytes, path: str) -> Optional[InputError]:
    from .lint import compiled

    try:
        compiled(data, path)
    except InputError as exc:
        return exc
    return None


def _lint_receivers(job: CheckJob, paths: Sequence[str], results: list, on_result) -> None:
    """The second pass: each file of the run that other files hand sharded modules (files of the
    run, and the project's files outside it), linted with them."""
    handed: dict = {}
    for result in results:
        for h in (result.handed if result is not None else ()):
            handed.setdefault(os.path.realpath(h.file), []).append(h)
    if job.importers:
        from .importers import received_from_outside

        ok = [p for p, r in zip(paths, results) if r is not None and r.error is None and r.fixed is None]
        for target, records in received_from_outside(job.rules, paths, job.exclude, job.cache, ok).items():
            handed.setdefault(target, []).extend(records)
    for i, path in enumerate(paths):
        received = handed.get(os.path.realpath(path))
        if not received or results[i] is None or results[i].error is not None or results[i].fixed is not None:
            continue
        # in the order of the files that hand them, wherever they were found (as `check .` reads them)
        received = sorted(received, key=lambda h: os.path.realpath(h.where.rpartition(":")[0]))
        again = _lint_path(job, path, tuple(received))
        if again.error is None:
            results[i] = again
            if on_result is not None:
                on_result(again)
