"""The published training runs `benchmarks/published.py` holds autopar's step model against.

Only figures read in a source are here; each row names its source (URL and table row) and what was
measured. What a source does not state is marked as assumed in `assumed`, and is how the row is
priced. Rows are split into a fit half and a held-out half before any error was looked at:
alternating by model size within each weak-scaling table (1st, 3rd, 5th ... row: fit), and the
torchtitan rows all held out (their framework's constant is not fitted).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.cost.work import AttentionKernel

PTDP_URL = (
    "https://github.com/NVIDIA/Megatron-LM/blob/306eb24e27/README.md (images/cases_april2021.png), "
    "= Narayanan et al., SC'21 (arXiv 2104.04473) Table 1"
)
MCORE_URL = "https://github.com/NVIDIA/Megatron-LM/blob/main/README.md (images/model_table.png, Megatron-Core r0.8.0)"
TITAN_URL = "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md"

PTDP_FLOPS = "96 B s l h^2 (1 + s/(6h) + V/(16 l h)) per step (the paper's count: forward run twice, recomputation)"
MCORE_FLOPS = "72 B s l h^2 (1 + s/(6h) + V/(12 l h)) per step (model FLOPs, no recomputation; MFU = x / 989)"
TOKENS = "tokens per second per GPU (local batch x sequence / step time)"

FULL_SCORES = (
    "attention computes all s x s scores, then masks them: Megatron-LM of 2021 has no flash attention "
    "(https://github.com/NVIDIA/Megatron-LM/blob/306eb24e27/megatron/model/transformer.py, ParallelSelfAttention: "
    "torch.baddbmm of the whole [b np, sq, sk] scores, FusedScaleMaskSoftmax's upper-triangular masked softmax, "
    "torch.bmm with the values)"
)
FLASH_MCORE = (
    "attention skips the masked blocks: Megatron-Core r0.8 runs Transformer Engine's DotProductAttention, "
    "whose flash and cuDNN fused backends skip the blocks above the diagonal of a causal mask"
)
FLASH_TITAN = (
    "attention skips the masked blocks: torchtitan's Llama 3 calls F.scaled_dot_product_attention(is_causal=True), "
    "the flash kernel on H100"
)


class ParallelShape:
    """What a run's GPUs, tensor size t, pipeline depth p, global batch B and microbatch size b
    give: the data-parallel size d and the microbatches per pipeline replica (the rows here and
    `ptdp_modeled.Config` share it)."""

    gpus: int
    t: int
    p: int
    batch: int
    microbatch: int

    @property
    def d(self) -> int:
        return self.gpus // (self.t * self.p)

    @property
    def microbatches(self) -> int:
        """Microbatches per pipeline replica per step: B / (d b)."""
        return self.batch // (self.d * self.microbatch)


@dataclass(frozen=True)
class Row(ParallelShape):
    """One published configuration: the model, how it ran, and what it measured."""

    key: str
    gpu: str  # hardware table
    framework: str  # "megatron-2021", "mcore-r0.8", "torchtitan-eager": which fitted constant applies
    arch: str  # "gpt" (examples.models.GPT, GELU 4h) or "llama" (examples.zoo.Llama, SwiGLU, GQA)
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    gpus: int
    batch: int  # global batch, sequences
    microbatch: int  # sequences per microbatch per data-parallel replica
    t: int
    p: int
    v: int = 1
    schedule: str = "1f1b"
    tied: bool = True
    kv_heads: int = 0  # llama only
    ffn: int = 0  # llama only
    recompute: str = "none"  # "full", "selective-op" (torchtitan's op policy), "none"
    dp: str = "allreduce"  # "allreduce" (grads after the flush), "distopt" (RS grads + AG params), "fsdp"
    overlap_dp: bool = False
    overlap_tp: bool = False
    grad_bytes: int = 4  # bytes per gradient element the data axis reduces (4: fp32, 2: bf16)
    published: float = 0.0
    unit: str = "TFLOP/s/GPU"  # or "tokens/s/GPU"
    convention: str = ""
    source: str = ""
    assumed: tuple[str, ...] = field(default_factory=tuple)
    split: str = "fit"  # "fit" or "held-out"
    attention: AttentionKernel = "flash"  # how its kernel does causal attention: "flash" (skips the masked blocks) or "full"
    attention_source: str = ""  # why: the code the run used


def _ptdp(key: str, hidden: int, layers: int, heads: int, mp: int, gpus: int, batch: int, tflops: float,
          split: str) -> Row:  # fmt: skip
    t, p = (mp, 1) if mp <= 8 else (8, mp // 8)
    return Row(
        key=f"PTD-P {key}", gpu="a100-calibrated", framework="megatron-2021", arch="gpt", layers=layers,
        hidden=hidden, heads=heads, vocab=51200, seq=2048, gpus=gpus, batch=batch, microbatch=1, t=t, p=p,
        recompute="full", dp="allreduce", published=tflops, convention=PTDP_FLOPS, attention="full",
        attention_source=FULL_SCORES,
        source=f"{PTDP_URL}, row {key}: hidden {hidden}, {layers} layers, model-parallel size {mp}, "
        f"{gpus} GPUs, batch {batch}, {tflops:g} TFLOP/s per GPU",
        assumed=(
            "t = min(model-parallel size, 8), p = the rest (the paper's Table 1 keeps tensor parallelism in a node)",
            "microbatch 1, 1F1B (not interleaved), full recomputation (the paper's FLOP count assumes it)",
            f"{heads} heads (head dim {hidden // heads}); priced FLOPs do not depend on it",
            "gradient all-reduce in float32 (Megatron-LM of 2021 forces fp32 gradient accumulation and all-reduce under bf16: arguments.py, accumulate_allreduce_grads_in_fp32) after the pipeline flush, not overlapped; Adam unsharded",
        ),
        split=split,
    )  # fmt: skip


def _mcore(key: str, heads: int, hidden: int, layers: int, t: int, p: int, gpus: int, batch: int,
           tflops: float, split: str) -> Row:  # fmt: skip
    return Row(
        key=f"Mcore {key}", gpu="h100-calibrated", framework="mcore-r0.8", arch="gpt", layers=layers,
        hidden=hidden, heads=heads, vocab=131072, seq=4096, gpus=gpus, batch=batch, microbatch=1, t=t, p=p,
        tied=False, recompute="none", dp="distopt", overlap_dp=True, overlap_tp=True, grad_bytes=2, published=tflops,
        convention=MCORE_FLOPS, attention="flash", attention_source=FLASH_MCORE,
        source=f"{MCORE_URL}, row {key}: {heads} heads, hidden {hidden}, {layers} layers, TP {t}, PP {p}, "
        f"DP 48, {gpus} GPUs, batch {batch}, {tflops:g} TFLOP/s per GPU",
        assumed=(
            "BF16: MFU column = TFLOP/s / 989 (H100 SXM dense BF16 peak)",
            "untied embeddings (the parameter counts in the table match untied GELU-4h GPTs)",
            "microbatch 1, 1F1B (not interleaved), no recomputation, distributed optimizer",
            "gradients reduced in bf16: Megatron-Core's default (megatron/core/distributed/distributed_data_parallel_config.py, "
            "grad_reduce_in_fp32 = False; --accumulate-allreduce-grads-in-fp32 is off unless given), fp32 master weights "
            "and AdamW states sharded by the distributed optimizer",
            "overlapped DP reduce-scatter/all-gather and TP collectives (README: --overlap-grad-reduce, "
            "--overlap-param-gather, --tp-comm-overlap)",
        ),
        split=split,
    )  # fmt: skip


PTDP = [
    _ptdp("1.7B", 2304, 24, 24, 1, 32, 512, 137, "fit"),
    _ptdp("3.6B", 3072, 30, 32, 2, 64, 512, 138, "held-out"),
    _ptdp("7.5B", 4096, 36, 32, 4, 128, 512, 142, "fit"),
    _ptdp("18B", 6144, 40, 48, 8, 256, 1024, 135, "held-out"),
    _ptdp("39B", 8192, 48, 64, 16, 512, 1536, 138, "fit"),
    _ptdp("76B", 10240, 60, 80, 32, 1024, 1792, 140, "held-out"),
    _ptdp("145B", 12288, 80, 96, 64, 1536, 2304, 148, "fit"),
    _ptdp("310B", 16384, 96, 128, 128, 1920, 2160, 155, "held-out"),
    _ptdp("530B", 20480, 105, 128, 280, 2520, 2520, 163, "fit"),
    _ptdp("1T", 25600, 128, 160, 512, 3072, 3072, 163, "held-out"),
]

MCORE = [
    _mcore("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8, "fit"),
    _mcore("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9, "held-out"),
    _mcore("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1, "fit"),
    _mcore("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6, "held-out"),
    _mcore("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7, "fit"),
    _mcore("119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5, "held-out"),
    _mcore("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8, "fit"),
    _mcore("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4, "held-out"),
    _mcore("462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9, "fit"),
]


def _titan(gpus: int, tps: float, table: str) -> Row:
    return Row(
        key=f"torchtitan 8B x{gpus}", gpu="h100-500w-calibrated", framework="torchtitan-eager", arch="llama",
        layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, seq=8192, gpus=gpus,
        batch=2 * gpus, microbatch=2, t=1, p=1, tied=False, recompute="selective-op", dp="fsdp", overlap_dp=True,
        published=tps, unit="tokens/s/GPU", convention=TOKENS, attention="flash", attention_source=FLASH_TITAN,
        source=f"{TITAN_URL}, {table}, row 'FSDP': Llama 3.1 8B, {gpus} GPUs, local batch 2, "
        f"{tps:,.0f} TPS/GPU (BF16, eager)",
        assumed=(
            "sequence 8192 (train_configs/llama3_8b.toml at torchtitan 9dec370, the commit the table names)",
            "selective activation checkpointing 'op': every second matmul and the element-wise ops recomputed",
            "FSDP2: bf16 all-gather in forward and backward, fp32 reduce-scatter, overlapped with compute",
            "their H100s are 96 GB HBM2e at the default 500 W power limit (2.4 TB/s), not 700 W SXM5s: priced on "
            "h100-500w-calibrated (its peak between the SXM's and the NVL's, as the benchmark page bounds it)",
            "attention by FlashAttention-2 (torch's SDPA flash backend on an H100), at its published H100 rates",
        ),
        split="held-out",
    )  # fmt: skip


TITAN = [_titan(8, 5762, "Table 1"), _titan(128, 5605, "Table 3")]

ROWS: list[Row] = PTDP + MCORE + TITAN
QUICK = ("PTD-P 1.7B", "PTD-P 3.6B", "PTD-P 7.5B", "PTD-P 18B", "Mcore 1.7B", "Mcore 7.1B", "Mcore 16B",
         "Mcore 32B", "torchtitan 8B x8")  # fmt: skip


def model_flops(row: Row) -> float:
    """The FLOPs of one step in the row's own counting convention."""
    B, s, L, h, V = row.batch, row.seq, row.layers, row.hidden, row.vocab
    if row.unit != "TFLOP/s/GPU":
        raise ValueError(f"{row.key} publishes {row.unit}, not FLOP/s")
    if row.framework == "megatron-2021":
        return 96.0 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))
    return 72.0 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))


def published_step(row: Row) -> float:
    """Seconds per step implied by the published figure."""
    if row.unit == "TFLOP/s/GPU":
        return model_flops(row) / (row.published * 1e12 * row.gpus)
    return row.batch * row.seq / (row.published * row.gpus)


def figure(row: Row, step: float) -> float:
    """A step time in the row's published unit."""
    if row.unit == "TFLOP/s/GPU":
        return model_flops(row) / step / row.gpus / 1e12
    return row.batch * row.seq / step / row.gpus
