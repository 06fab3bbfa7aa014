"""A method called on a model whose class is chosen at run time is registered as an FSDP2 forward method
under `hasattr` when only some of the classes have it (forward_method_class_choice, with its golden and
execution tests); the same with the classes in a module beside the script."""
from __future__ import annotations

from pathlib import Path

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
