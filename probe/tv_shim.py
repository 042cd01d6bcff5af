"""Probes only: import torchvision's Python parts where its compiled ops cannot load (PyPI's CUDA
wheel beside a CPU-only torch). Its fake and autograd registrations of `torchvision::` ops fail
then; they are skipped while it imports (timm's models never call those ops). Imported by
probe/loss_outside.py when TV_SHIM=1 (see common.py).
"""
import torch
import torch.library

_orig_register_fake = torch.library.register_fake
_orig_register_autograd = torch.library.register_autograd


def _tolerant(orig):
    def wrap(op, *a, **k):
        if isinstance(op, str) and op.startswith("torchvision::"):
            if a or k.get("func") is not None:
                return None
            return lambda f: f
        return orig(op, *a, **k)
    return wrap


torch.library.register_fake = _tolerant(_orig_register_fake)
torch.library.register_autograd = _tolerant(_orig_register_autograd)
import torchvision  # noqa: E402,F401

torch.library.register_fake = _orig_register_fake
torch.library.register_autograd = _orig_register_autograd
