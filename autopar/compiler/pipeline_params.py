"""Which tensors a rank of a pipeline trains, under which names: a base of `PipelinedModule`.

A rank holds its stages' parameters only: on a 1-D ("pp",) mesh the user's own tensors that its
stages read, with tensor axes beside "pp" the DTensor blocks of each stage's parallel module
(`stage_parallel`). Found once, at the first program (`_first_program`): this rank's parameters
by the model's names (`named_parameters`, `get_parameter`), the weights several stages read
(tied: their gradients summed over ranks and a rank's own copies), and the copies a norm counts
once (`clip_grad_norm_`, the serial clip over the pp group). Split from `pipeline.py`, whose
module runs the steps."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from autopar.compiler.pipeline_batch import clip_pipelined_grad_norm
from autopar.compiler.pipeline_checkpoint import pipelined_buffers
from autopar.compiler.pipeline_split import StageProgram, get_attr
from autopar.compiler.pipeline_stage import StageModule
from autopar.core.pipeline_schedule import Schedule
from autopar.runtime.clip_watch import ClipWatch
from autopar.runtime.pipeline_transport import PipelineTransport
from autopar.runtime.source_attributes import ModuleAttributeError


class PipelineParameters:
    """This rank's trained tensors of a pipelined module (see the module doc). The module sets
    the attributes below in its constructor; `_first_program` fills the rest."""

    schedule: Schedule
    stages: tuple[int, ...]
    transport: PipelineTransport
    device: str
    stage_modules: tuple[tuple[str, ...], ...]
    _names: dict[int, str]
    _local: list[tuple[str, nn.Parameter]]
    _in_norm: set[int]
    _shared: list[tuple[str, nn.Parameter, list[nn.Parameter]]]
    _readers: dict[int, set[int]]
    _clip_watch: ClipWatch
    _programs: dict[Any, list[StageProgram]]  # the exported programs (`named_buffers` reads them)

    @property
    def _model(self) -> nn.Module:
        """The user's model (kept outside the module tree: it holds every stage's parameters)."""
        model: nn.Module = self.__dict__["_model"]
        return model

    def get_parameter(self, target: str) -> nn.Parameter:
        """This rank's parameter `target` (the model's name), or an error saying which rank's stages
        hold it."""
        for name, p in self.named_parameters():
            if name == target:
                return p
        known = target in self._names.values()
        raise ModuleAttributeError(
            f"{target!r} is " + ("held by another rank's stage" if known else "not a parameter of the model")
            + f": this rank holds the parameters of stages {list(self.stages)}",
            hint="dict(pmodel.named_parameters()) lists this rank's; run per-parameter code on every rank "
            "for the names it holds" if known else "check the name (model.named_parameters() lists them)",
        )

    def _parameter_names(self) -> dict[int, str]:
        names: dict[int, str] = {}
        for name, p in self._model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), name)
        return names

    def _user_params(self, program: StageProgram, stage: int) -> list[nn.Parameter]:
        """The user's trainable tensors that stage `stage` reads."""
        found: dict[int, nn.Parameter] = {}
        for attr in program.stages[stage].attrs:
            value = program.constants.get(attr)
            if value is None:
                value = get_attr(self._model, attr)
            if isinstance(value, nn.Parameter) and value.requires_grad:
                found.setdefault(id(value), value)
        return list(found.values())

    def _stage_params(self, program: StageProgram, stage: int) -> list[nn.Parameter]:
        """The tensors stage `stage` trains on this rank (its parallel module's, with tensor axes)."""
        parallel = self.__dict__["stage_parallel"].get(stage)
        if parallel is None:
            return self._user_params(program, stage)
        return [p for p in parallel.parameters() if p.requires_grad]

    def _copies(
        self, owner: dict[int, int]
    ) -> tuple[list[tuple[str, nn.Parameter]], dict[int, list[nn.Parameter]]]:
        """This rank's trained tensors by name, and the copies of each user tensor among them;
        `owner` (user tensor -> the first stage reading it) marks the copies a norm counts."""
        local: list[tuple[str, nn.Parameter]] = []
        copies: dict[int, list[nn.Parameter]] = {}
        wrappers: dict[int, StageModule] = self.__dict__["_stage_wrappers"]
        for s in self.stages:
            parallel = self.__dict__["stage_parallel"].get(s)
            if parallel is None:
                continue
            for name, p in parallel.named_parameters():
                if p.requires_grad:
                    user = get_attr(wrappers[s], name)
                    local.append((self._names.get(id(user), name), p))
                    copies.setdefault(id(user), []).append(p)
                    if owner.get(id(user)) == s:
                        self._in_norm.add(id(p))
        return local, copies

    def _first_program(self, program: StageProgram) -> None:
        """Which parameters this rank holds and which several stages read (their gradients summed:
        over ranks, and over a rank's own copies when its stages are parallel modules)."""
        holders: dict[int, set[int]] = {}
        for s in range(self.schedule.num_stages):
            for p in self._user_params(program, s):
                holders.setdefault(id(p), set()).add(s)
        order = [p for p in self._model.parameters() if id(p) in holders]
        owner = {key: min(stages) for key, stages in holders.items()}
        self._in_norm = set()  # the tensors whose gradient this rank counts in a norm
        if self.__dict__["stage_parallel"]:
            self._local, copies = self._copies(owner)
        else:
            mine = {id(p) for s in self.stages for p in self._user_params(program, s)}
            self._local = [(self._names[id(p)], p) for p in order if id(p) in mine]
            copies = {id(p): [p] for _, p in self._local}
            self._in_norm = {id(p) for _, p in self._local if owner[id(p)] in self.stages}
        self._shared = [
            (self._names[id(p)], p, copies.get(id(p), [])) for p in order if len(holders[id(p)]) > 1
        ]
        self.stage_modules = program.stage_units
        self._readers = holders

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` over the whole model: every rank holds only its stages'
        gradients, so torch's function would clip each stage by its own norm. Each stage's norm is
        taken on its sub-mesh (DTensor gradients), a tied weight counted once (its first stage's
        copy), the total reduced over the pp group; every gradient is scaled by the same factor.
        Returns the total norm (the serial model's), on every rank."""
        params = [param for _, param in self._local]
        counted = [param for param in params if id(param) in self._in_norm]
        norm = clip_pipelined_grad_norm(params, counted, max_norm, norm_type, self.transport, self.device)
        self._clip_watch.record(params)  # the serial clip: the next step has nothing to warn of
        return norm

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        for name, p in self._local:
            yield prefix + name, p

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's stages' buffers under the model's names (`pipelined_buffers`): those its
        stages read, and the model's unread ones (BatchNorm's `num_batches_tracked` in eval) whose
        module its stages hold."""
        for name, b in pipelined_buffers(self):
            yield prefix + name, b
