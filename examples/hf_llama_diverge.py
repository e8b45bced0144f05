"""A tiny Llama trained by ``transformers.Trainer`` that diverges on purpose, recovered by
spikeguard through the Trainer's own checkpoints.

An ordinary Trainer script (torchrun-style: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``; gloo on CPU) with the two spikeguard lines of the README's
"Hugging Face Trainer" section::

    spikeguard submit examples/hf_llama_diverge.yaml

Model: ``LlamaForCausalLM`` from a ``LlamaConfig`` with random weights (4 layers, d=64, 4
heads / 2 KV heads, RoPE, no QK-norm, vocab 256: bytes), no hub download, no tokenizer. Data: the
standard library's ``*.py`` bytes (:mod:`.data`), windows of 64 bytes, batch 16 per rank.
Recipe: AdamW (betas 0.9/0.95, no weight decay, no gradient clipping), ``gpt_diverge.py``'s
schedule as the Trainer's scheduler (:func:`lr_factor`, a ``LambdaLR`` the Trainer saves and
resumes like its own): a geometric warm-up from ``--lr-start`` 1e-3 to ``--lr`` 0.15 over
``--warmup`` 600 steps, then a cosine to ``--final-frac`` 10 % at ``--steps`` 800. The model
trains cleanly to ~1.9 nats while the LR is small; from LR ~0.05 (step ~480) on, the peak is
past this model's stability edge: the attention logits grow, the min-head attention entropy
collapses and the loss climbs ~1 nat to ~2.9 by step ~620, ending near 2.5
(``bench/hf_llama_seeds.py`` measures the onset over seeds and the runs under spikeguard; the
README has the table). A linear warm-up to a high peak does not give a clean divergence: the
attention collapses in the first 200 steps, before the model learned anything, and the loss only
stalls. ``--stable``: the same schedule x0.3 (a control).

Test hooks (read by this script only, never by the library): ``SG_HF_COLLAPSE=STEP:GEN``
multiplies the LM head's weights by 30 at that step of that launch generation (an instant loss
spike); ``SG_HF_OBSERVE=DIR`` makes each rank write what it saw at (re)start to
``DIR/gen{G}-rank{R}.json``: the Trainer's ``global_step``, the optimizer's state size and the LR
the first optimizer step actually used (after spikeguard's scale).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
from spikeguard.examples.data import DEFAULT_MAX_BYTES, load_corpus

STABLE_FACTOR = 0.3


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--steps", type=int, default=800, help="total optimizer steps")
    p.add_argument("--seed", type=int, default=0, help="init and data seed")
    p.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=64, help="tokens (bytes) per sequence")
    p.add_argument("--lr", type=float, default=0.15, help="peak LR (end of the warm-up)")
    p.add_argument("--lr-start", type=float, default=1e-3, help="LR at step 0")
    p.add_argument("--warmup", type=int, default=600, help="geometric warm-up steps")
    p.add_argument("--final-frac", type=float, default=0.1, help="cosine floor, x the peak")
    p.add_argument("--stable", action="store_true", help=f"control: the LR x{STABLE_FACTOR}")
    p.add_argument("--save-steps", type=int, default=50, help="Trainer checkpoint interval")
    p.add_argument("--sample-every", type=int, default=25, help="spikeguard probe interval")
    p.add_argument("--output-dir", default="runs/hf-llama", help="the Trainer's output_dir")
    p.add_argument("--no-sdk", action="store_true", help="run without spikeguard")
    p.add_argument("--metrics", default=None, help="rank 0 writes one JSON line per step here")
    p.add_argument("--data-bytes", type=int, default=DEFAULT_MAX_BYTES)
    p.add_argument("--layers", type=int, default=4)
    return p


class ByteWindows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Fixed windows of ``seq + 1`` bytes of the corpus as causal-LM examples."""

    def __init__(self, corpus: torch.Tensor, seq: int) -> None:
        self.corpus, self.seq = corpus, seq

    def __len__(self) -> int:
        return (self.corpus.numel() - 1) // self.seq

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        w = self.corpus[i * self.seq : i * self.seq + self.seq].long()
        return {"input_ids": w, "labels": w.clone()}


def build_model(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(cfg)


def lr_factor(step: int, args: argparse.Namespace) -> float:
    """The LR at ``step`` as a fraction of the peak: a geometric warm-up from ``lr_start`` over
    ``warmup`` steps, then a cosine to ``final_frac`` at ``steps`` (``gpt_diverge.py``'s shape)."""
    import math

    if args.warmup > 0 and step < args.warmup:
        return (args.lr_start / args.lr) ** (1.0 - step / args.warmup)
    frac = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.final_frac + (1.0 - args.final_frac) * 0.5 * (1.0 + math.cos(math.pi * frac))


def _hooks(model: Any) -> list[Any]:
    """The test hooks (see the module docstring): extra callbacks, or none."""
    from transformers import TrainerCallback

    gen = int(os.environ.get("SPIKEGUARD_GENERATION", "0"))
    rank = int(os.environ.get("RANK", "0"))
    out: list[Any] = []
    collapse = os.environ.get("SG_HF_COLLAPSE")
    if collapse:
        at, at_gen = (int(x) for x in collapse.split(":"))

        class Collapse(TrainerCallback):  # type: ignore[misc]
            def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                if gen == at_gen and state.global_step + 1 == at:
                    with torch.no_grad():
                        model.lm_head.weight.mul_(30.0)

        out.append(Collapse())
    observe = os.environ.get("SG_HF_OBSERVE")
    if observe:

        class Observe(TrainerCallback):  # type: ignore[misc]
            def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                opt = kw["optimizer"]
                inner = getattr(opt, "optimizer", opt)
                seen: dict[str, Any] = {"global_step": state.global_step, "gen": gen}

                def pre(o: Any, a: Any, k: Any) -> None:  # runs after spikeguard's scale hook
                    if "lr_used" not in seen:
                        seen["optimizer_state_at_first_step"] = len(o.state)
                        seen["lr_used"] = o.param_groups[0]["lr"]
                        seen["lr_schedule"] = kw["lr_scheduler"].get_last_lr()[0]
                        os.makedirs(observe, exist_ok=True)
                        with open(os.path.join(observe, f"gen{gen}-rank{rank}.json"), "w") as f:
                            json.dump(seen, f)

                inner.register_step_pre_hook(pre)

        out.append(Observe())
    return out


class _Metrics:
    """Rank 0's per-step loss as JSON lines (for the bench), from the Trainer's logs."""

    def __init__(self, path: str) -> None:
        from transformers import TrainerCallback

        class Log(TrainerCallback):  # type: ignore[misc]
            def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any):
                if state.is_world_process_zero and logs and "loss" in logs:
                    with open(path, "a") as f:
                        f.write(json.dumps({"step": state.global_step, **logs}) + "\n")

        self.callback = Log()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)
    from transformers import PrinterCallback, Trainer, TrainingArguments

    lr = args.lr * (STABLE_FACTOR if args.stable else 1.0)
    model = build_model(args)
    data = ByteWindows(load_corpus(args.data_bytes), args.seq)
    targs = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        learning_rate=lr,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_epsilon=1e-8,
        max_grad_norm=0.0,  # no clipping
        logging_steps=1,
        save_strategy="steps",
        save_steps=args.save_steps,
        save_only_model=False,
        report_to="none",
        seed=args.seed,
        data_seed=args.seed,
        use_cpu=True,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        dataloader_num_workers=0,
        ddp_find_unused_parameters=False,
        disable_tqdm=True,
        log_level="warning",
    )
    callbacks: list[Any] = _hooks(model)
    if args.metrics:
        callbacks.append(_Metrics(args.metrics).callback)
    sg = None
    if not args.no_sdk:
        from spikeguard.workers.integrations.hf import SpikeguardCallback

        sg = SpikeguardCallback(sample_every=args.sample_every)
        callbacks.insert(0, sg)

    class GeometricWarmupTrainer(Trainer):  # type: ignore[misc]
        """The Trainer with :func:`lr_factor` as its scheduler (saved and resumed as usual)."""

        def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
            if self.lr_scheduler is None:
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                    optimizer if optimizer is not None else self.optimizer,
                    lambda step: lr_factor(step, args),
                )
            return self.lr_scheduler

    trainer = GeometricWarmupTrainer(
        model=model, args=targs, train_dataset=data, callbacks=callbacks
    )
    trainer.remove_callback(PrinterCallback)  # a line per step otherwise (logging_steps=1)
    resume = sg.resume_from_checkpoint() if sg is not None else None
    trainer.train(resume_from_checkpoint=resume)
    if trainer.is_world_process_zero():
        print(f"finished: step {trainer.state.global_step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
