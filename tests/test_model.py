"""The pose model: timm key layout, BatchNorm folding, strategies, SimCC, checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedpose.shared.configuration.schema import ModelConfig
from fedpose.shared.model.posenet import PoseNet, build_model, load_checkpoint, load_tinyvit_weights, save_checkpoint
from fedpose.shared.model.pose_loss import make_loss_fn
from fedpose.shared.model.strategy import apply_strategy, trainable_names
from fedpose.shared.model.simcc_decode import decode_simcc
from fedpose.shared.model.simcc import gaussian_targets
from fedpose.shared.model.tinyvit import fuse_batchnorm, is_fused, resample_attention_biases, tinyvit

# Key names and shapes of timm's tiny_vit_5m_224 (embed (64,128,160,320), depths (2,2,6,2),
# heads (2,4,5,10), windows (7,7,14,7)), pinned so that TinyViT checkpoints keep loading.
TIMM_5M_PINS = {
    "patch_embed.conv1.conv.weight": (32, 3, 3, 3),
    "patch_embed.conv1.bn.running_var": (32,),
    "patch_embed.conv2.conv.weight": (64, 32, 3, 3),
    "stages.0.blocks.0.conv1.conv.weight": (256, 64, 1, 1),
    "stages.0.blocks.1.conv2.conv.weight": (256, 1, 3, 3),
    "stages.0.blocks.1.conv3.bn.weight": (64,),
    "stages.1.downsample.conv1.conv.weight": (128, 64, 1, 1),
    "stages.1.downsample.conv2.conv.weight": (128, 1, 3, 3),
    "stages.1.downsample.conv3.bn.num_batches_tracked": (),
    "stages.1.blocks.0.attn.attention_biases": (4, 49),
    "stages.1.blocks.0.attn.norm.weight": (128,),
    "stages.1.blocks.0.attn.qkv.weight": (384, 128),
    "stages.1.blocks.0.attn.proj.weight": (128, 128),
    "stages.1.blocks.1.local_conv.conv.weight": (128, 1, 3, 3),
    "stages.1.blocks.1.mlp.norm.bias": (128,),
    "stages.1.blocks.1.mlp.fc1.weight": (512, 128),
    "stages.1.blocks.1.mlp.fc2.weight": (128, 512),
    "stages.2.blocks.5.attn.attention_biases": (5, 196),
    "stages.2.blocks.5.attn.qkv.bias": (480,),
    "stages.3.downsample.conv1.conv.weight": (320, 160, 1, 1),
    "stages.3.blocks.1.attn.attention_biases": (10, 49),
    "stages.3.blocks.1.mlp.fc2.weight": (320, 1280),
    "head.norm.weight": (320,),
}


def test_tinyvit_5m_state_dict_matches_timm_layout():
    model = PoseNet(ModelConfig(variant="tinyvit-5m"), (256, 192))
    sd = model.state_dict()
    for key, shape in TIMM_5M_PINS.items():
        assert key in sd, key
        assert tuple(sd[key].shape) == shape, (key, tuple(sd[key].shape))
    trunk = [k for k in sd if not k.startswith("head.")]
    # timm's trunk: 6 tensors per ConvNorm (conv + 5 BatchNorm entries), 19 per attention block:
    # patch_embed 2 ConvNorm (12) + stage 1 2 MBConv x 3 ConvNorm (36) + 3 PatchMerging x 3 ConvNorm (54)
    # + 10 attention blocks (190) = 292.
    assert len(trunk) == 292
    n_params = sum(v.numel() for k, v in model.named_parameters() if not k.startswith("head."))
    assert 5.0e6 < n_params < 5.1e6  # 5.07M trunk parameters, as timm's model minus its classifier
    assert not any("bias_idxs" in k for k in sd)  # index table is not a buffer


def test_timm_style_checkpoint_loads_and_folds(tmp_path):
    src = tinyvit("tinyvit-small")
    # give BatchNorm non-trivial statistics so folding is actually exercised
    for m in src.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
    sd = {k: v for k, v in src.state_dict().items()}
    sd["head.fc.weight"] = torch.zeros(1000, 160)  # an ImageNet classifier is dropped
    sd["head.norm.weight"] = torch.full((160,), 2.0)
    path = tmp_path / "tinyvit.pth"
    torch.save({"model": sd}, path)
    model = PoseNet(ModelConfig(variant="tinyvit-small"), (64, 48))
    missing = load_tinyvit_weights(model, path)
    assert all(k.startswith("head.") for k in missing)
    assert torch.equal(model.head.norm.weight, torch.full((160,), 2.0))
    model.eval()
    x = torch.rand(2, 3, 64, 48)
    before = model.forward_features(x)
    fuse_batchnorm(model)
    assert is_fused(model)
    after = model.forward_features(x)
    torch.testing.assert_close(before, after, rtol=1e-4, atol=1e-4)
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())


def test_attention_bias_resampling_preserves_constant_tables():
    table = torch.full((3, 49), 0.7)
    out = resample_attention_biases(table, 4)
    assert out.shape == (3, 16)
    torch.testing.assert_close(out, torch.full((3, 16), 0.7))
    with pytest.raises(ValueError):
        resample_attention_biases(torch.zeros(2, 10), 3)


def test_a_map_smaller_than_its_window_attends_as_the_zero_padded_window_does():
    """A map that fits in one attention window (stages 2-4 at 128x96) is zero-padded to the window, as timm does.
    With a frozen bias table the padding is folded into one key (its tokens are all equal) and its queries are not
    computed: the block's output and the gradients of everything that trains through it (LayerNorms, inputs)
    are those of the padded window. A trainable or tapped bias table keeps the padded window."""
    import torch.nn.functional as F

    from fedpose.shared.model.tinyvit import TinyVitBlock

    torch.manual_seed(0)
    block = TinyVitBlock(dim=32, num_heads=2, window=7, mlp_ratio=2.0, local_conv_size=3)
    with torch.no_grad():
        block.attn.attention_biases.normal_()
        block.attn.norm.bias.normal_()  # the padding's token is the norm's bias: make it count
    block.attn.attention_biases.requires_grad_(False)
    for h, w in ((4, 3), (7, 5), (1, 1)):
        x = torch.randn(3, h, w, 32)
        padded = F.pad(x, (0, 0, 0, 7 - w, 0, 7 - h)).reshape(3, 1, 49, 32)
        reference = block.attn(padded).reshape(3, 7, 7, 32)[:, :h, :w]
        folded = block.attn.forward_in_one_window(x)
        assert torch.allclose(folded, reference, atol=1e-5, rtol=1e-5), (h, w)

        x.requires_grad_(True)
        grads_folded = torch.autograd.grad(block(x).square().sum(), [x, block.attn.norm.weight, block.attn.norm.bias])
        block.attn.attention_biases.requires_grad_(True)  # a trainable table: the padded window itself
        out = block(x)
        grads_padded = torch.autograd.grad(out.square().sum(), [x, block.attn.norm.weight, block.attn.norm.bias])
        block.attn.attention_biases.requires_grad_(False)
        for a, b in zip(grads_folded, grads_padded):
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (h, w)
    assert block.attn.can_fold_padding()
    block.attn.attention_biases.requires_grad_(True)
    assert not block.attn.can_fold_padding()  # its gradient is computed
    with torch.no_grad():
        assert block.attn.can_fold_padding()  # evaluation and export fold a trainable table too
    handle = block.attn.logits.register_forward_hook(lambda *_: None)  # book-keeping taps the logits
    assert not block.attn.can_fold_padding()
    handle.remove()


def test_forward_shapes_and_samples_are_independent():
    torch.manual_seed(0)
    model = build_model(ModelConfig(), (64, 48))
    model.train()
    x = torch.rand(3, 3, 64, 48)
    xl, yl, vl = model(x)
    assert xl.shape == (3, 16, 96) and yl.shape == (3, 16, 128) and vl.shape == (3, 16)
    # No BatchNorm: in training mode a sample's output does not depend on the rest of the batch.
    alone = model(x[:1])[0]
    torch.testing.assert_close(alone, xl[:1], rtol=1e-5, atol=1e-5)


def test_strategies_select_the_right_parameters():
    model = build_model(ModelConfig(), (64, 48))
    ft = set(trainable_names(model, "finetune"))
    assert "stages.3.blocks.0.attn.qkv.weight" in ft
    assert "head.x_head.weight" in ft
    assert "stages.1.blocks.0.attn.norm.weight" in ft  # LayerNorms everywhere train
    assert "stages.2.blocks.0.mlp.norm.bias" in ft
    assert "stages.1.blocks.0.attn.qkv.weight" not in ft
    assert "patch_embed.conv1.conv.weight" not in ft
    assert "stages.0.blocks.0.conv1.conv.weight" not in ft
    full = set(trainable_names(model, "full"))
    assert ft < full and full == {n for n, _ in model.named_parameters()}
    names = apply_strategy(model, "finetune")
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(names)
    with pytest.raises(ValueError):
        trainable_names(model, "partial")


def test_loss_fn_differentiates_only_trainable_and_per_sample():
    torch.manual_seed(0)
    model = build_model(ModelConfig(), (64, 48))
    names = apply_strategy(model, "finetune")
    loss_fn = make_loss_fn(model, names)
    params = {n: p.detach() for n, p in model.named_parameters() if n in names}
    batch = {
        "image": torch.rand(4, 3, 64, 48),
        "joints": torch.rand(4, 16, 2) * torch.tensor([48.0, 64.0]),
        "visible": torch.ones(4, 16),
    }
    losses = loss_fn(params, batch)
    assert losses.shape == (4,) and torch.isfinite(losses).all()
    one = torch.func.grad(lambda p: loss_fn(p, {k: v[:1] for k, v in batch.items()}).sum())(params)
    vm = torch.func.vmap(
        torch.func.grad(lambda p, s: loss_fn(p, {k: v[None] for k, v in s.items()}).sum()), in_dims=(None, 0)
    )(params, batch)
    for name in names:
        torch.testing.assert_close(vm[name][0], one[name], rtol=1e-4, atol=1e-6)
    # the task-uncertainty scales get a gradient like any other parameter
    assert vm["head.log_task_scale"].abs().sum() > 0


def test_simcc_targets_decode_back_to_the_joint():
    coords = torch.tensor([[[10.3, 40.75], [0.0, 63.0]]])  # (1, K=2, 2)
    split = 2.0
    tx = gaussian_targets(coords[..., 0], 96, split_ratio=split, sigma=1.5)
    ty = gaussian_targets(coords[..., 1], 128, split_ratio=split, sigma=1.5)
    torch.testing.assert_close(tx.sum(-1), torch.ones(1, 2))
    kp, sc = decode_simcc(np.log(tx.numpy() + 1e-12), np.log(ty.numpy() + 1e-12), split_ratio=split)
    np.testing.assert_allclose(kp[0, 0], [10.3, 40.75], atol=0.05)
    assert kp.shape == (1, 2, 2) and sc.shape == (1, 2) and (sc > 0).all() and (sc <= 1).all()
    with pytest.raises(ValueError):
        decode_simcc(np.zeros((1, 2, 5)), np.zeros((2, 2, 5)), split_ratio=2.0)


def test_checkpoint_round_trip(tmp_path):
    torch.manual_seed(0)
    model = build_model(ModelConfig(task_uncertainty=False), (64, 48))
    path = tmp_path / "m.pt"
    save_checkpoint(path, model, {"note": "x"})
    loaded, meta = load_checkpoint(path)
    assert meta == {"note": "x"} and loaded.input_size == (64, 48)
    x = torch.rand(2, 3, 64, 48)
    torch.testing.assert_close(loaded(x)[0], model(x)[0])
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="bad.pt"):
        load_checkpoint(tmp_path / "bad.pt")
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "missing.pt")


@pytest.mark.parametrize("window", [1, 2, 5, 7, 14])
def test_the_attention_bias_index_numbers_offsets_in_first_seen_order(window):
    """Each pair of window points reads the table entry of its offset (|dy|, |dx|), the entries numbered in the
    order the offsets are first seen over the row-major points (timm's layout, which checkpoints assume)."""
    import itertools

    from fedpose.shared.model.tinyvit import offset_index

    points = list(itertools.product(range(window), range(window)))
    seen: dict[tuple[int, int], int] = {}
    want = [[seen.setdefault((abs(a[0] - b[0]), abs(a[1] - b[1])), len(seen)) for b in points] for a in points]
    got = offset_index(window)
    assert got.dtype == torch.long and got.shape == (window * window, window * window)
    assert got.tolist() == want
