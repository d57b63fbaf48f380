"""The transformers integration under data-parallel engines, on CPU with gloo (2 ranks): FSDP2 however it wraps
(root only; per decoder layer and the root; per layer, the lm_head apart and the root, resharding after forward or
not; bf16 parameters with float32 reduction), DDP, tied embeddings, PEFT LoRA (attention and lm_head), and
gradient accumulation with transformers' num_items_in_batch. Each rank trains on its own micro-batches; the loss
and every full gradient are compared with one process training the unsharded model on the whole batch.

DeepSpeed ZeRO-3 needs a GPU: test_deepspeed_zero3 (GPU).
"""

import copy
import os
import sys

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers", reason="needs transformers")

from test_distributed import spawn  # noqa: E402

from fused_ce.integrations.transformers import apply  # noqa: E402

VOCAB, BATCH, SEQ = 301, 4, 12  # BATCH sequences per rank and micro-batch


def tiny(family="llama", tied=False, seed=0):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied)  # fmt: skip
    torch.manual_seed(seed)
    if family == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))


def batches(world, micro, seed=1):
    """[world][micro] (input_ids, labels): about a third of the labels ignored (prompts, padding)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(world):
        rank = []
        for _ in range(micro):
            ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
            labels = ids.clone()
            labels[torch.rand(BATCH, SEQ, generator=g) < 0.33] = -100
            rank.append((ids, labels))
        out.append(rank)
    return out


def counted(labels):
    return int((labels[:, 1:] != -100).sum())


def reference(model, data):
    """One process, the whole batch: transformers' own loss (unpatched), its mean over every counted token."""
    model = copy.deepcopy(model)
    ids = torch.cat([b[0] for rank in data for b in rank])
    labels = torch.cat([b[1] for rank in data for b in rank])
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def full(t):
    return t.full_tensor() if type(t).__name__ == "DTensor" else t


def train_step(model, data, rank, world):
    """This rank's micro-batches, accumulated as the HF Trainer does with num_items_in_batch (the counted
    tokens of every rank's micro-batches; the loss times the world size, the engines averaging over ranks).
    Returns this rank's share of the global mean loss."""
    items = sum(counted(b[1]) for r in data for b in r)
    total = torch.zeros(())
    for ids, labels in data[rank]:
        loss = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(items)).loss
        (loss * world).backward()
        total += loss.detach()
    return total


def check(case, model, data, want_loss, want_grads, rank, world, rtol=1e-4):
    share = train_step(model, data, rank, world)
    dist.all_reduce(share)
    assert abs(share.item() - want_loss.item()) <= rtol * abs(want_loss.item()) + 1e-6, (case, share, want_loss)
    names = dict(model.named_parameters())
    for name, want in want_grads.items():
        got = names.get(name)
        if got is None:  # DDP, PEFT prefixes
            got = next(p for n, p in names.items() if n.endswith(name))
        grad = full(got.grad).float()
        err = ((grad - want).norm() / want.norm().clamp_min(1e-30)).item()
        assert err <= rtol, (case, name, err)


def wrap(model, how, mesh, **fsdp):
    from torch.distributed.fsdp import fully_shard

    layers = model.model.layers if hasattr(model, "model") else None
    if how in ("layers", "layers+head"):
        for layer in layers:
            fully_shard(layer, mesh=mesh, **fsdp)
    if how == "layers+head":
        fully_shard(model.lm_head, mesh=mesh, **fsdp)  # the output layer apart, as torchtitan shards it
    fully_shard(model, mesh=mesh, **fsdp)
    return model


def check_engines(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.nn.parallel import DistributedDataParallel

    mesh = init_device_mesh("cpu", (world,))
    data = batches(world, micro=2)
    for family, tied in (("llama", False), ("qwen2", True)):
        model = tiny(family, tied)
        want_loss, want_grads = reference(model, data)
        hows = ["root", "layers"] + ([] if tied else ["layers+head"])  # a tied head shares the embedding's shard
        for how in hows:
            for reshard in (True, False):
                fused = wrap(apply(copy.deepcopy(model)), how, mesh, reshard_after_forward=reshard)
                check(f"{family} tied={tied} fsdp2 {how} reshard={reshard}", fused, data, want_loss, want_grads,
                      rank, world)  # fmt: skip
        ddp = DistributedDataParallel(apply(copy.deepcopy(model)))
        check(f"{family} tied={tied} ddp", ddp, data, want_loss, want_grads, rank, world)
    # bf16 parameters, float32 reduction: against the unpatched model under the same policy
    model = tiny()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    unpatched = wrap(copy.deepcopy(model), "layers+head", mesh, mp_policy=policy)
    want_loss = train_step(unpatched, data, rank, world)
    dist.all_reduce(want_loss)
    want_grads = {n: full(p.grad).float() for n, p in unpatched.named_parameters()}
    fused = wrap(apply(copy.deepcopy(model)), "layers+head", mesh, mp_policy=policy)
    check("fsdp2 layers+head bf16/fp32", fused, data, want_loss, want_grads, rank, world, rtol=2e-2)


def check_peft(rank, world):
    import peft
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    mesh = init_device_mesh("cpu", (world,))
    data = batches(world, micro=1, seed=2)
    for targets in (["q_proj", "v_proj"], ["q_proj", "v_proj", "lm_head"]):
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)
        torch.manual_seed(3)
        model = peft.get_peft_model(tiny(), lora)
        want_loss, want_grads = reference(model, data)
        fused = apply(copy.deepcopy(model))
        assert type(fused).__name__.startswith("Peft")  # the PEFT model, its causal LM switched inside
        base = fused.get_base_model()
        check(f"peft {targets} ddp", DistributedDataParallel(copy.deepcopy(fused)), data, want_loss, want_grads,
              rank, world)  # fmt: skip
        for layer in base.model.layers:
            from torch.distributed.fsdp import fully_shard

            fully_shard(layer, mesh=mesh)
        fully_shard(base.lm_head, mesh=mesh)
        fully_shard(fused, mesh=mesh)
        check(f"peft {targets} fsdp2 layers+head", fused, data, want_loss, want_grads, rank, world)


ZERO3 = {
    "train_micro_batch_size_per_gpu": BATCH,
    "gradient_accumulation_steps": 1,
    # every parameter partitioned, however small (the default keeps small ones whole on every rank)
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "zero_allow_untested_optimizer": True,
}


def check_zero3(rank, world):
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    data = [[(ids.cuda(), labels.cuda()) for ids, labels in r] for r in batches(world, micro=1, seed=4)]
    for family, tied in (("llama", False), ("qwen2", True)):
        model = tiny(family, tied).cuda()
        want_loss, want_grads = reference(model, data)
        engine, *_ = deepspeed.initialize(model=apply(copy.deepcopy(model)), config=copy.deepcopy(ZERO3))
        head = engine.module.lm_head.weight
        assert head.numel() == 0 and head.ds_shape[0] == VOCAB  # partitioned outside the head's forward
        ids, labels = data[rank][0]
        items = sum(counted(b[1]) for r in data for b in r)
        loss = engine(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(items, device="cuda")).loss
        engine.backward(loss * world)
        share = loss.detach().clone()
        dist.all_reduce(share)
        assert abs(share.item() - want_loss.item()) <= 1e-4 * abs(want_loss.item()), (family, share, want_loss)
        for name, p in engine.module.named_parameters():
            if name in want_grads:
                grad = safe_get_full_grad(p)
                err = ((grad.float() - want_grads[name]).norm() / want_grads[name].norm()).item()
                assert err <= 1e-4, (family, name, err)
        engine.destroy()
    # the HF Trainer with a ZeRO-3 config: the same losses as transformers' own
    from torch.utils.data import Dataset

    class Data(Dataset):
        def __len__(self):
            return 4 * BATCH

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
            labels = ids.clone()
            labels[: SEQ // 3] = -100
            return dict(input_ids=ids, labels=labels)

    def trainer_losses(model, out):
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=BATCH, max_steps=3, learning_rate=1e-3, logging_steps=1,
            report_to=[], save_strategy="no", deepspeed=copy.deepcopy(ZERO3), seed=0,
        )  # fmt: skip
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Data())
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    import tempfile

    with tempfile.TemporaryDirectory() as out:
        want = trainer_losses(tiny(), out)
        got = trainer_losses(apply(tiny()), out)
    assert len(got) == len(want) == 3 and all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(got, want)), (got, want)


@pytest.mark.cuda
def test_deepspeed_zero3():
    pytest.importorskip("deepspeed", reason="needs deepspeed")
    spawn(check_zero3, 1, backend="nccl")


def test_fsdp2_every_wrapping_ddp_and_tied_embeddings():
    spawn(check_engines, 2)


def test_peft_lora_under_ddp_and_fsdp2():
    pytest.importorskip("peft", reason="needs peft")
    spawn(check_peft, 2)


@pytest.mark.parametrize("adapters", [1, 2])
def test_lora_dropout_on_the_head_equals_unpatched(adapters):
    """LoRA on the lm_head with dropout: the adapters as the loss's low-rank term, the dropout drawn as the head's
    own call draws it (the same masks under the same seed): the loss and every gradient as unpatched, no logits.
    (Without dropout, the same term: check_peft, under DDP and FSDP2.)"""
    peft = pytest.importorskip("peft", reason="needs peft")
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"], lora_dropout=0.3, init_lora_weights=False)
    torch.manual_seed(0)
    model = peft.get_peft_model(tiny(), lora)
    if adapters == 2:  # both active: their terms summed (ranks side by side)
        model.add_adapter("second", peft.LoraConfig(r=2, target_modules=["lm_head"], lora_dropout=0.5,
                                                    init_lora_weights=False))  # fmt: skip
        model.base_model.set_adapter(["default", "second"])
    model.train()
    ids = torch.randint(0, VOCAB, (2, 12))
    labels = ids.clone()
    labels[:, :3] = -100

    def step(m):
        torch.manual_seed(5)
        out = m(input_ids=ids, labels=labels)
        out.loss.backward()
        return out, {n: p.grad for n, p in m.named_parameters() if p.grad is not None}

    want, want_grads = step(copy.deepcopy(model))
    got, got_grads = step(apply(copy.deepcopy(model), logits="never"))
    assert got.logits is None
    assert abs(got.loss.item() - want.loss.item()) <= 1e-6 * abs(want.loss.item())
    assert got_grads.keys() == want_grads.keys() and any("lm_head.lora_A" in n for n in want_grads)
    for name, grad in want_grads.items():
        assert ((got_grads[name] - grad).norm() / grad.norm()).item() <= 1e-5, name
    model.eval()  # no dropout in eval
    out = apply(model, logits="never")(input_ids=ids, labels=labels)
    assert out.logits is None and out.loss.isfinite()


if __name__ == "__main__":
    sys.exit(pytest.main([os.path.abspath(__file__), "-q"]))
