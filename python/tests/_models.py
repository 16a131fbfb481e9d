"""Shared pieces of the tests and of examples/torch_optimizer: a tiny GPT (explicit attention, so
the CUDA backward can be made deterministic), synthetic data, param groups, and the reference
AdamW on f32 master weights."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(d // h))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab=64, d=64, heads=4, layers=2, seq=32):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def make_model(seed, device, dtype, **kw):
    torch.manual_seed(seed)
    m = TinyGPT(**kw)
    return m.to(device=device, dtype=dtype)


def make_data(steps, batch, seq, vocab, seed=1234):
    """Affine sequences x[t+1] = (a*x[t] + c) mod vocab: learnable, so the loss falls."""
    g = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(steps):
        a = torch.randint(1, vocab, (batch, 1), generator=g)
        c = torch.randint(0, vocab, (batch, 1), generator=g)
        x0 = torch.randint(0, vocab, (batch, 1), generator=g)
        seqs = [x0]
        for _ in range(seq):
            seqs.append((seqs[-1] * a + c) % vocab)
        s = torch.cat(seqs, dim=1)
        data.append((s[:, :-1].contiguous(), s[:, 1:].contiguous()))
    return data


def loss_fn(model, x, y):
    """Cross-entropy written with log_softmax + gather (deterministic on CUDA, unlike nll_loss)."""
    logp = model(x).float().log_softmax(-1)
    return -logp.gather(-1, y.unsqueeze(-1)).mean()


def backward_batch(model, x, y, accumulation=1):
    """Forward and backward of one batch in `accumulation` micro-batches; the batch's loss."""
    total = 0.0
    for xs, ys in zip(x.chunk(accumulation), y.chunk(accumulation)):
        loss = loss_fn(model, xs, ys) / accumulation
        loss.backward()
        total += loss.item()
    return total


def param_groups(named, wd=0.1):
    """Weights decay, biases / norms / embeddings' 1-d params do not (two interleaved groups)."""
    decay = [(n, p) for n, p in named if p.ndim >= 2]
    no_decay = [(n, p) for n, p in named if p.ndim < 2]
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def lr_lambda(step):
    """Warm-up then cosine: the learning rate changes at every step."""
    warm = 5
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / 100)))


class MasterAdamW:
    """The reference: torch.optim.AdamW on f32 master weights. For f32 CPU models the master is
    the parameter itself; for bf16 models the masters are f32 copies (on the model's device), the
    gradients are cast to f32, clipped with clip_grad_norm_, stepped, and copied back."""

    def __init__(self, model, lr, betas, eps, wd, max_norm):
        named = list(model.named_parameters())
        self.model_params = [p for _, p in named]
        self.same = all(p.dtype == torch.float32 for p in self.model_params)
        if self.same:
            self.masters = self.model_params
        else:
            self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.model_params]
        master_of = {id(p): q for p, q in zip(self.model_params, self.masters)}
        groups = [{"params": [master_of[id(p)] for _, p in g["params"]], "weight_decay": g["weight_decay"]}
                  for g in param_groups(named, wd)]
        self.opt = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=False)
        self.max_norm = max_norm
        self.last_norm = None

    @torch.no_grad()
    def step(self):
        if not self.same:
            for p, q in zip(self.model_params, self.masters):
                q.grad = p.grad.float()
                p.grad = None
        if self.max_norm > 0:
            self.last_norm = float(torch.nn.utils.clip_grad_norm_(self.masters, self.max_norm))
        else:
            self.last_norm = float(torch.nn.utils.clip_grad_norm_(self.masters, float("inf")))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if not self.same:
            for p, q in zip(self.model_params, self.masters):
                p.copy_(q)


def rel_diffs(a, b):
    return [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)]


def train_reference(model, ref, sched, batches, device):
    """One MasterAdamW step per batch; returns (losses, global norms before clipping)."""
    losses, norms = [], []
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        loss = loss_fn(model, x, y)
        loss.backward()
        ref.step()
        sched.step()
        losses.append(loss.item())
        norms.append(ref.last_norm)
    return losses, norms
