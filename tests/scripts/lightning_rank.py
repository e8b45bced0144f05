"""The Lightning example (examples/lightning_diverge.py), with what a test sees inside a rank.

Runs the example's ``main`` with a subclass of its module that, when ``SG_OBSERVE_DIR`` is set,
writes ``DIR/gen{GEN}-rank{RANK}.json`` once the first optimizer step of the launch is done: what
the rank itself observed at the start of training (Lightning's ``global_step``, how many
parameters had optimizer state, the cluster environment Lightning detected) and inside that first
``optimizer.step`` (the LR each param group had while stepping, after spikeguard's scale, next to
the schedule's LR for that step, and AdamW's step counter after it). The collapse comes from the
example itself (``SG_COLLAPSE_AT``).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
from spikeguard.examples.gpt_diverge import lr_at
from spikeguard.examples.lightning_diverge import GPTModule, main


class ObservedModule(GPTModule):
    """The example's module, recording the rank's view of its (re)start."""

    def on_train_start(self) -> None:
        out = os.environ.get("SG_OBSERVE_DIR")
        if not out:
            return
        [optimizer] = self.trainer.optimizers
        step = self.trainer.global_step
        seen: dict[str, Any] = {
            "generation": int(os.environ.get("SPIKEGUARD_GENERATION") or 0),
            "rank": self.trainer.global_rank,
            "global_step_at_start": step,
            "optimizer_state_entries_at_start": len(optimizer.state),
            "cluster_environment": type(self.trainer.strategy.cluster_environment).__name__,
            "world_size": self.trainer.world_size,
            "scheduled_lr": lr_at(step, self.args),
        }
        handles: list[Any] = []

        # registered after spikeguard's hooks (callbacks' on_train_start runs before the
        # module's): sees the LR the step really uses
        def pre(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            seen["lr_in_step"] = [g["lr"] for g in opt.param_groups]

        def post(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            first = opt.param_groups[0]["params"][0]
            seen["adam_step_after_first_step"] = int(opt.state[first]["step"])
            for h in handles:
                h.remove()
            os.makedirs(out, exist_ok=True)
            path = os.path.join(out, f"gen{seen['generation']}-rank{seen['rank']}.json")
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                json.dump(seen, f)
            os.replace(path + ".tmp", path)

        handles += [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]


if __name__ == "__main__":
    sys.exit(main(module_class=ObservedModule))
