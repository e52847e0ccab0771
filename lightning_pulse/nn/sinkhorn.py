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


class _SinkhornKnopp(torch.autograd.Function):
    """Sinkhorn-Knopp on ``(n, n, N)`` fp32 logits, with a hand-written backward through every iteration.

    Layout: with the batch axis last, every sum and division runs over contiguous memory; with ``(N, n, n)``
    each op would loop over rows of 4 values, which made these tiny ops ~10x slower on CPU.

    Backward: for one normalisation ``y = m / s`` with ``s = m.sum(d)``, the exact derivative is
    ``dm = (dy - (dy * y).sum(d)) / s``, four ops instead of the seven autograd records for a broadcast
    division (with the reduction of the broadcast gradient). Walking these back over the stored iterates is
    reverse-mode differentiation of the unrolled loop (its first round, computed as softmaxes, takes their
    derivatives, which divide by no sum), the same gradient plain autograd would give (a test checks it), not
    an implicit fixed-point gradient. ``torch.compile`` traces both directions (a test checks value and
    gradient against eager).
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor, iters: int) -> Tensor:
        # The first round runs on the logits as given, so the result is the exact iteration however far
        # apart they are (no floor): the column normalisation of exp(logits) is a softmax over each column,
        # the row normalisation after it a softmax over each row of its log. Plain exp() then sums would turn
        # a row lying ~90 or more below its columns' maxima into zeros in fp32, and 0/0. After this round rows
        # sum to 1 and columns to within [1/n, n], and each later normalisation keeps every sum within
        # [1/n, n]: the plain loop below cannot underflow. A row or column of -inf (no scaling exists) and
        # any NaN or +inf give NaN.
        log_columns = torch.log_softmax(logits, dim=0)
        columns = log_columns.exp()
        matrix = torch.softmax(log_columns, dim=1)
        saved = [columns, matrix]
        for step in range(2 * (iters - 1)):
            sums = matrix.sum(dim=step % 2, keepdim=True)  # columns sum to 1, then rows sum to 1
            matrix = matrix / sums
            saved += [sums, matrix]
        ctx.save_for_backward(*saved)
        return matrix

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        saved = ctx.saved_tensors
        grad = grad.contiguous()
        for step in range((len(saved) - 2) // 2 - 1, -1, -1):
            sums, matrix = saved[2 * step + 2], saved[2 * step + 3]
            dim = step % 2  # even steps normalised columns (sum over dim 0), odd steps rows (dim 1)
            grad = (grad - (grad * matrix).sum(dim=dim, keepdim=True)).div_(sums)
        columns, matrix = saved[0], saved[1]
        grad = (grad - (grad * matrix).sum(dim=1, keepdim=True)).mul_(matrix)  # softmax over rows
        return grad - columns * grad.sum(dim=0, keepdim=True), None  # log_softmax over columns


def sinkhorn_knopp(logits: Tensor, iters: int = 20) -> Tensor:
    """Project square logits onto the doubly stochastic matrices by Sinkhorn-Knopp iteration.

    ``M = exp(logits)``, then ``iters`` rounds of "divide every column by its sum, then every row by its sum"
    (mHC Eq. 9), computed exactly for logits of any spread (the first round as softmaxes, so a row whose
    ``exp`` underflows in fp32 still normalises; a ``-inf`` logit is an exact zero, a row or column of them
    NaN). After the last round the rows sum to 1 up to rounding; the columns approach 1 as ``iters``
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
