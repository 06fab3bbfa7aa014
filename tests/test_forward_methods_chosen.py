"""A method called on a model whose class is chosen at run time is registered as an FSDP2 forward method
under `hasattr` when only some of the classes have it (forward_method_class_choice, with its golden and
execution tests); the same with the classes in a module beside the script."""
from __future__ import annotations

from pathlib import Path

import pytest

from fsdp2_retrofit.pipeline import rewrite_source

CASE = Path(__file__).resolve().parents[1] / "fixtures" / "rewrite" / "forward_method_class_choice" / "input.py"


def _split(tmp_path: Path) -> Path:
    """The fixture written as a project: its two classes in model.py, the script calling `models.RNNModel`."""
    src = CASE.read_text()
    start, end = src.index("class RNNModel"), src.index("def main():")
    (tmp_path / "model.py").write_text("import torch.nn as nn\n\nNTOKEN = 12\n\n\n" + src[start:end].rstrip() + "\n")
    main = (src[:start] + src[end:]).replace("NTOKEN = 12\n", "").replace(
        "import torch.nn as nn\n", "import torch.nn as nn\n\nimport model as models\nfrom model import NTOKEN\n")
    main = main.replace("model = RNNModel(16)", "model = models.RNNModel(16)").replace(
        "model = BagModel(16)", "model = models.BagModel(16)")
    (tmp_path / "main.py").write_text(main)
    return tmp_path / "main.py"


def test_the_classes_in_a_module_beside_the_script_get_the_same_guarded_registration(tmp_path):
    script = _split(tmp_path)
    result = rewrite_source(script.read_bytes(), str(script))
    assert not result.refusals, result.refusals
    text = result.code.decode()
    assert '    if hasattr(model, "init_hidden"):\n        register_fsdp_forward_method(model, "init_hidden")\n' in text
    assert text.index("fully_shard(model, mesh=mesh)") < text.index("register_fsdp_forward_method(model")


def test_a_method_every_class_has_is_registered_plainly():
    src = CASE.read_text().replace(
        "        return self.decoder(self.encoder(tokens)), hidden\n",
        "        return self.decoder(self.encoder(tokens)), hidden\n\n"
        "    def init_hidden(self, bsz):\n        return None\n")
    text = rewrite_source(src.encode(), "train.py").code.decode()
    assert '    register_fsdp_forward_method(model, "init_hidden")\n' in text and "hasattr" not in text


TERNARY = Path(__file__).resolve().parents[1] / "fixtures" / "rewrite" / "forward_method_class_ternary" / "input.py"
_PICK = '    net = CharGRU(12) if args.arch == "gru" else CharConv(12)\n'


def _without_registration(text: str) -> str:
    return "".join(line for line in text.splitlines(True) if "begin_state\")" not in line)


def _rewrite_and_check(src: str, tmp_path: Path, name: str = "train.py"):
    """The rewrite's output, and FSD122's findings on it and on it with the registration taken out."""
    from fsdp2_retrofit.check.lint import lint_source
    from fsdp2_retrofit.check.rules import all_rules

    result = rewrite_source(src.encode(), str(tmp_path / name))
    assert not result.refusals, result.refusals
    text = result.code.decode()
    kept = [f for f in lint_source(text.encode(), str(tmp_path / name), all_rules()).findings if f.code == "FSD122"]
    dropped = [f for f in lint_source(_without_registration(text).encode(), str(tmp_path / name), all_rules()).findings
               if f.code == "FSD122"]
    return text, kept, dropped


@pytest.mark.parametrize("pick, helper", [
    # the fixture: a conditional expression
    (_PICK, ""),
    # the classes the other way round
    ('    net = CharConv(12) if args.arch != "gru" else CharGRU(12)\n', ""),
    # a helper function of the script returning one of them, other names
    ("    net = make_net(args.arch, 12)\n",
     "def make_net(kind, width):\n    if kind == \"gru\":\n        return CharGRU(width).to(\"cpu\")\n"
     "    return CharConv(width)\n\n\n"),
    # an if/else whose last branch builds the class without the method (check read the last binding only)
    ('    if args.arch == "gru":\n        net = CharGRU(12)\n    else:\n        net = CharConv(12)\n', ""),
])
def test_a_class_chosen_at_run_time_is_read_alike_by_rewrite_and_check(pick, helper, tmp_path):
    """The rewrite registers begin_state under hasattr however the choice is written, and check (FSD122)
    reads the same classes: nothing on the output, the call flagged once the registration is taken out."""
    src = TERNARY.read_text()
    assert _PICK in src
    src = src.replace(_PICK, pick).replace("def main():", helper + "def main():")
    text, kept, dropped = _rewrite_and_check(src, tmp_path)
    assert '    if hasattr(net, "begin_state"):\n        register_fsdp_forward_method(net, "begin_state")\n' in text
    assert not kept, kept
    bare = _without_registration(text).splitlines()
    assert [f.line for f in dropped] == [next(i for i, line in enumerate(bare, 1) if "net.begin_state(" in line)]
