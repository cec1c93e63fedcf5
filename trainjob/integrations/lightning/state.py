"""What a checkpoint of a Lightning fit holds, as one trainjob Stateful.

    script      ``trainjob.torch.TrainingState`` over what the Trainer built: the LightningModule's
                tensors (given DDP's wrapper under ``strategy="ddp"``, so that DDP's buffers, BatchNorm's
                running statistics, are saved as DDP defines them: rank 0's, ``trainers/torch/ddp.py``),
                its optimizer (one; from step 0), its LR schedulers, the precision
                plugin's grad scaler, the train loader's position (a torchdata StatefulDataLoader,
                with the generator fixes of ``trainers/torch/loader.py``) and each rank's RNG streams
    lightning   the fit loop's counters, ``fit_loop.state_dict()`` (epochs, batches, optimizer and
                scheduler steps, ``_batches_that_stepped``) as plain values, without the loader's
                state, which ``script`` holds; ``trainer.should_stop`` (an early stop decided:
                ``EarlyStopping``, ``max_time``); each rank's own: every callback's ``state_dict()``
                (EarlyStopping's ``wait_count`` and ``best_score``, ModelCheckpoint's best scores),
                as Lightning's own checkpoint holds them, and ``trainer.callback_metrics`` (what
                they read); under Lightning's own DistributedSampler, the generator the epoch's
                order was drawn from (``sampler.py``)

Lightning's own checkpoints hold no RNG state and, with a plain DataLoader, no position inside an
epoch; this state holds both. A load hands everything back in the order Lightning's own
``fit(ckpt_path=...)`` would have by the time the fit loop starts: the loop then restarts from its
counters, as after a checkpoint that Lightning's ModelCheckpoint saved in ``on_train_batch_end``.

Must not: run anything per step, or know about the PVC (the callback and the Run do).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl

from . import sampler as distributed
from ...errors import UsageError
from ...state_tree import RankLocal
from ...torch import TrainingState
from ...trainers.torch import ddp, loader as loader_state


def train_loader(trainer: pl.Trainer) -> Any:
    """The one loader the fit loop trains on, once its data is set up; UsageError for anything a
    checkpoint cannot resume mid-epoch (exit 2)."""
    combined = trainer.fit_loop._combined_loader
    loaders = [] if combined is None else list(combined.flattened)
    if len(loaders) != 1:
        raise UsageError(f"trainjob's Lightning callback trains on one train loader; this fit has {len(loaders)}")
    loader = loaders[0]
    if not (callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))):
        raise UsageError(f"the train loader is a {type(loader).__name__}, which cannot say where it is inside an "
                         "epoch; build it with torchdata.stateful_dataloader.StatefulDataLoader (the same arguments)")
    return loader


def script_state(trainer: pl.Trainer, loader: Any) -> TrainingState:
    """The TrainingState of what ``trainer`` built for this fit (after its strategy's setup)."""
    if len(trainer.optimizers) != 1:
        raise UsageError(f"trainjob's Lightning callback resumes one optimizer; configure_optimizers gave "
                         f"{len(trainer.optimizers)}")
    schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    wrapped = ddp.find(trainer.strategy.model) if trainer.strategy.model is not None else None
    model = wrapped if wrapped is not None else trainer.lightning_module
    return TrainingState(model=model, optimizer=trainer.optimizers[0],
                         scheduler=schedulers[0] if schedulers else None, loader=loader, scaler=scaler,
                         extra={f"scheduler{i}": s for i, s in enumerate(schedulers) if i})


class LightningState:
    """The Stateful a ``trainjob.Run`` checkpoints for a Lightning fit (module docstring)."""

    def __init__(self, trainer: pl.Trainer, script: TrainingState) -> None:
        self.trainer, self.script = trainer, script
        self.loaded = False  # a checkpoint was loaded into the live state
        self.replay = distributed.install(script.loader)  # under Lightning's DistributedSamplerWrapper

    def restart(self) -> None:
        """Build the loader's first iterator again, at the same place, now that ``TrainingState``
        has wrapped its workers' ``worker_init_fn`` and ``sampler.py`` notes the draws of
        Lightning's distributed sampler: on a fresh start (a load does it itself).

        Lightning built the fit loop's first iterator when its data was set up, before the
        callback could reach the loader, so that iterator's workers (all of them, with
        ``persistent_workers``) run without the wrapper: their random streams stayed out of the
        loader's snapshot, and a resume in that epoch drew other augmentation than the
        uninterrupted run (measured: a dataset drawing noise in two workers, stopped at step 12
        of epoch 0, published other bytes; stopped in epoch 1, the same). Nothing has been
        handed out yet, so the loader's state now (the epoch's order, its seed, its generators)
        is loaded back, as a resume at this point would, and the new workers start from the same
        seeds: the same batches as the iterator they replace. Under Lightning's
        DistributedSamplerWrapper, the first iterator drew its permutation before ``Replay``
        could note the generator it drew from: the new one draws again, noted (an order other
        than plain Lightning's, as the workers' restart already gives)."""
        loader = self.script.loader
        workers = getattr(loader, "num_workers", 0)
        if (isinstance(workers, int) and workers > 0) or self.replay is not None:
            loader_state.load_state_dict(loader, loader_state.state_dict(loader))
            assert self.trainer.fit_loop._data_fetcher is not None
            iter(self.trainer.fit_loop._data_fetcher)

    def state_dict(self) -> dict[str, Any]:
        out = dict(self.script.state_dict())
        loops = self.trainer.fit_loop.state_dict()
        loops["state_dict"].pop("combined_loader", None)  # the loader's position is the script's
        out["lightning"] = lightning = {"fit_loop": loops, "should_stop": bool(self.trainer.should_stop)}
        callbacks = {cb.state_key: state for cb in self.trainer.callbacks if (state := cb.state_dict())}
        lightning["logged"] = RankLocal({
            "callbacks": loader_state.as_text(callbacks, "a callback's state_dict()"),
            "metrics": loader_state.as_text(dict(self.trainer.callback_metrics), "trainer.callback_metrics")})
        if self.replay is not None:
            lightning["sampler"] = RankLocal(self.replay.state_dict())
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.loaded = True
        replay, drawn = self.replay, state["lightning"].get("sampler")
        if replay is not None and drawn is not None:
            replay.replay_from(drawn)  # the resumed iterator, built by the load, draws the saved order
        self.script.load_state_dict(state)
        if replay is not None and drawn is not None:
            replay.done(drawn)
        fit_loop, loops = self.trainer.fit_loop, state["lightning"]["fit_loop"]
        fit_loop.load_state_dict(loops)
        self.trainer.should_stop = bool(state["lightning"].get("should_stop", False))
        if (logged := state["lightning"].get("logged")) is not None:  # absent after a reshard --drop-rank-local
            callbacks = loader_state.from_text(logged["callbacks"])
            for cb in self.trainer.callbacks:
                if cb.state_key in callbacks:
                    cb.load_state_dict(callbacks[cb.state_key])
            # What the callbacks read: a restart may run the epoch-end hooks of the epoch the
            # checkpoint was taken in (EarlyStopping's check of the last validation's val_loss).
            self.trainer._logger_connector._callback_metrics = loader_state.from_text(logged["metrics"])
        batches = loops["epoch_loop.batch_progress"]
        if batches["is_last_batch"] and batches["total"]["completed"] == batches["total"]["processed"] - 1:
            # Saved in on_train_batch_end after an epoch's last batch: Lightning's restart counts
            # that epoch as done and trains the next one on the iterator below without calling
            # iter() again, where the uninterrupted run built a new one. Resumed, the loader's
            # iterator would be the spent one, and the next epoch would end at once (measured: a
            # whole epoch skipped). So it starts afresh, drawing its order from the generators the
            # load put back. (Saved after the validation that followed the batch, the batch is
            # counted completed, and Lightning calls iter() at the next epoch itself.)
            self.script.loader.load_state_dict({})
            for sampler in loader_state.epoch_samplers(self.script.loader):  # the next epoch's, as Lightning's
                sampler.set_epoch(loops["epoch_progress"]["current"]["processed"] + 1)  # restart will count it
        # The fit loop set its data up (and built an iterator) before this load: it trains on
        # from the loader's resumed iterator, as Lightning's own restore would have it.
        assert fit_loop._data_fetcher is not None
        iter(fit_loop._data_fetcher)
