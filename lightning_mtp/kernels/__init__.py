"""Fused ops of lightning-mtp. Each op has a plain-torch twin that is the CPU path and the reference.

Ops and their backends:

==========================  =================================  ==================================
dispatcher                  torch twin (CPU path, reference)   Triton kernel (CUDA)
==========================  =================================  ==================================
``linear_cross_entropy``    ``linear_cross_entropy_torch``     ``linear_cross_entropy_triton``
``verify_drafts``           ``verify_drafts_torch``            ``verify_drafts_triton``
``verify_tree``             ``verify_tree_torch``              ``verify_tree_triton``
==========================  =================================  ==================================

The dispatchers take ``backend="auto" | "triton" | "torch"``. ``auto`` defers to ``$LIGHTNING_MTP_KERNELS`` (same
values, default ``auto``), and then CUDA tensors use the Triton kernel and anything else the torch twin. Forcing
``"triton"`` on CPU tensors needs ``TRITON_INTERPRET=1`` (Triton's interpreter, read at launch time), else a clear
``RuntimeError``. Importing this package never needs a GPU: the kernel modules import ``triton.language`` only if it
is installed (guarded) and build their kernels on first launch.

``linear_cross_entropy`` computes its gradients during the forward, and only those that backward will ask for: grad
mode on and the input requiring grad (``grads_wanted``). Under ``torch.no_grad()`` or ``torch.inference_mode()``
(validation, with the head's weight still a ``requires_grad`` Parameter) both backends run the forward alone.

Note: the submodule ``lightning_mtp.kernels.linear_cross_entropy`` shares its name with the dispatcher function, and
the function wins as the package attribute. Use ``from lightning_mtp.kernels.linear_cross_entropy import ...`` (which
goes through ``sys.modules``) rather than ``import lightning_mtp.kernels.linear_cross_entropy as m``.

Example::

    >>> import torch
    >>> hidden, weight = torch.randn(6, 8), torch.randn(16, 8)
    >>> out = linear_cross_entropy(hidden, weight, torch.tensor([1, 2, 3, -100, 5, 6]))  # CPU: the torch twin
    >>> out.row_loss.shape
    torch.Size([6])
"""

from typing import Optional

import torch
from torch import Tensor

# Import the kernel modules first: importing a submodule sets it as a package attribute, and the dispatcher
# function `linear_cross_entropy` defined below must be the one that stays.
from lightning_mtp.kernels.dispatch import resolve_backend
from lightning_mtp.kernels.linear_cross_entropy import linear_cross_entropy_triton
from lightning_mtp.kernels.linear_cross_entropy_torch import (
    LinearCrossEntropyOutput,
    default_chunk_size,
    linear_cross_entropy_torch,
)
from lightning_mtp.kernels.speculative_verify import verify_drafts_triton
from lightning_mtp.kernels.speculative_verify_torch import VerifyOutput, sampling_randomness, verify_drafts_torch
from lightning_mtp.kernels.tree_verify import verify_tree_triton
from lightning_mtp.kernels.tree_verify_torch import TreeVerifyOutput, tree_sampling_randomness, verify_tree_torch


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    row_weights: Optional[Tensor] = None,
    ignore_index: int = -100,
    chunk_size: Optional[int] = None,
    backend: str = "auto",
    overwrite_hidden: bool = False,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
) -> LinearCrossEntropyOutput:
    """Weighted cross-entropy of ``hidden (N, H) @ weight (V, H).T`` against ``targets (N,)``, chunked.

    See :func:`linear_cross_entropy_torch` for the arguments (``logit_scale``/``softcap`` for hosts that scale or
    soft-cap their logits) and outputs; ``backend`` picks the
    implementation (module docstring). ``overwrite_hidden`` lets the torch twin reuse a scratch ``hidden`` for its
    gradient (the kernel ignores it).
    """
    args = (hidden, weight, targets, row_weights, ignore_index, chunk_size)
    transform = dict(logit_scale=logit_scale, softcap=softcap)
    if resolve_backend(backend, hidden, weight, targets, row_weights) == "triton":
        return linear_cross_entropy_triton(*args, **transform)
    return linear_cross_entropy_torch(*args, overwrite_hidden=overwrite_hidden, **transform)


def verify_drafts(
    draft_tokens: Tensor,
    target: Tensor,
    draft_probs: Optional[Tensor] = None,
    *,
    mode: str = "greedy",
    uniforms: Optional[Tensor] = None,
    exponentials: Optional[Tensor] = None,
    generator: Optional[torch.Generator] = None,
    backend: str = "auto",
) -> VerifyOutput:
    """Verify drafted tokens against the target model (speculative decoding), greedy or by rejection sampling.

    See :func:`verify_drafts_torch` for the arguments and outputs; ``backend`` picks the implementation. Both backends
    draw the same random numbers from ``generator`` and return identical tokens.

    Example::

        >>> logits = torch.zeros(1, 3, 5)
        >>> logits[0, 0, 2] = logits[0, 1, 4] = logits[0, 2, 1] = 1.0  # target argmax: 2, 4, 1
        >>> verify_drafts(torch.tensor([[2, 4]]), logits).output_tokens.tolist()  # both accepted + bonus
        [[2, 4, 1]]
    """
    kwargs = dict(mode=mode, uniforms=uniforms, exponentials=exponentials, generator=generator)
    if resolve_backend(backend, draft_tokens, target, draft_probs) == "triton":
        return verify_drafts_triton(draft_tokens, target, draft_probs, **kwargs)
    return verify_drafts_torch(draft_tokens, target, draft_probs, **kwargs)


def verify_tree(
    tokens: Tensor,
    parents: Tensor,
    depths: Tensor,
    target: Tensor,
    draft_probs: Optional[Tensor] = None,
    *,
    mode: str = "greedy",
    max_depth: Optional[int] = None,
    uniforms: Optional[Tensor] = None,
    exponentials: Optional[Tensor] = None,
    generator: Optional[torch.Generator] = None,
    backend: str = "auto",
    anc: Optional[Tensor] = None,
) -> TreeVerifyOutput:
    """Verify draft trees against the target model: the longest accepted path per row plus one more token.

    See :func:`verify_tree_torch` for the arguments, the acceptance rules (greedy; recursive rejection sampling with
    candidates drawn without replacement, or deterministic candidates) and the outputs; ``backend`` picks the
    implementation (module docstring). Both backends draw the same random numbers from ``generator`` and return
    identical tokens. ``anc``: the trees' ancestor matrices if already computed (the torch path reuses them).
    """
    kwargs = dict(mode=mode, max_depth=max_depth, uniforms=uniforms, exponentials=exponentials, generator=generator)
    if resolve_backend(backend, tokens, parents, depths, target, draft_probs) == "triton":
        return verify_tree_triton(tokens, parents, depths, target, draft_probs, **kwargs)
    return verify_tree_torch(tokens, parents, depths, target, draft_probs, anc=anc, **kwargs)


__all__ = [
    "LinearCrossEntropyOutput",
    "TreeVerifyOutput",
    "VerifyOutput",
    "default_chunk_size",
    "linear_cross_entropy",
    "linear_cross_entropy_torch",
    "linear_cross_entropy_triton",
    "resolve_backend",
    "sampling_randomness",
    "verify_drafts",
    "verify_drafts_torch",
    "verify_drafts_triton",
    "tree_sampling_randomness",
    "verify_tree",
    "verify_tree_torch",
    "verify_tree_triton",
]
