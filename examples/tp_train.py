"""A tiny causal transformer whose lm_head is split by vocabulary across ranks, trained with fused_ce.

    torchrun --nproc-per-node 2 examples/tp_train.py              # GPUs (NCCL) if there are enough, else CPU (gloo)
    torchrun --nproc-per-node 4 examples/tp_train.py --device cpu --steps 50

Each rank holds the whole body and 1/P of the lm_head's rows (its vocabulary shard); the loss is
`fused_ce.linear_cross_entropy(hidden, shard, labels, process_group=...)`: the [tokens, V] logits are
never built on any rank, every rank gets the same loss, the body's gradient arrives summed over the
group, and each rank's optimizer updates its own shard. The data is a fixed random sequence repeated,
so the loss falls quickly; rank 0 prints it and checks that every rank saw the same loss.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

import fused_ce


class TinyLM(nn.Module):
    def __init__(self, vocab, dim, layers, shard_rows, vocab_start):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=4 * dim, batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers)
        self.norm = nn.LayerNorm(dim)
        # this rank's rows of the output layer: classes [vocab_start, vocab_start + shard_rows)
        self.lm_head_shard = nn.Parameter(torch.randn(shard_rows, dim) / dim**0.5)

    def forward(self, tokens, labels, group):
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        hidden = self.norm(self.body(self.embed(tokens), mask=mask, is_causal=True))
        return fused_ce.linear_cross_entropy(hidden, self.lm_head_shard, labels, process_group=group)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    device = args.device or ("cuda" if torch.cuda.device_count() >= world else "cpu")
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank = dist.get_rank()
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    group = dist.group.WORLD
    # contiguous shards in rank order; they may differ in size (here the last one takes the remainder)
    rows = args.vocab // world
    shard_rows = rows if rank < world - 1 else args.vocab - rows * (world - 1)
    torch.manual_seed(0)  # the same body on every rank
    model = TinyLM(args.vocab, args.dim, 2, shard_rows, rank * rows).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1))
    tokens, labels = data[:, :-1].to(device), data[:, 1:].to(device)
    for step in range(args.steps):
        loss = model(tokens, labels, group)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        every = [torch.zeros((), device=device) for _ in range(world)]
        dist.all_gather(every, loss.detach())
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            same = all(torch.equal(e, every[0]) for e in every)
            print(f"step {step:3d}  loss {loss.item():.4f}  same on all {world} ranks: {same}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
