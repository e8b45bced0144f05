"""The example GPT (``model.py``) trained by a Lightning ``Trainer``, with spikeguard.

A ``LightningModule`` around the example's byte-level GPT (built from the arguments, random
weights, no downloads), trained with ``strategy="ddp"`` over gloo on CPU. The only spikeguard
lines are the callback and the ``ckpt_path`` of ``fit``::

    sg = SpikeguardCallback(sample_every=..., checkpoint_every=...)
    trainer = L.Trainer(callbacks=[sg], strategy=DDPStrategy(process_group_backend="gloo"), ...)
    trainer.fit(module, ckpt_path=sg.ckpt_path(module))

Under ``spikeguard submit`` (``examples/lightning_diverge.yaml``) every rank gets torchrun's
environment, which Lightning recognises (``TorchElasticEnvironment``): ``devices`` and
``num_nodes`` are taken from ``LOCAL_WORLD_SIZE`` and ``WORLD_SIZE``, and Lightning launches
nothing itself. Alone, ``python examples/lightning_diverge.py`` trains one process.

Data: synthetic (:class:`MarkovBatches`, a random Markov chain: learnable, no downloads), the batch
of step ``s`` on rank ``r`` drawn from ``(seed, s, r)``. The training dataloader starts at
``trainer.global_step``: Lightning builds it after restoring a checkpoint, so a rollback replays
exactly the batches that followed it. Recipe: the LR schedule of ``gpt_diverge.py`` (geometric
warm-up to ``--lr-peak``, then cosine decay; a ``LambdaLR`` stepped every optimizer step), AdamW,
no clipping; run to the end of the warm-up (``--steps 300``) the attention entropy starts to
fall by itself.

``SG_COLLAPSE_AT=STEP`` injects a collapse from that step on in the first generation (the job file
sets it): the supervisor rolls back into the Lightning checkpoint before it, with the LR cut and a
fresh optimizer, and the next generation trains on.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from spikeguard.examples import gpt_diverge
from spikeguard.examples.gpt_diverge import lr_at
from spikeguard.examples.model import GPT
from spikeguard.workers.integrations.lightning import SpikeguardCallback
from torch.utils.data import DataLoader, IterableDataset

VOCAB = 256
COLLAPSE_ENV = "SG_COLLAPSE_AT"
"""A step: from it on, in the first generation only, every step multiplies the attention's
query and key weights and the output head's weights by :data:`COLLAPSE_FACTOR` (an injected
entropy collapse and loss spike, to watch a recovery in a minute)."""
COLLAPSE_FACTOR = 1.5


def build_parser() -> argparse.ArgumentParser:
    """``gpt_diverge.py``'s arguments (the same recipe flags), the model's size, shorter defaults.

    Of those, the SDK's (``--report``, ``--ckpt-dir``, ``--sample-every``, ``--ckpt-every``,
    ``--no-sdk``), the recipe's and ``--qk-norm``, ``--beta2``, ``--weight-decay``,
    ``--log-every``, ``--threads`` apply; the loop's own (``--metrics``, ``--logit-every``,
    ``--nan-patience``, ``--data-bytes``, ``--device``) do not: Lightning runs the loop.
    """
    p = gpt_diverge.build_parser()
    p.description = __doc__.split("\n\n")[0]
    p.add_argument("--d-model", type=int, default=64, help="model width")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.set_defaults(steps=600, warmup=300, batch=8, sample_every=25, ckpt_every=50, log_every=50)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed arguments (``--lr-peak`` and ``--stable`` as in ``gpt_diverge.py``)."""
    return gpt_diverge.parse_args(argv, build_parser())


class MarkovBatches:
    """Synthetic text: sequences of a random Markov chain over ``vocab`` tokens, each token
    followed by one of ``branching`` successors (a fixed table drawn from ``seed``). Learnable
    (the loss falls from ln(vocab) towards ln(branching)) and deterministic: the batch of
    ``step`` for ``rank`` is drawn from ``(seed, step, rank)`` alone."""

    def __init__(
        self, *, vocab: int, seq_len: int, batch: int, seed: int, branching: int = 4
    ) -> None:
        self.vocab, self.seq_len, self.batch, self.seed = vocab, seq_len, batch, seed
        table = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(0, vocab, (vocab, branching), generator=table)

    def get(self, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``: inputs and next-token targets, int64 ``[batch, seq_len]``."""
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 4096 + rank)
        tokens = torch.empty(self.batch, self.seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.vocab, (self.batch,), generator=g)
        picks = torch.randint(0, self.successors.shape[1], (self.batch, self.seq_len), generator=g)
        for t in range(self.seq_len):
            tokens[:, t + 1] = self.successors[tokens[:, t], picks[:, t]]
        return tokens[:, :-1], tokens[:, 1:]


class StepBatches(IterableDataset):
    """This rank's batches of steps ``start``..``stop - 1``, each ``(x, y)`` of one step."""

    def __init__(self, batches: MarkovBatches, rank: int, start: int, stop: int) -> None:
        super().__init__()
        self.batches, self.rank, self.start, self.stop = batches, rank, start, stop

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for step in range(self.start, self.stop):
            yield self.batches.get(step, self.rank)


class GPTModule(L.LightningModule):
    """The example's GPT as a ``LightningModule``: loss, AdamW, the LR schedule, the data."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        at = os.environ.get(COLLAPSE_ENV)
        generation = int(os.environ.get("SPIKEGUARD_GENERATION") or 0)
        self.collapse_at = int(at) if at and generation <= 1 else None
        torch.manual_seed(args.seed)
        self.model = GPT(
            seq_len=args.seq,
            d_model=args.d_model,
            n_layer=args.layers,
            n_head=args.heads,
            qk_norm=args.qk_norm,
        )

    def on_train_batch_start(self, batch: object, batch_idx: int) -> None:
        """The demo's injected collapse (``SG_COLLAPSE_AT``), first generation only."""
        if self.collapse_at is not None and self.trainer.global_step >= self.collapse_at:
            with torch.no_grad():  # attention logits and output logits blow up: a real collapse
                for block in self.model.blocks:
                    block.attn.q_proj.weight.mul_(COLLAPSE_FACTOR)
                    block.attn.k_proj.weight.mul_(COLLAPSE_FACTOR)
                self.model.lm_head.weight.mul_(COLLAPSE_FACTOR)

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        _, loss = self.model(x, y)
        return loss

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(
            self.parameters(),
            lr=1.0,
            betas=(0.9, self.args.beta2),
            weight_decay=self.args.weight_decay,
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, self.args))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        """Built after a checkpoint is restored: it starts at the restored ``global_step``."""
        batches = MarkovBatches(
            vocab=VOCAB, seq_len=self.args.seq, batch=self.args.batch, seed=self.args.seed
        )
        data = StepBatches(
            batches, self.trainer.global_rank, self.trainer.global_step, self.args.steps
        )
        return DataLoader(data, batch_size=None)

    def on_train_batch_end(self, outputs: dict, batch: object, batch_idx: int) -> None:
        step = self.trainer.global_step - 1
        if self.trainer.is_global_zero and self.args.log_every and step % self.args.log_every == 0:
            lr = self.trainer.optimizers[0].param_groups[0]["lr"]
            print(f"step {step:5d} loss {float(outputs['loss']):.4f} lr {lr:.3e}", flush=True)


def trainer_for(args: argparse.Namespace, callback: SpikeguardCallback | None) -> L.Trainer:
    """A CPU trainer: DDP over gloo across the ranks torchrun's variables describe (one process
    alone)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return L.Trainer(
        accelerator="cpu",
        devices=local,
        num_nodes=world // local,
        strategy=DDPStrategy(process_group_backend="gloo") if world > 1 else "auto",
        max_steps=args.steps,
        callbacks=[] if callback is None else [callback],
        logger=False,
        enable_checkpointing=False,  # spikeguard's callback saves the checkpoints it grades
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def main(argv: list[str] | None = None, module_class: type[GPTModule] = GPTModule) -> int:
    """Train (every rank); ``module_class`` lets a test subclass the module."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    module = module_class(args)
    callback = None
    if not args.no_sdk:
        callback = SpikeguardCallback(
            sample_every=args.sample_every,
            checkpoint_every=args.ckpt_every,
            ckpt_dir=args.ckpt_dir,
            report=args.report,
        )
    trainer = trainer_for(args, callback)
    trainer.fit(module, ckpt_path=None if callback is None else callback.ckpt_path(module))
    if trainer.is_global_zero:
        print(f"finished: global_step {trainer.global_step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
