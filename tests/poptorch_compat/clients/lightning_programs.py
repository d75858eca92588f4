"""PyTorch Lightning programs on IPUs (lightning-graphcore), run by ``test_lightning.py`` in the Lightning venv.

``python lightning_programs.py SCENARIO OUT [options]`` trains, validates, tests and
predicts one module with ``Trainer(accelerator=IPUAccelerator(), devices=N,
strategy=IPUStrategy(...))`` and saves what the test compares with eager PyTorch
(``torch.save`` to OUT): the weights before and after ``fit``, every step's outputs,
the predictions, and what the strategy set up. It imports ``poptorch`` as a Lightning
program on an IPU machine does: the venv has ``python -m ipuxl.compat --install``.
"""
from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset

import poptorch
import pytorch_lightning as pl
from lightning_graphcore import IPUAccelerator, IPUPrecision, IPUStrategy
from pytorch_lightning.trainer.states import RunningStage


def regression_data(rows: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 8, generator=g)
    return TensorDataset(x, x @ torch.randn(8, 2, generator=g) + 0.1)


class Regression(pl.LightningModule):
    """BoringModel-style: one linear layer, an MSE loss, every step returning a tensor."""

    def __init__(self, lr: float = 0.05, batch_size: int = 4, poptorch_loader: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(8, 2)
        self.lr, self.batch_size, self.poptorch_loader = lr, batch_size, poptorch_loader

    def forward(self, x):
        return self.layer(x)

    def _loss(self, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        return self._loss(batch)

    def test_step(self, batch, batch_idx):
        return self._loss(batch)

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def _loader(self, seed: int, stage: str):
        dataset = regression_data(32, seed)
        if self.poptorch_loader:  # the program hands Lightning a poptorch.DataLoader itself
            opts = self.trainer.strategy.training_opts if stage == "train" else self.trainer.strategy.inference_opts
            return poptorch.DataLoader(opts, dataset, batch_size=self.batch_size)
        return DataLoader(dataset, batch_size=self.batch_size)

    def train_dataloader(self):
        return self._loader(1, "train")

    def val_dataloader(self):
        return self._loader(2, "val")

    def test_dataloader(self):
        return self._loader(3, "test")

    def predict_dataloader(self):
        return self._loader(4, "predict")


class Classifier(pl.LightningModule):
    """A small MLP classifier with Adam, on three well-separated clusters."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return (self(x).argmax(-1) == y).float().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    @staticmethod
    def data(seed: int) -> TensorDataset:
        g = torch.Generator().manual_seed(seed)
        y = torch.arange(96) % 3
        return TensorDataset(torch.randn(96, 4, generator=g) * 0.3 + torch.eye(3, 4)[y] * 2, y)

    def train_dataloader(self):  # one device: Lightning 2.0 leaves a torch DataLoader as it is
        return poptorch.DataLoader(self.trainer.strategy.training_opts, self.data(5), batch_size=8)

    def val_dataloader(self):
        return poptorch.DataLoader(self.trainer.strategy.inference_opts, self.data(6), batch_size=8)


class Collect(pl.Callback):
    """Every step's outputs, by stage."""

    def __init__(self):
        self.outputs = {"train": [], "validate": [], "test": []}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.outputs["train"].append(outputs["loss"].detach().clone())

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking:
            self.outputs["validate"].append(outputs.detach().clone())

    def on_test_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        self.outputs["test"].append(outputs.detach().clone())


def state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def trainer(devices: int, strategy: IPUStrategy | None, collect: Collect, epochs: int, accumulate: int = 1,
            builtin: bool = False) -> pl.Trainer:
    common = dict(max_epochs=epochs, accumulate_grad_batches=accumulate, callbacks=[collect], logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  num_sanity_val_steps=0)
    if builtin:  # pytorch-lightning 2.0's own IPU support: Trainer(accelerator="ipu")
        return pl.Trainer(accelerator="ipu", devices=devices, **common)
    return pl.Trainer(accelerator=IPUAccelerator(), devices=devices, strategy=strategy, **common)


def run_regression(args: argparse.Namespace) -> dict:
    module = Regression(poptorch_loader=args.poptorch_loader)
    before = state(module)
    collect = Collect()
    strategy = None if args.builtin else IPUStrategy(device_iterations=args.device_iterations,
                                                     precision_plugin=IPUPrecision("32-true"))
    t = trainer(args.devices, strategy, collect, epochs=1, accumulate=args.accumulate, builtin=args.builtin)
    t.fit(module)
    fitted = {"replication_factor": t.strategy.poptorch_models[RunningStage.TRAINING]._options.toDict()
              ["replication_factor"], "train_loader": type(t.train_dataloader).__name__,
              "accelerator": type(t.accelerator).__module__}
    after = state(module)
    t.validate(module)
    t.test(module)
    predictions = [p.detach().clone() for p in t.predict(module)]
    return {"before": before, "after": after, "outputs": collect.outputs, "predictions": predictions, **fitted}


def run_classifier(args: argparse.Namespace) -> dict:
    module = Classifier()
    if args.half:
        module = module.half()
    before = state(module)
    collect = Collect()
    training = poptorch.Options().deviceIterations(2)
    inference = poptorch.Options().deviceIterations(3)
    precision = IPUPrecision("16-mixed" if args.half else "32-true")
    strategy = IPUStrategy(training_opts=training, inference_opts=inference, precision_plugin=precision)
    t = trainer(1, strategy, collect, epochs=args.epochs)
    t.fit(module)
    return {"before": before, "after": state(module), "outputs": collect.outputs,
            "options": (t.strategy.training_opts is training, t.strategy.inference_opts is inference)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["regression", "classifier"])
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--device-iterations", type=int, default=1)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--builtin", action="store_true")
    parser.add_argument("--poptorch-loader", action="store_true")
    parser.add_argument("--half", action="store_true")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    result = run_regression(args) if args.scenario == "regression" else run_classifier(args)
    torch.save(result, args.out)


if __name__ == "__main__":
    main()
