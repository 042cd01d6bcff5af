"""timm and diffusers models with the loss outside, as their training scripts write it:
`F.cross_entropy(pmodel(x), y)` or `F.mse_loss(pmodel(noisy, t).sample, noise)`, in train mode with
the models' own randomness on (timm's drop_path: stochastic depth, one draw per sample).

torchrun --standalone --nproc_per_node=2 probe/loss_outside.py KIND [fp32|fp64]
KIND: convnext | efficientnet | vit-droppath | swin-droppath | resnet-bn | unet2d | unet2dcond | vae
(unet2dcond: UNet2DConditionModel (32, 64), cross-attention dim 32, called as diffusers' tutorial does,
`pmodel(noisy, t, encoder_hidden_states=h).sample`; vae: AutoencoderKL (32, 64) reconstruction MSE;
resnet-bn: timm resnet18-style with BatchNorm at 0.25 width.)
timm imports torchvision; where only PyPI's CUDA build is installed, its extension cannot load: run
with TV_SHIM=1, which lets torchvision's Python parts import without its compiled ops (unused here).
The last of the 3 batches has 5 rows (a data set's remainder: uneven over the ranks).
Prints loss, gradient and parameter differences against serial separately (max abs, and relative to
the largest serial value), one line a step.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.nn.functional as F
from common import Timer, finish, maxdiff, say, setup

import autopar

if os.environ.get("TV_SHIM"):
    import tv_shim  # noqa: F401

kind = sys.argv[1] if len(sys.argv) > 1 else "convnext"
dtype = torch.float64 if len(sys.argv) > 2 and sys.argv[2] == "fp64" else torch.float32
mesh = setup()
torch.manual_seed(0)
B = 8
g = torch.Generator().manual_seed(1234)

kwarg_names: tuple[str, ...] = ()  # trailing inputs passed by keyword
if kind in ("convnext", "efficientnet", "vit-droppath", "swin-droppath", "resnet-bn"):
    import timm

    if kind == "convnext":
        model = timm.create_model("convnext_atto", num_classes=10, depths=(1, 1, 2, 1), dims=(8, 16, 24, 32),
                                  drop_path_rate=0.1)
        shape = (3, 32, 32)
    elif kind == "efficientnet":
        from timm.models.efficientnet import _gen_efficientnet

        model = _gen_efficientnet("efficientnet_b0", channel_multiplier=0.25, depth_multiplier=0.25,
                                  pretrained=False, num_classes=10, drop_path_rate=0.1)
        shape = (3, 32, 32)
    elif kind == "vit-droppath":
        model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2,
                                  num_heads=4, num_classes=10, drop_path_rate=0.2)
        shape = (3, 32, 32)
    elif kind == "resnet-bn":
        from timm.models.resnet import BasicBlock, ResNet

        model = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10, stem_width=8,
                       channels=(8, 16, 32, 64))
        shape = (3, 32, 32)
    else:
        model = timm.create_model("swin_tiny_patch4_window7_224", img_size=32, patch_size=2, embed_dim=16,
                                  depths=(2, 2), num_heads=(2, 4), window_size=4, num_classes=10,
                                  drop_path_rate=0.2)
        shape = (3, 32, 32)

    def make(n=B):
        return (torch.randn(n, *shape, generator=g, dtype=dtype),), torch.randint(0, 10, (n,), generator=g)

    def loss_of(m, inputs, target):
        return F.cross_entropy(m(*inputs), target)
elif kind == "unet2d":
    from diffusers import DDPMScheduler, UNet2DModel

    model = UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                        block_out_channels=(16, 32), norm_num_groups=8,
                        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                        up_block_types=("AttnUpBlock2D", "UpBlock2D"), dropout=0.1)
    sched = DDPMScheduler(num_train_timesteps=1000)

    def make(n=B):
        clean = torch.randn(n, 3, 16, 16, generator=g, dtype=dtype)
        noise = torch.randn(clean.shape, generator=g, dtype=dtype)
        t = torch.randint(0, 1000, (n,), generator=g)
        return (sched.add_noise(clean, noise, t), t), noise

    def loss_of(m, inputs, target):
        return F.mse_loss(m(*inputs).sample, target)
elif kind == "unet2dcond":
    from diffusers import DDPMScheduler, UNet2DConditionModel

    model = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                 block_out_channels=(32, 64), cross_attention_dim=32, norm_num_groups=8,
                                 down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), attention_head_dim=8)
    sched = DDPMScheduler(num_train_timesteps=1000)
    kwarg_names = ("encoder_hidden_states",)

    def make(n=B):
        lat = torch.randn(n, 4, 8, 8, generator=g, dtype=dtype)
        noise = torch.randn(lat.shape, generator=g, dtype=dtype)
        t = torch.randint(0, 1000, (n,), generator=g)
        h = torch.randn(n, 7, 32, generator=g, dtype=dtype)
        return (sched.add_noise(lat, noise, t), t, h), noise

    def loss_of(m, inputs, target):
        noisy, t, h = inputs
        return F.mse_loss(m(noisy, t, encoder_hidden_states=h).sample, target)
elif kind == "vae":
    from diffusers import AutoencoderKL

    model = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 64),
                          down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                          layers_per_block=1, norm_num_groups=8, sample_size=16)

    def make(n=B):
        x = torch.randn(n, 3, 16, 16, generator=g, dtype=dtype)
        return (x,), x.clone()

    def loss_of(m, inputs, target):
        return F.mse_loss(m(*inputs).sample, target)
else:
    raise SystemExit(kind)

model = model.to(dtype).train()
serial = copy.deepcopy(model)
exact = copy.deepcopy(model).double()  # serial in float64: how far float32 itself drifts
data = [make(), make(), make(B - 3)]  # the last batch: a data set's remainder (new shapes)
with Timer() as tm:
    n_pos = len(data[0][0]) - len(kwarg_names)
    pmodel = autopar.parallelize(model, mesh, example_inputs=data[0][0][:n_pos],
                                 example_kwargs=dict(zip(kwarg_names, data[0][0][n_pos:])) or None)
say(f"{kind} {dtype} mesh {tuple(mesh.shape)}: parallelize cpu {tm.cpu:.1f}s wall {tm.wall:.1f}s")
opt_s = torch.optim.SGD(serial.parameters(), lr=0.05, momentum=0.9)
opt_e = torch.optim.SGD(exact.parameters(), lr=0.05, momentum=0.9)
opt_p = torch.optim.SGD(pmodel.parameters(), lr=0.05, momentum=0.9)
tol = 2e-4 if dtype == torch.float32 else 1e-9


def worst(pairs):
    out, at = 0.0, "-"
    for name, a, b in pairs:
        d = maxdiff(a, b)
        scale = max(float(a.abs().max()) if a is not None and a.numel() else 0.0, 1e-12)
        if d / max(scale, 1.0) > out:
            out, at = d / max(scale, 1.0), name
    return out, at


ok = True
sp, pp = dict(serial.named_parameters()), dict(pmodel.named_parameters())
ep = dict(exact.named_parameters())
assert set(sp) == set(pp), sorted(set(sp) ^ set(pp))[:6]
for step, (inputs, target) in enumerate(data):
    opt_s.zero_grad(set_to_none=True)
    opt_p.zero_grad(set_to_none=True)
    opt_e.zero_grad(set_to_none=True)
    torch.manual_seed(100 + step)
    le = loss_of(exact, tuple(x.double() if x.is_floating_point() else x for x in inputs),
                 target.double() if target.is_floating_point() else target)
    le.backward()
    torch.manual_seed(100 + step)
    ls = loss_of(serial, inputs, target)
    ls.backward()
    after_serial = torch.get_rng_state()
    torch.manual_seed(100 + step)
    with Timer() as tm:
        lp = loss_of(pmodel, inputs, target)
        lp.backward()
    same_rng = torch.equal(after_serial, torch.get_rng_state())
    gd, gat = worst((n, sp[n].grad, pp[n].grad) for n in sp)
    drift, _ = worst((n, ep[n].grad, sp[n].grad) for n in sp)
    say(f"  serial {dtype} against serial float64: loss {maxdiff(le, ls):.2e}, grad {drift:.2e}")
    say(f"step {step}: loss {ls.item():.6f} diff {maxdiff(ls, lp):.2e}; grad diff {gd:.2e} ({gat});"
        f" generator left as serial's: {same_rng}; step cpu {tm.cpu:.2f}s")
    ok &= maxdiff(ls, lp) <= tol and gd <= tol and same_rng
    opt_s.step()
    opt_p.step()
    opt_e.step()
pd, pat = worst((n, sp[n].detach(), pp[n].detach()) for n in sp)
bd, bat = worst((n, b, dict(pmodel.named_buffers())[n]) for n, b in serial.named_buffers() if b.is_floating_point())
say(f"after 3 steps: serial against float64: param {worst((n, ep[n].detach(), sp[n].detach()) for n in sp)[0]:.2e}")
say(f"after 3 steps: param diff {pd:.2e} ({pat}); buffer diff {bd:.2e} ({bat})")
ok &= pd <= tol and bd <= tol
finish(ok)
