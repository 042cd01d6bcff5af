"""The option groups of `autopar.parallelize` and `autopar.plan`, and the old keywords' mapping.

The common options are plain keywords of both calls; the rest are grouped by concern in frozen
dataclasses, so that one object describes one concern wherever it is passed, `plan` and
`parallelize` read the same defaults from the same place, and every name has one meaning
(`PlanOptions.overlap` turns the overlap pass on or off; `PipelineOptions.schedule` names a
pipeline schedule). The keywords these groups replaced are accepted for one release with a
`DeprecationWarning` naming the new spelling (`from_keywords`).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Sequence
from typing import Any, Literal

from autopar.core.errors import UsageError
from autopar.passes.decompose_matmul import MODES as DECOMPOSE_MODES
from autopar.planning.step_accounting import RECOMPUTE_MODES, WEIGHT_STATES
from autopar.planning.storage import STORAGE_MODES
from autopar.rules.base import RuleRegistry
from autopar.rules.context_parallel import CP_STRATEGIES
from autopar.rules.routed_experts import TOKEN_DISPATCHERS

WEIGHT_STATE_NAMES = (None, *WEIGHT_STATES)  # None: by the parameters' dtype (`weight_state_for`)
RECOMPUTE_NAMES = ("auto", *RECOMPUTE_MODES)
STORAGE_NAMES = ("auto", *STORAGE_MODES)
Storage = Literal["auto", "sharded", "replicated"]


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """How the layouts and the step are planned; `plan` and `parallelize` read the same defaults.

    Fields (default in brackets):
      planner (str) ["search"]: "search", the whole-graph search over every op's strategy, or
          "greedy", each op's cheapest strategy in graph order (docs/planning.md).
      hardware (str | None) [None]: the hardware table the cost model prices with, e.g.
          "h100-nvlink-ib", "cpu-gloo". None: by the mesh's device type (`default_tables`):
          a CUDA mesh plans and prices on "h100-nvlink-ib"; a CPU mesh plans a given mesh's
          layouts by element counts and prices on "cpu-gloo" (mesh shape, pipeline stages).
          `plan`, which has no mesh, takes the device type as `device_type=` ["cuda"].
      over_decompose (int | "auto") [1]: batch chunks per rank whose collectives overlap each
          other's compute; "auto" lets the modeled step time choose.
      split_fused (bool | None) [None]: plan a fused projection (qkv) as one linear per piece;
          None: yes with the search planner.
      in_flight_bytes (int | None) [None]: bytes per rank of collective buffers in flight at
          once; None: the memory limit's headroom over the plan.
      overlap (bool) [True]: run the overlap scheduling pass (bucketing, collectives' waits
          moved after independent compute); False keeps each wait right after its issue.
      registry (RuleRegistry | None) [None]: the sharding rules; None: the default registry
          (docs/layouts-and-rules.md to add rules for your own ops).
      weight_state (str | None) [None]: the bytes per parameter element the mesh choice with
          pipeline depths prices every candidate's memory and optimizer step with (`mesh_shape=
          "auto"` with `PipelineOptions(microbatches=...)`): "plain", the parameter, its gradient
          and AdamW's two states in the parameter's dtype (16 bytes for float32 parameters, what
          `parallelize` keeps, with `mp_policy` too); "mixed", a 16-bit weight with float32
          gradient, master and AdamW states (18 bytes, Megatron's mixed precision). None: by the
          traced parameters' dtype, "mixed" when they are all 16-bit floats (a model held in
          bfloat16 for training stands for a mixed-precision run), else "plain".
      recompute (str) ["auto"]: what the blocks (numbered layers) of a pipeline stage run again in
          backward in that choice: "none"; "selective", their element-wise ops (matmul and
          attention outputs kept); "full", their whole forward (each keeps only its input);
          "auto", each, the fastest that fits `memory_limit` per depth and schedule. The
          tensor-only candidate recomputes what its plan search chooses to fit the limit.
      context_parallel (str) ["auto"]: on a mesh with an axis named "cp", which attention strategy
          splits the sequence over it (docs/context-parallel.md): "allgather", queries split along
          the sequence with keys and values all-gathered (Llama 3's CP); "ring", queries, keys
          and values split, key/value blocks passed around the ring (ring attention); "ulysses",
          the all-to-all from the sequence split to a heads split around attention and back,
          every weight whole on the axis and the tokens split (DeepSpeed-Ulysses); "balanced", "allgather" in the load-balanced causal order (rank i
          holds chunk i and chunk 2p-1-i of 2p: equal causal work per rank) over the whole block;
          "ring_balanced", "ring" in that load-balanced order (each rank's two chunks travel as one
          block, every step half a block of causal work);
          "auto", the cheapest by the search's cost. Without a "cp" axis it must be
          "auto" (the search may still split the sequence where it prices best).
      storage (str) ["auto"]: how the search planner stores the weights (`planning.storage`):
          "sharded", ~1/p of each weight per rank, gathered where used and its gradient
          reduce-scattered (FSDP's pattern); "replicated", each weight as it computes (whole
          unless a tensor split divides it), gradients all-reduced (DDP's pattern; an error
          when the whole weight state does not fit `memory_limit`); "auto", both priced on a
          hardware table where the replicated weights fit, the cheaper kept (in element counts,
          a given mesh without a table: sharded).
      decompose_matmuls (str) ["auto"]: all-gather -> matmul and matmul -> reduce-scatter pairs cut
          into pieces whose transfers overlap each other's matmuls (docs/scheduling.md, "Decomposed
          collective matmuls"): "auto", each pair where the modeled step is shorter; "on", every
          pair that qualifies; "off", none.
      token_dispatch (str) ["allgather"]: how the tokens of mixture-of-experts layers reach experts
          split over a mesh axis (docs/expert-parallel.md): "allgather", every rank of the axis
          gathers every token (or the experts are split inside, or kept whole, by cost);
          "alltoall", each rank sends only the rows routed to other ranks' experts, with split
          sizes known at run time, wherever the experts are split; "auto", the cheaper of the two
          by the planner's cost. "alltoall" and "auto" trace transformers' experts modules as one
          op each (gated, no bias), which offers no split inside the experts.
    """

    planner: str = "search"
    hardware: str | None = None
    over_decompose: int | str = 1
    split_fused: bool | None = None
    in_flight_bytes: int | None = None
    overlap: bool = True
    registry: RuleRegistry | None = None
    weight_state: str | None = None
    recompute: str = "auto"
    context_parallel: str = "auto"
    storage: Storage = "auto"
    decompose_matmuls: str = "auto"
    token_dispatch: str = "allgather"

    def __post_init__(self) -> None:
        if self.token_dispatch not in TOKEN_DISPATCHERS:
            raise UsageError(
                f"PlanOptions(token_dispatch={self.token_dispatch!r}) is not a token dispatcher",
                hint=f"one of {', '.join(map(repr, TOKEN_DISPATCHERS))}",
            )
        if self.decompose_matmuls not in DECOMPOSE_MODES:
            raise UsageError(
                f"PlanOptions(decompose_matmuls={self.decompose_matmuls!r}) is not a mode of the "
                "collective-matmul decomposition",
                hint=f"one of {', '.join(map(repr, DECOMPOSE_MODES))}",
            )
        if self.context_parallel not in CP_STRATEGIES:
            raise UsageError(
                f"PlanOptions(context_parallel={self.context_parallel!r}) is not an attention strategy",
                hint=f"one of {', '.join(map(repr, CP_STRATEGIES))}",
            )
        if self.storage not in STORAGE_NAMES:
            raise UsageError(
                f"PlanOptions(storage={self.storage!r}) is not a way the planner stores weights",
                hint=f"one of {', '.join(map(repr, STORAGE_NAMES))}",
            )
        if self.storage != "auto" and self.planner != "search":
            raise UsageError(
                f"PlanOptions(storage={self.storage!r}) with planner={self.planner!r}: only the search "
                "planner chooses how weights are stored (the greedy planner shards them)",
                hint='use planner="search" (the default), or leave storage="auto"',
            )
        if self.weight_state not in WEIGHT_STATE_NAMES:
            raise UsageError(
                f"PlanOptions(weight_state={self.weight_state!r}) is not a weight state the planner prices",
                hint=f"one of {', '.join(map(repr, WEIGHT_STATE_NAMES))}",
            )
        if self.recompute not in RECOMPUTE_NAMES:
            raise UsageError(
                f"PlanOptions(recompute={self.recompute!r}) is not a recomputation the planner prices",
                hint=f"one of {', '.join(map(repr, RECOMPUTE_NAMES))}",
            )


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """A pipeline over a mesh axis named "pp" (docs/pipeline.md).

    Fields (default in brackets):
      microbatches (int | None) [None]: microbatches per step; required on a "pp" mesh, and with
          `mesh_shape="auto"` it lets pipeline depths compete in the mesh choice.
      schedule (str | None) [None]: the pipeline schedule, "1f1b", "gpipe", "interleaved-1f1b"
          (with virtual_stages > 1), "zero-bubble" (virtual_stages 1 or 2) or "auto"; None:
          "1f1b" on a given "pp" mesh, the schedule the depth choice priced best under
          `mesh_shape="auto"`.
      stage_boundaries (sequence of str | None) [None]: the first module of each later stage,
          by qualified name; None: the cost model cuts the stages.
      virtual_stages (int) [1]: model chunks per pipeline rank (interleaved schedules).
    """

    microbatches: int | None = None
    schedule: str | None = None
    stage_boundaries: Sequence[str] | None = None
    virtual_stages: int = 1


@dataclasses.dataclass(frozen=True)
class DebugOptions:
    """What `parallelize` writes and checks to find a problem (docs/debugging.md).

    Fields (default in brackets):
      dump_dir (path | None) [None]: write each program's graph with its layouts, local shapes
          and collectives to `<dir>/rank<r>/`; None: the AUTOPAR_DUMP_DIR environment variable.
      check_inputs (bool) [True]: check on each call, with a small all-reduce of fingerprints,
          that every rank passes the same inputs; False skips it.
    """

    dump_dir: str | os.PathLike[str] | None = None
    check_inputs: bool = True


def default_tables(hardware: str | None, device_type: str) -> tuple[str, str | None]:
    """What `PlanOptions.hardware` means on a mesh of `device_type`, in `parallelize` and `plan`
    alike: (the table that prices what must be priced in seconds: the mesh choice, a pipeline's
    stage cut, `plan`'s report; the table a given mesh's layouts are planned on, None: element
    counts). A named table is both. None on a CPU mesh plans layouts by element counts: measured on
    this repository's CPU machine, plans priced on the cpu-gloo table ran slower than element-count
    plans in 7 of 7 runs (docs/benchmarks.md, "Where the ~60 collectives per block came from");
    any other device plans on the H100 table, whose per-axis links an element count cannot see."""
    if hardware is not None:
        return hardware, hardware
    if device_type == "cpu":
        return "cpu-gloo", None
    return "h100-nvlink-ib", "h100-nvlink-ib"


# old keyword -> (group, field); `schedule` is mapped by its value's type, see `from_keywords`
PLAN_FIELDS = ("planner", "hardware", "over_decompose", "split_fused", "in_flight_bytes", "registry")
_PIPELINE_FIELDS = ("microbatches", "stage_boundaries", "virtual_stages")
_DEBUG_FIELDS = ("dump_dir", "check_inputs")
OLD_KEYWORDS = (*PLAN_FIELDS, "schedule", *_PIPELINE_FIELDS, *_DEBUG_FIELDS)


def from_keywords(
    function: str,
    old: dict[str, Any],
    planning: PlanOptions | None,
    pipeline: PipelineOptions | None,
    debug: DebugOptions | None,
    *,
    allowed: Sequence[str] = OLD_KEYWORDS,
    stacklevel: int = 3,
) -> tuple[PlanOptions, PipelineOptions, DebugOptions]:
    """The groups, with the deprecated keywords in `old` moved into them (one warning each).

    An old keyword given beside the group that now holds it is refused (two spellings of one
    option could disagree); a keyword that was never `function`'s is a TypeError, as Python's own."""
    planning = planning if planning is not None else PlanOptions()
    pipeline = pipeline if pipeline is not None else PipelineOptions()
    debug = debug if debug is not None else DebugOptions()
    given = {"planning": planning, "pipeline": pipeline, "debug": debug}
    for group, value in given.items():
        expected = {"planning": PlanOptions, "pipeline": PipelineOptions, "debug": DebugOptions}[group]
        if not isinstance(value, expected):
            raise UsageError(
                f"{function}(): {group}= takes an autopar.{expected.__name__}, got {type(value).__name__}",
                hint=f"{group}=autopar.{expected.__name__}(...)",
            )
    moved: dict[str, dict[str, Any]] = {"planning": {}, "pipeline": {}, "debug": {}}
    for name, value in old.items():
        if name not in allowed:
            raise TypeError(f"{function}() got an unexpected keyword argument {name!r}")
        if name == "schedule":  # True/False was the overlap pass; a string, the pipeline schedule
            group, field = ("planning", "overlap") if isinstance(value, bool) else ("pipeline", "schedule")
        elif name in PLAN_FIELDS:
            group, field = "planning", name
        elif name in _PIPELINE_FIELDS:
            group, field = "pipeline", name
        else:
            group, field = "debug", name
        cls = type(given[group]).__name__
        warnings.warn(
            f"{function}({name}=...) is deprecated: pass {group}={cls}({field}=...)",
            DeprecationWarning,
            stacklevel=stacklevel,
        )
        moved[group][field] = value
    for group, fields in moved.items():
        if fields and given[group] != type(given[group])():
            raise UsageError(
                f"{function}() got {', '.join(fields)} as old keywords beside {group}=",
                hint=f"pass them in {group}= only",
            )
    return (
        dataclasses.replace(planning, **moved["planning"]),
        dataclasses.replace(pipeline, **moved["pipeline"]),
        dataclasses.replace(debug, **moved["debug"]),
    )
