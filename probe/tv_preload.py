"""Lets PyPI's torchvision (CUDA-linked _C.so) import beside the CPU torch: define the one op
its meta registrations name unconditionally. No torchvision op is run by the probes."""
import torch

_lib = torch.library.Library("torchvision", "DEF")
_lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
