"""One Lightning fit, run as a script (Lightning starts the other ranks by running it again).

    python tests/dist/lightning_fit.py {ddp|torchweave} OUT_DIR [PLAN]

Writes OUT_DIR/result.json on rank 0: each step's loss (the mean over ranks), the
validation loss, the final weights and the last checkpoint's path.
"""

from __future__ import annotations

import json
import math
import sys

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

GLOBAL_BATCH, RANKS, STEPS = 16, 2, 8


class Classifier(pl.LightningModule):  # an unmodified LightningModule
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=2e-2, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / STEPS)))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Record(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.val: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"].detach().clone().double()
        dist.all_reduce(loss)
        self.losses.append(loss.item() / dist.get_world_size())

    def on_validation_epoch_end(self, trainer, pl_module):
        self.val.append(float(trainer.callback_metrics["val_loss"]))


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return TensorDataset(x, (x[:, :4].argmax(1)))


def main() -> None:
    which, out = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    module = Classifier()
    if which == "ddp":
        strategy, batch = "ddp", GLOBAL_BATCH // RANKS  # DDP's batch is per rank
    else:
        import torchweave.lightning

        strategy = torchweave.lightning.Strategy(plan=sys.argv[3] if len(sys.argv) > 3 else "auto")
        batch = GLOBAL_BATCH  # every rank reads the whole batch; the plan splits it
    record = Record()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=RANKS, max_steps=STEPS,
                         default_root_dir=out, callbacks=[record], log_every_n_steps=1,
                         enable_progress_bar=False, enable_model_summary=False,
                         gradient_clip_val=1.0, val_check_interval=4, num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(data(GLOBAL_BATCH * STEPS, 1), batch_size=batch),
                DataLoader(data(GLOBAL_BATCH * 2, 2), batch_size=batch))
    path = f"{out}/last.ckpt"
    trainer.save_checkpoint(path)
    if trainer.global_rank == 0:
        weights = {k: v.tolist() for k, v in module.state_dict().items()}
        with open(f"{out}/result.json", "w") as f:
            json.dump({"losses": record.losses, "val": record.val, "weights": weights,
                       "checkpoint": path, "train_loss": float(trainer.callback_metrics["train_loss"])},
                      f)


if __name__ == "__main__":
    main()
