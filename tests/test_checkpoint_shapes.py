"""Checkpoint shapes of issue 16 item 3, on the rewrite alone (no torch): pickled modules
reloaded (converted, or refused with FSR804 where loading into the sharded model would
change what trains), best.pt copies, and the placeholders of values a checkpoint dict
holds besides states. The fixtures whole_model_reload, best_copy(_async) and
checkpoint_extras run them (tests/test_checkpoint_reload.py, test_execution.py,
test_checkpoint.py)."""
from __future__ import annotations

from pathlib import Path

from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "rewrite"
RELOAD = (FIXTURES / "whole_model_reload" / "input.py").read_text()
RELOAD_LINE = "    model = torch.load(args.best, weights_only=False)\n"
COPY = (FIXTURES / "best_copy" / "input.py").read_text()


def _rewrite(text: str, **options):
    return rewrite_source(text.encode(), "train.py", RetrofitOptions(**options))


def _line_of(text: str, fragment: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if fragment in line)


def test_the_fixtures_hold_the_lines_these_tests_edit():
    assert RELOAD.count(RELOAD_LINE) == 1 and "            torch.save(model, args.best)\n" in RELOAD
    assert "            shutil.copyfile(args.last, args.best)\n" in COPY


def test_a_reload_into_another_name_is_refused():
    text = RELOAD.replace(RELOAD_LINE, "    best_model = torch.load(args.best, weights_only=False)\n    best_model.eval()\n")
    result = _rewrite(text)
    assert [(r.code, r.line) for r in result.refusals] == [("FSR804", _line_of(text, "best_model = torch.load("))]
    assert "second copy of `model`" in result.refusals[0].what


def test_a_reload_inside_the_training_loop_is_refused():
    text = RELOAD.replace(RELOAD_LINE, "").replace(
        "            torch.save(model, args.best)\n",
        "            torch.save(model, args.best)\n            model = torch.load(args.best, weights_only=False)\n")
    result = _rewrite(text)
    assert [(r.code, r.line) for r in result.refusals] == [("FSR804", _line_of(text, "model = torch.load(args"))]
    assert "inside a loop" in result.refusals[0].what


def test_a_reload_before_more_training_is_refused():
    more = "    for x, y in loader:\n        loss = F.cross_entropy(model(x), y)\n        optimizer.zero_grad()\n" \
           "        loss.backward()\n        optimizer.step()\n"
    text = RELOAD.replace("    model.eval()\n    print(f\"best val", more + "    model.eval()\n    print(f\"best val")
    result = _rewrite(text)
    assert [r.code for r in result.refusals] == ["FSR804"]
    assert "a training loop runs after it" in result.refusals[0].what


def test_a_reload_after_training_loads_into_the_sharded_model():
    result = _rewrite(RELOAD)
    assert not result.refusals
    code = result.code.decode()
    assert "torch.load(args" not in code
    assert "dcp.load(model_state, checkpoint_id=args.best)\n    set_model_state_dict(model, model_state)" in code
    assert any(c.line == _line_of(RELOAD, "model = torch.load(args") and "pickled module" in c.what for c in result.changes)
    assert not any("train/eval mode" in a.what for a in result.attention)  # model.eval() follows


def test_a_reload_without_eval_after_it_says_the_mode_is_not_restored():
    result = _rewrite(RELOAD.replace("    model.eval()\n    print(f\"best val", "    print(f\"best val"))
    assert not result.refusals
    assert any("train/eval mode" in a.what for a in result.attention)


def test_with_export_full_rank_0_reads_the_file_after_a_barrier_and_broadcasts():
    result = _rewrite(RELOAD, export="full")
    assert not result.refusals
    code = result.code.decode()
    barrier = code.index("dist.barrier()  # every rank reads the file rank 0 wrote")
    load = code.index("set_model_state_dict(model, torch.load(args.best, weights_only=False) if rank == 0 else {}, "
                      "options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))")
    assert barrier < load


def test_a_load_of_a_copy_waits_at_a_barrier_and_is_not_asked_about():
    result = _rewrite(COPY)
    assert not result.refusals
    code = result.code.decode()
    assert "shutil.copytree(args.last, args.best, dirs_exist_ok=True)" in code
    assert code.index("dist.barrier()  # rank 0 copies") < code.index("dcp.load(ckpt, checkpoint_id=args.best)")
    assert not any("check that it names one" in a.what for a in result.attention)


def test_with_async_saves_the_copy_waits_for_the_running_save():
    code = _rewrite(COPY, async_checkpoint=True).code.decode()
    wait = code.index("if checkpoint_future is not None:  # the copy reads the finished checkpoint")
    assert code.index("checkpoint_future = dcp.async_save({\"model\"") < wait < code.index("shutil.copytree(")


def test_the_placeholders_of_an_rng_state_a_namespace_a_config_and_a_tensor():
    text = (FIXTURES / "checkpoint_extras" / "input.py").read_text()
    result = _rewrite(text)
    assert not result.refusals
    code = result.code.decode()
    for entry in ('"rng": torch.get_rng_state(),', '"args": None,', '"config": {"dim": None, "depth": None, "lr": None},',
                  '"lr_sum": lr_sum.clone() if torch.is_tensor(lr_sum) else None,'):
        assert entry in code, entry
    assert not any("may be saved as a tensor" in a.what for a in result.attention)
    assert any("every rank restores that copy" in c.why for c in result.changes)


def test_a_tensor_bound_only_after_the_load_keeps_a_none_placeholder_and_the_attention():
    text = (FIXTURES / "checkpoint_extras" / "input.py").read_text()
    text = text.replace("    lr_sum = torch.zeros(())\n", "").replace(
        "    while step < args.steps:\n", "    if step == 0:\n        lr_sum = torch.zeros(())\n    while step < args.steps:\n")
    result = _rewrite(text)
    assert '"lr_sum": None,' in result.code.decode()
    assert any("'lr_sum'" in a.what and "may be saved as a tensor" in a.what for a in result.attention)
