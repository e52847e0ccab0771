"""Sinkhorn-Knopp projection onto (approximately) doubly stochastic matrices, as mHC uses it (Eq. 9).

A doubly stochastic matrix has non-negative entries and every row and every column summing to 1 (the
Birkhoff polytope). Products of such matrices stay doubly stochastic, so their spectral norm never exceeds
1: this is what keeps a deep stack of mHC residual mixings from amplifying the signal.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

# exp() of a logit this far below the largest one in its matrix is still a normal fp32 number (~1e-26), so
# no row or column sum can underflow to zero and divide by zero, however far apart the logits drift.
_MIN_SHIFTED_LOGIT = -60.0


class _SinkhornKnopp(torch.autograd.Function):
    """Sinkhorn-Knopp on ``(n, n, N)`` fp32 logits, with a hand-written backward through every iteration.

    Layout: with the batch axis last, every sum and division runs over contiguous memory; with ``(N, n, n)``
    each op would loop over rows of 4 values, which made these tiny ops ~10x slower on CPU.

    Backward: for one normalisation ``y = m / s`` with ``s = m.sum(d)``, the exact derivative is
    ``dm = (dy - (dy * y).sum(d)) / s``, four ops instead of the seven autograd records for a broadcast
    division (with the reduction of the broadcast gradient). Walking these back over the stored iterates is
    reverse-mode differentiation of the unrolled loop, the same gradient plain autograd would give (a test
    checks it), not an implicit fixed-point gradient. ``torch.compile`` traces both directions (a test checks
    value and gradient against eager).
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor, iters: int) -> Tensor:
        # Normalisation removes any per-matrix scale, so shifting by the max changes nothing but keeps exp()
        # finite. The floor's own (zero) gradient is ignored in backward: exp(-60) bounds the difference.
        shifted = logits - logits.amax(dim=(0, 1), keepdim=True)
        matrix = shifted.clamp_min(_MIN_SHIFTED_LOGIT).exp()
        saved = [matrix]
        for _ in range(iters):
            for dim in (0, 1):  # columns sum to 1, then rows sum to 1
                sums = matrix.sum(dim=dim, keepdim=True)
                matrix = matrix / sums
                saved += [sums, matrix]
        ctx.save_for_backward(*saved)
        return matrix

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        saved = ctx.saved_tensors
        grad = grad.contiguous()
        for step in range((len(saved) - 1) // 2 - 1, -1, -1):
            sums, matrix = saved[2 * step + 1], saved[2 * step + 2]
            dim = step % 2  # even steps normalised columns (sum over dim 0), odd steps rows (dim 1)
            grad = (grad - (grad * matrix).sum(dim=dim, keepdim=True)).div_(sums)
        return grad * saved[0], None


def sinkhorn_knopp(logits: Tensor, iters: int = 20) -> Tensor:
    """Project square logits onto the doubly stochastic matrices by Sinkhorn-Knopp iteration.

    ``M = exp(logits)``, then ``iters`` rounds of "divide every column by its sum, then every row by its sum"
    (mHC Eq. 9). After the last round the rows sum to 1 up to rounding; the columns approach 1 as ``iters``
    grows (at 20 iterations, typically within 1e-6 and at worst about 1e-3 for logits of standard deviation 1;
    up to about 7e-2 for std 4).

    The computation runs in fp32 whatever the input dtype and even inside a ``bf16`` autocast region, because
    repeated normalisation in bf16 (8 mantissa bits) leaves row/column errors near 1e-2. It is differentiable:
    the gradient is backpropagated through every iteration of the unrolled loop (no implicit differentiation).
    Torch ops only, with no branch on tensor values: ``torch.compile`` traces it as one graph (the loop of
    ``iters`` rounds is unrolled), forward and hand-written backward.

    Args:
        logits: ``(..., n, n)`` real logits; every leading dimension is a batch dimension.
        iters: number of column+row normalisation rounds, at least 1.

    Returns:
        ``(..., n, n)`` fp32 tensor with non-negative entries, rows summing to 1, columns approximately so.

    Raises:
        ValueError: if ``iters`` is not a positive int, or ``logits`` is not a batch of square matrices.

    Example::

        >>> h_res = sinkhorn_knopp(torch.randn(8, 4, 4), iters=20)
        >>> bool(torch.allclose(h_res.sum(-1), torch.ones(8, 4)))
        True
    """
    try:  # integer-like values (numpy / torch integer scalars) count as ints; bool does not
        count = None if isinstance(iters, bool) else operator.index(iters)
    except TypeError:
        count = None
    if count is None or count < 1:
        raise ValueError(f"`iters`={iters!r} must be a positive int.")
    iters = count
    if logits.dim() < 2 or logits.shape[-1] != logits.shape[-2]:
        raise ValueError(f"`logits` must have shape (..., n, n); got {tuple(logits.shape)}.")
    n = logits.shape[-1]
    with torch.autocast(device_type=logits.device.type, enabled=False):
        batch_last = logits.float().reshape(-1, n, n).permute(1, 2, 0).contiguous()  # (n, n, N)
        matrix = _SinkhornKnopp.apply(batch_last, iters)
    # contiguous: a strided (N, n, n) view would push the bmm that applies H_res onto a per-matrix loop
    return matrix.permute(2, 0, 1).reshape(logits.shape).contiguous()


def doubly_stochastic_error(matrix: Tensor) -> tuple[Tensor, Tensor]:
    """The largest deviation of any row sum and of any column sum from 1, over the whole batch.

    Args:
        matrix: ``(..., n, n)``.

    Returns:
        ``(row_error, column_error)``, two scalar tensors.
    """
    row_error = (matrix.sum(dim=-1) - 1).abs().amax()
    column_error = (matrix.sum(dim=-2) - 1).abs().amax()
    return row_error, column_error
