"""The PyTorch adapter: a training script's whole state as one trainjob Stateful.

    from trainjob.torch import TrainingState
    state = TrainingState(model=model, optimizer=opt, scheduler=sched, loader=loader, scaler=scaler)

One module per part, each small: ``optim`` (optimizer state torch has not created yet, on
torch.distributed.checkpoint's FQN-keyed helpers), ``rng`` (each rank's random streams), ``loader``
(a data loader's position), ``ddp`` (what DDP keeps alike across ranks and what it does not: its
buffers), ``workers``
(its worker processes ignore a signal sent to the whole process group), ``forking`` (a worker
forked while a C++ thread made a thread state starts anyway: a CPython 3.11 fork bug), and
``state`` (``TrainingState``, which holds them together); beside them, ``tensors``, the smaller
tensors-only helpers (a module's and an SGD optimizer's live tensors by name). Users import all of
it from ``trainjob.torch``, the one public path. Needs the optional ``torch`` extra
(``trainjob[torch]``); ``torchdata`` for a ``StatefulDataLoader``.
"""

from ...errors import require

require("trainjob.torch", "torch", "torch")  # before the modules below import it: one line naming the extra

from . import forking  # noqa: E402
from .state import TrainingState  # noqa: E402

forking.install()  # every script that trains with torch under trainjob imports this package

__all__ = ["TrainingState"]
