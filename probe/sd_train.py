"""diffusers' train_text_to_image.py loop in full on a small UNet2DConditionModel: gradient
checkpointing enabled, a frozen CLIP text encoder, noise offset, v-prediction targets, min-SNR
loss weighting (per-sample loss outside the model), gradient accumulation, clip_grad_norm_,
AdamW with a warmup scheduler, diffusers' EMAModel, and an EMA-weights validation (store,
copy_to, restore).

torchrun --standalone --nproc_per_node=4 probe/sd_train.py [fp32|fp64]
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.nn.functional as F
from common import Timer, compare, finish, maxdiff, say, setup
from diffusers import DDPMScheduler, UNet2DConditionModel
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel, compute_snr
from transformers import CLIPTextConfig, CLIPTextModel

import autopar

dtype = torch.float64 if len(sys.argv) > 1 and sys.argv[1] == "fp64" else torch.float32
mesh = setup()
B, ACCUM = 4, 2
torch.manual_seed(0)
sched = DDPMScheduler(num_train_timesteps=1000, prediction_type="v_prediction")
unet = UNet2DConditionModel(
    sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
    block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
    attention_head_dim=8, norm_num_groups=8,
).to(dtype)
unet.enable_gradient_checkpointing()
unet.train()
text = CLIPTextModel(CLIPTextConfig(vocab_size=100, hidden_size=32, intermediate_size=37,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    max_position_embeddings=16)).to(dtype).eval()
text.requires_grad_(False)
serial = copy.deepcopy(unet)
g = torch.Generator().manual_seed(1234)


def make():
    ids = torch.randint(0, 100, (B, 16), generator=g)
    lat = torch.randn(B, 4, 8, 8, generator=g, dtype=dtype)
    noise = torch.randn(lat.shape, generator=g, dtype=dtype)
    noise = noise + 0.1 * torch.randn(B, 4, 1, 1, generator=g, dtype=dtype)  # noise offset
    t = torch.randint(0, 1000, (B,), generator=g)
    return ids, sched.add_noise(lat, noise, t), sched.get_velocity(lat, noise, t), t


def loss_fn(model, ids, noisy, target, t):
    with torch.no_grad():
        enc = text(ids, return_dict=False)[0]
    pred = model(noisy, t, encoder_hidden_states=enc, return_dict=False)[0]
    snr = compute_snr(sched, t)
    weights = torch.stack([snr, 5.0 * torch.ones_like(t)], dim=1).min(dim=1)[0] / (snr + 1)
    loss = F.mse_loss(pred.float(), target.float(), reduction="none")
    loss = loss.mean(dim=list(range(1, len(loss.shape)))) * weights
    return loss.mean()


steps = 3
data = [make() for _ in range(steps * ACCUM)]
ids0, noisy0, _, t0 = data[0]
with torch.no_grad():
    enc0 = text(ids0, return_dict=False)[0]
with Timer() as tm:
    pmodel = autopar.parallelize(unet, mesh, example_inputs=(noisy0, t0),
                                 example_kwargs={"encoder_hidden_states": enc0, "return_dict": False})
say(f"sd_train {dtype}: parallelize cpu {tm.cpu:.1f}s wall {tm.wall:.1f}s")
opt_s = torch.optim.AdamW(serial.parameters(), lr=1e-3, weight_decay=1e-2)
opt_p = torch.optim.AdamW(pmodel.parameters(), lr=1e-3, weight_decay=1e-2)
lr_s = get_scheduler("constant_with_warmup", optimizer=opt_s, num_warmup_steps=2)
lr_p = get_scheduler("constant_with_warmup", optimizer=opt_p, num_warmup_steps=2)
ema_s = EMAModel(serial.parameters(), decay=0.9)
ema_p = EMAModel(pmodel.parameters(), decay=0.9)
tol = 2e-4 if dtype == torch.float32 else 1e-9
ltol = 2e-4 if dtype == torch.float32 else 1e-6  # the script computes the loss in float32 (.float())
ok = True
for step in range(steps):
    lsum = lpsum = 0.0
    for m in range(ACCUM):
        ids, noisy, target, t = data[step * ACCUM + m]
        ls = loss_fn(serial, ids, noisy, target, t) / ACCUM
        ls.backward()
        lp = loss_fn(pmodel, ids, noisy, target, t) / ACCUM
        lp.backward()
        lsum += ls.item()
        lpsum += lp.item()
    ns = torch.nn.utils.clip_grad_norm_(serial.parameters(), 1.0)
    npar = torch.nn.utils.clip_grad_norm_(pmodel.parameters(), 1.0)
    say(f"step {step}: loss serial {lsum:.6f} par {lpsum:.6f} diff {abs(lsum - lpsum):.2e}"
        f" grad norm serial {float(ns):.6f} diff {maxdiff(ns, npar):.2e}")
    ok &= abs(lsum - lpsum) <= ltol and maxdiff(ns, npar) <= tol
    ok &= compare(serial, pmodel, f"grads step {step}", tol) <= tol
    for opt, lr in ((opt_s, lr_s), (opt_p, lr_p)):
        opt.step()
        lr.step()
        opt.zero_grad(set_to_none=True)
    ema_s.step(serial.parameters())
    ema_p.step(pmodel.parameters())
    worst = max(maxdiff(a, b) for a, b in zip(ema_s.shadow_params, ema_p.shadow_params))
    say(f"  EMA shadow diff {worst:.2e}")
    ok &= worst <= tol
ok &= compare(serial, pmodel, f"params after {steps} steps", tol, grads=False) <= tol
# validation with the EMA weights, as the script's log_validation does, then back
for ema, m in ((ema_s, serial), (ema_p, pmodel)):
    ema.store(m.parameters())
    ema.copy_to(m.parameters())
    m.eval()
with torch.no_grad():
    vs = loss_fn(serial, *data[0])
    vp = loss_fn(pmodel, *data[0])
say(f"EMA-weights validation loss serial {vs.item():.6f} par {vp.item():.6f} diff {maxdiff(vs, vp):.2e}")
ok &= maxdiff(vs, vp) <= ltol
for ema, m in ((ema_s, serial), (ema_p, pmodel)):
    ema.restore(m.parameters())
    m.train()
ok &= compare(serial, pmodel, "params restored", tol, grads=False) <= tol
finish(ok)
