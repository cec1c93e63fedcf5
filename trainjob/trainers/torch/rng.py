"""Each rank's random streams as plain values: Python's ``random``, numpy's global generator,
torch's CPU generator and every CUDA device's, and explicit generators a script names.

Dropout masks, random crops and a DataLoader's shuffle draw from these; a resume that does not
restore them trains on other numbers than the uninterrupted run. Captured without drawing from
them; bytes are written as hex strings, numpy's keys as ints, so the checkpoint holds them as
plain JSON (``plain.py``), not pickled.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch


def _hex(t: torch.Tensor) -> str:
    return t.cpu().numpy().tobytes().hex()


def _bytes(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray.fromhex(text), dtype=torch.uint8).clone()


def capture() -> dict[str, Any]:
    """The global streams of this process, now."""
    out: dict[str, Any] = {"python": random.getstate(), "torch": _hex(torch.get_rng_state())}
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        out["numpy"] = (kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached))
    # Only devices torch already uses: asking for their state would initialise CUDA otherwise.
    out["cuda"] = [_hex(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_initialized() else []
    return out


def restore(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(_bytes(state["torch"]))
    if "numpy" in state:
        import numpy as np
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if state["cuda"]:
        torch.cuda.set_rng_state_all([_bytes(s) for s in state["cuda"]])


def generator_state(gen: Any) -> Any:
    """A ``torch.Generator``'s or a ``numpy.random.Generator``'s state as plain values."""
    if isinstance(gen, torch.Generator):
        return _hex(gen.get_state())
    return gen.bit_generator.state  # a dict of ints (128-bit ones included) and strs


def set_generator_state(gen: Any, state: Any) -> None:
    if isinstance(gen, torch.Generator):
        gen.set_state(_bytes(state))
    else:
        gen.bit_generator.state = state


def is_generator(obj: object) -> bool:
    np = sys.modules.get("numpy")
    return isinstance(obj, torch.Generator) or (np is not None and isinstance(obj, np.random.Generator))
