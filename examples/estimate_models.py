"""Model factories for ``torchdoctor estimate`` and its accuracy benchmark.

Each factory returns a model, or ``(model, make_batch)``, or ``(model, make_batch, loss)``, where
``make_batch(batch_size)`` returns ``(inputs, target)``. Use them as
``torchdoctor estimate examples/estimate_models.py:gpt2_small --tokens 1024 --batch 8``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def plain_cnn() -> tuple[nn.Module, object]:
    """A VGG-style CNN for 3x64x64 images, 10 classes."""
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, 10),
    )

    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 3, 64, 64), torch.randint(0, 10, (n,))

    return model, make_batch


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class SmallResNet(nn.Module):
    """ResNet-18-style network for 3x32x32 images (CIFAR sized)."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU()
        )
        self.layers = nn.Sequential(
            BasicBlock(32, 32, 1),
            BasicBlock(32, 64, 2),
            BasicBlock(64, 128, 2),
            BasicBlock(128, 128, 1),
        )
        self.head = nn.Linear(128, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


def resnet() -> tuple[nn.Module, object]:
    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))

    return SmallResNet(), make_batch


class EncoderClassifier(nn.Module):
    """nn.TransformerEncoder over token ids, mean-pooled into 4 classes."""

    def __init__(self, vocab: int = 1000, dim: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)).mean(dim=1))


def transformer_encoder() -> tuple[nn.Module, object]:
    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(0, 1000, (n, 64)), torch.randint(0, 4, (n,))

    return EncoderClassifier(), make_batch


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.dropout = dropout
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.resid_drop(self.proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, dropout)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-2-style decoder: learned positions, pre-norm blocks, tied output head."""

    def __init__(
        self, vocab: int, context: int, dim: int, layers: int, heads: int, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.drop(self.tok(ids) + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt_tiny() -> nn.Module:
    """A 4-layer GPT (about 1 M parameters) without dropout; use --tokens."""
    return GPT(vocab=2048, context=256, dim=128, layers=4, heads=4)


def gpt_tiny_dropout() -> nn.Module:
    """gpt_tiny with dropout 0.1 everywhere, attention included."""
    return GPT(vocab=2048, context=256, dim=128, layers=4, heads=4, dropout=0.1)


def gpt2_small() -> nn.Module:
    """GPT-2 small: 12 layers, 768 wide, 12 heads, 50257 tokens (124 M parameters)."""
    return GPT(vocab=50257, context=1024, dim=768, layers=12, heads=12, dropout=0.1)


def gpt2_medium() -> nn.Module:
    """GPT-2 medium: 24 layers, 1024 wide, 16 heads (355 M parameters)."""
    return GPT(vocab=50257, context=1024, dim=1024, layers=24, heads=16, dropout=0.1)


class LSTMTagger(nn.Module):
    """Embedding, 2-layer LSTM and a per-token classifier."""

    def __init__(self, vocab: int = 1000, dim: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, num_layers=2, batch_first=True)
        self.head = nn.Linear(dim, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(ids))
        return self.head(out)


def lstm() -> tuple[nn.Module, object]:
    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(0, 1000, (n, 32)), torch.randint(0, 16, (n, 32))

    return LSTMTagger(), make_batch


def mlp_dropout() -> tuple[nn.Module, object]:
    """A 3-layer MLP with dropout on flattened 28x28 images."""
    model = nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 1024),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(1024, 10),
    )

    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,))

    return model, make_batch


class ViTBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        # need_weights=True (the default) takes the unfused path: softmax scores are kept.
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h)[0]
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    """A ViT for 3x64x64 images: 8x8 patches, 4 blocks of width 192, GroupNorm-free."""

    def __init__(self, dim: int = 192, depth: int = 4, heads: int = 3, classes: int = 100) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 8, 8)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.zeros(1, 65, dim))
        self.blocks = nn.Sequential(*(ViTBlock(dim, heads) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.norm(self.blocks(x))[:, 0])


def vit_tiny() -> tuple[nn.Module, object]:
    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 3, 64, 64), torch.randint(0, 100, (n,))

    return TinyViT(), make_batch


def data_dependent() -> tuple[nn.Module, object]:
    """A model whose forward calls .item(): fake tensors cannot trace it."""

    class Gated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.fc(x)
            return y * 2 if y.mean().item() > 0 else y

    def make_batch(n: int) -> tuple[torch.Tensor, None]:
        return torch.randn(n, 16), None

    return Gated(), make_batch


class NanoGPT(nn.Module):
    """A nanoGPT-style decoder (written for torchdoctor, not vendored): ``forward(idx,
    targets)`` computes the loss itself and returns ``(logits, loss)``, logits for every
    position when there are targets, else for the last position only."""

    def __init__(
        self,
        vocab: int = 50304,
        context: int = 256,
        dim: int = 256,
        layers: int = 4,
        heads: int = 4,
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(context, dim)
        self.h = nn.ModuleList(Block(dim, heads, 0.0) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT does
        self.context = context
        print(f"number of parameters: {sum(p.numel() for p in self.parameters()) / 1e6:.2f}M")

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def nanogpt(
    vocab: int = 50304, context: int = 256, dim: int = 256, layers: int = 4
) -> tuple[nn.Module, object]:
    """nanoGPT's shape: 4 layers, 256 wide, vocabulary 50304, sequence 256; the batch is
    ``((X, Y), None)`` so that the step calls ``model(X, Y)`` and trains on the loss it returns.
    It prints its parameter count when built, as nanoGPT does."""
    model = NanoGPT(vocab, context, dim, layers)

    def make_batch(n: int) -> tuple[tuple[torch.Tensor, torch.Tensor], None]:
        x = torch.randint(0, vocab, (n, context))
        return (x, torch.roll(x, -1, dims=1)), None

    return model, make_batch


def nanogpt_small() -> tuple[nn.Module, object]:
    """nanogpt at test size: 2 layers, 128 wide, vocabulary 8192, sequence 64."""
    return nanogpt(vocab=8192, context=64, dim=128, layers=2)


class DictOutputClassifier(nn.Module):
    """An MLP whose forward returns a dict: the logits and the pooled features."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 512), nn.GELU())
        self.head = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        features = self.body(x)
        return {"logits": self.head(features), "features": features}


def dict_output() -> tuple[nn.Module, object]:
    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 3, 32, 32), torch.randint(0, 1000, (n,))

    def loss(output: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output["logits"], target)

    return DictOutputClassifier(), make_batch, loss


def hf_gpt2_tiny() -> nn.Module:
    """A 2-layer GPT-2 from transformers (random weights, no download), vocabulary 8192."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=8192, n_positions=128, n_embd=128, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def lightning_lm() -> tuple[nn.Module, object]:
    """A LightningModule around gpt_tiny: ``training_step`` computes the token cross-entropy
    and logs it; ``configure_optimizers`` is AdamW. Needs lightning."""
    import lightning as L

    class LitLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = GPT(vocab=2048, context=256, dim=128, layers=4, heads=4)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.model(ids)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
            ids, targets = batch
            logits = self(ids)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, 2048, (n, 64))
        return ids, torch.roll(ids, -1, dims=1)

    return LitLM(), make_batch
