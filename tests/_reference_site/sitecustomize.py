"""Reference-run shuffling for the execution tests.

The harness puts this directory first on PYTHONPATH when it runs an original,
single-process script. With FSDP2_RETROFIT_REFERENCE_SAMPLER=1 set, every
``torch.utils.data.RandomSampler`` yields the permutation that
``DistributedSampler(shuffle=True, seed=0)`` draws before it splits it between
ranks: at the e-th iteration of a sampler instance (e = 0, 1, ...) it yields
``torch.randperm(n, generator=torch.Generator().manual_seed(e))``.

DistributedSampler hands rank r the indices ``perm[r::world]``, so batch k of
the single run at batch ``world * B`` holds exactly the samples of batch k on
all ranks at batch B, and a shuffled single run can be compared weight for
weight with its retrofit (which calls ``set_epoch(epoch)`` each epoch).

Limits: the dataset length must be divisible by the world size (then
DistributedSampler neither pads nor truncates). Samplers drawing with
replacement or a different number of samples keep their usual behaviour.
Like DistributedSampler, the patched sampler draws nothing from the global RNG.

Without the environment variable this module does nothing and imports nothing.
"""
import os

if os.environ.get("FSDP2_RETROFIT_REFERENCE_SAMPLER") == "1":
    import torch
    from torch.utils.data import RandomSampler

    _original_iter = RandomSampler.__iter__

    def _reference_iter(self):
        n = len(self.data_source)
        if self.replacement or self.num_samples != n:
            return _original_iter(self)
        epoch = getattr(self, "_reference_epoch", 0)
        self._reference_epoch = epoch + 1
        generator = torch.Generator()
        generator.manual_seed(0 + epoch)  # DistributedSampler: seed + epoch
        return iter(torch.randperm(n, generator=generator).tolist())

    RandomSampler.__iter__ = _reference_iter
