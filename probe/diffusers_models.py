"""diffusers models with the loss outside, as their training scripts write it.

torchrun --standalone --nproc_per_node=4 probe/diffusers_models.py vae|unet1d|dit [float32|float64]
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.nn.functional as F
from common import Timer, compare, finish, maxdiff, say, setup
from diffusers import AutoencoderKL, DDPMScheduler, DiTTransformer2DModel, UNet1DModel

import autopar

kind = sys.argv[1] if len(sys.argv) > 1 else "vae"
dtype = getattr(torch, sys.argv[2] if len(sys.argv) > 2 else "float32")
mesh = setup()
B = 8
torch.manual_seed(0)
sched = DDPMScheduler(num_train_timesteps=1000)

if kind == "vae":
    model = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                          up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32),
                          layers_per_block=1, latent_channels=4, norm_num_groups=8, sample_size=16)
elif kind == "unet1d":
    model = UNet1DModel(block_out_channels=(8, 8, 16, 16), in_channels=14, out_channels=14,
                        time_embedding_type="positional", use_timestep_embedding=True, flip_sin_to_cos=False,
                        freq_shift=1.0, out_block_type="OutConv1DBlock", mid_block_type="MidResTemporalBlock1D",
                        down_block_types=("DownResnetBlock1D",) * 4, up_block_types=("UpResnetBlock1D",) * 3,
                        act_fn="swish")
elif kind == "dit":
    model = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                                  num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=10,
                                  norm_num_groups=4)
else:
    raise SystemExit(kind)
model = model.to(dtype)
serial = copy.deepcopy(model)
g = torch.Generator().manual_seed(1234)


def make():
    if kind == "vae":
        x = torch.randn(B, 3, 16, 16, generator=g, dtype=dtype)
        return (x,), x
    if kind == "unet1d":
        x0 = torch.randn(B, 14, 16, generator=g, dtype=dtype)
        noise = torch.randn(x0.shape, generator=g, dtype=dtype)
        t = torch.randint(0, 1000, (B,), generator=g)
        return (sched.add_noise(x0, noise, t), t), noise
    x0 = torch.randn(B, 4, 8, 8, generator=g, dtype=dtype)
    noise = torch.randn(x0.shape, generator=g, dtype=dtype)
    t = torch.randint(0, 1000, (B,), generator=g)
    labels = torch.randint(0, 10, (B,), generator=g)
    return (sched.add_noise(x0, noise, t), t, labels), noise


def run(m, args):
    if kind == "dit":
        return m(args[0], timestep=args[1], class_labels=args[2]).sample
    return m(*args).sample


data = [make() for _ in range(3)]
with Timer() as t:
    if kind == "dit":
        a = data[0][0]
        pmodel = autopar.parallelize(model, mesh, example_inputs=(a[0],),
                                     example_kwargs={"timestep": a[1], "class_labels": a[2]})
    else:
        pmodel = autopar.parallelize(model, mesh, example_inputs=data[0][0])
say(f"{kind} {dtype}: parallelize cpu {t.cpu:.1f}s wall {t.wall:.1f}s")
opt_s = torch.optim.SGD(serial.parameters(), lr=0.05, momentum=0.9)
opt_p = torch.optim.SGD(pmodel.parameters(), lr=0.05, momentum=0.9)
tol = 2e-4 if dtype == torch.float32 else 1e-9
ok = True
for step, (args, target) in enumerate(data):
    opt_s.zero_grad()
    opt_p.zero_grad()
    rng = torch.get_rng_state()
    ls = F.mse_loss(run(serial, args), target)
    ls.backward()
    torch.set_rng_state(rng)
    with Timer() as t:
        lp = F.mse_loss(run(pmodel, args), target)
        lp.backward()
    say(f"step {step}: loss serial {ls.item():.6f} par {lp.item():.6f} diff {maxdiff(ls, lp):.2e}"
        f" step cpu {t.cpu:.2f}s wall {t.wall:.2f}s")
    ok &= maxdiff(ls, lp) <= tol
    ok &= compare(serial, pmodel, f"grads step {step}", tol) <= tol
    opt_s.step()
    opt_p.step()
ok &= compare(serial, pmodel, "params after 3 steps", tol, grads=False) <= tol
if kind == "vae":
    # the VAE's own methods a user's loop calls (latents for a diffusion model)
    try:
        lat = pmodel.encode(data[0][0][0]).latent_dist.mode()
        ref = serial.encode(data[0][0][0]).latent_dist.mode()
        say(f"pmodel.encode: diff {maxdiff(lat, ref):.2e}")
    except Exception as e:  # noqa: BLE001
        say(f"pmodel.encode raised {type(e).__name__}: {e}")
finish(ok)
