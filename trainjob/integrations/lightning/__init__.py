"""trainjob under ``lightning.Trainer.fit``: one callback (needs ``trainjob[lightning]``).

    from trainjob.integrations.lightning import TrainJob
    job = TrainJob(args.pvc, ckpt_every=5, gate=score)
    trainer = L.Trainer(..., callbacks=[job])
    trainer.fit(model, loader)
    sys.exit(job.exit_code)

``callback`` (``TrainJob``: Lightning's hooks drive a ``trainjob.Run``) and ``state`` (what a
checkpoint holds: the script's training state and the fit loop's counters). docs/lightning.md.
"""

from ...errors import require

require("trainjob.integrations.lightning", "lightning", "lightning", "torch", "torchdata")

from .callback import TrainJob  # noqa: E402

__all__ = ["TrainJob"]
