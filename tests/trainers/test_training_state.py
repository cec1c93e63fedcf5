"""trainjob.torch.TrainingState in process: through trainjob's own snapshot and load, a resumed
state trains on to the uninterrupted bits, for each optimizer and scheduler; taking the state
changes nothing; and DCP's known traps (a dummy step for lazy state, initial_lr, later param
groups, compiled FQNs) are each checked."""

from __future__ import annotations

import math
import random
import re
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from trainjob.checkpoint.snapshot import HostState  # noqa: E402
from trainjob.errors import UsageError  # noqa: E402
from trainjob.torch import TrainingState  # noqa: E402

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
}
SCHEDULERS = {
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(
        o, lambda s: (s + 1) / 3 if s < 3 else 0.5 * (1 + math.cos(math.pi * (s - 3) / 7))),
    "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=20),
    "sequential": lambda o: torch.optim.lr_scheduler.SequentialLR(o, [
        torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=3),
        torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=7)], milestones=[3]),
}


class Setup:
    """A small model with dropout, an optimizer over two param groups, a scheduler: a script's state."""

    def __init__(self, optimizer="adamw", scheduler="lambda", **state_kw):
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 2))
        groups = [{"params": self.model[0].parameters()},
                  {"params": self.model[2].parameters(), "lr": 0.003, "weight_decay": 0.5}]
        self.opt = OPTIMIZERS[optimizer](groups)
        self.sched = SCHEDULERS[scheduler](self.opt) if scheduler else None
        self.state = TrainingState(model=self.model, optimizer=self.opt, scheduler=self.sched, **state_kw)
        self.data = torch.randn(32, 6)

    def step(self, n=1):
        for _ in range(n):
            batch = self.data[torch.randint(0, 32, (8,))]  # the global RNG, as dropout draws from it too
            self.model(batch).pow(2).mean().backward()
            self.opt.step()
            if self.sched is not None:
                self.sched.step()
            self.opt.zero_grad()

    def bits(self):
        return [p.detach().clone() for p in self.model.parameters()]


def checkpoint(state):
    """What trainjob writes and reads back: host arrays (copied, as a file would hold them) and the
    plain documents as text."""
    arrays = HostState().snapshot(state.state_dict(), 1)
    return {k: np.array(v) for k, v in arrays.items()}, arrays.plain, arrays.local


def resume(setup, saved):
    host = HostState()
    host.snapshot(setup.state.state_dict(), 0)  # a run's first snapshot: what a checkpoint must fit
    arrays, plain_text, local_text = saved
    setup.state.load_state_dict(host.live(arrays, plain_text, local_text))


def equal(a, b):
    return len(a) == len(b) and all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b))


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_taking_the_state_at_every_step_changes_nothing(optimizer):
    plain = Setup(optimizer)
    plain.step(3)
    watched = Setup(optimizer)
    for _ in range(3):
        checkpoint(watched.state)  # from step 0, while torch has created no optimizer state yet
        watched.step()
    assert equal(plain.bits(), watched.bits())


@pytest.mark.parametrize("optimizer, scheduler", [(o, "lambda") for o in OPTIMIZERS]
                         + [("adamw", s) for s in SCHEDULERS if s != "lambda"])
def test_a_resumed_state_trains_on_to_the_uninterrupted_bits(optimizer, scheduler):
    straight = Setup(optimizer, scheduler)
    straight.step(6)
    first = Setup(optimizer, scheduler)
    first.step(3)
    saved = checkpoint(first.state)
    torch.manual_seed(123)  # the relaunch's RNG is not the killed run's
    again = Setup(optimizer, scheduler)
    resume(again, saved)
    again.step(3)
    assert equal(straight.bits(), again.bits())
    assert [{k: v for k, v in g.items() if k != "params"} for g in again.opt.param_groups] == \
        [{k: v for k, v in g.items() if k != "params"} for g in straight.opt.param_groups]  # lr, initial_lr, group 2


@pytest.mark.parametrize("leave_out", ["rng", "scheduler", "optimizer"])
def test_a_resume_without_one_piece_differs(leave_out):
    """The control: the test above fails when a piece of the state is missing."""
    kw = {"rng": False} if leave_out == "rng" else {}
    straight = Setup(scheduler="lambda")
    straight.step(6)
    first = Setup(**kw)
    if leave_out != "rng":
        setattr(first.state, leave_out, None)
    first.step(3)
    saved = checkpoint(first.state)
    torch.manual_seed(123)
    again = Setup(**kw)
    if leave_out != "rng":
        setattr(again.state, leave_out, None)
    resume(again, saved)
    again.step(3)
    assert not equal(straight.bits(), again.bits())


def test_a_checkpoint_before_the_first_step_leaves_the_optimizer_state_uncreated():
    setup = Setup("sgd")
    saved = checkpoint(setup.state)
    assert set(saved[0]) >= {"optim.state.0.weight.momentum_buffer"}  # the names a later checkpoint has
    setup.step(2)
    again = Setup("sgd")
    resume(again, saved)
    assert not again.opt.state  # torch creates it at the first step, exactly as it would have
    again.step(2)
    assert equal(setup.bits(), again.bits())


def test_a_dummy_step_would_have_changed_adamw():
    """The trap this adapter avoids: DCP's get_optimizer_state_dict at step 0 steps the optimizer."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    plain = Setup("adamw")
    plain.step(3)
    dcp = Setup("adamw")
    get_optimizer_state_dict(dcp.model, dcp.opt)
    dcp.step(3)
    assert not equal(plain.bits(), dcp.bits())


@pytest.mark.process
def test_a_compiled_model_has_the_plain_model_s_names():
    """In a process of its own: importing torch.compile's machinery takes seconds."""
    script = ("import torch; from trainjob.torch import TrainingState\n"
              "m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))\n"
              "s = TrainingState(model=torch.compile(m), optimizer=torch.optim.Adam(m.parameters())).state_dict()\n"
              "print(sorted(s['model']), sorted(s['optim']['state']))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    names = ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert out.stdout.strip() == f"{names} {names}", out.stderr[-2000:]


def test_the_scaler_the_global_streams_and_named_generators_come_back():
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
    gen, npgen = torch.Generator().manual_seed(5), np.random.default_rng(2 ** 100)
    setup = Setup(scaler=scaler, extra={"noise": gen, "np": npgen})
    scaler._growth_tracker = torch.tensor([7], dtype=torch.int32)
    saved = checkpoint(setup.state)
    expect = (random.random(), np.random.rand(), torch.rand(2), torch.rand(1, generator=gen), npgen.random())
    torch.manual_seed(9), random.seed(9), np.random.seed(9)
    scaler2, gen2, npgen2 = torch.amp.GradScaler("cpu", init_scale=2.0), torch.Generator(), np.random.default_rng(0)
    again = Setup(scaler=scaler2, extra={"noise": gen2, "np": npgen2})
    resume(again, saved)
    assert scaler2.get_scale() == 512.0 and scaler2._get_growth_tracker() == 7
    got = (random.random(), np.random.rand(), torch.rand(2), torch.rand(1, generator=gen2), npgen2.random())
    assert got[:2] == expect[:2] and torch.equal(got[2], expect[2]) and torch.equal(got[3], expect[3])
    assert got[4] == expect[4]


def test_an_ema_copy_in_extra_is_checkpointed_and_comes_back_with_its_count():
    """torch's own EMA (AveragedModel) holds a 0-d ``n_averaged``: refused as any 0-d tensor until
    extra's modules were given an axis as the model's are."""
    def ema_setup():
        setup = Setup()
        setup.ema = torch.optim.swa_utils.AveragedModel(
            setup.model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
        setup.state = TrainingState(model=setup.model, optimizer=setup.opt, scheduler=setup.sched,
                                    extra={"ema": setup.ema})
        return setup

    def train(setup, n):
        for _ in range(n):
            setup.step()
            setup.ema.update_parameters(setup.model)

    straight = ema_setup()  # each Setup seeds the global stream its steps draw from
    train(straight, 5)
    first = ema_setup()
    train(first, 3)
    saved = checkpoint(first.state)
    torch.manual_seed(123)
    again = ema_setup()
    resume(again, saved)
    assert int(again.ema.n_averaged) == 3
    train(again, 2)
    assert equal([p.detach() for p in straight.ema.parameters()], [p.detach() for p in again.ema.parameters()])
    assert int(again.ema.n_averaged) == 5


class Counter:
    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"seen": self.value}

    def load_state_dict(self, state):
        self.value = state["seen"]["n"]


@pytest.mark.parametrize("value, says", [({1, 2}, "extra.counter.seen: a set cannot be checkpointed"),
                                         (b"x", "extra.counter.seen: a bytes"),
                                         ({"n": {2: 1}}, "extra.counter.seen.n: a key of type int")])
def test_a_value_that_is_not_plain_is_refused_naming_its_key(value, says):
    setup = Setup(extra={"counter": Counter(value)})
    with pytest.raises(UsageError) as info:
        HostState().snapshot(setup.state.state_dict(), 0)
    assert says in str(info.value) and "\n" not in str(info.value)


REFUSED_MEMBERS = {
    "loader": (lambda m: dict(loader=torch.utils.data.DataLoader([1, 2])),
               "use torchdata.stateful_dataloader.StatefulDataLoader"),
    "model": (lambda m: dict(model=m.state_dict()), "model= must be a torch.nn.Module, got OrderedDict"),
    "scheduler": (lambda m: dict(scheduler=object()), "scheduler is a object, which has no state_dict()"),
    "optimizer": (lambda m: dict(optimizer=torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)),
                  "parameter(s) that are not the model's"),
}


@pytest.mark.parametrize("member", REFUSED_MEMBERS)
def test_what_a_state_cannot_hold_is_refused_when_the_state_is_first_asked_for(member):
    """Not at construction: raised there, before the Run exists, the refusal would end the
    script in Python's exit 1 (test below)."""
    model = torch.nn.Linear(1, 1)
    given, says = REFUSED_MEMBERS[member]
    state = TrainingState(**{"model": model, **given(model)})
    for call in (state.state_dict, lambda: state.load_state_dict({})):
        with pytest.raises(UsageError, match=re.escape(says)) as info:
            call()
        assert str(info.value).startswith("TrainingState: ") and "\n" not in str(info.value)


@pytest.mark.process
def test_a_script_with_a_plain_dataloader_exits_2_in_one_line_and_writes_nothing(tmp_path):
    """The mistake a typical script makes first (docs/trainers.md), as the operating system sees it."""
    script = tmp_path / "loop.py"
    script.write_text(
        "import sys, torch, trainjob\nfrom trainjob.torch import TrainingState\n"
        "net = torch.nn.Linear(2, 2)\n"
        "state = TrainingState(model=net, optimizer=torch.optim.AdamW(net.parameters()),\n"
        "                      loader=torch.utils.data.DataLoader(torch.zeros(8, 2), shuffle=True))\n"
        "with trainjob.Run(sys.argv[1], state=state, steps=4, ckpt_every=2) as run:\n"
        "    for step in run:\n"
        "        run.report(0.5)\n"
        "sys.exit(run.exit_code)\n")
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "pvc")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "StatefulDataLoader" in done.stderr, done.stderr
    assert not (tmp_path / "pvc").exists()  # a refused launch takes away its lock file and the PVC it made


@pytest.mark.parametrize("own_generator", [False, True], ids=["global-stream", "own-generator"])
def test_a_loader_resumed_mid_epoch_yields_the_same_batches_and_leaves_the_global_stream_as_it_was(own_generator):
    """Without a generator of its own a loader draws a seed from torch's global stream for every
    iterator it builds, the resumed one too; every dropout mask after the resume moved (found by
    ``trainjob prove`` on a script passing no ``generator=``). A draw after each batch stands for
    the step's dropout; the run crosses two epoch boundaries after the resume."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    def run(resume_at: int | None) -> list:
        torch.manual_seed(0)
        make = lambda: StatefulDataLoader(list(range(12)), batch_size=4, shuffle=True,  # noqa: E731
                                          generator=torch.Generator().manual_seed(1) if own_generator else None)
        loader = make()
        state = TrainingState(model=torch.nn.Linear(1, 1), loader=loader)
        state.state_dict()  # as the Run's start takes it
        seen, batches = [], iter(loader)
        for step in range(1, 9):
            if step - 1 == resume_at:  # a relaunch: a new loader, the checkpoint loaded into it
                saved = state.state_dict()
                loader = make()
                state = TrainingState(model=torch.nn.Linear(1, 1), loader=loader)
                state.load_state_dict(saved)
                batches = iter(loader)
            try:
                batch = next(batches)
            except StopIteration:
                batches = iter(loader)
                batch = next(batches)
            seen.append((batch.tolist(), torch.rand(1).item()))
        return seen

    reference = run(resume_at=None)
    for at in (2, 3, 4):  # 3 batches an epoch: mid-epoch, at the boundary, just after it
        assert run(resume_at=at) == reference, at


def test_a_loader_over_a_distributed_sampler_resumed_after_epoch_0_walks_its_epochs_order():
    """A DistributedSampler draws each epoch's order from ``seed + epoch``; the script (or
    Lightning's fit loop) calls ``set_epoch`` before each epoch's ``iter()``. The load builds the
    resumed iterator at once, so the sampler's epoch must be back before it: built at epoch 0, the
    resumed epoch walked epoch 0's order (Lightning's DDP default diverged under ``trainjob prove``)."""
    from torch.utils.data.distributed import DistributedSampler
    from torchdata.stateful_dataloader import StatefulDataLoader

    def run(resume_at: int | None) -> list:
        def make():
            sampler = DistributedSampler(list(range(24)), num_replicas=2, rank=1, shuffle=True, seed=3)
            return StatefulDataLoader(list(range(24)), batch_size=4, sampler=sampler), sampler

        loader, sampler = make()
        state = TrainingState(model=torch.nn.Linear(1, 1), loader=loader)
        seen = []
        for epoch in range(3):  # 3 batches an epoch
            sampler.set_epoch(epoch)
            batches = iter(loader)
            for i in range(3):
                if resume_at == len(seen):  # a relaunch: a new loader, the checkpoint loaded into it
                    saved = state.state_dict()
                    loader, sampler = make()
                    state = TrainingState(model=torch.nn.Linear(1, 1), loader=loader)
                    state.load_state_dict(saved)
                    sampler.set_epoch(epoch)  # as the script's loop does again at the resumed epoch
                    batches = iter(loader)
                seen.append(next(batches).tolist())
        return seen

    reference = run(resume_at=None)
    for at in (4, 7):  # mid-epoch 1, mid-epoch 2
        assert run(resume_at=at) == reference, at


# --- a loader's worker processes: the randomness drawn in them (worker_rng.py) ----------------------


class Noisy(torch.utils.data.Dataset):
    """A dataset that draws in its workers, as augmentation does: torch, random and numpy."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        return torch.tensor([float(i), torch.rand(()).item(), random.random(), float(np.random.rand())])


class OwnState(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(8))

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def _collate(batch):
    return batch


INEXACT_LOADERS = {
    "out-of-order": (lambda: dict(dataset=Noisy(), in_order=False), "in_order=False"),
    "stateful-iterable": (lambda: dict(dataset=OwnState()), "iterable dataset (OwnState) that has a state_dict()"),
    "list-with-own-collate": (lambda: dict(dataset=list(range(8)), collate_fn=_collate),
                              "a collate_fn of its own over a list"),
}


@pytest.mark.parametrize("case", INEXACT_LOADERS)
def test_a_loader_whose_workers_cannot_resume_exactly_is_refused_when_the_state_is_first_asked_for(case):
    """Refused in one line at the ``with`` (no worker is started), never trained on."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    given, says = INEXACT_LOADERS[case]
    state = TrainingState(model=torch.nn.Linear(1, 1), loader=StatefulDataLoader(num_workers=2, **given()))
    with pytest.raises(UsageError, match=re.escape(says)) as info:
        state.state_dict()
    assert str(info.value).startswith("TrainingState: ") and "\n" not in str(info.value)
    plain = StatefulDataLoader(list(range(8)), num_workers=2)  # nothing drawn in the workers: accepted
    assert TrainingState(model=torch.nn.Linear(1, 1), loader=plain)._refusal is None


def _noisy_batches(resume_at: int | None, hooked: bool = True, **options) -> list:
    """Ten batches of ``Noisy`` through a 2-worker loader (3 an epoch, over three epochs), and a draw
    after each (the step's dropout); resumed at ``resume_at`` into a new loader and state."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    from trainjob.trainers.torch import worker_rng

    def make():
        loader = StatefulDataLoader(Noisy(), batch_size=8, shuffle=True, num_workers=2,
                                    generator=torch.Generator().manual_seed(1), **options)
        state = TrainingState(model=torch.nn.Linear(1, 1), loader=loader)
        if not hooked:  # the control: the workers' streams left out of the loader's snapshot
            loader.worker_init_fn.inner = loader.worker_init_fn.inner.inner
        assert hooked == isinstance(loader.worker_init_fn.inner, worker_rng.Streams)
        return loader, state

    torch.manual_seed(0)
    loader, state = make()
    state.state_dict()  # as the Run's start takes it: the workers start here
    seen, batches = [], iter(loader)
    for step in range(1, 11):
        if step - 1 == resume_at:
            saved = HostState().snapshot(state.state_dict(), step)  # through trainjob's plain text, as a checkpoint
            del batches
            loader, state = make()
            host = HostState()
            host.snapshot(state.state_dict(), 0)
            state.load_state_dict(host.live(saved, saved.plain, saved.local))
            batches = iter(loader)
        try:
            batch = next(batches)
        except StopIteration:
            batches = iter(loader)
            batch = next(batches)
        seen.append((batch.tolist(), torch.rand(1).item()))
    return seen


@pytest.mark.process
@pytest.mark.parametrize("options", [{}, {"persistent_workers": True}, {"snapshot_every_n_steps": 2}],
                         ids=["default", "persistent", "snapshot-every-2"])
def test_a_loader_with_workers_resumed_mid_epoch_draws_the_uninterrupted_noise_in_them(options):
    """torch, random and numpy draws in two workers' ``__getitem__``, resumed mid-epoch (the
    workers' streams were not at their seeds) and at an epoch's end. Without the workers' streams
    in the loader's snapshot (the control) the batches after a mid-epoch resume carry other noise."""
    reference = _noisy_batches(None, **options)
    assert len({b[0][0][1] for b in reference}) == 10  # noise: every batch draws anew
    for at in (2, 3):
        assert _noisy_batches(at, **options) == reference, at
    assert _noisy_batches(2, hooked=False, **options) != reference


@pytest.mark.process
def test_an_iterable_dataset_whose_iterator_keeps_a_state_is_refused_once_its_workers_show_it():
    from torchdata.stateful_dataloader import StatefulDataLoader

    class Counting:
        def __init__(self):
            self.i = 0

        def __next__(self):
            self.i += 1
            if self.i > 8:
                raise StopIteration
            return self.i

        def state_dict(self):
            return {"i": self.i}

        def load_state_dict(self, state):
            self.i = state["i"]

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return Counting()

    state = TrainingState(model=torch.nn.Linear(1, 1), loader=StatefulDataLoader(Stream(), num_workers=2))
    with pytest.raises(UsageError, match=re.escape("iterable dataset whose iterator has a state_dict()")) as info:
        state.state_dict()
    assert "\n" not in str(info.value)


def test_a_workers_dataset_copy_hands_out_its_streams_and_its_own_state_and_takes_both_back(monkeypatch):
    """What ``Streams`` gives a worker's dataset copy, called in this process as torchdata calls it
    in a worker: the state holds the three streams (read, never drawn from) beside the dataset's
    own; loading it puts both back; a state from before the streams were kept is the dataset's own."""
    from trainjob.trainers.torch import worker_rng

    class Own(torch.utils.data.Dataset):
        def __init__(self):
            self.epoch = 0

        def state_dict(self):
            return {"epoch": self.epoch}

        def load_state_dict(self, state):
            self.epoch = state["epoch"]

    dataset = Own()
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: type("Info", (), {"dataset": dataset}))
    worker_rng.Streams(None)(0)
    dataset.epoch = 3
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state(legacy=True)[1].copy())
    saved = dataset.state_dict()
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]  # nothing drawn
    assert np.array_equal(np.random.get_state(legacy=True)[1], before[2])
    drawn = (torch.rand(2).tolist(), random.random(), np.random.rand())
    dataset.epoch = 5
    dataset.load_state_dict(saved)
    assert dataset.epoch == 3 and (torch.rand(2).tolist(), random.random(), np.random.rand()) == drawn
    dataset.load_state_dict({"epoch": 7})  # the old format: the dataset's own state alone
    assert dataset.epoch == 7
