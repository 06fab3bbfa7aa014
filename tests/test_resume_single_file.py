"""resume: a checkpoint path this script saves with DCP may hold, before the first save,
the file a single-GPU run left there (a run switched to FSDP2 and resumed). The load is
told apart at run time: a directory with dcp.load, a file with torch.load and the
full-state setters, the file then moved aside for the DCP save. Fixture
resume_single_gpu_file (golden; executed by test_checkpoint: DCP 2->1/2/4 and the
single-GPU script's own file on 2 ranks); these are the shapes around it."""
from __future__ import annotations

from pathlib import Path

from fsdp2_retrofit.pipeline import rewrite_source

CASE = Path(__file__).resolve().parents[1] / "fixtures" / "rewrite" / "resume_single_gpu_file"
LOADS = '''        state = torch.load("checkpoint/last.pth")
        net.load_state_dict(state["net"])
        optimizer.load_state_dict(state["optim"])
        start_epoch = state["epoch"] + 1
        print(f"resumed after epoch {state['epoch']}")
'''


def _rewrite(old: str, new: str) -> str:
    text = (CASE / "input.py").read_text()
    assert old in text
    result = rewrite_source(text.replace(old, new).encode(), "train.py")
    assert not result.refusals, result.refusals
    return result.code.decode()


def _resume_changes(old: str, new: str):
    text = (CASE / "input.py").read_text().replace(old, new)
    return [c for c in rewrite_source(text.encode(), "train.py").changes if c.code == "resume"]


def test_the_kept_checkpoint_is_loaded_by_what_it_is():
    code = _rewrite(LOADS, LOADS)
    isdir = code.index('if os.path.isdir("checkpoint/last.pth"):')
    assert code.index('dcp.load(state, checkpoint_id="checkpoint/last.pth")') > isdir
    single = code.index('state = torch.load("checkpoint/last.pth", map_location="cpu")')
    numbered = code.index('if all(isinstance(k, int) for k in state["optim"]["state"]):')
    aside = code.index('os.replace("checkpoint/last.pth", "checkpoint/last.pth.single-gpu")')
    assert isdir < single < numbered < aside
    # the move is rank 0's, between two barriers every rank passes (no collective under the rank-0 `if`)
    assert '    dist.barrier()  # every rank has read the file' in code
    assert code.count("dist.barrier()  # every rank has read the file") == 1
    # and each of the two DCP saves waits at one more, after rank 0 moved a file at its path aside
    assert code.count("dist.barrier()") == 4 and code.count("dist.barrier()  # the path is free on every rank") == 2
    assert 'set_model_state_dict(net, state["net"], options=state_options)' in code
    assert 'set_optimizer_state_dict(net, optimizer, state["optim"], options=state_options)' in code
    assert "StateDictOptions(full_state_dict=True)" in code


def test_the_report_says_which_is_which():
    changes = _resume_changes(LOADS, LOADS)
    what = " ".join(c.what + " " + c.why for c in changes)
    assert "by what it is at run time" in what and "full_state_dict=True" in what and ".single-gpu" in what


def test_strict_false_reaches_both_options():
    code = _rewrite('net.load_state_dict(state["net"])', 'net.load_state_dict(state["net"], strict=False)\n'
                    '        optimizer.load_state_dict(state["optim"])  # again')
    assert "state_options = StateDictOptions(strict=False)" not in code  # the loads disagree: DCP only
    code = _rewrite('net.load_state_dict(state["net"])\n        optimizer.load_state_dict(state["optim"])',
                    'net.load_state_dict(state["net"], strict=False)')
    assert "state_options = StateDictOptions(strict=False)" in code
    assert "state_options = StateDictOptions(full_state_dict=True, strict=False)" in code


def test_a_bare_model_resume_before_the_save_is_told_apart_and_moved_aside():
    code = _rewrite(LOADS, '        net.load_state_dict(torch.load("checkpoint/last.pth"))\n'
                           '        print("resumed after epoch 0")\n')
    isdir = code.index('if os.path.isdir("checkpoint/last.pth"):')
    broadcast = code.index('set_model_state_dict(net, torch.load("checkpoint/last.pth") if rank == 0 else {}, '
                           'options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))')
    aside = code.index('        os.replace("checkpoint/last.pth", "checkpoint/last.pth.single-gpu")')
    assert isdir < broadcast < aside
    assert code.index("    dist.barrier()", aside) > aside


def test_a_bare_reload_after_this_runs_save_stays_a_dcp_load():
    tail = '    torch.save(net.state_dict(), args.out)\n'
    code = _rewrite(tail, tail + '    net.load_state_dict(torch.load(args.out))\n')
    assert "os.path.isdir(\"checkpoint/last.pth\")" in code  # the resume at the start
    reload = code[code.index("dcp.save(get_model_state_dict(net), checkpoint_id=args.out)"):]
    assert "os.path.isdir" not in reload and "dcp.load(state_dict, checkpoint_id=args.out)" in reload


def test_a_kept_reload_after_this_runs_save_stays_a_dcp_load():
    tail = '    torch.save(net.state_dict(), args.out)\n'
    code = _rewrite(tail, tail + '    final = torch.load("checkpoint/last.pth")\n    net.load_state_dict(final["net"])\n')
    reload = code[code.index("dcp.save(get_model_state_dict(net), checkpoint_id=args.out)"):]
    assert "os.path.isdir" not in reload and 'dcp.load(final, checkpoint_id="checkpoint/last.pth")' in reload
    assert 'set_model_state_dict(net, final["net"])' in reload
