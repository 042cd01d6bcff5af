"""Pipelined models we did not write, as a user reading README.md and docs/pipeline.md writes them:
a mesh whose first axis is "pp", `PipelineOptions(microbatches=2)` at its defaults otherwise,
3 SGD-momentum steps against serial (loss, every gradient, parameters after the steps).

torchrun --standalone --nproc_per_node=N probe/pipeline_user.py KIND [compile]
KIND: unet2dcond (UNet2DConditionModel, `encoder_hidden_states=` by keyword, MSE outside) | resnet-bn (timm ResNet with BatchNorm, CE outside) | vit (timm ViT, `F.cross_entropy(pmodel(x), y)` outside) | unet2d (diffusers UNet2DModel,
`F.mse_loss(pmodel(noisy, t).sample, noise)` outside) | gpt2 (GPT2LMHeadModel at its defaults,
dropout 0.1, labels inside) | gpt2-outside (the same, shifted cross entropy on `.logits` outside).
compile: train through `torch.compile(pmodel)` instead of `pmodel`; clip: `pmodel.clip_grad_norm_(0.05)`
(docs/pipeline.md's) beside serial's torch clip; torchclip: `torch.nn.utils.clip_grad_norm_(pmodel.parameters(),
0.05)`, the habit README.md's loop has on a tensor-only module; hooks (gpt2): probe/hooks_state.py's
forward pre-hook (with kwargs) and forward hooks on blocks, registered before `parallelize`.
MESH=2 (pp), 2,2 (pp, x) or 2,2,2 (pp, x, y).
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import Timer, finish, maxdiff, say
from torch.distributed.device_mesh import init_device_mesh

import autopar

if os.environ.get("TV_SHIM"):
    import tv_shim  # noqa: F401

kind = sys.argv[1]
compiled = "compile" in sys.argv[2:]
clip = "clip" in sys.argv[2:]
torchclip = "torchclip" in sys.argv[2:]
dist.init_process_group("gloo")
shape = tuple(int(n) for n in os.environ.get("MESH", str(dist.get_world_size())).split(","))
mesh = init_device_mesh("cpu", shape, mesh_dim_names=("pp", "x", "y")[: len(shape)])
torch.manual_seed(0)
g = torch.Generator().manual_seed(1234)
B = 8
kwargs_call = False
if kind == "vit":
    import timm

    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=4,
                              num_heads=4, num_classes=10)

    def make():
        return (torch.randn(B, 3, 32, 32, generator=g),), torch.randint(0, 10, (B,), generator=g)

    def loss_of(m, inputs, target):
        return F.cross_entropy(m(*inputs), target)
elif kind == "resnet-bn":  # BatchNorm in training: batch statistics of a microbatch
    from timm.models.resnet import BasicBlock, ResNet

    model = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10, stem_width=8, channels=(8, 16, 32, 64))

    def make():
        return (torch.randn(B, 3, 32, 32, generator=g),), torch.randint(0, 10, (B,), generator=g)

    def loss_of(m, inputs, target):
        return F.cross_entropy(m(*inputs), target)
elif kind == "unet2d":
    from diffusers import DDPMScheduler, UNet2DModel

    model = UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                        block_out_channels=(16, 32), norm_num_groups=8,
                        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                        up_block_types=("AttnUpBlock2D", "UpBlock2D"))
    sched = DDPMScheduler(num_train_timesteps=1000)

    def make():
        clean = torch.randn(B, 3, 16, 16, generator=g)
        noise = torch.randn(clean.shape, generator=g)
        t = torch.randint(0, 1000, (B,), generator=g)
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
    kwargs_call = True

    def make():
        lat = torch.randn(B, 4, 8, 8, generator=g)
        noise = torch.randn(lat.shape, generator=g)
        t = torch.randint(0, 1000, (B,), generator=g)
        h = torch.randn(B, 7, 32, generator=g)
        return (sched.add_noise(lat, noise, t), t, h), noise

    def loss_of(m, inputs, target):
        noisy, t, h = inputs
        return F.mse_loss(m(noisy, t, encoder_hidden_states=h).sample, target)
elif kind in ("gpt2", "gpt2-outside"):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=4, n_head=4))
    kwargs_call = True

    def make():
        ids = torch.randint(0, 64, (B, 12), generator=g)
        return (ids,), ids

    def loss_of(m, inputs, target):
        if kind == "gpt2":
            return m(input_ids=inputs[0], labels=target).loss
        logits = m(input_ids=inputs[0]).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, 64), target[:, 1:].reshape(-1))
else:
    raise SystemExit(kind)

if "hooks" in sys.argv[2:]:
    from hooks_state_hooks import attach

    attach(model)
model.train()
serial = copy.deepcopy(model)
data = [make() for _ in range(3)]
options = autopar.PipelineOptions(microbatches=2)
with Timer() as tm:
    if kind == "unet2dcond":
        pmodel = autopar.parallelize(model, mesh, example_inputs=data[0][0][:2],
                                     example_kwargs={"encoder_hidden_states": data[0][0][2]}, pipeline=options)
    elif kwargs_call:
        pmodel = autopar.parallelize(model, mesh, example_kwargs={"input_ids": data[0][0][0], **(
            {"labels": data[0][1]} if kind == "gpt2" else {})}, pipeline=options)
    else:
        pmodel = autopar.parallelize(model, mesh, example_inputs=data[0][0], pipeline=options)
say(f"{kind} mesh {shape} compile={compiled}: parallelize cpu {tm.cpu:.1f}s wall {tm.wall:.1f}s")
run = torch.compile(pmodel) if compiled else pmodel
opt_s = torch.optim.SGD(serial.parameters(), lr=0.05, momentum=0.9)
opt_p = torch.optim.SGD(pmodel.parameters(), lr=0.05, momentum=0.9)
sp, pp = dict(serial.named_parameters()), dict(pmodel.named_parameters())
say(f"parameters: serial {len(sp)}, this rank {len(pp)}")
tol = 2e-4
ok = True
for step, (inputs, target) in enumerate(data):
    opt_s.zero_grad(set_to_none=True)
    opt_p.zero_grad(set_to_none=True)
    torch.manual_seed(100 + step)
    ls = loss_of(serial, inputs, target)
    ls.backward()
    torch.manual_seed(100 + step)
    with Timer() as tm:
        lp = loss_of(run, inputs, target)
        lp.backward()
    if clip or torchclip:
        torch.nn.utils.clip_grad_norm_(serial.parameters(), 0.05)
        if torchclip:
            torch.nn.utils.clip_grad_norm_(pmodel.parameters(), 0.05)
        else:
            pmodel.clip_grad_norm_(0.05)
    gd = max(maxdiff(sp[n].grad, p.grad) / max(1.0, sp[n].grad.abs().max().item()) for n, p in pp.items())
    missing = [n for n, p in pp.items() if p.grad is None and sp[n].grad is not None]
    say(f"step {step}: loss {ls.item():.6f} diff {maxdiff(ls, lp):.2e}; grad diff (this rank's) {gd:.2e};"
        f" missing grads {missing[:3]}; step cpu {tm.cpu:.2f}s")
    ok &= maxdiff(ls, lp) <= tol and gd <= tol and not missing
    opt_s.step()
    opt_p.step()
pd = max(maxdiff(sp[n].detach(), p.detach()) for n, p in pp.items())
worst = torch.tensor([pd, float(not ok)], dtype=torch.float64)
dist.all_reduce(worst, op=dist.ReduceOp.MAX)
say(f"after 3 steps: param diff (max over ranks) {worst[0].item():.2e}; any rank failed: {bool(worst[1])}")
ok = worst[0].item() <= tol and not bool(worst[1])
finish(ok)
