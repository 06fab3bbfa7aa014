"""resume: a checkpoint read before the model it fills is built. nanoGPT's order (the
config read first, the model built from it, the optimizer's state in a later `if` with
the same test) is converted (fixture resume_config_first, golden and resumed by
test_checkpoint, from its DCP directory and from a single-GPU file); any other such order stays refused (FSR801)."""
from __future__ import annotations

from pathlib import Path

from fsdp2_retrofit.pipeline import rewrite_source

CASE = Path(__file__).resolve().parents[1] / "fixtures" / "rewrite" / "resume_config_first"


def _rewrite(text: str):
    return rewrite_source(text.encode(), "train.py")


def _variant(old: str, new: str) -> str:
    text = (CASE / "input.py").read_text()
    assert old in text
    return text.replace(old, new)


def test_the_config_first_order_is_converted():
    result = _rewrite((CASE / "input.py").read_text())
    assert not result.refusals
    code = result.code.decode()
    values = code.index('ckpt = {"model_args": {"dim": None, "depth": None}, "step": None}')
    shard = code.index("fully_shard(model, mesh=mesh)")
    state = code.index('"model": get_model_state_dict(model)')
    assert values < shard < state  # values before the build, states after sharding
    # one torch.load: a single file (a single-GPU run's) there, told apart from the DCP directory
    assert code.count("torch.load(") == 1
    assert code.index("if os.path.isdir(") < values < code.index("torch.load(") < shard
    assert code.index("if not ckpt_options.full_state_dict:") < state


def test_without_the_later_if_the_early_read_stays_refused():
    text = _variant('    if args.init_from == "resume":\n        optimizer.load_state_dict', '    if step > 0:\n        optimizer.load_state_dict')
    assert [r.code for r in _rewrite(text).refusals] == ["FSR801"]


def test_a_path_rebound_between_the_two_reads_stays_refused():
    text = _variant("    model.to(device)\n", "    model.to(device)\n    args.out_dir = 'elsewhere'\n")
    assert [r.code for r in _rewrite(text).refusals] == ["FSR801"]


WARM = CASE.parent / "warm_start_flag"


def test_a_warm_start_kept_in_a_variable_is_a_full_state_load_and_flagged():
    text = (WARM / "input.py").read_text()
    old = "        model.load_state_dict(torch.load(args.init_from, map_location=device))\n"
    assert old in text
    text = text.replace(old, "        state = torch.load(args.init_from, map_location=device)\n        model.load_state_dict(state)\n")
    result = _rewrite(text)
    assert not result.refusals
    assert "set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))" in result.code.decode()
    assert [a.line for a in result.attention if "never names this script's own model save" in a.what] == [54]


def test_the_dispatch_and_the_resume_are_reported_as_what_they_are():
    result = _rewrite((WARM / "input.py").read_text())
    either = [c.line for c in result.changes if c.code == "resume" and "by what it is at run time" in c.what]
    flagged = [a.line for a in result.attention if "loaded as a DCP checkpoint directory of this script" in a.what]
    # 54: --init-from, a bare model load; 61: --resume, kept in a variable (no longer flagged: both told apart)
    assert (either, flagged) == ([54, 61], [])
