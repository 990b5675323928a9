"""oneDNN linear layers for a full-precision model on CPU: verification that costs less than it does through MKL.

A speculative step verifies ``gamma + 1`` tokens in one target forward. On CPU
that forward goes through ``torch.nn.functional.linear`` -> MKL ``sgemm``, whose
small-``M`` path is slow on the machine measured here: SmolLM2-135M in fp32
costs ~43 ms for one token and 61-84 ms for 2-9 (+44-97%, not monotone in the
count), so a multi-token verification eats most of what speculation saves.
The same layers with their weights pre-packed for oneDNN (``Tensor.to_mkldnn``)
cost ~31 ms for one token and 38-46 ms for 2-9
(``python benchmarks/verify_cost.py``; docs/user_guide.md).

Each layer runs oneDNN's fused linear (``torch.ops.mkldnn._linear_pointwise``,
the op torch's own CPU compiler emits for a linear layer, on a weight reordered
once by ``torch.ops.mkldnn._reorder_linear_weight``): it reads and writes plain
tensors, so no activation is converted to oneDNN's layout and back around every
layer (on the 2-core CPU measured, the conversions took 9-27 ms of a 37-55 ms
SmolLM2 forward: ``python benchmarks/verify_cost.py --converted``). A torch build without that op, or a call that needs autograd,
takes the conversions instead (same arithmetic, :func:`fused_linear_available`).

:func:`use_onednn_linear` swaps, in place, every plain ``torch.nn.Linear`` of a
float32 CPU model for :class:`OneDNNLinear`. It is opt-in and for inference only
(the packed weights are plain attributes, not parameters: nothing can be trained). It
changes the model's numerics slightly (another summation order: at most 7.3e-5 in
SmolLM2's logits), so a comparison must use the converted model for every arm, the target
alone included: speculation with the converted target is lossless against the
converted target's own greedy output (``tests/test_onednn.py``), as with any
target. Quantized layers (bitsandbytes' ``Linear8bitLt`` / ``Linear4bit``,
subclasses of ``nn.Linear``) and layers in other dtypes or on other devices are
left alone: by default only float32 layers are converted; a bf16 model's layers
(the draft's, ``--draft-linear onednn``) with ``dtypes=(torch.bfloat16,)``, on the
fused linear only.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

__all__ = [
    "LINEAR_BACKENDS",
    "ONEDNN_DTYPES",
    "OneDNNLinear",
    "apply_linear_backend",
    "fused_linear_available",
    "onednn_available",
    "use_onednn_linear",
]


# oneDNN's fused linear and its weight reorder, as torch's operator registry names them (a leading underscore:
# CPU-build operators without a public wrapper), looked up at call time (builds without them fail there, checked)
def _linear_pointwise(*args: Any) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(*args)  # noqa: SLF001


def _reorder_linear_weight(*args: Any) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(*args)  # noqa: SLF001


#: What ``--target-linear`` accepts: torch's own layers, or :func:`use_onednn_linear`.
LINEAR_BACKENDS = ("default", "onednn")


def onednn_available() -> bool:
    """Whether this torch build can run oneDNN (MKL-DNN) linear layers."""
    return bool(torch.backends.mkldnn.is_available())


#: Weight dtypes a :class:`OneDNNLinear` takes: float32 (fused or through conversions) and bfloat16 (fused only).
ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def fused_linear_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN's fused linear runs here in ``dtype`` and computes what ``torch.nn.functional.linear`` does.

    It is an operator of torch's CPU build (``torch.ops.mkldnn._linear_pointwise``),
    not a documented API: a build that lacks it, or where it disagrees on a
    small check (made once per dtype), runs a float32 :class:`OneDNNLinear`
    through layout conversions instead and leaves bfloat16 layers to torch.
    """
    if not onednn_available() or dtype not in ONEDNN_DTYPES:
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w, b, x = (torch.randn(*shape, generator=gen).to(dtype) for shape in ((24, 16), (24,), (2, 3, 16)))
        with torch.no_grad():
            packed = _reorder_linear_weight(w, None)
            got = _linear_pointwise(x, packed, b, "none", [], "")
            want = torch.nn.functional.linear(x, w, b)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        return bool(got.shape == (2, 3, 24) and got.dtype == dtype and torch.allclose(got, want, rtol=tol, atol=tol))
    except (AttributeError, RuntimeError, TypeError):
        return False


class OneDNNLinear(torch.nn.Module):
    """A float32 or bfloat16 ``nn.Linear`` whose weight is pre-packed for oneDNN; inference only.

    Parameters
    ----------
    linear : torch.nn.Linear
        A plain linear layer with a float32 or bfloat16 weight on CPU. Its
        weight (and bias) are copied into oneDNN's layout; the layer itself is
        not modified.
    fused : bool or None, default=None
        Run oneDNN's fused linear (``True``) or convert the activations to and
        from oneDNN's layout around the call (``False``, the slower way, kept for
        comparison; float32 only); ``None``: fused where
        :func:`fused_linear_available` for the weight's dtype.

    Attributes
    ----------
    in_features, out_features : int
        As the original layer's.
    """

    def __init__(self, linear: torch.nn.Linear, fused: bool | None = None) -> None:
        super().__init__()
        if type(linear) is not torch.nn.Linear:
            raise TypeError(f"OneDNNLinear converts a plain torch.nn.Linear, got {type(linear).__name__}")
        w = linear.weight
        if w.device.type != "cpu" or w.dtype not in ONEDNN_DTYPES:
            raise ValueError(f"OneDNNLinear needs a float32 or bfloat16 weight on CPU, got {w.dtype} on {w.device}")
        if not onednn_available():
            raise RuntimeError("this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        if (fused or w.dtype != torch.float32) and not fused_linear_available(w.dtype):
            raise RuntimeError(f"this torch build cannot run oneDNN's fused linear in {w.dtype}")
        if fused is False and w.dtype != torch.float32:
            raise ValueError("a bfloat16 layer runs on oneDNN's fused linear only (fused=False is for float32)")
        #: whether the layer runs oneDNN's fused linear (else the same weights through layout conversions)
        self.fused = fused_linear_available(w.dtype) if fused is None else bool(fused)
        with torch.no_grad():  # plain attributes, not buffers: state_dict() and .to() never see oneDNN tensors
            weight = w.detach()
            # one packed copy: the fused op's reordered weight also serves the conversions' path
            self.packed_weight = _reorder_linear_weight(weight, None) if self.fused else weight.to_mkldnn()
            self.bias = None if linear.bias is None else linear.bias.detach().clone()
            self.packed_bias = None if self.bias is None else self.bias.to_mkldnn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T + bias`` over the last dimension (any leading shape)."""
        if self.fused and not (x.requires_grad and torch.is_grad_enabled()):  # the op has no autograd kernel
            # the hot path (every linear of every forward): the operator itself, not through _linear_pointwise's frame
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")  # noqa: SLF001
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features).contiguous().to_mkldnn()
        y = torch.nn.functional.linear(rows, self.packed_weight, self.packed_bias).to_dense()
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        way = "fused" if self.fused else "converted"
        return f"in_features={self.in_features}, out_features={self.out_features}, backend=onednn ({way})"


def use_onednn_linear(model: Any, fused: bool | None = None, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> int:
    """Swap every plain CPU ``nn.Linear`` of ``model`` in ``dtypes`` for :class:`OneDNNLinear`, in place.

    Parameters
    ----------
    model : torch.nn.Module
        Typically a Hugging Face causal LM loaded in float32 on CPU, used for
        inference only (``generate``). Tied weights (an LM head sharing the
        embedding matrix) are copied, so the head's weight is held twice.
    fused : bool or None, default=None
        As :class:`OneDNNLinear`'s (``None``: oneDNN's fused linear where it runs).
    dtypes : tuple of torch.dtype, default=(torch.float32,)
        The weight dtypes to convert: float32 and/or bfloat16 (a bf16 draft:
        ``dtypes=(torch.bfloat16,)``, fused linear only).

    Returns
    -------
    int
        How many layers were swapped (0: nothing to do, e.g. a quantized or
        bf16 model, or a model on CUDA).

    Raises
    ------
    RuntimeError
        When this torch build has no oneDNN (or, with ``fused=True``, no fused linear).
    """
    if not onednn_available():
        raise RuntimeError("this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)")
    unknown = [d for d in dtypes if d not in ONEDNN_DTYPES]
    if unknown:
        raise ValueError(f"dtypes {unknown} cannot run on oneDNN here; expected float32 and/or bfloat16")
    swaps = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is torch.nn.Linear and child.weight.device.type == "cpu" and child.weight.dtype in dtypes:
                swaps.append((parent, name, child))
    for d in {child.weight.dtype for _, _, child in swaps} | ({torch.float32} if fused else set()):
        if (fused or d != torch.float32) and not fused_linear_available(d):
            raise RuntimeError(f"this torch build cannot run oneDNN's fused linear in {d}")
    for parent, name, child in swaps:
        setattr(parent, name, OneDNNLinear(child, fused=fused))
    return len(swaps)


def apply_linear_backend(model: Any, backend: str, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> int:
    """Run ``model``'s linear layers on ``backend`` (:data:`LINEAR_BACKENDS`); returns how many layers were swapped.

    ``"default"`` leaves the model as loaded (0); ``"onednn"`` is :func:`use_onednn_linear`
    for the layers of ``dtypes``, with a warning when it finds nothing to convert
    (a model on CUDA, or in another dtype).
    """
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"unknown linear backend {backend!r}; expected one of {', '.join(LINEAR_BACKENDS)}")
    if backend == "default":
        return 0
    swapped = use_onednn_linear(model, dtypes=dtypes)
    if swapped == 0:
        names = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        warnings.warn(
            f"linear backend 'onednn': the model has no {names} nn.Linear on CPU to convert; it runs as loaded",
            stacklevel=2,
        )
    return swapped
