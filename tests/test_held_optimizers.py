"""Issue 27: an optimizer's state saved or loaded in a function other than the one that
builds it is followed by value (held_values): a global a helper reads, a parameter its
calls bind under another name, `self.<attr>` of an object handed it. The save becomes
dcp.save of get_optimizer_state_dict(<the model that optimizer trains>, <optimizer>);
where the calls disagree the file is refused at the call that lost it (FSR706, FSR805).
The fixtures checkpoint_helper_globals and checkpoint_holder_object run the first two
shapes under torchrun and resume from their checkpoints (test_execution.py,
test_checkpoint.py)."""
from __future__ import annotations

from pathlib import Path

from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "rewrite"
GLOBALS = (FIXTURES / "checkpoint_helper_globals" / "input.py").read_text()
HOLDER = (FIXTURES / "checkpoint_holder_object" / "input.py").read_text()
SAVE_CALL = "            save_checkpoint(step, args.ckpt)\n"
LOAD_CALL = "    step = load_checkpoint(net, optimizer, args.ckpt)\n"
BUILD = "    checkpointer = Checkpointer(net, opt, args.ckpt)\n"


class _Rewritten:
    def __init__(self, text: str):
        result = rewrite_source(text.encode(), "train.py", RetrofitOptions())
        self.refusals, self.code = result.refusals, result.code.decode()


def _rewrite(text: str) -> _Rewritten:
    return _Rewritten(text)


def _line_of(text: str, fragment: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if fragment in line)


def test_the_fixtures_hold_the_lines_these_tests_edit():
    assert GLOBALS.count(SAVE_CALL) == 1 and GLOBALS.count(LOAD_CALL) == 1 and HOLDER.count(BUILD) == 1


def test_a_save_helper_reading_the_optimizer_as_a_global_saves_its_dcp_state():
    result = _rewrite(GLOBALS)
    assert not result.refusals
    assert '"optimizer": get_optimizer_state_dict(net, optimizer)' in result.code
    assert "optimizer.state_dict()" not in result.code


def test_a_helper_handed_the_optimizer_under_other_names_saves_its_dcp_state():
    text = GLOBALS.replace("def save_checkpoint(step, path):\n    torch.save({\"model\": net.state_dict(), "
                           "\"optimizer\": optimizer.state_dict()",
                           "def save_checkpoint(model, opt, step, path):\n    torch.save({\"model\": model.state_dict(), "
                           "\"optimizer\": opt.state_dict()").replace(SAVE_CALL, SAVE_CALL.replace("(step", "(net, optimizer, step"))
    assert text != GLOBALS
    result = _rewrite(text)
    assert not result.refusals
    assert '"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)' in result.code


def test_an_object_keeping_the_optimizer_as_an_attribute_saves_and_loads_its_dcp_state():
    result = _rewrite(HOLDER)
    assert not result.refusals
    assert '"optimizer": get_optimizer_state_dict(self.model, self.optimizer)' in result.code
    assert "set_optimizer_state_dict(self.model, self.optimizer, ckpt[\"optimizer\"]" in result.code
    assert "torch.save(state" not in result.code and "self.optimizer.load_state_dict" not in result.code


def test_the_optimizers_model_is_found_by_value_not_as_the_helpers_one_model():
    """The helper reads `net` as a global but saves the state of the optimizer it is
    handed, which trains `head`: get_optimizer_state_dict takes `head`."""
    text = GLOBALS.replace(
        "def save_checkpoint(step, path):\n    torch.save({\"model\": net.state_dict(), \"optimizer\": optimizer.state_dict()",
        "def save_checkpoint(opt, step, path):\n    torch.save({\"model\": net.state_dict(), \"optimizer\": opt.state_dict()",
    ).replace(SAVE_CALL, "            save_checkpoint(head_opt, step, args.ckpt)\n").replace(
        "optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)\n",
        "optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)\nhead = nn.Linear(10, 10)\n"
        "head_opt = torch.optim.SGD(head.parameters(), lr=0.1)\n",
    ).replace("        loss = F.cross_entropy(net(x), y)\n", "        loss = F.cross_entropy(head(net(x)), y)\n"
              ).replace("        optimizer.step()\n", "        optimizer.step()\n        head_opt.step()\n")
    result = _rewrite(text)
    assert not result.refusals
    assert '"optimizer": get_optimizer_state_dict(head, opt)' in result.code


def test_a_call_handing_the_helper_something_else_is_refused_at_that_call():
    text = GLOBALS.replace(
        "def save_checkpoint(step, path):\n    torch.save({\"model\": net.state_dict(), \"optimizer\": optimizer.state_dict()",
        "def save_checkpoint(opt, step, path):\n    torch.save({\"model\": net.state_dict(), \"optimizer\": opt.state_dict()",
    ).replace(SAVE_CALL, "            save_checkpoint(optimizer, step, args.ckpt)\n").replace(
        "torch.save(net.state_dict(), args.out)\n", "save_checkpoint(None, step, args.out)\n")
    result = _rewrite(text)
    assert [(r.code, r.line) for r in result.refusals] == [("FSR706", _line_of(text, "save_checkpoint(None"))]
    assert "passes None as `opt`" in result.refusals[0].what


def test_a_load_helper_handed_another_optimizer_is_refused_at_that_call():
    text = GLOBALS.replace(LOAD_CALL, LOAD_CALL + "    load_checkpoint(net, torch.optim.SGD(net.parameters()), args.ckpt)\n")
    result = _rewrite(text)
    assert [(r.code, r.line) for r in result.refusals] == [("FSR805", _line_of(text, "torch.optim.SGD(net"))]


def test_an_attribute_assigned_again_is_refused_where_it_is_assigned():
    text = HOLDER.replace("    def save(self, step):\n",
                          "    def reset(self, optimizer):\n        self.optimizer = optimizer\n\n    def save(self, step):\n")
    result = _rewrite(text)
    assert [(r.code, r.line) for r in result.refusals] == [("FSR706", _line_of(text, "def reset(") + 1)]


def test_constructions_handing_different_values_are_refused_at_the_construction():
    text = HOLDER.replace(BUILD, BUILD + "    spare = Checkpointer(net, None, args.ckpt + \".spare\")\n")
    result = _rewrite(text)
    assert [(r.code, r.line) for r in result.refusals] == [("FSR706", _line_of(text, "spare = Checkpointer("))]
