"""diffusers models at toy size, each with its training loss computed outside the model as
diffusers' training scripts compute it (`F.mse_loss(unet(noisy, t, ...).sample, noise)`).

Why a case splits into `inputs` and `loss`: the parallel module is the bare diffusers model, called
with the model's own arguments, and the loss is computed by the user's code on its output, as in
`examples/text_to_image/train_text_to_image.py`. `LossInside` puts the same two halves inside one
module for harnesses that compare a model whose first output is the loss.

Sizes divide every axis of a 2x2x2 mesh (batch 8). Weights are random; nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

BATCH, IMAGE, LATENT = 8, 8, 4
TEXT_LEN, TEXT_DIM = 4, 16
CLASSES = 10
KL_WEIGHT = 1e-6  # diffusers' train_autoencoderkl.py default `kl_scale`

Batch = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Case:
    """`build(dtype)` -> (model, batch); `inputs(batch)` -> the model's (args, kwargs);
    `loss(output, batch)` -> the training loss, computed outside the model."""

    name: str
    build: Callable[[torch.dtype], tuple[nn.Module, Batch]]
    inputs: Callable[[Batch], tuple[tuple[Any, ...], dict[str, Any]]]
    loss: Callable[[Any, Batch], torch.Tensor]


class LossInside(nn.Module):
    """The model and its loss in one module: `forward(*batch)` returns the loss."""

    def __init__(self, model: nn.Module, case: Case) -> None:
        super().__init__()
        self.model = model
        self.case = case

    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        args, kwargs = self.case.inputs(batch)
        return self.case.loss(self.model(*args, **kwargs), batch)


def _noise_batch(channels: int, dtype: torch.dtype, *extra: torch.Tensor) -> Batch:
    """(noisy, timesteps, noise, *extra): a clean sample noised at random timesteps; the fixed
    mixing stands in for the scheduler's `add_noise`, which the user's loop runs outside the model.
    Drawn in float32 and cast, so that both dtypes see the same values."""
    gen = torch.Generator().manual_seed(1)
    clean = torch.randn(BATCH, channels, IMAGE, IMAGE, generator=gen).to(dtype)
    noise = torch.randn(BATCH, channels, IMAGE, IMAGE, generator=gen).to(dtype)
    timesteps = torch.randint(0, 1000, (BATCH,), generator=gen)
    return (0.8 * clean + 0.6 * noise, timesteps, noise, *extra)


def _noise_mse(out: Any, batch: Batch) -> torch.Tensor:
    return F.mse_loss(out.sample, batch[2])


def toy_unet2d() -> nn.Module:
    """A toy UNet2DModel (seeded): a plain and an attention block each way, so group norm, the
    skip concatenation, down/upsampling and the timestep embedding all appear."""
    import diffusers

    torch.manual_seed(0)
    return diffusers.UNet2DModel(
        sample_size=IMAGE,
        in_channels=3,
        out_channels=3,
        block_out_channels=(16, 32),
        layers_per_block=1,
        norm_num_groups=4,
        attention_head_dim=8,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    )


def _unet2d(dtype: torch.dtype) -> tuple[nn.Module, Batch]:
    return toy_unet2d().to(dtype), _noise_batch(3, dtype)


def _unet2d_condition(dtype: torch.dtype) -> tuple[nn.Module, Batch]:
    import diffusers

    torch.manual_seed(0)
    model = diffusers.UNet2DConditionModel(
        sample_size=IMAGE,
        in_channels=LATENT,
        out_channels=LATENT,
        block_out_channels=(16, 32),
        layers_per_block=1,
        norm_num_groups=4,
        cross_attention_dim=TEXT_DIM,
        attention_head_dim=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    )
    text = torch.randn(BATCH, TEXT_LEN, TEXT_DIM, generator=torch.Generator().manual_seed(2)).to(dtype)
    return model.to(dtype), _noise_batch(LATENT, dtype, text)


def _autoencoder_kl(dtype: torch.dtype) -> tuple[nn.Module, Batch]:
    import diffusers

    torch.manual_seed(0)
    model = diffusers.AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(16, 32),
        latent_channels=LATENT,
        norm_num_groups=4,
        sample_size=IMAGE,
    )
    gen = torch.Generator().manual_seed(1)
    images = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=gen).to(dtype)
    # the posterior's reparameterisation noise (latents are downsampled once per extra block)
    eps = torch.randn(BATCH, LATENT, IMAGE // 2, IMAGE // 2, generator=gen).to(dtype)
    return VAEStep(model.to(dtype)), (images, eps)


class VAEStep(nn.Module):
    """AutoencoderKL's training forward as train_autoencoderkl.py runs it: encode, sample the
    posterior, decode; returns the reconstruction and the posterior's KL per sample. The sample's
    noise is an input (`mean + std * eps`, what `DiagonalGaussianDistribution.sample` draws) so that
    serial and parallel runs see the same draw."""

    def __init__(self, vae: nn.Module) -> None:
        super().__init__()
        self.vae = vae

    def forward(self, images: torch.Tensor, eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        posterior = self.vae.encode(images).latent_dist
        latents = posterior.mean + posterior.std * eps
        return self.vae.decode(latents).sample, posterior.kl()


def _vae_loss(out: Any, batch: Batch) -> torch.Tensor:
    reconstruction, kl = out
    return F.mse_loss(reconstruction, batch[0]) + KL_WEIGHT * kl.mean()


def _dit(dtype: torch.dtype) -> tuple[nn.Module, Batch]:
    import diffusers

    torch.manual_seed(0)
    model = diffusers.DiTTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=LATENT,
        out_channels=LATENT,
        num_layers=2,
        sample_size=IMAGE,
        patch_size=2,
        num_embeds_ada_norm=CLASSES,
    )
    labels = torch.randint(0, CLASSES, (BATCH,), generator=torch.Generator().manual_seed(3))
    return model.to(dtype), _noise_batch(LATENT, dtype, labels)


CASES: list[Case] = [
    Case("UNet2DModel", _unet2d, lambda b: ((b[0], b[1]), {}), _noise_mse),
    Case(
        "UNet2DConditionModel",
        _unet2d_condition,
        lambda b: ((b[0], b[1]), {"encoder_hidden_states": b[3]}),
        _noise_mse,
    ),
    Case("AutoencoderKL", _autoencoder_kl, lambda b: ((b[0], b[1]), {}), _vae_loss),
    Case(
        "DiTTransformer2DModel",
        _dit,
        lambda b: ((b[0],), {"timestep": b[1], "class_labels": b[3]}),
        _noise_mse,
    ),
]


def case(name: str) -> Case:
    return next(c for c in CASES if c.name == name)
