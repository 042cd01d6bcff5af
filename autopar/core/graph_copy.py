"""A deep copy of a traced GraphModule that does not leak torch's own deprecation warning.

torch 2.13's `copy.deepcopy` of a GraphModule rebuilds the pytree specs of its codegen, and
building a `LeafSpec` warns (`FutureWarning`: "isinstance(treespec, LeafSpec) is deprecated"):
torch's internals, nothing a user can act on. The driver copies graphs on paths every user meets
(a later program reusing the mesh choice's trace, chunk counts and mesh candidates priced on
copies), so a user running with warnings as errors (pytest's `-W error`, `filterwarnings =
error`) got that warning raised out of `parallelize` and `autopar.plan`. Every graph copy of the
compiler goes through here.
"""

from __future__ import annotations

import copy
import warnings

import torch.fx as fx

LEAF_SPEC_WARNING = r".*LeafSpec.*"


def graph_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """`copy.deepcopy(gm)` with torch's `LeafSpec` deprecation warning of the copy ignored (other
    warnings pass)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=LEAF_SPEC_WARNING, category=FutureWarning)
        return copy.deepcopy(gm)
