"""The user's forward hooks of probe/hooks_state.py, shared with probe/pipeline_user.py (hooks): a
pre-hook with kwargs changing a block's input, a hook changing an MLP's output, one changing the
first element of attention's tuple, on a GPT2LMHeadModel."""

from __future__ import annotations

import torch.nn as nn


def pre_scale(mod, args, kwargs):  # changes the block's input, whichever way it is passed
    if args:
        return (args[0] * 1.1, *args[1:]), kwargs
    kwargs = dict(kwargs)
    kwargs["hidden_states"] = kwargs["hidden_states"] * 1.1
    return args, kwargs


def post_mlp(mod, args, out):  # changes the MLP's output
    return out * 0.9 + 0.01


def post_attn(mod, args, out):  # attention returns a tuple: changes its first element
    return (out[0].tanh(), *out[1:]) if isinstance(out, tuple) else out.tanh()


def attach(m: nn.Module) -> None:
    m.transformer.h[0].register_forward_pre_hook(pre_scale, with_kwargs=True)
    m.transformer.h[1].mlp.register_forward_hook(post_mlp)
    m.transformer.h[0].attn.register_forward_hook(post_attn)
