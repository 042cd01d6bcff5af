"""Stage 1, trace: the joint graph computes eager autograd's loss and gradients, on fake tensors."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import torch
import torch.fx as fx
from pass_fixtures import assert_call_matches_serial, eager_step, run_joint
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from autopar.core.meta import info, signature
from autopar.passes.trace import trace
from examples.models import make_gpt

MODELS_PY = str(Path(__file__).resolve().parent.parent / "examples" / "models.py")


@functools.cache
def _traced(decompose: bool) -> tuple[fx.GraphModule, nn.Module, tuple[torch.Tensor, ...]]:
    model, inputs = make_gpt(0)
    return trace(model, inputs, decompose=decompose), model, inputs


def _placeholders(gm: fx.GraphModule, role: str) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder" and info(n).role == role]


def test_signature_of_the_gpt_joint_graph() -> None:
    gm, model, _ = _traced(False)
    sig = signature(gm)
    names = [n for n, _ in model.named_parameters()]  # tied alias listed once
    assert sorted(sig.param_names) == sorted(names) and len(sig.param_names) == len(names)
    assert sorted(sig.grad_of) == sorted(names)
    assert (sig.num_inputs, sig.num_tangents, sig.num_user_outputs) == (2, 1, 1)
    assert sig.aliases == {"lm_head.weight": "wte.weight"}
    assert sig.buffer_names == []
    assert [info(n).input_index for n in _placeholders(gm, "input")] == [0, 1]
    assert len(_placeholders(gm, "tangent")) == 1
    output = next(n for n in gm.graph.nodes if n.op == "output")
    assert len(output.args[0]) == 1 + len(names)


def test_signature_param_names_follow_placeholder_order() -> None:
    gm, _, _ = _traced(False)
    assert [info(n).param_name for n in _placeholders(gm, "param")] == signature(gm).param_names


def test_joint_graph_without_decomposition_is_bit_identical_toeager_step() -> None:
    gm, model, inputs = _traced(False)
    loss, grads = run_joint(gm, model, inputs)
    want_loss, want_grads = eager_step(model, inputs)
    assert torch.equal(loss, want_loss)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, want_grads[name]), name


def test_joint_graph_with_decomposition_matcheseager_step() -> None:
    gm, model, inputs = _traced(True)
    loss, grads = run_joint(gm, model, inputs)
    want_loss, want_grads = eager_step(model, inputs)
    torch.testing.assert_close(loss, want_loss, atol=1e-6, rtol=1e-6)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], atol=1e-6, rtol=1e-5, msg=name)
    # decomposition replaced the fused ops whose sharded forms need cross-rank sums
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.native_layer_norm.default not in targets
    plain = {n.target for n in _traced(False)[0].graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.native_layer_norm.default in plain


@pytest.mark.parametrize("decompose", [False, True])
def test_tied_weight_is_one_placeholder_with_the_summed_gradient(decompose: bool) -> None:
    gm, model, inputs = _traced(decompose)
    params = _placeholders(gm, "param")
    names = [info(n).param_name for n in params]
    assert names.count("wte.weight") == 1 and "lm_head.weight" not in names
    tied = params[names.index("wte.weight")]
    assert tuple(tied.meta["val"].shape) == tuple(model.wte.weight.shape)
    # both uses (embedding lookup, lm_head matmul) read the one placeholder
    user_targets = {u.target for u in tied.users}
    assert torch.ops.aten.embedding.default in user_targets
    assert len(tied.users) >= 2
    _, grads = run_joint(gm, model, inputs)
    _, want = eager_step(model, inputs)
    assert model.lm_head.weight is model.wte.weight
    torch.testing.assert_close(grads["wte.weight"], want["wte.weight"], atol=1e-7, rtol=1e-6)
    # the gradient sums both uses: untie a copy and add the two separate gradients
    untied = copy.deepcopy(model)
    untied.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())
    untied(*inputs).backward()
    emb, head = untied.wte.weight.grad, untied.lm_head.weight.grad
    assert emb.abs().sum() > 0 and head.abs().sum() > 0
    torch.testing.assert_close(grads["wte.weight"], emb + head, atol=1e-7, rtol=1e-6)


def test_every_op_knows_its_module_and_the_attention_its_source_line() -> None:
    gm, _, _ = _traced(True)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert calls and all(info(n).module_path for n in calls)
    assert all(info(n).phase in ("forward", "backward") for n in calls)
    attn = [
        n for n in calls if info(n).phase == "forward" and info(n).module_path.startswith("blocks.0.attn")
    ]
    assert {info(n).module_path for n in attn} >= {"blocks.0.attn", "blocks.0.attn.qkv", "blocks.0.attn.proj"}
    for node in attn:
        path, _, rest = info(node).source.rpartition(":")
        assert path == MODELS_PY, info(node).source
        line = int(rest.split()[0])
        assert 30 < line < 45, info(node).source  # CausalSelfAttention.forward
    sdpa = [n for n in attn if "scaled_dot_product" in str(n.target)]
    assert sdpa
    sdpa_line = int(info(sdpa[0]).source.rpartition(":")[2].split()[0])
    assert "scaled_dot_product_attention" in Path(MODELS_PY).read_text().splitlines()[sdpa_line - 1]
    qkv = next(n for n in attn if n.target is torch.ops.aten.addmm.default)
    assert info(qkv).module_path == "blocks.0.attn.qkv"
    # where() joins module path and source for error messages
    assert info(qkv).where().startswith("blocks.0.attn.qkv @ " + MODELS_PY)


def test_forward_and_backward_phases_split_at_the_tangent() -> None:
    gm, _, _ = _traced(False)
    tangent = _placeholders(gm, "tangent")[0]
    backward = {n for n in gm.graph.nodes if n.op == "call_function" and info(n).phase == "backward"}
    assert backward
    # everything downstream of the tangent is backward; nothing forward reads a backward value
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if tangent in node.all_input_nodes:
            assert node in backward
        if node not in backward:
            assert not any(i in backward for i in node.all_input_nodes), node.name
    loss_node = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    assert info(loss_node).phase == "forward"


def test_no_parameter_memory_is_copied() -> None:
    model, inputs = make_gpt(0)
    before = {n: (p.data_ptr(), p.clone()) for n, p in model.named_parameters()}
    gm = trace(model, inputs, decompose=False)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            assert isinstance(node.meta["val"], FakeTensor), node.name
    # no constants were captured from the weights either
    assert not [name for name, _ in gm.named_buffers()] and not list(gm.parameters())
    for n, p in model.named_parameters():
        assert p.data_ptr() == before[n][0] and torch.equal(p, before[n][1]) and p.grad is None


def test_a_meta_device_model_traces_to_the_same_graph() -> None:
    with torch.device("meta"):
        model, _ = make_gpt(0)
    _, inputs = make_gpt(0)
    assert model.wte.weight.device.type == "meta"
    gm = trace(model, inputs, decompose=False)
    ref, _, _ = _traced(False)
    shapes = [tuple(n.meta["val"].shape) for n in gm.graph.nodes if n.op == "placeholder"]
    assert shapes == [tuple(n.meta["val"].shape) for n in ref.graph.nodes if n.op == "placeholder"]
    assert [str(n.target) for n in gm.graph.nodes] == [str(n.target) for n in ref.graph.nodes]


def test_decomposed_ops_keep_the_module_and_phase_of_the_op_they_replace() -> None:
    gm, _, _ = _traced(True)
    plain, _, _ = _traced(False)
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    for fused in (
        torch.ops.aten.native_layer_norm.default,
        torch.ops.aten.native_layer_norm_backward.default,
        torch.ops.aten.nll_loss_forward.default,
        torch.ops.aten.nll_loss_backward.default,
    ):
        assert fused not in targets
        assert fused in {n.target for n in plain.graph.nodes if n.op == "call_function"}
    # the layer norm backward became sums and pointwise ops, still attributed to the norm module
    for path in ("blocks.0.ln_1", "blocks.1.ln_2", "ln_f"):
        back = [
            n
            for n in gm.graph.nodes
            if n.op == "call_function" and info(n).module_path == path and info(n).phase == "backward"
        ]
        assert torch.ops.aten.sum.dim_IntList in {n.target for n in back}, path
        fwd = [n for n in gm.graph.nodes if n.op == "call_function" and info(n).module_path == path]
        assert torch.ops.aten.rsqrt.default in {n.target for n in fwd}, path


def test_the_joint_module_regenerates_its_code_after_a_pass_edits_the_graph() -> None:
    model, inputs = make_gpt(0, n_layer=1)
    gm = trace(model, inputs, decompose=True)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    loss = output.args[0][0]
    with gm.graph.inserting_before(output):
        doubled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (loss, 2.0))
    output.args = ((doubled, *output.args[0][1:]),)
    gm.recompile()  # what insert_comm and schedule do after editing
    assert "aten.mul.Tensor(" in gm.code
    got, _ = run_joint(gm, model, inputs)
    want, _ = eager_step(model, inputs)
    torch.testing.assert_close(got, 2 * want, atol=1e-5, rtol=1e-5)


class _Repeats(nn.Module):
    """The same pure call twice (merged) and the same dropout twice (random: kept apart)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        twice = h * 2.0 + h * 2.0
        dropped = nn.functional.dropout(h, 0.5, training=True) + nn.functional.dropout(h, 0.5, training=True)
        return (twice + dropped).sum()


def test_repeated_pure_calls_merge_and_random_ones_stay_apart() -> None:
    gm = trace(_Repeats(), (torch.randn(8, 4),))
    forward = [n for n in gm.graph.nodes if n.op == "call_function" and info(n).phase == "forward"]
    doubles = [n for n in forward if n.target is torch.ops.aten.mul.Tensor and n.args[1] == 2.0]
    assert len(doubles) == 1
    random = [n for n in forward if torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())]
    assert len(random) == 2


def test_the_parts_of_a_cut_fused_linear_share_one_view_of_their_input() -> None:
    model, inputs = make_gpt(0)
    gm = trace(model, inputs, split_fused=True)
    parts = [
        n
        for n in gm.graph.nodes
        if n.target is torch.ops.aten.addmm.default
        and info(n).phase == "forward"
        and info(n).module_path == "blocks.0.attn.qkv"
    ]
    assert len(parts) == 3  # q, k and v
    assert len({n.args[1] for n in parts}) == 1  # one flattened input, so one redistribution of it


class _PooledTokens(nn.Module):
    """Swin's pooler: adaptive average pooling of (batch, channels, tokens), whose decomposition
    restrides a keepdim mean with as_strided and whose backward writes a whole buffer with
    as_strided_scatter; and a one-head relative-position table, far too small to split."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 256)
        self.table = nn.Parameter(torch.randn(3, 1))  # 3 of the model's 5 651 elements
        self.pool = nn.AdaptiveAvgPool1d(1)
        self.head = nn.Linear(256, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.proj(x) + self.table[1]
        pooled = self.pool(h.transpose(1, 2)).flatten(1)
        return nn.functional.cross_entropy(self.head(pooled), y)


def test_whole_buffer_strided_ops_become_views_and_the_model_matches_serial() -> None:
    torch.manual_seed(0)
    model = _PooledTokens()
    batch = (torch.randn(8, 6, 16), torch.randint(4, (8,)))
    gm = trace(model, batch, decompose=True)
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.as_strided.default not in targets
    assert torch.ops.aten.as_strided_scatter.default not in targets
    compiled = assert_call_matches_serial(model, (2, 2, 2), batch)
    report = str(next(iter(compiled.values())).report)
    assert "too small to split): table" in report, report


class _SlidingWindows(nn.Module):
    """Longformer's chunking: overlapping windows of 2w rows every w rows cut by `as_strided` from
    a contiguous view, windows of 3w rows from the padded values, a single window (the tensor
    itself, with a stride of its own on the one-window dim), and windows of a view whose dims are
    not in memory order (Longformer's query and key at a window below the sequence: a
    sequence-major projection transposed to batch-major, whose storage the strides step through)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)  # (batch, 16 tokens, 8)
        w, (b, s, d) = 2, h.shape
        blocks = h.view(b, s // (2 * w), 2 * w, d)
        stride = list(blocks.stride())
        stride[1] //= 2
        pairs = blocks.as_strided([b, s // w - 1, 2 * w, d], stride)
        padded = nn.functional.pad(h, (0, 0, w, w), value=-1.0)
        triples = padded.as_strided((b, s // w, 3 * w, d), (padded.stride(0), w * d, d, 1))
        weights = torch.arange(1.0, 2 * w + 1)[None, None, :, None]
        single = h.view(b, 1, s, d).as_strided([b, 1, s, d], [s * d, 7, d, 1])
        seq_major = self.proj(x.transpose(0, 1)).transpose(0, 1)  # (batch, tokens, 8), strides (8, 64, 1)
        seq_blocks = seq_major.view(b, s // (2 * w), 2 * w, d)
        seq_stride = list(seq_blocks.stride())
        seq_stride[1] //= 2
        seq_pairs = seq_blocks.as_strided([b, s // w - 1, 2 * w, d], seq_stride)
        pooled = (pairs * weights).mean(dim=(1, 2)) + triples.amax(dim=2).mean(dim=1) + single.std(dim=(1, 2))
        pooled = pooled + (seq_pairs * weights).amax(dim=1).mean(dim=1)
        return nn.functional.cross_entropy(self.head(pooled), y)


def test_overlapping_windows_become_slices_and_the_model_matches_serial() -> None:
    torch.manual_seed(0)
    model = _SlidingWindows()
    batch = (torch.randn(8, 16, 16), torch.randint(4, (8,)))
    gm = trace(model, batch)
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.as_strided.default not in targets and torch.ops.aten.cat.default in targets
    assert_call_matches_serial(model, (2, 2), batch)
