"""loss_outside.py's and hf_user_loop.py's models on 8 ranks in one process: every rank's program in
lockstep (tests/pass_fixtures.train_in_lockstep, collectives simulated), 3 SGD-momentum steps
against serial. A loss outside the model is wrapped in a loss module (lockstep backpropagates from
the program's first output). Run from the repository root:

PYTHONPATH=tests:. python probe/lockstep_trials.py KIND 2,2,2 [fp64]
KIND: convnext | efficientnet | vit-droppath | swin-droppath | unet2d | peft-dora | peft-bert-cls;
timm kinds need TVPKG=DIR (common.py): DIR and probe/ go on sys.path and tv_shim is imported.
"""

import os
import resource
import sys
import time
import warnings

if os.environ.get("TVPKG"):
    sys.path[:0] = [os.environ["TVPKG"], os.path.dirname(os.path.abspath(__file__))]
    import tv_shim  # noqa: F401
import torch
import torch.nn.functional as F
from pass_fixtures import train_in_lockstep
from torch import nn

torch.set_num_threads(1)

kind = sys.argv[1]
shape = tuple(int(s) for s in sys.argv[2].split(","))
dtype = torch.float64 if len(sys.argv) > 3 and sys.argv[3] == "fp64" else torch.float32
torch.manual_seed(0)
g = torch.Generator().manual_seed(1234)
B = 8


class WithLoss(nn.Module):
    def __init__(self, m, mse=False):
        super().__init__()
        self.m = m
        self.mse = mse

    def forward(self, *a):
        *inp, y = a
        out = self.m(*inp)
        return F.mse_loss(out.sample, y) if self.mse else F.cross_entropy(out, y)


mse = False
if kind in ("convnext", "efficientnet", "vit-droppath", "swin-droppath"):
    import timm

    if kind == "convnext":
        m = timm.create_model(
            "convnext_atto", num_classes=10, depths=(1, 1, 2, 1), dims=(8, 16, 24, 32), drop_path_rate=0.1
        )
    elif kind == "efficientnet":
        from timm.models.efficientnet import _gen_efficientnet

        m = _gen_efficientnet(
            "efficientnet_b0",
            channel_multiplier=0.25,
            depth_multiplier=0.25,
            pretrained=False,
            num_classes=10,
            drop_path_rate=0.1,
        )
    elif kind == "vit-droppath":
        m = timm.create_model(
            "vit_tiny_patch16_224",
            img_size=32,
            patch_size=8,
            embed_dim=32,
            depth=2,
            num_heads=4,
            num_classes=10,
            drop_path_rate=0.2,
        )
    else:
        m = timm.create_model(
            "swin_tiny_patch4_window7_224",
            img_size=32,
            patch_size=2,
            embed_dim=16,
            depths=(2, 2),
            num_heads=(2, 4),
            window_size=4,
            num_classes=10,
            drop_path_rate=0.2,
        )
    batches = [
        (torch.randn(B, 3, 32, 32, generator=g, dtype=dtype), torch.randint(0, 10, (B,), generator=g)) for _ in range(3)
    ]
elif kind in ("peft-dora", "peft-bert-cls"):
    import peft
    import transformers

    size = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
    if kind == "peft-dora":
        base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**size, intermediate_size=64, num_key_value_heads=2))
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=True)
    else:
        cfg = transformers.BertConfig(**size, intermediate_size=48, max_position_embeddings=32, num_labels=3)
        base = transformers.BertForSequenceClassification(cfg)
        lora = peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["query", "value"])
    m = peft.get_peft_model(base, lora)
    batches = []
    for _ in range(3):
        ids = torch.randint(0, 64, (B, 12), generator=g)
        mask = torch.ones(B, 12, dtype=torch.long)
        mask[1, -3:] = 0
        lab = torch.randint(0, 3, (B,), generator=g) if kind == "peft-bert-cls" else ids.masked_fill(mask == 0, -100)
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": lab})
    model = m.to(dtype).train()
else:
    from diffusers import DDPMScheduler, UNet2DModel

    m = UNet2DModel(
        sample_size=16,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(16, 32),
        norm_num_groups=8,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        dropout=0.1,
    )
    sched = DDPMScheduler(num_train_timesteps=1000)
    batches = []
    for _ in range(3):
        clean = torch.randn(B, 3, 16, 16, generator=g, dtype=dtype)
        noise = torch.randn(clean.shape, generator=g, dtype=dtype)
        t = torch.randint(0, 1000, (B,), generator=g)
        batches.append((sched.add_noise(clean, noise, t), t, noise))
    mse = True
if not kind.startswith("peft"):
    model = WithLoss(m.to(dtype).train(), mse)
t0 = time.process_time()
warnings.filterwarnings("ignore")
r = train_in_lockstep(model, shape, batches, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
print(
    f"{kind} {dtype} {shape}: loss_err {r['loss_err']:.2e} grad_err(rel) {r['grad_err']:.2e} param_err {r['param_err']:.2e} cpu {time.process_time() - t0:.0f}s",
    flush=True,
)
print("maxrss MiB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
