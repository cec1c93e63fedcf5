"""Frozen parameters under trainjob.torch.TrainingState (trainers/torch/frozen.py): a checkpoint holds
what changes (trainable parameters, their optimizer state, buffers) and references the frozen base by
its digest; a resume onto the same base trains on to the uninterrupted bits, onto another is refused
before anything is loaded; a frozen parameter that changes anyway is refused at the next checkpoint,
however it was written (the version counter, or through ``.data``, which only the fingerprint sees)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

torch = pytest.importorskip("torch")

from trainjob.checkpoint.snapshot import HostState  # noqa: E402
from trainjob.errors import UsageError  # noqa: E402
from trainjob.torch import TrainingState  # noqa: E402
from trainjob.trainers.torch import frozen  # noqa: E402


class Tower(torch.nn.Module):
    """A frozen backbone (embedding tied to the output, a BatchNorm whose statistics move) under a
    trainable adapter and head: what a fine-tune of a pretrained model looks like."""

    def __init__(self, base_seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(base_seed)
        self.embed = torch.nn.Embedding(16, 8)
        self.body = torch.nn.Linear(8, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.out = torch.nn.Linear(8, 16, bias=False)
        self.out.weight = self.embed.weight  # tied, as GPT-2's lm_head
        torch.manual_seed(1)
        self.adapter = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(16, 2)
        for m in (self.embed, self.body):
            m.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.relu(self.body(self.embed(ids))))
        return self.head(torch.nn.functional.dropout(self.out(h + self.adapter(h)), 0.2))


class Script:
    """An own loop: AdamW over ALL the parameters, as scripts write it (frozen ones get no grad)."""

    def __init__(self, base_seed: int = 0, **kw) -> None:
        self.model = Tower(base_seed)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.01)
        self.state = TrainingState(model=self.model, optimizer=self.opt, **kw)
        self.ids = torch.randint(0, 16, (32,), generator=torch.Generator().manual_seed(2))

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self.model(self.ids[torch.randint(0, 32, (8,))]).pow(2).mean().backward()
            self.opt.step()
            self.opt.zero_grad()

    def bits(self) -> list[torch.Tensor]:
        return [t.detach().clone() for t in self.model.state_dict().values()]


def checkpoint(state):
    arrays = HostState().snapshot(state.state_dict(), 1)
    return {k: np.array(v) for k, v in arrays.items()}, arrays.plain, arrays.local


def resume(script, saved):
    host = HostState()
    host.snapshot(script.state.state_dict(), 0)
    script.state.load_state_dict(host.live(*saved))


FROZEN = {"embed.weight", "out.weight", "body.weight", "body.bias"}


def test_a_checkpoint_holds_what_changes_and_references_the_frozen_base_by_its_digest():
    script = Script()
    script.step(2)
    arrays, _, local = checkpoint(script.state)
    names = {n.split(".", 1)[1] for n in arrays if n.startswith("model.")}
    assert names == {"adapter.weight", "adapter.bias", "head.weight", "head.bias", "norm.weight", "norm.bias",
                     "norm.running_mean", "norm.running_var", "norm.num_batches_tracked"}
    assert not [n for n in arrays if n.startswith("optim.") and any(f in n for f in FROZEN)]
    assert {n for n in arrays if n.startswith("optim.state.adapter.")} == {
        f"optim.state.adapter.{p}.{k}" for p in ("weight", "bias") for k in ("exp_avg", "exp_avg_sq", "step")}
    reference = script.state.state_dict()["rank"]["frozen"]
    assert reference["tensors"] == 4 and reference["bytes"] == 4 * (16 * 8 + 8 * 8 + 8)  # the tied one once
    assert reference["sha256"] in local


def test_write_frozen_writes_the_whole_model():
    arrays, _, _ = checkpoint(Script(write_frozen=True).state)
    assert {f"model.{n}" for n in FROZEN} <= set(arrays)


def test_a_resume_onto_the_same_base_trains_on_to_the_uninterrupted_bits():
    straight = Script()
    straight.step(6)
    first = Script()
    first.step(3)
    saved = checkpoint(first.state)
    torch.manual_seed(123)
    again = Script()  # the relaunch builds the base again, from the same seed
    resume(again, saved)
    again.step(3)
    assert all(torch.equal(a, b) for a, b in zip(straight.bits(), again.bits()))


def test_a_resume_onto_another_base_is_refused_before_anything_is_loaded():
    first = Script()
    first.step(3)
    saved = checkpoint(first.state)
    other = Script(base_seed=7)
    before = other.bits()
    with pytest.raises(UsageError, match=r"frozen parameters \(4 tensors .* are not those the checkpoint"):
        resume(other, saved)
    assert all(torch.equal(a, b) for a, b in zip(before, other.bits()))


@pytest.mark.parametrize("write", ["no_grad", "data"])
def test_a_frozen_parameter_that_changes_is_refused_at_the_next_checkpoint(write):
    """Through an op the version counter sees, or through ``.data``, which only the fingerprint sees
    (an EMA teacher's update, as DINO writes it)."""
    script = Script()
    checkpoint(script.state)
    script.step()
    checkpoint(script.state)  # training leaves the base alone
    if write == "no_grad":
        with torch.no_grad():
            script.model.body.weight.mul_(0.5)
    else:
        script.model.body.weight.data.mul_(0.5)
    with pytest.raises(UsageError, match=r"'body.weight' .* changed since the run's first checkpoint.*write_frozen=True"):
        script.state.state_dict()


def test_an_in_place_write_of_the_same_values_is_not_a_change():
    """DDP's start broadcasts rank 0's parameters into every rank's, frozen ones too: the version
    counter moves, the values do not (hashed again, the same digest)."""
    script = Script()
    first = script.state.state_dict()["rank"]["frozen"]
    with torch.no_grad():
        script.model.body.weight.copy_(script.model.body.weight.clone())
    assert script.state.state_dict()["rank"]["frozen"] == first


WORDS = torch.from_numpy(np.random.default_rng(0).integers(-2 ** 31, 2 ** 31, 3 * frozen._COLUMNS + 5,
                                                             dtype=np.int32))
positions = st.integers(0, len(WORDS) - 1)


@settings(max_examples=40)  # each example reads 49 kB four times
@given(positions, positions, st.integers(1, 2 ** 31 - 1))
@example(1, frozen._COLUMNS, 1)  # (row 0, column 1) and (row 1, column 0): the same row + column
@example(frozen._COLUMNS - 1, 3 * frozen._COLUMNS, 1)  # the last column of row 0, the first word past the rows
def test_the_fingerprint_changes_with_one_word_and_with_two_words_swapped(i, j, step):
    t = WORDS.view(torch.float32)
    changed = WORDS.clone()
    changed[i] += step
    assert frozen.fingerprint(changed.view(torch.float32)) != frozen.fingerprint(t)
    if WORDS[i] != WORDS[j]:
        swapped = WORDS.clone()
        swapped[[i, j]] = swapped[[j, i]]
        assert frozen.fingerprint(swapped.view(torch.float32)) != frozen.fingerprint(t)
