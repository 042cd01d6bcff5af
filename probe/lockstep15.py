"""hf_padding.py's decoders on a 3-D mesh in one process: every rank's program in lockstep
(tests/pass_fixtures.train_in_lockstep, collectives simulated), 3 SGD-momentum steps against serial.
The programs are compiled from the first batch (no padding) and then run on padded batches of the
same shape, so a program that baked "no padding" in would differ from serial here.

PYTHONPATH=tests:. python probe/lockstep15.py mistral|gemma2|gemma3 2,2,2
"""

import resource
import sys
import time
import warnings

import torch
from pass_fixtures import train_in_lockstep

torch.set_num_threads(1)
kind, shape = sys.argv[1], tuple(int(s) for s in sys.argv[2].split(","))
import transformers as tf  # noqa: E402

size = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
torch.manual_seed(0)
if kind == "mistral":
    model = tf.MistralForCausalLM(tf.MistralConfig(**size, sliding_window=4))
elif kind == "gemma2":
    model = tf.Gemma2ForCausalLM(tf.Gemma2Config(**size, head_dim=8, sliding_window=4))
else:
    model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**size, head_dim=8, sliding_window=4))
g = torch.Generator().manual_seed(1234)
batches = []
for step in range(3):
    ids = torch.randint(1, 64, (8, 12), generator=g)
    mask = torch.ones(8, 12, dtype=torch.long)
    if step:
        mask[1, -3:] = 0
        mask[3, :4] = 0
        mask[6, -step * 2 :] = 0
    batches.append(
        {
            "input_ids": ids.masked_fill(mask == 0, 0),
            "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100),
        }
    )
warnings.filterwarnings("ignore")
t0 = time.process_time()
r = train_in_lockstep(model.train(), shape, batches, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
print(
    f"{kind} {shape}: loss_err {r['loss_err']:.2e} grad_err(rel) {r['grad_err']:.2e} "
    f"param_err {r['param_err']:.2e} cpu {time.process_time() - t0:.0f}s",
    flush=True,
)
print("maxrss MiB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
