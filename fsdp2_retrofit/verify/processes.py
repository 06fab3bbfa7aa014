"""The processes a run starts, where they are when its time is up, and that none outlives it.

No torch here. torchrun starts each worker in a session of its own, so killing
torchrun's process group leaves the ranks running; a rank whose launcher died
is re-parented and no longer a descendant either. So every process a run starts
carries a mark in its environment (``MARK``: inherited by torchrun's workers
and their DataLoader workers), and ``kill_run`` kills the launcher's
descendants and every process with the mark, until none is left. Linux reads
both from /proc; elsewhere only the launcher's process group is killed.

Before killing a run that timed out, ``where_ranks_are`` asks each instrumented
rank where it is: the instrumentation registered faulthandler on SIGUSR1
(``stack_{pid}.txt``) and wrote its pid (``pid_rank{r}.json``) and step count
(``progress_rank{r}.json``); ``timeout_diagnosis`` reads the stacks and says
whether they show a hang (every rank waiting in torch.distributed) or a run
still working, and on which line.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set

MARK = "FSDP2_RETROFIT_VERIFY_RUN"
PROC = Path("/proc")


def marked(env: dict) -> tuple:
    """(a copy of env with a new run mark, the mark)."""
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    return {**env, MARK: tag}, tag


def _stat(pid: int) -> Optional[tuple]:
    """(state, parent pid) of a process, None when it is gone."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()
    return fields[0], int(fields[1])


def _pids() -> List[int]:
    try:
        return [int(p.name) for p in PROC.iterdir() if p.name.isdigit()]
    except OSError:
        return []


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    if PROC.is_dir():
        stat = _stat(pid)
        return stat is not None and stat[0] not in ("Z", "X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def descendants(pid: int) -> Set[int]:
    children: Dict[int, List[int]] = {}
    for p in _pids():
        stat = _stat(p)
        if stat is not None:
            children.setdefault(stat[1], []).append(p)
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _environ(pid: int) -> Optional[bytes]:
    """The process's environment block, None when it cannot be read (gone, another user's)."""
    try:
        return (PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return None


def with_mark(tag: Optional[str]) -> Set[int]:
    """The processes whose environment holds this run's mark (readable ones: this user's)."""
    return _scan_marks(tag)[0]


def _scan_marks(tag: Optional[str]) -> tuple:
    """(the marked processes, those whose environment read empty). A process in the middle of
    execve reads empty: its parent's Popen has returned (close-on-exec fired) before the kernel
    set the new image's environment up (measured: 98 of 2000 ``Popen`` calls read right after
    they returned); such a process is looked at again, not taken for unmarked."""
    if not tag:
        return set(), set()
    needle = f"{MARK}={tag}".encode()
    found, unsettled = set(), set()
    for p in _pids():
        if p == os.getpid():
            continue
        env = _environ(p)
        if env is None:
            continue
        if not env:
            unsettled.add(p)
        elif needle in env.split(b"\0"):
            found.add(p)
    return found, unsettled


def run_processes(root: Optional[int], tag: Optional[str]) -> Set[int]:
    """The live processes of a run: its launcher, the launcher's descendants, every marked process
    (``root`` None: the marked ones only, the launcher being gone)."""
    return _run_processes(root, tag)[0]


def _run_processes(root: Optional[int], tag: Optional[str]) -> tuple:
    """(the run's live processes, live processes whose environment read empty)."""
    marked_now, unsettled = _scan_marks(tag)
    pids = ({root} | descendants(root) if root is not None else set()) | marked_now
    pids.discard(os.getpid())
    return {p for p in pids if alive(p)}, {p for p in unsettled - pids if alive(p)}


def kill_run(root: Optional[int], tag: Optional[str], rounds: int = 50, settle_rounds: int = 10) -> Set[int]:
    """SIGKILL the run's processes until none is left (a rank may still be forking a DataLoader
    worker); returns those that survived every round (none, unless they belong to another user).
    While a process's environment reads empty (one still in execve) the scan is repeated, up to
    ``settle_rounds`` times (a process started with an empty environment reads empty for good)."""
    left: Set[int] = set()
    unsettled_rounds = 0
    for _ in range(rounds):
        left, unsettled = _run_processes(root, tag)
        if not left:
            if not unsettled or unsettled_rounds >= settle_rounds:
                return left
            unsettled_rounds += 1
        if root is not None:
            try:
                os.killpg(root, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.1)
    return left


# -- where the ranks were --------------------------------------------------------


@dataclass
class RankPlace:
    rank: int
    pid: int
    running: bool
    steps: Optional[int]  # optimizer steps it had finished (None: no record of any)
    stack: str = ""  # faulthandler's dump of every thread, "" when none came


def where_ranks_are(directory: Path, tree: Iterable[int], wait: float = 6.0) -> List[RankPlace]:
    """Ask each instrumented rank of the run (its pid in ``tree``) for its stacks (SIGUSR1 ->
    faulthandler) and wait up to ``wait`` seconds for them; a rank whose dump has not come
    halfway through is asked once more (a dump missing within 3 s failed the e2e timeout test
    about one run in four here, alone or under load)."""
    tree = set(tree)
    places = []
    for path in sorted(directory.glob("pid_rank*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        rank, pid = int(record["rank"]), int(record["pid"])
        steps = _read_steps(directory / f"progress_rank{rank}.json")
        running = pid in tree and alive(pid)
        places.append(RankPlace(rank, pid, running, steps))
        if running:
            try:
                os.kill(pid, signal.SIGUSR1)
            except (ProcessLookupError, PermissionError):
                pass
    started = time.monotonic()
    asked_again = False
    while True:
        for place in places:
            if place.running and not place.stack:
                place.stack = _read_text(directory / f"stack_{place.pid}.txt")
        if all(p.stack or not p.running for p in places) or time.monotonic() > started + wait:
            return places
        if not asked_again and time.monotonic() > started + wait / 2:
            asked_again = True
            for place in places:
                if place.running and not place.stack and alive(place.pid):
                    try:
                        os.kill(place.pid, signal.SIGUSR1)
                    except (ProcessLookupError, PermissionError):
                        pass
        time.sleep(0.1)


def _read_steps(path: Path) -> Optional[int]:
    try:
        return int(json.loads(path.read_text(encoding="utf-8"))["steps"])
    except (OSError, ValueError, KeyError):
        return None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)', re.MULTILINE)


def _threads(stack: str) -> List[List[tuple]]:
    """Each thread's frames, innermost first: (file, line, function)."""
    threads = []
    for block in re.split(r"\n\s*\n", stack.strip()):
        frames = [(m["file"], int(m["line"]), m["func"]) for m in _FRAME.finditer(block)]
        if frames:
            threads.append(frames)
    return threads


def _library(path: str) -> bool:
    parts = Path(path).parts
    return ("site-packages" in parts or "dist-packages" in parts or "_site" in parts
            or any(p.startswith("python3") for p in parts[-3:-1]))


def _in_distributed(path: str) -> bool:
    return "torch/distributed" in path.replace(os.sep, "/")


@dataclass
class Place:
    """Where a rank's main thread was: its innermost line of the script's own code, and the
    innermost frame of all (a library's), and whether that is inside torch.distributed."""

    line: Optional[str]
    inner: Optional[str]
    in_collective: bool


def main_thread_place(stack: str) -> Optional[Place]:
    threads = _threads(stack)
    # the main thread's outermost frame is the script's module level
    main = next((t for t in threads if t[-1][2] == "<module>"), threads[0] if threads else None)
    if not main:
        return None
    own = next((f for f in main if not _library(f[0])), None)
    inner = main[0]
    called = main[: main.index(own)] if own else main  # what the script's line was inside
    return Place(f"{Path(own[0]).name}:{own[1]} in {own[2]}" if own else None,
                 f"{_short(inner[0])}:{inner[1]} in {inner[2]}" if inner is not own else None,
                 any(_in_distributed(f[0]) for f in called))


def _short(path: str) -> str:
    parts = Path(path).parts
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor) + 1:])
    return Path(path).name


def timeout_diagnosis(places: List[RankPlace]) -> str:
    """What the ranks were doing when the time ran out, and whether that shows a hang."""
    if not places:
        return "no rank had started its script's instrumentation (where it was is unknown)"
    said, waiting, working = [], [], []
    for p in places:
        steps = f"{p.steps} step(s) done" if p.steps is not None else "no step done"
        if not p.running:
            said.append(f"rank {p.rank} (pid {p.pid}) had ended ({steps})")
            continue
        place = main_thread_place(p.stack) if p.stack else None
        if place is None:
            said.append(f"rank {p.rank} (pid {p.pid}) still running, {steps}, its stack could not be read")
            continue
        where = " ".join(x for x in (f"at {place.line}" if place.line else "", f"inside {place.inner}"
                                     if place.inner else "") if x)
        (waiting if place.in_collective else working).append(p.rank)
        said.append(f"rank {p.rank} (pid {p.pid}) still running, {steps}, {where}"
                    + (" (waiting in torch.distributed)" if place.in_collective else ""))
    running = [p for p in places if p.running]
    if running and len(waiting) == len(running):
        verdict = "every rank still running was waiting in torch.distributed: a hang (a collective not every " \
                  "rank reaches, or ranks in different collectives)"
    elif waiting:
        verdict = (f"rank(s) {', '.join(map(str, waiting))} waited in torch.distributed while rank(s) "
                   f"{', '.join(map(str, working))} were elsewhere: a hang if those never reach it, else a slow run")
    elif working:
        verdict = "no rank was waiting in torch.distributed: the run was still working, not hung as far as its " \
                  "stacks show (a slow run or a loaded machine: raise --timeout)"
    else:
        verdict = "no stack shows where the run was: not known to be a hang"
    return "; ".join(said) + ". " + verdict
