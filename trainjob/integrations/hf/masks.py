"""Masked-LM masks drawn where a resume draws them again: in the main process, by step.

``DataCollatorForLanguageModeling(mlm=True)`` draws each batch's masks when the batch is collated:
from torch's global stream in the main process (or in a loader worker, from the worker's, seeded
when the loader's iterator starts), or from its ``seed``'s generator. Collation runs ahead of
training (accelerate's loader fetches one batch ahead; the Trainer takes a step's micro-batches
at once), so a checkpoint's streams are already past the masks of batches it has not trained,
and a resume, which skips the trained batches without collating them, draws the next masks from
other numbers (issue 58: prove found it DIVERGES; the Trainer's own resume too, 0 of 4 trials).

Under ``hf.run`` the train loader's collator only pads (``Padding``, in whichever process collates)
and the masks are drawn in the main process as the Trainer takes each step's batches
(``Masker``): micro-batch ``j`` of step ``s`` on rank ``r`` from a generator seeded by the run's
seed, ``s``, ``j`` and ``r`` only. Nothing about them is in the RNG streams or depends on when the
batch was collated, so a run killed anywhere draws exactly the masks it would have, with loader
workers or without; the collator's own code draws them (``torch_mask_tokens``: its
probabilities, its special tokens, whole-word masking). The draws are other numbers than the
Trainer alone takes (the same distribution). The evaluation loader keeps the collator as it is:
an evaluation runs inside the step that is saved. Must not: import transformers at module level.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

KEEP = ("special_tokens_mask", "offset_mapping")  # what the collator's masking reads, besides the ids


def collator_of(trainer: Any) -> Any:
    """The Trainer's collator when it draws masked-LM masks (else None)."""
    from transformers import DataCollatorForLanguageModeling

    collator = trainer.data_collator
    return collator if isinstance(collator, DataCollatorForLanguageModeling) and collator.mlm else None


def refusal(collator: Any) -> str | None:
    if collator.return_tensors != "pt":
        return (f"DataCollatorForLanguageModeling(return_tensors={collator.return_tensors!r}): trainjob draws a "
                "masked-LM's masks as torch tensors; leave return_tensors at 'pt'")
    return None


class Padding:
    """The collator's batch before its masks: padded, with what its masking reads kept beside
    the ids (the first half of ``DataCollatorForLanguageModeling.torch_call``)."""

    def __init__(self, collator: Any) -> None:
        self.collator = collator

    def __call__(self, examples: list[Any]) -> dict[str, Any]:
        from transformers.data.data_collator import _torch_collate_batch, pad_without_fast_tokenizer_warning

        c = self.collator
        if isinstance(examples[0], Mapping):
            return dict(pad_without_fast_tokenizer_warning(c.tokenizer, examples, return_tensors="pt",
                                                           pad_to_multiple_of=c.pad_to_multiple_of))
        return {"input_ids": _torch_collate_batch(examples, c.tokenizer, pad_to_multiple_of=c.pad_to_multiple_of)}


class Masker:
    """Draws the masks of the batches the Trainer takes for a step (module docstring)."""

    def __init__(self, collator: Any, seed: int, rank: int) -> None:
        self.collator, self.seed, self.rank = collator, seed, rank

    def batches(self, batches: Iterator[dict[str, Any]], step: int) -> Iterator[dict[str, Any]]:
        """``batches`` (padded), each with its masks and labels, as micro-batches of ``step``."""
        for j, batch in enumerate(batches):
            yield self.mask(batch, step, j)

    def mask(self, batch: dict[str, Any], step: int, j: int) -> dict[str, Any]:
        c, out = self.collator, dict(batch)
        kept = {k: out.pop(k, None) for k in KEEP}
        ids = out["input_ids"]
        key = f"{self.seed} {self.collator.seed} {self.rank} {step} {j}".encode()
        generator = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1)
        was = c.generator
        c.generator = generator
        try:
            masked, labels = c.torch_mask_tokens(ids.cpu().clone(), special_tokens_mask=_cpu(kept["special_tokens_mask"]),
                                                 offset_mapping=_cpu(kept["offset_mapping"]))
        finally:
            c.generator = was
        out["input_ids"], out["labels"] = masked.to(ids.device), labels.to(ids.device)
        return out


def _cpu(value: Any) -> Any:
    return value.cpu() if isinstance(value, torch.Tensor) else value
