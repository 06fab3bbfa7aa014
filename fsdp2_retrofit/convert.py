"""`fsdp2-retrofit convert SRC DST`: a DCP checkpoint directory to one torch.save file,
and a torch.save file to a DCP directory.

The rewritten scripts save sharded state as DCP directories; single-GPU code
(evaluation, the original script) reads one torch.save file. The direction follows
SRC: a directory becomes a file, a file becomes a directory. Only this command
imports torch, and only when it runs (`rewrite` and `check` never do).

What changes on the way, besides the format:
- an optimizer state dict of the FSDP2 run (get_optimizer_state_dict: keyed by
  parameter name) is written keyed by number, in its param_groups' order, as
  torch.optim's own `state_dict()` writes it, so `optimizer.load_state_dict` of the
  single-GPU script takes it; a numbered one that went through DCP (which stores
  keys as strings) gets its numbers back;
- a pickled module (`torch.save(model, path)`) becomes its state dict.
Each is reported in a note line.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List

MIN_TORCH = (2, 6)


class ConvertError(Exception):
    """One line: what is wrong with SRC or DST (the command exits 2)."""


@dataclass
class Converted:
    direction: str  # "dcp->file" | "file->dcp"
    entries: List[str] = field(default_factory=list)  # top-level keys, described
    notes: List[str] = field(default_factory=list)


def convert(src: str, dst: str, *, force: bool = False, trust_pickle: bool = False) -> Converted:
    """Convert SRC into DST (the direction by what SRC is); raise ConvertError."""
    source, target = Path(src), Path(dst)
    if not os.path.lexists(source):
        raise ConvertError(f"{src}: no such file or directory")
    if source.is_dir():
        if not (source / ".metadata").is_file():
            raise ConvertError(f"{src}: not a DCP checkpoint directory (it has no .metadata file)")
        if not os.access(source / ".metadata", os.R_OK):
            raise ConvertError(f"{src}: cannot read its .metadata file (permission denied)")
    elif not source.is_file():
        raise ConvertError(f"{src}: not a regular file or a directory")
    elif not os.access(source, os.R_OK):
        raise ConvertError(f"{src}: cannot read it (permission denied)")
    if os.path.lexists(target):
        if not force:
            raise ConvertError(f"{dst}: already exists (pass --force to replace it)")
        if target.resolve() == source.resolve():
            raise ConvertError(f"{dst}: is SRC itself")
    parent = target.resolve().parent
    if not parent.is_dir():
        raise ConvertError(f"{dst}: its directory {parent} does not exist")
    torch = _torch()
    if source.is_dir():
        return _dcp_to_file(torch, source, target)
    return _file_to_dcp(torch, source, target, trust_pickle)


def _torch():
    try:
        import torch
    except ImportError as exc:  # found but broken (a missing shared library, a half install)
        raise ConvertError(f"convert cannot import torch: {exc}") from None
    found = tuple(int(p) for p in re.findall(r"\d+", torch.__version__)[:2])
    if found < MIN_TORCH:
        raise ConvertError(f"convert needs torch >= 2.6 (torch.distributed.checkpoint.format_utils); found {torch.__version__}")
    return torch


# -- a DCP directory to one file --------------------------------------------------------


def _dcp_to_file(torch, source: Path, target: Path) -> Converted:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    done = Converted("dcp->file")
    try:  # first on its own: DCP's loader logs a traceback per failed attempt
        FileSystemReader(str(source)).read_metadata()
    except Exception as exc:
        raise ConvertError(f"{source}: not a DCP checkpoint directory (its .metadata does not read: "
                           f"{type(exc).__name__}: {_first_line(exc)})") from None
    fd, tmp = tempfile.mkstemp(dir=target.resolve().parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    try:
        try:
            dcp_to_torch_save(str(source), tmp)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            raise ConvertError(f"{source}: cannot read the DCP checkpoint: {_first_line(exc)}") from None
        # our own file, just written from what DCP unpickled: no other code runs here
        state = torch.load(tmp, map_location="cpu", mmap=True, weights_only=False)
        done.notes.extend(_numbered_optimizers(torch, state, ""))
        if done.notes:  # written anew beside it (`tmp` is mapped into memory)
            renumbered = tmp + ".numbered"
            torch.save(state, renumbered)
            del state
            os.replace(renumbered, tmp)
        else:
            del state
        _put_in_place(tmp, target)
        tmp = ""
    finally:
        for leftover in (tmp, tmp + ".numbered" if tmp else ""):
            if leftover and os.path.exists(leftover):
                os.unlink(leftover)
    done.entries = _describe(torch, torch.load(target, map_location="cpu", mmap=True, weights_only=False))
    return done


def _numbered_optimizers(torch, obj: Any, where: str) -> List[str]:
    """Rewrite each optimizer state dict inside `obj` to torch.optim's numbered form; notes."""
    notes: List[str] = []
    if not isinstance(obj, dict):
        return notes
    groups = obj.get("param_groups")
    if "state" in obj and isinstance(obj["state"], dict) and _is_param_groups(groups):
        params = [p for g in groups for p in g["params"]]
        name = where or "the checkpoint"
        if params and all(isinstance(p, str) for p in params) and len(set(params)) == len(params):
            index = {p: i for i, p in enumerate(params)}
            missing = [k for k in obj["state"] if k not in index]
            if missing:
                raise ConvertError(f"{name}: optimizer state for {missing[0]!r}, a parameter no param group lists")
            obj["state"] = {index[k]: v for k, v in obj["state"].items()}
            start = 0
            for g in groups:
                g["params"] = list(range(start, start + len(g["params"])))
                start += len(g["params"])
            notes.append(f"{name}: optimizer state keyed by parameter name (get_optimizer_state_dict) is numbered "
                         "in its param_groups' order, as optimizer.state_dict() writes it")
        elif all(isinstance(p, int) for p in params) and any(isinstance(k, str) for k in obj["state"]):
            known = set(params)
            if not all(isinstance(k, int) or (k.isdigit() and int(k) in known) for k in obj["state"]):
                raise ConvertError(f"{name}: optimizer state keys {sorted(map(str, obj['state']))[:3]} match no "
                                   "parameter number of its param_groups")
            obj["state"] = {int(k): v for k, v in obj["state"].items()}
            notes.append(f"{name}: optimizer state keys back to parameter numbers (DCP stores keys as strings)")
        return notes
    for key, value in obj.items():
        notes.extend(_numbered_optimizers(torch, value, f"{where}.{key}" if where else str(key)))
    return notes


def _is_param_groups(groups) -> bool:
    return isinstance(groups, list) and bool(groups) and all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)


# -- one file to a DCP directory --------------------------------------------------------


def _file_to_dcp(torch, source: Path, target: Path, trust_pickle: bool) -> Converted:
    import argparse

    import torch.distributed.checkpoint as dcp

    done = Converted("file->dcp")
    with open(source, "rb") as f:
        head = f.read(4)
    if not (head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"):  # torch.save's zip, or a legacy pickle
        raise ConvertError(f"{source}: not a torch.save checkpoint (neither a zip archive nor a pickle)")
    try:
        if trust_pickle:
            state = torch.load(source, map_location="cpu", weights_only=False)
        else:
            # argparse.Namespace (a script's saved arguments) only sets attributes
            with torch.serialization.safe_globals([argparse.Namespace]):
                state = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:
        text = str(exc)
        if not trust_pickle and "Weights only load failed" in text:
            found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
            if found:
                raise ConvertError(f"{source}: holds {found.group(1)}, which torch.load(weights_only=True) does not "
                                   "unpickle; if you trust the file, pass --trust-pickle (unpickling runs code from "
                                   "it)") from None
            detail = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", text)
            why = detail.group(1) if detail else "it does not unpickle"
            raise ConvertError(f"{source}: not a torch.save checkpoint ({why})") from None
        raise ConvertError(f"{source}: not a torch.save checkpoint ({type(exc).__name__}: {_first_line(exc)})") from None
    if isinstance(state, torch.nn.Module):
        done.notes.append(f"{source}: a pickled module (torch.save(model, ...)): its state_dict() is written")
        state = state.state_dict()
    if not isinstance(state, dict):
        raise ConvertError(f"{source}: holds a {type(state).__name__}, not a dict of state (a state dict or a "
                           "checkpoint dict): DCP saves dicts")
    done.notes.extend(_unnamed_optimizers(state, ""))
    done.notes.extend(_non_string_keys(state, ""))
    tmp = tempfile.mkdtemp(dir=target.resolve().parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 -> an ordinary directory
        try:
            with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.save(state, checkpoint_id=tmp, no_dist=True)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            raise ConvertError(f"{source}: DCP cannot save what it holds: {_first_line(exc)}") from None
        _put_in_place(tmp, target)
        tmp = ""
    finally:
        if tmp and os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    done.entries = _describe(torch, state)
    return done


def _unnamed_optimizers(obj: Any, where: str) -> List[str]:
    """A note for each optimizer state keyed by parameter number: the FSDP2 script's
    get_optimizer_state_dict keys by name, so its dcp.load finds no such entries."""
    if not isinstance(obj, dict):
        return []
    if isinstance(obj.get("state"), dict) and _is_param_groups(obj.get("param_groups")):
        params = [p for g in obj["param_groups"] for p in g["params"]]
        if params and all(isinstance(p, int) for p in params):
            return [f"{where or 'the checkpoint'}: optimizer state keyed by parameter number (optimizer.state_dict()) "
                    "is written as it is; the FSDP2 script's dcp.load into get_optimizer_state_dict (keyed by "
                    "parameter name) will not find it: load the other entries only (dcp.load reads just the keys "
                    "of the dict it is given), and train the optimizer state afresh"]
        return []
    notes: List[str] = []
    for key, value in obj.items():
        notes.extend(_unnamed_optimizers(value, f"{where}.{key}" if where else str(key)))
    return notes


def _non_string_keys(obj: Any, where: str) -> List[str]:
    if not isinstance(obj, dict):
        return []
    if isinstance(obj.get("state"), dict) and _is_param_groups(obj.get("param_groups")):
        return []  # an optimizer's: said above
    odd = [k for k in obj if not isinstance(k, str)]
    notes = [f"{where or 'the checkpoint'}: keys {odd[:3]} are not strings; DCP stores them as strings "
             f"({str(odd[0])!r})"] if odd else []
    for key, value in obj.items():
        notes.extend(_non_string_keys(value, f"{where}.{key}" if where else str(key)))
    return notes


# -- shared ------------------------------------------------------------------------------


def _put_in_place(tmp: str, target: Path) -> None:
    """Move the finished `tmp` to `target`; an existing target (--force) goes only after."""
    old = ""
    if os.path.lexists(target):
        old = tempfile.mkdtemp(dir=target.resolve().parent, prefix=f".{target.name}.", suffix=".old")
        os.rename(target, os.path.join(old, "previous"))
    os.rename(tmp, target)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def _describe(torch, state: Any) -> List[str]:
    """One short description a top-level entry: `model (24 tensors)`, `step = 6`."""
    if not isinstance(state, dict):
        return [type(state).__name__]
    if state and all(isinstance(v, torch.Tensor) for v in state.values()):
        return [f"{len(state)} tensors (a state dict)"]
    out = []
    for key, value in state.items():
        if isinstance(value, dict):
            tensors = sum(1 for _ in _tensors(torch, value))
            out.append(f"{key} ({tensors} tensors)" if tensors else f"{key} (a dict)")
        elif isinstance(value, torch.Tensor):
            out.append(f"{key} (a tensor {tuple(value.shape)})")
        elif isinstance(value, (int, float, str, bool)) or value is None:
            out.append(f"{key} = {value!r}"[:60])
        else:
            out.append(f"{key} ({type(value).__name__})")
    return out


def _tensors(torch, obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(torch, v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(torch, v)


def _first_line(exc: BaseException) -> str:
    """The error in one line; for DCP's CheckpointException (a traceback per rank) the
    last `SomeError: ...` line of it."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception): ", line)]
    if len(lines) > 1 and errors:
        return errors[-1]
    return lines[0] if lines else type(exc).__name__
