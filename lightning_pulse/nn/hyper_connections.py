r"""Hyper-Connections (HC) and Manifold-Constrained Hyper-Connections (mHC) around any residual branch.

Both widen the residual stream into ``n`` parallel streams of width ``C`` and, around a branch ``F``
(attention, MLP, conv block), compute (mHC paper Eq. 3)

.. math::  x_{l+1} = H^{res}_l x_l + {H^{post}_l}^\top F(H^{pre}_l x_l),  \qquad x_l \in \mathbb{R}^{n \times C}

with coefficients produced per token (per pixel for images) from the streams themselves (Eq. 7):

.. math::  x' = \mathrm{RMSNorm}(\mathrm{vec}(x_l)) \in \mathbb{R}^{1 \times nC}, \qquad
           \tilde H^{\{pre,post,res\}} = \alpha_{\{pre,post,res\}} \cdot (x' \varphi_{\{pre,post,res\}}) + b

* :class:`ManifoldHyperConnection` (mHC, Xie et al. 2025, Eq. 8-9): ``H_pre = sigmoid``,
  ``H_post = 2 sigmoid``, ``H_res = Sinkhorn-Knopp`` (doubly stochastic, so products over depth stay bounded).
* :class:`HyperConnection` (HC, Zhu et al. 2024): unconstrained, ``H = alpha * tanh(x' phi) + b``. Its
  ``H_res`` products can grow without bound over depth; it is here for comparison.
* ``n_streams=1`` makes either class the plain residual ``x + F(x)``, bit for bit.

Layouts: the stream axis sits just before the channel axis. Token data ``(B, T, C)`` becomes
``(B, T, n, C)`` (``channel_dim=-1``); image data ``(B, C, H, W)`` becomes ``(B, n, C, H, W)``
(``channel_dim=1``). :func:`expand_streams` and :func:`collapse_streams` convert at the input and output of a
stack.

Initialisation (the paper leaves it to the implementer; ours makes the network *start as the plain residual
network* and keeps every coefficient trainable from step 0):

* :func:`expand_streams` puts ``w_i * x`` in stream ``i``, with fixed weights ``w`` evenly spread over
  ``[1 - spread, 1 + spread]`` (mean 1), and :func:`collapse_streams` takes the stream mean. Distinct streams
  matter for mHC: a doubly stochastic ``H_res`` maps identical streams to themselves whatever its entries,
  so with plain copies the first layer's ``H_res`` would get exactly zero gradient at step 0.
* static ``b_pre`` gives ``H_pre = 1/n`` (the branch reads the stream mean), ``b_post`` gives
  ``H_post_i = w_i`` (mean 1, spread so the streams keep differing), ``b_res`` gives ``H_res`` a diagonal of
  ``res_init_diagonal`` (0.9) and ``(1 - 0.9) / (n - 1)`` elsewhere: near the identity, but not so close that
  the Sinkhorn map saturates. Logits far apart (e.g. diagonal 20) would freeze ``H_res`` at the identity
  with vanishing gradients: the zero-gradient trap.
* the projection is ``phi_scale * phi`` with ``phi ~ N(0, 1)`` and ``phi_scale = 1/sqrt(nC)``, i.e. an
  ``N(0, 1/(nC))`` matrix, so ``x' phi`` has unit scale, and ``alpha = 0.01``: the dynamic part starts as a 1%
  perturbation, yet ``phi``, ``b`` and ``alpha`` all receive non-zero gradients at step 0 (a zero ``phi``
  would leave ``alpha`` with zero gradient). Storing ``phi`` at unit scale changes no value, only the step an
  optimizer takes: Adam moves each entry by about ``lr``, which for entries of scale ``1/sqrt(nC)`` would be a
  ``sqrt(nC)`` times larger relative step than for any unit-scale weight. At lr 3e-2 that made the ``H_res``
  logits spread by over 100 within a hundred steps, where 20 Sinkhorn iterations no longer converge.

With these choices the stream mean evolves exactly as the plain residual stream ``x + F(x)`` (up to the 1%
dynamic terms), because doubly stochastic (and identity) mixings preserve the mean of the streams.

Implementation: torch ops only, with no Python branch on tensor values and no host synchronisation, so
``torch.compile`` traces a layer as one graph, forward and backward (``fullgraph=True``; a test compares it with
eager in value and gradient). Three small autograd Functions (:class:`_RMSNormalizedProjection`,
:class:`_MixStreams`, :class:`_AddBranch`) hand autograd one ``(P, n, C)`` stream-gradient buffer per layer
instead of three; on the char LM they took mHC's step overhead at width 512 from +34.6% to +29.8% (commit
"mHC overhead: rerun", ``benchmarks/results/mhc_overhead.md`` at that commit).
"""

from __future__ import annotations

import math
import numbers
import operator
import warnings
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from lightning_pulse.nn.sinkhorn import sinkhorn_knopp

RESIDUAL_KINDS = ("plain", "hc", "mhc")
ResidualKind = Literal["plain", "hc", "mhc"]


class HyperConnectionCoefficients(NamedTuple):
    """The per-position mixing coefficients of one layer (positions = tokens, or pixels).

    Attributes:
        pre: ``(..., n)`` weights that read the branch input from the streams.
        post: ``(..., n)`` weights that write the branch output into the streams.
        res: ``(..., n, n)`` stream mixing matrix; ``res[..., i, j]`` carries stream ``j`` into stream ``i``.
    """

    pre: Tensor
    post: Tensor
    res: Tensor


def stream_weights(n_streams: int, spread: float = 0.5, dtype: torch.dtype | None = None) -> Tensor:
    """``(n,)`` weights evenly spaced over ``[1 - spread, 1 + spread]``; their mean is exactly 1."""
    if n_streams == 1:
        return torch.ones(1, dtype=dtype)
    return torch.linspace(1.0 - spread, 1.0 + spread, n_streams, dtype=dtype)


def _as_int(value: Any) -> int | None:
    """``value`` as an int if it is integer-like (``int``, a numpy integer, a one-element integer tensor),
    else ``None``; ``bool`` is not accepted as a count."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _check_positive_int(name: str, value: Any) -> int:
    as_int = _as_int(value)
    if as_int is None or as_int < 1:
        raise ValueError(f"`{name}`={value!r} must be a positive int.")
    return as_int


def _check_int(name: str, value: Any) -> int:
    as_int = _as_int(value)
    if as_int is None:
        raise ValueError(f"`{name}`={value!r} must be an int.")
    return as_int


def _as_real(value: Any) -> float | None:
    """``value`` as a finite float if it is a real number (not a ``bool``), else ``None``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        return None
    return float(value)


def _check_spread(spread: Any) -> float:
    value = _as_real(spread)
    if value is None or not 0.0 <= value < 1.0:
        raise ValueError(f"`spread`={spread!r} must be a number in [0, 1).")
    return value


def _check_axis(channel_dim: int, rank: int) -> int:
    """``channel_dim`` of a rank-``rank`` tensor as a non-negative axis; out of range raises (no
    wrap-around)."""
    if not -rank <= channel_dim < rank:
        raise ValueError(
            f"`channel_dim`={channel_dim} is out of range for a {rank}-D tensor (allowed: {-rank} to "
            f"{rank - 1})."
        )
    return channel_dim % rank


def expand_streams(x: Tensor, n_streams: int, channel_dim: int = -1, spread: float = 0.5) -> Tensor:
    """Widen a residual stream into ``n_streams`` streams, at the input of a hyper-connected stack.

    Stream ``i`` holds ``w_i * x`` with the fixed weights of :func:`stream_weights` (mean 1; ``spread=0`` gives
    plain copies). With ``n_streams=1`` the result is ``x`` with a size-1 stream axis, bit for bit.

    Args:
        x: ``(B, T, C)`` with ``channel_dim=-1``, or ``(B, C, H, W)`` with ``channel_dim=1`` (any layout
            works: the stream axis is inserted just before ``channel_dim``).
        n_streams: number of streams ``n``.
        channel_dim: the channel axis of ``x``.
        spread: how far the stream weights spread around 1, in ``[0, 1)``.

    Returns:
        ``(B, T, n, C)`` or ``(B, n, C, H, W)``.

    Raises:
        ValueError: for a non-positive ``n_streams``, a ``spread`` outside ``[0, 1)``, or a ``channel_dim``
            that is not an axis of ``x``.
    """
    n_streams = _check_positive_int("n_streams", n_streams)
    spread = _check_spread(spread)
    stream_axis = _check_axis(_check_int("channel_dim", channel_dim), x.dim())
    streams = x.unsqueeze(stream_axis)
    if n_streams == 1:
        return streams
    shape = [1] * streams.dim()
    shape[stream_axis] = n_streams
    return streams * stream_weights(n_streams, spread, dtype=x.dtype).to(x.device).view(shape)


def collapse_streams(streams: Tensor, channel_dim: int = -1) -> Tensor:
    """The mean over the streams, at the output of a hyper-connected stack (inverse of :func:`expand_streams`).

    Args:
        streams: ``(B, T, n, C)`` or ``(B, n, C, H, W)``.
        channel_dim: the channel axis of the *collapsed* tensor (as given to :func:`expand_streams`).

    Returns:
        ``(B, T, C)`` or ``(B, C, H, W)``.

    Raises:
        ValueError: for a ``channel_dim`` that is not an axis of the collapsed tensor.
    """
    stream_axis = _check_axis(_check_int("channel_dim", channel_dim), streams.dim() - 1)
    if streams.shape[stream_axis] == 1:
        return streams.squeeze(stream_axis)
    return streams.mean(dim=stream_axis)


class _RMSNormalizedProjection(torch.autograd.Function):
    """``RMSNorm(vec(x)) @ phi`` computed as ``(vec(x) @ phi) / rms(x)``, with a hand-written backward.

    ``(P, n, C)`` streams, ``(nC, k)`` phi -> ``(P, k)`` fp32 projection, and the streams passed through.

    Equal to normalising first (the RMSNorm has no gain; one would be absorbed by ``phi``), but it never
    materialises the normalised ``(P, nC)`` copy: the same reordering the mHC paper uses in its kernels.

    The pass-through output is what the rest of the layer reads the streams from (:class:`_MixStreams`). So the
    streams' whole gradient arrives here as one buffer, the one :class:`_MixStreams` allocated, and this
    function adds its own term into it in place, where two separate gradients would cost a second ``(P, n, C)``
    buffer and an extra pass for autograd to add them. The buffer is private to the layer: the pass-through has
    no other reader, so nothing else can hold the gradient being updated.
    """

    @staticmethod
    def forward(ctx: Any, streams: Tensor, phi: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        # explicit sizes: reshape(0, -1) of an empty batch (no positions) is ambiguous
        flat = streams.reshape(streams.shape[0], phi.shape[0]).to(
            phi.dtype
        )  # in phi's dtype (fp32 in layers)
        raw = flat @ phi
        inv_rms = torch.rsqrt(
            torch.linalg.vector_norm(flat, dim=-1, keepdim=True).square() / flat.shape[-1] + eps
        )
        ctx.save_for_backward(streams, phi, raw, inv_rms)
        return raw * inv_rms, streams

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor, grad_streams: Tensor) -> tuple[Tensor, Tensor, None]:
        streams, phi, raw, inv_rms = ctx.saved_tensors
        flat = streams.reshape(streams.shape[0], phi.shape[0])
        grad_raw = grad * inv_rms
        # d inv_rms / d flat = -inv_rms^3 * flat / K
        grad_inv_rms = (grad * raw).sum(dim=-1, keepdim=True) * inv_rms.pow(3) / -flat.shape[-1]
        grad_streams = grad_streams.contiguous()  # a no-op for the buffer _MixStreams returns
        grad_flat = grad_streams.view(flat.shape)
        grad_flat.addmm_(grad_raw.to(flat.dtype), phi.t().to(flat.dtype))
        grad_flat.addcmul_(flat, grad_inv_rms.to(flat.dtype))
        # (g^T x)^T rather than x^T g: MKL runs the skinny product ~3x faster with the long axis innermost.
        return grad_streams, (grad_raw.t() @ flat.to(phi.dtype)).t(), None


class _MixStreams(torch.autograd.Function):
    """The two products of Eq. 3 that read ``x_l``: the branch input ``H_pre x`` and the mixed streams ``H_res x``.

    ``(P, n)`` pre, ``(P, n, n)`` res, ``(P, n, C)`` streams -> ``(P, C)`` branch input, ``(P, n, C)`` mixed.
    ``H_res x`` does not depend on the branch, so it is computed here, before the branch runs, and
    :class:`_AddBranch` adds ``H_post^T F`` into it in place afterwards. One function for both reads means the
    stream gradient is one buffer: ``H_res^T g`` with the rank-1 ``H_pre`` term added in place, where two
    functions would each allocate a ``(P, n, C)`` gradient and autograd would add them in a third pass.
    """

    @staticmethod
    def forward(ctx: Any, pre: Tensor, res: Tensor, streams: Tensor) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(pre, res, streams)
        return torch.bmm(pre.unsqueeze(1), streams).squeeze(1), torch.bmm(res, streams)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_branch_input: Tensor, grad_mixed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        pre, res, streams = ctx.saved_tensors
        grad_mixed = grad_mixed.contiguous()
        grad_pre = torch.bmm(streams, grad_branch_input.unsqueeze(-1)).squeeze(-1)
        grad_res = torch.bmm(grad_mixed, streams.transpose(1, 2))
        # the H_pre term is a rank-1 outer product: a broadcast multiply-add, not a bmm with inner size 1
        grad_streams = torch.bmm(res.transpose(1, 2), grad_mixed).addcmul_(
            pre.unsqueeze(-1), grad_branch_input.unsqueeze(1)
        )
        return grad_pre, grad_res, grad_streams


class _AddBranch(torch.autograd.Function):
    """``x_{l+1} = H_res x + H_post^T F``, written into the mixed streams in place.

    ``(P, n, C)`` mixed (overwritten), ``(P, n)`` post, ``(P, C)`` branch output -> ``(P, n, C)``. The update
    is a broadcast multiply-add; the backward passes the incoming gradient through to ``mixed`` unchanged (no
    copy) and uses batched matmuls with inner size ``C`` or ``n``, never 1.
    """

    @staticmethod
    def forward(ctx: Any, mixed: Tensor, post: Tensor, branch_output: Tensor) -> Tensor:
        ctx.mark_dirty(mixed)
        ctx.save_for_backward(post, branch_output)
        mixed.addcmul_(post.unsqueeze(-1), branch_output.unsqueeze(1))
        return mixed  # the dirty input itself, as torch.compile requires of mark_dirty

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        post, branch_output = ctx.saved_tensors
        grad = grad.contiguous()
        grad_post = torch.bmm(grad, branch_output.unsqueeze(-1)).squeeze(-1)
        grad_branch_output = torch.bmm(post.unsqueeze(1), grad).squeeze(1)
        return grad, grad_post, grad_branch_output


class HyperConnection(nn.Module):
    r"""Unconstrained Hyper-Connections (Zhu et al. 2024) around a residual branch.

    ``x_{l+1} = H_res x_l + H_post^T F(H_pre x_l)`` over ``n`` streams, with
    ``H = alpha * tanh(RMSNorm(vec(x_l)) phi) + b`` and no constraint on ``H_res``: over a deep stack the
    product of ``H_res`` matrices can amplify the signal without bound. Use
    :class:`ManifoldHyperConnection` for training; this class exists for comparison and ablation.

    Args:
        branch: the residual branch ``F``, any module mapping the collapsed layout to itself (e.g. a pre-norm
            attention or MLP block on ``(B, T, C)``, or a conv block on ``(B, C, H, W)``). Extra positional
            and keyword arguments of :meth:`forward` are passed to it.
        dim: channel width ``C`` of one stream.
        n_streams: number of streams ``n``; ``1`` makes this the plain residual ``x + F(x)``.
        channel_dim: the channel axis of the branch's input (``-1`` for tokens, ``1`` for images).
        alpha_init: initial value of the three dynamic gates ``alpha_pre``, ``alpha_post``, ``alpha_res``.
        spread: the spread of the initial ``H_post`` around 1, matching :func:`expand_streams`.
        eps: RMSNorm epsilon.

    Raises:
        ValueError: for a non-positive ``dim`` or ``n_streams``, a non-int ``channel_dim``, a negative or
            non-finite ``alpha_init``, a ``spread`` outside ``[0, 1)``, or an ``eps`` that is not a finite
            positive number; at call time, for streams whose ``(n_streams, dim)`` axes do not match the layer,
            or a branch output that is not one tensor of the branch input's shape and layout.

    Example::

        >>> block = HyperConnection(nn.Linear(16, 16), dim=16, n_streams=4)
        >>> streams = expand_streams(torch.randn(2, 5, 16), 4)
        >>> block(streams).shape
        torch.Size([2, 5, 4, 16])
    """

    def __init__(
        self,
        branch: nn.Module,
        dim: int,
        n_streams: int = 4,
        channel_dim: int = -1,
        alpha_init: float = 0.01,
        spread: float = 0.5,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        dim = _check_positive_int("dim", dim)
        n_streams = _check_positive_int("n_streams", n_streams)
        channel_dim = _check_int("channel_dim", channel_dim)  # its range is checked against the input's rank
        spread = _check_spread(spread)
        if _as_real(alpha_init) is None or alpha_init < 0:
            raise ValueError(f"`alpha_init`={alpha_init!r} must be a finite non-negative number.")
        if _as_real(eps) is None or eps <= 0:
            # eps = 0 divides by zero on an all-zero position (zero padding): NaN coefficients
            raise ValueError(f"`eps`={eps!r} must be a finite positive number.")
        self.branch = branch
        self.dim = dim
        self.n_streams = n_streams
        self.channel_dim = channel_dim
        self.eps = float(eps)
        if n_streams == 1:
            return  # the plain residual: no coefficients at all
        n, width = n_streams, n_streams * dim
        # The projection is phi_scale * phi with phi ~ N(0, 1) stored at unit scale, i.e. N(0, 1/(nC)): x' has
        # unit RMS, so x' phi has unit scale and alpha alone sets the dynamic size. Storing it at unit scale sets
        # how far an optimizer step moves it: Adam moves every entry by about lr whatever its scale, which for
        # N(0, 1/(nC)) entries is a relative change of lr * sqrt(nC) per step (34% at lr 3e-2, nC = 128); the
        # H_res logits then spread by 100+ within a hundred steps and 20 Sinkhorn iterations stop converging.
        self.phi_scale = 1.0 / math.sqrt(width)
        self._alpha_init, self._spread = float(alpha_init), spread  # for reset_parameters
        self.phi_pre = nn.Parameter(torch.empty(width, n))
        self.phi_post = nn.Parameter(torch.empty(width, n))
        self.phi_res = nn.Parameter(torch.empty(width, n * n))
        self.alpha_pre = nn.Parameter(torch.empty(()))
        self.alpha_post = nn.Parameter(torch.empty(()))
        self.alpha_res = nn.Parameter(torch.empty(()))
        self.b_pre = nn.Parameter(torch.empty(n))
        self.b_post = nn.Parameter(torch.empty(n))
        self.b_res = nn.Parameter(torch.empty(n, n))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """(Re)initialise the coefficient parameters as at construction (the branch is left alone).

        What Lightning and FSDP2 call on each module after materialising a model built on the meta device
        (``to_empty`` + ``reset_parameters``); without it the layer would keep uninitialised memory.
        """
        if self.n_streams == 1:
            return
        with torch.no_grad():
            for phi in (self.phi_pre, self.phi_post, self.phi_res):
                phi.normal_()  # the values torch.randn gave, draw for draw
            for alpha in (self.alpha_pre, self.alpha_post, self.alpha_res):
                alpha.fill_(self._alpha_init)
            for bias, value in zip((self.b_pre, self.b_post, self.b_res), self._initial_biases(self._spread)):
                bias.copy_(value)

    # ------------------------------------------------------------------ variant-specific parts
    def _initial_biases(self, spread: float) -> tuple[Tensor, Tensor, Tensor]:
        """Static coefficients at init: read the stream mean, write ``w_i``, mix by the identity."""
        n = self.n_streams
        return torch.full((n,), 1.0 / n), stream_weights(n, spread), torch.eye(n)

    def _coefficient_maps(self, pre: Tensor, post: Tensor, res: Tensor) -> HyperConnectionCoefficients:
        """From the dynamic projections ``x' phi`` to the coefficients (Zhu et al.: tanh-gated, unconstrained)."""
        return HyperConnectionCoefficients(
            self.alpha_pre * torch.tanh(pre) + self.b_pre,
            self.alpha_post * torch.tanh(post) + self.b_post,
            self.alpha_res * torch.tanh(res) + self.b_res,
        )

    # ------------------------------------------------------------------ shared machinery
    def _stream_axis(self, streams: Tensor) -> int:
        """The stream axis of ``streams``, after checking that it and the channel axis hold ``(n, C)``."""
        rank = streams.dim() - 1  # of the collapsed layout the branch sees
        if rank < 1 or not -rank <= self.channel_dim < rank:
            raise ValueError(
                f"{type(self).__name__}: `channel_dim`={self.channel_dim} is out of range for streams of "
                f"shape {tuple(streams.shape)} (a {rank}-D branch input once the stream axis is removed)."
            )
        axis = self.channel_dim % rank
        if tuple(streams.shape[axis : axis + 2]) != (self.n_streams, self.dim):
            # A (B, T, C) input with T == n_streams passes this check: nothing tells tokens from streams.
            raise ValueError(
                f"{type(self).__name__}(dim={self.dim}, n_streams={self.n_streams}, "
                f"channel_dim={self.channel_dim}) expects streams with (n_streams, dim) = ({self.n_streams}, "
                f"{self.dim}) at axes ({axis}, {axis + 1}), the stream axis just before the channel axis: "
                f"(..., {self.n_streams}, {self.dim}) for tokens (channel_dim=-1) or (B, {self.n_streams}, "
                f"{self.dim}, H, W) for images (channel_dim=1); got {tuple(streams.shape)}. Likely causes: "
                f"the input was not widened with expand_streams(x, {self.n_streams}, channel_dim=...), "
                "`channel_dim` does not match the layout, or `dim` / `n_streams` differ from the streams'."
            )
        return axis

    def _to_positions_last(self, streams: Tensor) -> Tensor:
        """``(..., n, C)`` view: every position (token, pixel) in front, the ``n x C`` matrix last."""
        axis = self._stream_axis(streams)
        if axis == streams.dim() - 2:
            return streams
        return streams.movedim((axis, axis + 1), (-2, -1))

    def coefficients(self, streams: Tensor) -> HyperConnectionCoefficients:
        """The mixing coefficients this layer uses for ``streams`` (Eq. 7-8), in fp32, with autograd.

        Args:
            streams: the layer's input, ``(B, T, n, C)`` or ``(B, n, C, H, W)``.

        Returns:
            :class:`HyperConnectionCoefficients` with ``pre``/``post`` ``(..., n)`` and ``res`` ``(..., n, n)``,
            where ``...`` are the positions (``(B, T)`` or ``(B, H, W)``).
        """
        if self.n_streams == 1:
            raise ValueError("`n_streams`=1 is the plain residual and has no coefficients.")
        n = self.n_streams
        matrices = self._to_positions_last(streams)  # checks the (n, C) axes
        positions = matrices.shape[:-2]
        (pre, post, res), _ = self._coefficients(matrices.reshape(-1, n, self.dim))
        return HyperConnectionCoefficients(
            pre.view(*positions, n), post.view(*positions, n), res.view(*positions, n, n)
        )

    def _coefficients(self, matrices: Tensor) -> tuple[HyperConnectionCoefficients, Tensor]:
        """Coefficients for ``(P, n, C)`` stream matrices, one per position: ``(P, n)``, ``(P, n)``, ``(P, n, n)``,
        and the matrices again, as passed through the projection: the layer must read them from there (see
        :class:`_RMSNormalizedProjection`)."""
        n = self.n_streams
        # The coefficient path is tiny (nC -> n^2 + 2n) and feeds an exp(), so it always runs in fp32.
        with torch.autocast(device_type=matrices.device.type, enabled=False):
            phi = torch.cat((self.phi_pre, self.phi_post, self.phi_res), dim=1).float() * self.phi_scale
            projection, matrices = _RMSNormalizedProjection.apply(matrices, phi, self.eps)
            pre, post, res = projection.split((n, n, n * n), dim=-1)  # x' phi for Eq. 7
            return self._coefficient_maps(pre, post, res.unflatten(-1, (n, n))), matrices

    def _check_branch_output(self, branch_input: Tensor, branch_output: Any) -> None:
        """Refuse a branch output that is not one tensor of the branch input's shape: the layer flattens it to
        ``(positions, C)``, so another layout with as many elements (``(B, C, T)`` for ``(B, T, C)``) would be
        scrambled into the streams silently, where the plain ``x + F(x)`` fails on the shapes. Under
        ``torch.compile`` the comparison is a guard on the shapes, not a graph break."""
        if not isinstance(branch_output, Tensor):
            raise ValueError(
                f"{type(self).__name__}: the branch returned a {type(branch_output).__name__}, not a tensor, for "
                f"a branch input of shape {tuple(branch_input.shape)}; it must return one tensor of that shape. "
                "A branch returning a tuple (e.g. nn.MultiheadAttention's (output, weights)) must be unwrapped "
                "to its output."
            )
        if branch_output.shape != branch_input.shape:
            raise ValueError(
                f"{type(self).__name__}: the branch returned shape {tuple(branch_output.shape)} for a branch "
                f"input of shape {tuple(branch_input.shape)}; a residual branch must return its input's shape "
                f"and layout (channel_dim={self.channel_dim}), as `x + F(x)` requires. A block that transposes "
                "(e.g. a Conv1d over tokens) must transpose back."
            )

    def forward(self, streams: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        """``x_{l+1} = H_res x_l + H_post^T F(H_pre x_l)`` for ``streams`` of shape ``(B, T, n, C)`` or
        ``(B, n, C, H, W)``; the output has the same shape.

        Raises:
            ValueError: for streams whose ``(n_streams, dim)`` axes do not match the layer, or (with
                ``n_streams > 1``) a branch output that is not one tensor of the branch input's shape.
        """
        axis = self._stream_axis(streams)
        if self.n_streams == 1:
            x = streams.squeeze(axis)
            return (x + self.branch(x, *args, **kwargs)).unsqueeze(axis)
        channels_last = axis == streams.dim() - 2
        positions_last = self._to_positions_last(streams)  # (..., n, C)
        positions = positions_last.shape[:-2]
        matrices = positions_last.reshape(-1, self.n_streams, self.dim)  # (P, n, C); a view for tokens
        coefficients, matrices = self._coefficients(matrices)
        pre, post, res = (c.to(matrices.dtype) for c in coefficients)
        # The stream mixing stays in the streams' own precision even under autocast: the residual path is
        # where rounding accumulates over depth. Only the branch runs under the caller's autocast.
        with torch.autocast(device_type=matrices.device.type, enabled=False):
            branch_input, mixed = _MixStreams.apply(pre, res, matrices)  # H_pre x_l and H_res x_l
            branch_input = branch_input.view(*positions, self.dim)
        if not channels_last:
            branch_input = branch_input.movedim(-1, axis)
        branch_output = self.branch(branch_input, *args, **kwargs)
        self._check_branch_output(branch_input, branch_output)
        if not channels_last:
            branch_output = branch_output.movedim(axis, -1)
        with torch.autocast(device_type=matrices.device.type, enabled=False):
            branch_output = branch_output.reshape(-1, self.dim).to(matrices.dtype)
            # H_res x_l + H_post^T F(H_pre x_l): batched over positions, no loop over streams
            out = _AddBranch.apply(mixed, post, branch_output)
        out = out.view(*positions, self.n_streams, self.dim)
        if not channels_last:
            out = out.movedim((-2, -1), (axis, axis + 1))
        return out

    # ------------------------------------------------------------------ state_dict layout
    # Version 2 (2026-12): state_dicts record the variant ("hc" / "mhc") in their metadata. Version 1 (torch's
    # default) covers two layouts metadata cannot tell apart: phi stored at N(0, 1/(nC)) and used unscaled
    # (before commit adeed8c, 2026-11-29) and phi at unit scale times phi_scale (since then).
    _version = 2
    _variant = "hc"

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        metadata = getattr(destination, "_metadata", None)
        if metadata is not None and self.n_streams > 1:
            metadata.setdefault(prefix[:-1], {})["hyper_connection"] = self._variant

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        if self.n_streams > 1:
            variant = local_metadata.get("hyper_connection")
            if variant is not None and variant != self._variant:
                # same names and shapes, but b_* (and alpha) mean different things in HC and mHC
                error_msgs.append(
                    f"{type(self).__name__} at {prefix[:-1] or '<root>'!r} ({self._variant}) cannot load the "
                    f"state of a{'n' if variant == 'mhc' else ''} {variant} layer: the parameters have the same "
                    "names and shapes but another meaning (HC's b_* are the coefficients, mHC's the logits of "
                    "sigmoid / Sinkhorn). Build the model with the variant it was trained with."
                )
                return
            if (local_metadata.get("version") or 1) < 2:
                self._warn_if_phi_looks_pre_adeed8c(state_dict, prefix)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def _warn_if_phi_looks_pre_adeed8c(self, state_dict: dict[str, Any], prefix: str) -> None:
        """A state_dict without a version may hold phi as stored before commit adeed8c (2026-11-29), at
        N(0, 1/(nC)) and used unscaled, which this layer would scale by 1/sqrt(nC) again. Its RMS tells: about
        1/sqrt(nC) then, about 1 since; but a current phi that training shrank (weight decay) is small too, so
        the warning says how to tell the two apart before rescaling. Warn (never convert: most such state_dicts
        are of the current layout)."""
        phis = [state_dict.get(prefix + name) for name in ("phi_pre", "phi_post", "phi_res")]
        if not all(type(phi) in (Tensor, nn.Parameter) and not phi.is_meta for phi in phis):
            return  # absent (reported by torch), sharded or meta: nothing to read cheaply
        width = self.n_streams * self.dim
        rms = float(torch.cat([phi.detach().reshape(-1).float().cpu() for phi in phis]).pow(2).mean().sqrt())
        if rms < width**-0.25:  # the geometric midpoint of the two layouts' initial RMS
            warnings.warn(
                f"{type(self).__name__} at {prefix[:-1] or '<root>'!r}: the loaded phi has RMS {rms:.3g}, the scale "
                f"of state_dicts saved before 2026-11-29 (commit adeed8c; init 1/sqrt(nC) = {width**-0.5:.3g}), "
                f"whose layer used phi unscaled; this layer multiplies it by 1/sqrt(nC), so those weights would "
                f"compute a different function. A state_dict saved since whose phi training shrank (long weight "
                f"decay) reads the same: load it as it is, as rescaling it would corrupt it. So only if it was "
                f"saved before 2026-11-29, multiply phi_pre, phi_post and phi_res by sqrt(nC) = {width**0.5:.4g} "
                f"before loading. To tell: the file's date or the commit of the code that saved it; its "
                f"metadata, which a checkpoint or `torch.save(model.state_dict())` keeps (safetensors and a "
                f"rebuilt dict drop it): version 2 there means the current layout; or evaluate data it trained "
                f"on both ways and keep the one that gives the loss the run reached (docs/mhc.md, Changelog).",
                stacklevel=2,
            )

    def extra_repr(self) -> str:
        return f"dim={self.dim}, n_streams={self.n_streams}, channel_dim={self.channel_dim}"


class ManifoldHyperConnection(HyperConnection):
    r"""Manifold-Constrained Hyper-Connections (mHC, Xie et al. 2025) around a residual branch.

    ``x_{l+1} = H_res x_l + H_post^T F(H_pre x_l)`` over ``n`` streams (Eq. 3), with the coefficients of
    Eq. 7-9: ``x' = RMSNorm(vec(x_l))`` over all ``nC`` values, ``H~ = alpha * (x' phi) + b``,
    ``H_pre = sigmoid(H~_pre)``, ``H_post = 2 sigmoid(H~_post)``, ``H_res = SinkhornKnopp(H~_res)``. ``H_res``
    is (approximately) doubly stochastic, so any product of them over depth has spectral norm at most 1 and
    the streams' mean passes through unchanged: the identity-mapping property that unconstrained HC loses.

    Initialisation is described in :mod:`lightning_pulse.nn.hyper_connections`: the network starts as the
    plain residual network and every coefficient parameter gets a gradient at step 0.

    Args:
        branch: the residual branch ``F`` (see :class:`HyperConnection`).
        dim: channel width ``C`` of one stream.
        n_streams: number of streams ``n`` (the paper uses 4); ``1`` makes this the plain residual ``x + F(x)``.
        channel_dim: the channel axis of the branch's input (``-1`` for tokens, ``1`` for images).
        sinkhorn_iters: Sinkhorn-Knopp iterations (the paper uses 20).
        res_init_diagonal: the diagonal of ``H_res`` at init, in ``(1/n, 1)``; the rest of each row shares
            ``1 - res_init_diagonal``. Values very close to 1 saturate the Sinkhorn map (zero-gradient trap).
        alpha_init: initial value of the three dynamic gates (the paper uses 0.01).
        spread: the spread of the initial ``H_post`` around 1, matching :func:`expand_streams`.
        eps: RMSNorm epsilon.

    Raises:
        ValueError: for a non-positive ``dim``, ``n_streams`` or ``sinkhorn_iters``, a ``res_init_diagonal``
            that is not a number in ``(1/n, 1)``, and the cases of :class:`HyperConnection`.

    Example::

        >>> from lightning_pulse.nn import ManifoldHyperConnection, collapse_streams, expand_streams
        >>> blocks = nn.Sequential(*[ManifoldHyperConnection(nn.Linear(16, 16), dim=16) for _ in range(3)])
        >>> x = torch.randn(2, 5, 16)
        >>> collapse_streams(blocks(expand_streams(x, 4))).shape
        torch.Size([2, 5, 16])
    """

    _variant = "mhc"

    def __init__(
        self,
        branch: nn.Module,
        dim: int,
        n_streams: int = 4,
        channel_dim: int = -1,
        sinkhorn_iters: int = 20,
        res_init_diagonal: float = 0.9,
        alpha_init: float = 0.01,
        spread: float = 0.5,
        eps: float = 1e-6,
    ) -> None:
        sinkhorn_iters = _check_positive_int("sinkhorn_iters", sinkhorn_iters)
        n_streams = _check_positive_int("n_streams", n_streams)
        diagonal = _as_real(res_init_diagonal)
        if diagonal is None or (n_streams > 1 and not 1.0 / n_streams < diagonal < 1.0):
            raise ValueError(
                f"`res_init_diagonal`={res_init_diagonal!r} must be a number in (1/n_streams, 1) = "
                f"({1.0 / n_streams:.4g}, 1)."
            )
        self.sinkhorn_iters = sinkhorn_iters
        self.res_init_diagonal = diagonal
        super().__init__(branch, dim, n_streams, channel_dim, alpha_init, spread, eps)

    def _initial_biases(self, spread: float) -> tuple[Tensor, Tensor, Tensor]:
        n = self.n_streams
        pre = torch.full((n,), math.log(1.0 / (n - 1)))  # sigmoid(b) = 1/n
        post = torch.logit(stream_weights(n, spread) / 2)  # 2 sigmoid(b) = w_i
        # exp(d I) has diagonal e^d and ones elsewhere: every row and column sums to e^d + n - 1, so it is
        # doubly stochastic after scaling, and Sinkhorn returns diagonal e^d / (e^d + n - 1) = p exactly.
        p = self.res_init_diagonal
        res = torch.eye(n) * math.log(p * (n - 1) / (1.0 - p))
        return pre, post, res

    def _coefficient_maps(self, pre: Tensor, post: Tensor, res: Tensor) -> HyperConnectionCoefficients:
        return HyperConnectionCoefficients(
            torch.sigmoid(self.alpha_pre * pre + self.b_pre),  # Eq. 8
            2 * torch.sigmoid(self.alpha_post * post + self.b_post),
            sinkhorn_knopp(self.alpha_res * res + self.b_res, self.sinkhorn_iters),  # Eq. 9
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, sinkhorn_iters={self.sinkhorn_iters}"


class PlainResidual(nn.Module):
    """The plain residual connection ``x + F(x)``, for stacks that switch between plain, HC and mHC.

    Args:
        branch: the residual branch ``F``; extra arguments of :meth:`forward` are passed to it.
    """

    def __init__(self, branch: nn.Module) -> None:
        super().__init__()
        self.branch = branch

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return x + self.branch(x, *args, **kwargs)


def residual_connection(
    kind: ResidualKind, branch: nn.Module, dim: int, n_streams: int = 4, **kwargs: Any
) -> nn.Module:
    """Wrap ``branch`` in the residual connection named by ``kind``.

    Args:
        kind: ``"plain"`` (:class:`PlainResidual`, on the collapsed layout), ``"hc"`` (:class:`HyperConnection`)
            or ``"mhc"`` (:class:`ManifoldHyperConnection`), both on the stream layout.
        branch: the residual branch ``F``.
        dim: channel width ``C``.
        n_streams: streams for ``"hc"`` / ``"mhc"``.
        **kwargs: further arguments of the chosen class.

    Raises:
        ValueError: for an unknown ``kind``.
    """
    if kind == "plain":
        return PlainResidual(branch)
    if kind == "hc":
        return HyperConnection(branch, dim, n_streams, **kwargs)
    if kind == "mhc":
        return ManifoldHyperConnection(branch, dim, n_streams, **kwargs)
    raise ValueError(f"`residual`={kind!r} is not one of {list(RESIDUAL_KINDS)}.")
