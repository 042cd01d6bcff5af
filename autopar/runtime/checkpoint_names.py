"""The names transformers' `save_pretrained` gives tensors that its model calls otherwise.

transformers 5 keeps some checkpoints' historical tensor names: it saves GPT-NeoX's `lm_head.weight`
as `embed_out.weight` (as Pythia's checkpoints on the hub have it) and renames on load through the
model's conversion mapping (`transformers.conversion_mapping`). `load_checkpoint` reads such a
directory slice by slice, so it applies the same renames to the checkpoint's keys before matching
them with the module's tensors; a key the mapping would *convert* (experts stacked or split, a
fused projection cut) cannot be read as a slice of one stored tensor and stays unmatched, named in
the error with what to do. The renames are worked out at `parallelize`, from the model itself:
transformers is imported by then if the model is one of its.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch.nn as nn

Renamer = Callable[[str], tuple[str, bool]]  # checkpoint key -> (model-side name, converted)


@dataclass
class CheckpointNames:
    """Checkpoint keys by the name the model gives them, and those only a conversion could load."""

    by_name: dict[str, str] = field(default_factory=dict)
    converted: list[str] = field(default_factory=list)


def transformers_renamer(model: nn.Module) -> Renamer | None:
    """The first transformers model in `model` (itself or a submodule the user's module holds) as
    its `save_pretrained` names map to its own: None where there is none, or nothing to rename."""
    found = next((m for m in model.modules() if _is_transformers_model(m)), None)
    if found is None:
        return None
    try:
        mapping = importlib.import_module("transformers.conversion_mapping")
        loading = importlib.import_module("transformers.core_model_loading")
        transforms = mapping.get_model_conversion_mapping(found)
    except (ImportError, AttributeError, TypeError, ValueError):  # another transformers version
        return None
    renamings = [t for t in transforms if isinstance(t, loading.WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, loading.WeightRenaming)]
    if not renamings and not converters:
        return None

    def rename(key: str) -> tuple[str, bool]:
        name, converter = loading.rename_source_key(key, renamings, converters)
        return name, converter is not None

    return rename


def checkpoint_names(keys: Iterable[str], renamer: Renamer | None) -> CheckpointNames:
    """Each checkpoint key under the name the model would load it as (itself where no rename
    applies); keys a conversion would turn into another tensor are set apart."""
    names = CheckpointNames()
    for key in sorted(keys):
        name, converted = renamer(key) if renamer is not None else (key, False)
        if converted:
            names.converted.append(key)
        else:
            names.by_name.setdefault(name, key)
    return names


def _is_transformers_model(module: nn.Module) -> bool:
    return type(module).__module__.startswith("transformers.") and hasattr(module, "config") and hasattr(
        module, "base_model_prefix"
    )
