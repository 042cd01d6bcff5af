"""Stable Diffusion's training step on a small UNet2DConditionModel, as diffusers' train script
writes it: latents, noise, random timesteps, `encoder_hidden_states` from a frozen CLIPTextModel,
`F.mse_loss(unet(noisy, t, encoder_hidden_states).sample, noise)`.

torchrun --standalone --nproc_per_node=4 probe/sd_unet.py [fp32|fp64|autocast] [serial-text|par-text]

serial-text: the text encoder runs serially (frozen, under no_grad) on every rank;
par-text: the text encoder is parallelized too and called under no_grad (a forward-only program).
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.nn.functional as F
from common import Timer, compare, finish, maxdiff, say, setup
from diffusers import DDPMScheduler, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel

import autopar

mode = sys.argv[1] if len(sys.argv) > 1 else "fp32"
text_mode = sys.argv[2] if len(sys.argv) > 2 else "serial-text"
dtype = torch.float64 if mode == "fp64" else torch.float32
mesh = setup()
B = 4
torch.manual_seed(0)
sched = DDPMScheduler(num_train_timesteps=1000)
unet = UNet2DConditionModel(
    sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
    block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
    attention_head_dim=8, norm_num_groups=8,
).to(dtype)
text_cfg = CLIPTextConfig(vocab_size=100, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=16)
text = CLIPTextModel(text_cfg).to(dtype).eval()
text.requires_grad_(False)
serial = copy.deepcopy(unet)
g = torch.Generator().manual_seed(1234)


def make():
    ids = torch.randint(0, 100, (B, 16), generator=g)
    lat = torch.randn(B, 4, 8, 8, generator=g, dtype=dtype)
    noise = torch.randn(lat.shape, generator=g, dtype=dtype)
    t = torch.randint(0, 1000, (B,), generator=g)
    return ids, sched.add_noise(lat, noise, t), noise, t


data = [make() for _ in range(3)]
with torch.no_grad():
    enc0 = text(data[0][0])[0]
ptext = None
if text_mode == "par-text":
    ptext = autopar.parallelize(text, mesh, example_inputs=(data[0][0],))
with Timer() as tm:
    pmodel = autopar.parallelize(unet, mesh, example_inputs=(data[0][1], data[0][3], enc0))
say(f"sd_unet {mode} {text_mode}: parallelize cpu {tm.cpu:.1f}s wall {tm.wall:.1f}s")
opt_s = torch.optim.SGD(serial.parameters(), lr=0.05, momentum=0.9)
opt_p = torch.optim.SGD(pmodel.parameters(), lr=0.05, momentum=0.9)
tol = {"fp32": 2e-4, "fp64": 1e-9, "autocast": 3e-2}[mode]
ok = True


def ctx():
    if mode == "autocast":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def up(x):
    """float32 for the loss under autocast, as diffusers' script writes it; float64 stays."""
    return x.float() if mode == "autocast" else x


for step, (ids, noisy, noise, t) in enumerate(data):
    opt_s.zero_grad()
    opt_p.zero_grad(set_to_none=True)
    with torch.no_grad():
        enc = text(ids)[0]
        if ptext is not None:
            penc = ptext(ids)[0]
            say(f"step {step}: parallel text encoder diff {maxdiff(enc, penc):.2e}")
            ok &= maxdiff(enc, penc) <= tol
        else:
            penc = enc
    with ctx():
        ls = F.mse_loss(up(serial(noisy, t, enc).sample), up(noise))
    ls.backward()
    with Timer() as tm, ctx():
        lp = F.mse_loss(up(pmodel(noisy, t, penc).sample), up(noise))
    lp.backward()
    say(f"step {step}: loss serial {ls.item():.6f} par {lp.item():.6f} diff {maxdiff(ls, lp):.2e}"
        f" fwd cpu {tm.cpu:.2f}s")
    ok &= maxdiff(ls, lp) <= tol
    ok &= compare(serial, pmodel, f"grads step {step}", tol) <= tol
    opt_s.step()
    opt_p.step()
ok &= compare(serial, pmodel, "params after 3 steps", tol, grads=False) <= tol
finish(ok)
