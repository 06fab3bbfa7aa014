"""The corpus harness's shim, run in every process of a corpus run (after verify's instrumentation).

It does two things, each switched by the environment, and nothing else:

* REALWORLD_SEED=N: ``torch.manual_seed(N + RANK)`` at start-up (RANK is 0 in
  the single run). An unseeded script then builds the single run's initial
  weights on rank 0 and other weights on the other ranks, as it would for a
  user (each process draws its own seed): a retrofit that does not make every
  rank start from rank 0's weights shows up as a divergence instead of being
  hidden by the harness.
* REALWORLD_SKIP_INTEGRITY=1: torchvision's CIFAR datasets skip their md5
  integrity check (synthetic batch files cannot match the real checksums), so
  ``download=True`` finds the files present and downloads nothing. The
  loading code (unpickling the batches) is torchvision's own, unchanged. The
  patch is applied when ``torchvision.datasets.cifar`` is first imported.
"""
import os
import sys


def _seed():
    value = os.environ.get("REALWORLD_SEED")
    if value:
        import torch

        torch.manual_seed(int(value) + int(os.environ.get("RANK", "0")))


def _patch_cifar(module):
    # the module's own check_integrity (by md5) becomes "the file exists"; used by
    # CIFAR10._check_integrity (download=True) and _load_meta
    module.check_integrity = lambda fpath, md5=None: os.path.isfile(fpath)


class _AfterImport:
    """A meta-path finder that patches a module right after its own loader ran."""

    target = "torchvision.datasets.cifar"

    def find_spec(self, name, path=None, target=None):
        if name != self.target:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module):
            original(module)
            _patch_cifar(module)

        loader.exec_module = exec_module
        return spec


if os.environ.get("REALWORLD_SKIP_INTEGRITY") == "1":
    sys.meta_path.insert(0, _AfterImport())
_seed()
