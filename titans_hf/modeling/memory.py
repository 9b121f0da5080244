"""Titans neural long-term memory (Behrouz et al. 2025, arXiv 2501.00663): an MLP whose weights learn at test time.

Exact definitions (the tests' reference loop restates them; `H` heads of size `d`, all heads batched):

* ``x_t = RMSNorm(h_t) = h_t / sqrt(mean(h_t**2) + eps) * g`` (learned ``g``).
* ``[q, k, v]_t = causal_depthwise_conv(x W_qkv)_t``: per channel ``c``,
  ``y_t[c] = sum_{i<K} w[c, i] * u_{t-K+1+i}[c]`` with ``u`` zero before the first token (and zero on padding tokens),
  ``K = conv_kernel``. Then ``q = l2norm(silu(q))``, ``k = l2norm(silu(k))`` per head, ``v`` as is, where
  ``l2norm(z) = z / max(||z||_2, 1e-12)`` (``F.normalize``).
* Memory ``M_W`` per head, one of :data:`MEMORY_MODELS` (``memory_model``). The default ``"mlp"``
  (:class:`MLPMemory`), depth ``L``, hidden width ``expansion * d``: ``a_0 = z``, ``a_l = silu(a_{l-1} W_l)`` for
  ``l < L``, ``M_W(z) = z + a_{L-1} W_L`` (depth 1: ``M_W(z) = z + z W_1``). The fast weights start from the learned
  parameters ``initial_weights[l]`` of shape ``[H, d_in, d_out]``.
* Gates from ``x_t W_g + b_g`` (``3H`` logits): ``theta_t = max_lr * sigmoid(logit_theta) * mask_t`` per token,
  ``eta_j = sigmoid(mean logit_eta)`` and ``alpha_j = sigmoid(mean logit_alpha)`` where the mean runs over the real
  (mask = 1) tokens of update chunk ``j``.
* Update chunk ``j`` = tokens ``[j*C, (j+1)*C)`` with ``C = chunk_size``; memory batch ``b`` = chunks
  ``[b*m, (b+1)*m)`` with ``m = batch_size // chunk_size``. Surprise of chunk ``j``:
  ``G_j = grad_W sum_{t in j} theta_t ||M_W(k_t) - v_t||^2`` at ``W = W_{b*m-1}`` (weights before its batch; with the
  default ``batch_size = chunk_size`` this is ``W_{j-1}``), clipped per head:
  ``G_j *= c / max(||G_j||, c)`` with ``||G_j||`` the norm over all layers and ``c = max_surprise_norm``.
  ``S_j = eta_j S_{j-1} - G_j``; ``W_j = (1 - alpha_j) W_{j-1} + S_j``; ``S_{-1} = 0``, ``W_{-1}`` = initial weights.
  A chunk without any real token leaves ``S`` and ``W`` unchanged.
* The delta rule (``update_rule="delta"``, linear memory only, the configs' default): every token takes its own step
  at the weights the tokens before it left, ``W <- W - theta_t grad_W ||M_W(k_t) - v_t||^2 = W + beta_t k_t^T (v_t -
  k_t - k_t W)`` with ``beta_t = 2 theta_t <= 2 max_lr <= 1``; Titans' per-token rule without momentum, i.e. the
  (gated) delta rule of DeltaNet. Since ``||k_t|| = 1``, each step maps ``W`` by ``I - beta_t k_t^T k_t``, whose
  eigenvalues lie in ``[0, 1]``: a write contracts the memory along its key and replaces the value stored there
  (in one step at ``beta = 1``). After the chunk's tokens, ``W_j = (1 - alpha_j) W_{j-1} + (W' - W_{j-1})`` with
  ``W'`` the stepped weights, then ``W_j *= m / max(||W_j||_F, m)`` per head with ``m = max_memory_norm``: for any
  input, ``||W_j||_F <= max(m, ||W_{-1}||_F)`` per head (the delta rule alone is not bounded: writes of opposite
  values under nearly equal keys chase a least-squares solution of unbounded norm). Momentum is unused.
* Read: token ``t`` of chunk ``j`` returns ``M_{W_{j-1}}(q_t)``: only strictly earlier chunks wrote what it reads.
  :meth:`NeuralMemory.retrieve` reads the current weights for tokens outside the stream, writing nothing.
* Initial gate biases (``theta_bias_init`` -2, ``momentum_bias_init`` 0, ``forget_bias_init`` -4): small steps,
  since a chunk's summed gradient multiplies the step by the chunk length; the surprise clip then bounds every
  update, so ``||W_j|| <= ||W_{-1}|| + c / ((1 - max eta) min alpha)`` per head.

A memory model is a :class:`MemoryModel`: weight shapes, init and ``M_W(z)``; its inner gradients then come from
autograd. An :class:`ExplicitMemoryModel` (the MLP) writes the inner gradient and its reverse out as batched
matmuls, so each update chunk runs as one autograd node (:class:`_ChunkStep`) and the surprise of a memory batch as
another (:class:`_Surprise`); all heads, and all chunks of a memory batch, run as single matmuls either way. At depth 1
(``M_W(z) = z + z W``, the default) the surprise is affine in ``W`` and the reads are linear in it: the stream then
runs as a scan that only writes, and every chunk's reads are one product after it (:meth:`NeuralMemory._scan_affine`;
the delta rule's :meth:`NeuralMemory._scan_delta` solves each chunk's triangular system for all chunks before its
loop, the WY form of DeltaNet's chunkwise algorithm).
State is fp32 (fp64 when the module is fp64) whatever the activation dtype, and everything needed to continue
mid-chunk lives in :class:`MemoryState`, so feeding the tokens in any pieces gives the same reads and state as one
pass.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_LIST_FIELDS = ("weights", "momentum", "batch_start_weights")
_TENSOR_FIELDS = ("conv_tail", "buffer_keys", "buffer_values", "buffer_lr", "buffer_gate_logits", "buffer_mask")


@dataclass
class MemoryState:
    """Everything the memory needs to continue a stream exactly where it stopped.

    The buffers hold the ``position % chunk_size`` tokens of the update chunk that has started but not finished:
    they were already read, and will write once their chunk completes.
    """

    weights: list[Tensor]  # fast weights W_{j-1}, per MLP layer [B, H, d_in, d_out]
    momentum: list[Tensor]  # S_{j-1}, same shapes
    batch_start_weights: list[Tensor]  # weights where the current memory batch takes its inner gradients
    conv_tail: Tensor  # [B, K-1, 3*H*d] pre-convolution projections of the last K-1 tokens
    buffer_keys: Tensor  # [B, H, r, d]
    buffer_values: Tensor  # [B, H, r, d]
    buffer_lr: Tensor  # [B, H, r] theta (already zero on padding)
    buffer_gate_logits: Tensor  # [B, r, 2H] momentum and forget logits
    buffer_mask: Tensor  # [B, r]
    position: int  # tokens seen so far
    # sum of theta / max_lr over the real tokens and heads of the call that made this state (what the write cost
    # averages); not part of the stream: None on states no call made, never saved or carried on
    written: Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.conv_tail.shape[0]

    def _map(self, fn) -> "MemoryState":
        # m = chunk size: batch_start_weights *is* weights; keep that identity so nothing is stored twice.
        shared = self.batch_start_weights is self.weights
        weights = [fn(t) for t in self.weights]
        return MemoryState(
            weights=weights,
            momentum=[fn(t) for t in self.momentum],
            batch_start_weights=weights if shared else [fn(t) for t in self.batch_start_weights],
            **{name: fn(getattr(self, name)) for name in _TENSOR_FIELDS},
            position=self.position,
        )

    def detach(self) -> "MemoryState":
        """Cut the autograd graph (truncated BPTT): values kept, history forgotten."""
        return self._map(Tensor.detach)

    def select(self, index: Tensor | list[int]) -> "MemoryState":
        """Rows `index` of the batch, e.g. to reorder beams or expand a prompt to several samples."""
        index = torch.as_tensor(index, dtype=torch.long, device=self.conv_tail.device)
        return self._map(lambda t: t.index_select(0, index))

    @classmethod
    def concatenated(cls, states: Sequence["MemoryState"]) -> "MemoryState":
        """The rows of `states` (all at one position) one after another in one batch."""
        shared = all(state.batch_start_weights is state.weights for state in states)
        lists = {name: [torch.cat(layer) for layer in zip(*(getattr(state, name) for state in states))]
                 for name in _LIST_FIELDS if not (shared and name == "batch_start_weights")}
        return cls(**lists, batch_start_weights=lists["weights"] if shared else lists["batch_start_weights"],
                   **{name: torch.cat([getattr(state, name) for state in states]) for name in _TENSOR_FIELDS},
                   position=states[0].position)

    def to(self, device: torch.device | str) -> "MemoryState":
        return self._map(lambda t: t.to(device))

    def state_dict(self) -> dict[str, Tensor]:
        """Flat dict of contiguous, unshared tensors (safetensors-ready); `from_state_dict` inverts it."""
        out = {}
        for name in _LIST_FIELDS:
            for i, t in enumerate(getattr(self, name)):
                out[f"{name}.{i}"] = torch.clone(t.detach(), memory_format=torch.contiguous_format)
        for name in _TENSOR_FIELDS:
            out[name] = torch.clone(getattr(self, name).detach(), memory_format=torch.contiguous_format)
        out["position"] = torch.tensor(self.position, dtype=torch.long)
        return out

    @classmethod
    def from_state_dict(cls, state_dict: dict[str, Tensor]) -> "MemoryState":
        expected = {f.name for f in fields(cls)} - {"written"}
        present = {key.split(".")[0] for key in state_dict}
        if present != expected:
            raise ValueError(
                f"state_dict: keys do not describe a MemoryState (missing {sorted(expected - present)}, "
                f"unexpected {sorted(present - expected)})"
            )
        lists = {
            name: [state_dict[f"{name}.{i}"] for i in range(sum(k.startswith(name + ".") for k in state_dict))]
            for name in _LIST_FIELDS
        }
        return cls(**lists, **{name: state_dict[name] for name in _TENSOR_FIELDS},
                   position=int(state_dict["position"]))


CONV_INITS = ("identity", "window")
# How an update chunk writes: "gradient" (Titans' chunked rule: every token's gradient at the chunk's starting weights,
# clipped, with momentum) or "delta" (the exact per-token delta rule, a contraction along each key)
UPDATE_RULES = ("gradient", "delta")


# ---- memory models ----
# Fast weights are lists of [rows, d_in, d_out] tensors, rows = batch * heads, so every product is one bmm; where a
# memory batch reads with several chunks' weights at once they carry a chunk axis after rows ([rows, n, d_in, d_out]
# with inputs [rows, n, tokens, d]).


class MemoryModel(ABC):
    """The function ``M_W`` each head's memory learns, of fast weights ``W``.

    A subclass sets :attr:`shapes` in ``__init__(head_dim, depth, expansion)`` (it may ignore depth and expansion)
    and defines ``__call__``; :meth:`surprise` then takes the inner gradients by autograd, and every update chunk runs
    the memory-batch path of :meth:`NeuralMemory.forward`. Add it to :data:`MEMORY_MODELS` to select it by name.
    """

    shapes: list[tuple[int, int]]  # (d_in, d_out) of each fast weight, in order

    @abstractmethod
    def __call__(self, weights: Sequence[Tensor], z: Tensor) -> Tensor:
        """``M_W(z)`` for ``z`` [..., tokens, d] and weights [..., d_in, d_out] with the same leading axes."""

    def init_weights(self, weights: Sequence[Tensor]) -> None:
        """Initialise the learned initial weights ([heads, d_in, d_out] each) in place: normal, std d_in ** -0.5."""
        for weight in weights:
            nn.init.normal_(weight, std=weight.shape[1] ** -0.5)

    def surprise(self, point: Sequence[Tensor], keys: Tensor, values: Tensor, lr2: Tensor) -> list[Tensor]:
        """Per chunk ``G_j = grad_W sum_t theta_t ||M_W(k_t) - v_t||^2`` at the weights `point` [rows, d_in, d_out]
        shared by the n chunks of `keys`, `values` [rows, n, C, d] with ``lr2 = 2 theta`` [rows, n, C]. Returns one
        [rows, n, d_in, d_out] tensor per weight, differentiable (``create_graph``) when grad mode is on. Here by
        autograd, which inference mode forbids."""
        n, outer = keys.shape[1], torch.is_grad_enabled()
        with torch.enable_grad():
            point = [w.unsqueeze(1).expand(-1, n, -1, -1) for w in point]  # one gradient per chunk
            point = [w if w.requires_grad else w.detach().requires_grad_() for w in point]
            loss = (lr2.unsqueeze(-1) * (self(point, keys) - values).square()).sum() / 2
            return list(torch.autograd.grad(loss, point, create_graph=outer))


class ExplicitMemoryModel(MemoryModel):
    """A memory model whose inner gradient and its reverse are written out (no autograd inside): an update chunk whose
    reads and surprise share the current weights then runs as one autograd node (:class:`_ChunkStep`), and the
    surprise of a memory batch as another (:class:`_Surprise`).

    Both methods see rows ``z`` [rows, r + n * C, d] through weights [rows, d_in, d_out] shared by all of them: the
    first ``r`` rows are only read, the last ``n * C`` are the keys of ``n`` chunks of ``C`` tokens (the fused step:
    ``r = C`` queries and one chunk; a memory batch: ``r = 0`` and its n chunks).
    """

    @abstractmethod
    def inner_gradient(self, weights: Sequence[Tensor], z: Tensor, values: Tensor, lr2: Tensor, chunk: int
                       ) -> tuple[Tensor, Tensor, list[Tensor]]:
        """``(M_W(z_read), M_W(k) - v, G)``, the reads of the first r rows, the keys' errors for `values`
        [rows, n * C, d] and ``lr2 = 2 theta`` [rows, n * C], and ``G``, one [rows * n, d_in, d_out] tensor per
        weight, ``G_j = grad_W sum_{t in j} theta_t ||M_W(k_t) - v_t||^2``."""

    @abstractmethod
    def inner_gradient_backward(self, weights: Sequence[Tensor], z: Tensor, err: Tensor, lr2: Tensor, chunk: int,
                                g_reads: Tensor | None, g_grads: Sequence[Tensor], g_weights: Sequence[Tensor]
                                ) -> tuple[Tensor, Tensor, Tensor]:
        """Reverse of :meth:`inner_gradient` given the gradients of the first r rows' reads (`g_reads`, None: zero)
        and of ``G`` (`g_grads`): adds the weights' gradients into `g_weights` in place and returns those of ``z``,
        the values and ``lr2``."""

    def surprise(self, point: Sequence[Tensor], keys: Tensor, values: Tensor, lr2: Tensor) -> list[Tensor]:
        n, C = keys.shape[1:3]
        grads = _Surprise.apply(self, C, *point, keys.flatten(1, 2), values.flatten(1, 2), lr2.flatten(1, 2))
        return [g.unflatten(0, (-1, n)) for g in grads]


class MLPMemory(ExplicitMemoryModel):
    """``M_W(z) = z + a_{L-1} W_L`` with ``a_0 = z``, ``a_l = silu(a_{l-1} W_l)``: depth ``L``, hidden width
    ``expansion * head_dim``, and its inner backprop written out."""

    def __init__(self, head_dim: int, depth: int, expansion: int):
        dims = [head_dim] + [head_dim * expansion] * (depth - 1) + [head_dim]
        self.shapes = list(zip(dims[:-1], dims[1:]))

    def __call__(self, weights: Sequence[Tensor], z: Tensor) -> Tensor:
        return _residual_matmul(z, self._hidden(weights, z)[0][-1], weights[-1])

    @staticmethod
    def _hidden(weights: Sequence[Tensor], z: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """The layer inputs ``a_0 .. a_{L-1}`` and the hidden layers' ``sigmoid(a_{l-1} W_l)``."""
        acts, sigmoids = [z], []
        for w in weights[:-1]:
            pre = acts[-1] @ w
            sigmoids.append(torch.sigmoid(pre))
            acts.append(pre * sigmoids[-1] if torch.is_grad_enabled() else pre.mul_(sigmoids[-1]))
        return acts, sigmoids

    @staticmethod
    def _slopes(acts: Sequence[Tensor], sigmoids: Sequence[Tensor]) -> list[Tensor]:
        """``silu'`` of each hidden layer's pre-activation: ``s + a (1 - s)``."""
        return [torch.addcmul(s, a, 1 - s) for s, a in zip(sigmoids, acts[1:])]

    @staticmethod
    def _backprop(weights: Sequence[Tensor], slopes: Sequence[Tensor], top: Tensor
                  ) -> tuple[list[Tensor], list[Tensor]]:
        """The inner backprop from the output gradient `top`: ``delta_{L-1} = top``, ``u_l = delta_{l+1} W_{l+1}^T``,
        ``delta_l = u_l silu'_l``. Returns the deltas (one per weight) and the u's (one per hidden layer)."""
        deltas, ups = [top], []
        for w, slope in zip(weights[:0:-1], slopes[::-1]):
            ups.append(deltas[-1] @ w.transpose(-1, -2))
            deltas.append(ups[-1] * slope)
        return deltas[::-1], ups[::-1]

    def inner_gradient(self, weights: Sequence[Tensor], z: Tensor, values: Tensor, lr2: Tensor, chunk: int
                       ) -> tuple[Tensor, Tensor, list[Tensor]]:
        acts, sigmoids = self._hidden(weights, z)
        keys = slice(z.shape[1] - values.shape[1], None)
        # [reads; M_W(k) - v] = [z_read; k - v] + a W_L: the residual's subtraction first, as one fused product
        base = z.clone()
        base[:, keys].sub_(values)
        out = _residual_matmul(base, acts[-1], weights[-1])
        err = out[:, keys]
        acts = [a[:, keys] for a in acts]
        deltas, _ = self._backprop(weights, self._slopes(acts, [s[:, keys] for s in sigmoids]), err * lr2.unsqueeze(-1))
        grads = [_chunks(a, chunk).transpose(1, 2) @ _chunks(delta, chunk) for a, delta in zip(acts, deltas)]
        return out[:, :keys.start], err, grads

    def inner_gradient_backward(self, weights: Sequence[Tensor], z: Tensor, err: Tensor, lr2: Tensor, chunk: int,
                                g_reads: Tensor | None, g_grads: Sequence[Tensor], g_weights: Sequence[Tensor]
                                ) -> tuple[Tensor, Tensor, Tensor]:
        W, gG, gW, L = weights, g_grads, g_weights, len(weights)
        keys = slice(z.shape[1] - err.shape[1], None)
        key = lambda t: t[:, keys]  # noqa: E731
        chunks = lambda t: _chunks(t, chunk)  # noqa: E731
        tokens = lambda t: t.view(z.shape[0], -1, t.shape[-1])  # noqa: E731
        # recompute the activations of all rows; silu' = s + a (1 - s), silu'' = s + silu' (1 - 2 s)
        acts, sigmoids = self._hidden(W, z)
        slopes = self._slopes(acts, sigmoids)
        delta, u = self._backprop(W, [key(slope) for slope in slopes], err * lr2.unsqueeze(-1))

        # reverse of the inner backprop on the key rows; layer i: input acts[i], output gradient delta[i], and
        # G_i = acts[i]^T delta[i] per chunk
        g_acts_extra, g_pre_extra, g_delta = [None] * L, [None] * (L - 1), [None] * L
        for i in range(L):
            g_acts_extra[i] = tokens(chunks(delta[i]) @ gG[i].transpose(1, 2))
            if g_delta[i] is None:
                g_delta[i] = tokens(chunks(key(acts[i])) @ gG[i])
            else:
                chunks(g_delta[i]).baddbmm_(chunks(key(acts[i])), gG[i])
            if i < L - 1:
                s, slope = key(sigmoids[i]), key(slopes[i])
                g_pre_extra[i] = torch.addcmul(s, slope, s * -2 + 1).mul_(u[i]).mul_(g_delta[i])
                g_u = g_delta[i].mul_(slope)
                g_delta[i + 1] = g_u @ W[i + 1]
                gW[i + 1].baddbmm_(g_u.transpose(1, 2), delta[i + 1])
        g_lr2 = (g_delta[L - 1] * err).sum(-1)
        g_err = g_delta[L - 1].mul_(lr2.unsqueeze(-1))

        # one MLP backward for all rows: upstream [g_reads; g_err], key rows carrying the extra terms
        if keys.start == 0:
            g_top = g_err
        else:
            g_top = torch.cat([err.new_zeros(z.shape[0], keys.start, z.shape[2]) if g_reads is None else g_reads,
                               g_err], 1)
        gW[L - 1].baddbmm_(acts[L - 1].transpose(1, 2), g_top)
        g_a = g_top @ W[L - 1].transpose(1, 2)
        key(g_a).add_(g_acts_extra[L - 1])
        for i in range(L - 2, -1, -1):
            g_pre = g_a.mul_(slopes[i])
            key(g_pre).add_(g_pre_extra[i])
            gW[i].baddbmm_(acts[i].transpose(1, 2), g_pre)
            g_a = g_pre @ W[i].transpose(1, 2)
            key(g_a).add_(g_acts_extra[i])
        return g_a.add_(g_top), -g_err, g_lr2  # the residual: M_W(z) = z + ...


MEMORY_MODELS: dict[str, type[MemoryModel]] = {"mlp": MLPMemory}


class NeuralMemory(nn.Module):
    """Multi-head Titans memory: ``forward(hidden, state) -> (reads, new_state)``; no output projection (the model
    owns it). `memory_model` names the function each head learns, a key of :data:`MEMORY_MODELS`. See the module
    docstring for the exact math."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        depth: int = 2,
        expansion: int = 4,
        conv_kernel: int = 4,
        conv_init: str = "identity",
        chunk_size: int = 64,
        batch_size: int | None = None,
        max_lr: float = 0.1,
        max_surprise_norm: float | None = 1.0,
        theta_bias_init: float = -2.0,
        momentum_bias_init: float = 0.0,
        forget_bias_init: float = -4.0,
        norm_eps: float = 1e-6,
        memory_model: str = "mlp",
        update_rule: str = "gradient",
        max_memory_norm: float | None = None,
    ):
        super().__init__()
        for name, value in dict(hidden_size=hidden_size, num_heads=num_heads, head_dim=head_dim, depth=depth,
                                expansion=expansion, conv_kernel=conv_kernel, chunk_size=chunk_size).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"NeuralMemory: {name} must be a positive integer, got {value!r}")
        if conv_init not in CONV_INITS:
            raise ValueError(f"NeuralMemory: conv_init must be one of {CONV_INITS}, got {conv_init!r}")
        if memory_model not in MEMORY_MODELS:
            raise ValueError(f"NeuralMemory: memory_model must be one of {sorted(MEMORY_MODELS)}, got {memory_model!r}")
        batch_size = chunk_size if batch_size is None else batch_size
        if batch_size < chunk_size or batch_size % chunk_size:
            raise ValueError(f"NeuralMemory: batch_size ({batch_size}) must be a multiple of chunk_size ({chunk_size})")
        if not max_lr > 0:
            raise ValueError(f"NeuralMemory: max_lr must be > 0, got {max_lr}")
        if max_surprise_norm is not None and not max_surprise_norm > 0:
            raise ValueError(f"NeuralMemory: max_surprise_norm must be > 0 or None, got {max_surprise_norm}")
        if update_rule not in UPDATE_RULES:
            raise ValueError(f"NeuralMemory: update_rule must be one of {UPDATE_RULES}, got {update_rule!r}")
        if update_rule == "delta":
            if memory_model != "mlp" or depth != 1:
                raise ValueError(f"NeuralMemory: update_rule='delta' needs the linear memory (memory_model='mlp', "
                                 f"depth=1), got memory_model={memory_model!r}, depth={depth}")
            if batch_size != chunk_size:
                raise ValueError(f"NeuralMemory: update_rule='delta' takes every token's step at the weights it "
                                 f"meets, so batch_size ({batch_size}) must equal chunk_size ({chunk_size})")
            if max_lr > 0.5:
                raise ValueError(f"NeuralMemory: update_rule='delta' needs max_lr <= 0.5 (a step 2 theta <= 1 keeps "
                                 f"each write a contraction along its key), got {max_lr}")
            if max_memory_norm is None or not max_memory_norm > 0:
                raise ValueError(f"NeuralMemory: update_rule='delta' needs max_memory_norm > 0, got {max_memory_norm}")
        elif max_memory_norm is not None:
            raise ValueError("NeuralMemory: max_memory_norm bounds the delta rule's state; update_rule='gradient' is "
                             "bounded by max_surprise_norm and the forget gate")
        self.hidden_size, self.num_heads, self.head_dim, self.depth = hidden_size, num_heads, head_dim, depth
        self.conv_kernel, self.chunk_size, self.batch_size = conv_kernel, chunk_size, batch_size
        self.conv_init, self.memory_model = conv_init, memory_model
        self.model = MEMORY_MODELS[memory_model](head_dim, depth, expansion)
        # M_W(z) = z + z W: the surprise is affine in W, and the stream runs as :meth:`_scan_affine`
        self.affine = isinstance(self.model, MLPMemory) and len(self.model.shapes) == 1
        self.chunks_per_batch = batch_size // chunk_size
        self.max_lr, self.max_surprise_norm = max_lr, max_surprise_norm
        self.update_rule, self.max_memory_norm = update_rule, max_memory_norm
        self.bias_init = (theta_bias_init, momentum_bias_init, forget_bias_init)
        inner = num_heads * head_dim

        self.norm = nn.RMSNorm(hidden_size, eps=norm_eps)
        self.to_qkv = nn.Linear(hidden_size, 3 * inner, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(3 * inner, conv_kernel))
        self.to_gates = nn.Linear(hidden_size, 3 * num_heads)
        self.initial_weights = nn.ParameterList(
            nn.Parameter(torch.empty(num_heads, d_in, d_out)) for d_in, d_out in self.model.shapes
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise everything; models whose `_init_weights` re-initialise Linears should call this afterwards,
        since the negative gate biases are what keep the first updates stable."""
        self.norm.reset_parameters()
        self.to_qkv.reset_parameters()
        with torch.no_grad():
            # identity: q, k, v start as the plain projections, the other taps are learned. window: q and k start
            # as the mean over the kernel, so a key holds a few neighbouring tokens together from the first step.
            self.conv_weight.zero_()
            self.conv_weight[:, -1] = 1.0
            if self.conv_init == "window":
                self.conv_weight[: 2 * self.num_heads * self.head_dim] = 1.0 / self.conv_kernel
            nn.init.normal_(self.to_gates.weight, std=self.hidden_size**-0.5)
            bias = self.to_gates.bias.view(3, self.num_heads)
            for row, value in zip(bias, self.bias_init):
                row.fill_(value)
            self.model.init_weights(self.initial_weights)

    @property
    def state_dtype(self) -> torch.dtype:
        return torch.float64 if self.to_qkv.weight.dtype == torch.float64 else torch.float32

    def init_state(self, batch_size: int, device: torch.device | str | None = None) -> MemoryState:
        """Fresh state; its weights stay connected to `initial_weights`, so the outer loss trains them."""
        device = self.to_qkv.weight.device if device is None else device
        dtype, heads, d = self.state_dtype, self.num_heads, self.head_dim
        weights = [w.to(device=device, dtype=dtype).unsqueeze(0).expand(batch_size, -1, -1, -1)
                   for w in self.initial_weights]
        empty = dict(device=device, dtype=dtype)
        return MemoryState(
            weights=weights,
            momentum=[torch.zeros_like(w) for w in weights],
            batch_start_weights=weights,
            conv_tail=torch.zeros(batch_size, self.conv_kernel - 1, 3 * heads * d, **empty),
            buffer_keys=torch.zeros(batch_size, heads, 0, d, **empty),
            buffer_values=torch.zeros(batch_size, heads, 0, d, **empty),
            buffer_lr=torch.zeros(batch_size, heads, 0, **empty),
            buffer_gate_logits=torch.zeros(batch_size, 0, 2 * heads, **empty),
            buffer_mask=torch.zeros(batch_size, 0, **empty),
            position=0,
        )

    def retrieve(self, hidden: Tensor, state: MemoryState) -> Tensor:
        """Read without writing: ``M_W(q)`` with the state's current weights for `hidden` [B or 1, M, hidden_size]
        that is not part of the stream (e.g. MAC's learned memory queries). Such tokens have no history, so only
        the convolution's current-token tap applies. Returns [B, M, H*d] in hidden's dtype."""
        rows, H, d, inner = state.batch_size, self.num_heads, self.head_dim, self.num_heads * self.head_dim
        if hidden.dim() != 3 or hidden.shape[-1] != self.hidden_size or hidden.shape[0] not in (1, rows):
            raise ValueError(f"NeuralMemory.retrieve: hidden must be [1 or {rows}, tokens, {self.hidden_size}], "
                             f"got {tuple(hidden.shape)}")
        x = self.norm(hidden.to(self.to_qkv.weight.dtype))
        q = F.linear(x, self.to_qkv.weight[:inner]).to(self.state_dtype)
        q = q * self.conv_weight[:inner, -1].to(self.state_dtype)
        q = F.normalize(F.silu(q.view(q.shape[0], -1, H, d).transpose(1, 2)), dim=-1).expand(rows, -1, -1, -1)
        read = self.model(state.weights, q)
        return read.transpose(1, 2).reshape(rows, -1, inner).to(hidden.dtype)

    def state_problem(self, state: MemoryState, batch_size: int) -> str | None:
        """What keeps `state` from continuing this memory's stream for `batch_size` rows, as "<field>: expected ...,
        got ...": the first field that is not what `init_state` makes for this memory (a list of one tensor per fast
        weight; tensors of its shapes, the buffers holding ``position % chunk_size`` tokens, in the state dtype), a
        `position` that is not a count of tokens, or a tensor holding NaN or inf; None when it can continue it.
        Shapes and dtypes are read without touching the values; finiteness is one reduction per tensor and one
        device sync for all of them."""
        position = state.position
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            return f"position: expected the number of tokens seen (an integer >= 0), got {position!r}"
        B, H, d, dtype = batch_size, self.num_heads, self.head_dim, self.state_dtype
        held = position % self.chunk_size  # tokens of the unfinished update chunk
        expected: list[tuple[str, Any, tuple[int, ...]]] = []
        for name in _LIST_FIELDS:
            tensors = getattr(state, name)
            if not isinstance(tensors, (list, tuple)) or len(tensors) != len(self.model.shapes):
                got = f"{len(tensors)} tensors" if isinstance(tensors, (list, tuple)) else f"a {type(tensors).__name__}"
                return (f"{name}: expected a list of {len(self.model.shapes)} tensor(s), one per fast weight of this "
                        f"memory ({self.memory_model}, depth {self.depth}), got {got}")
            expected += [(f"{name}[{i}]", tensor, (B, H, d_in, d_out))
                         for i, (tensor, (d_in, d_out)) in enumerate(zip(tensors, self.model.shapes))]
        expected += [("conv_tail", state.conv_tail, (B, self.conv_kernel - 1, 3 * H * d)),
                     ("buffer_keys", state.buffer_keys, (B, H, held, d)),
                     ("buffer_values", state.buffer_values, (B, H, held, d)),
                     ("buffer_lr", state.buffer_lr, (B, H, held)),
                     ("buffer_gate_logits", state.buffer_gate_logits, (B, held, 2 * H)),
                     ("buffer_mask", state.buffer_mask, (B, held))]
        for label, tensor, shape in expected:
            if not isinstance(tensor, Tensor) or tuple(tensor.shape) != shape or tensor.dtype != dtype:
                got = (f"a {tensor.dtype} tensor of shape {tuple(tensor.shape)}" if isinstance(tensor, Tensor)
                       else f"a {type(tensor).__name__}")
                why = "" if not label.startswith("buffer_") else (
                    f" (position {position} leaves {held} token(s) of an unfinished update chunk of {self.chunk_size})")
                return f"{label}: expected a {dtype} tensor of shape {shape}{why}, got {got}"
        present = [(label, tensor) for label, tensor, _ in expected if tensor.numel()]
        device = present[0][1].device
        finite = torch.stack([torch.isfinite(tensor).all().to(device) for _, tensor in present])
        if not bool(finite.all()):
            label = present[int((~finite).nonzero()[0])][0]
            return f"{label}: expected finite values, got NaN or infinite ones (a stream that diverged)"
        return None

    def token_inputs(self, hidden: Tensor, conv_tail: Tensor, mask: Tensor | None, real: Tensor
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """What each token of `hidden` [B, T, hidden_size] brings to the update rule: ``(q, k, v, theta,
        gate_logits, conv_tail)`` with q, k, v [B, H, T, d] (the convolution continuing from `conv_tail`, the
        previous tokens' K-1 projections), theta [B, H, T] (zero where `real` [B, T] is 0), the momentum and forget
        logits [B, T, 2H] (averaged per update chunk by the caller) and the new conv tail; all in the state dtype."""
        B, T, _ = hidden.shape
        H, d, dtype = self.num_heads, self.head_dim, self.state_dtype
        x = self.norm(hidden.to(self.to_qkv.weight.dtype))
        qkv = self.to_qkv(x).to(dtype)
        gates = self.to_gates(x).to(dtype)
        if mask is not None:
            qkv = qkv * real[..., None]

        # causal depthwise convolution, continuing from the previous call's last K-1 tokens
        seq = torch.cat([conv_tail, qkv], dim=1)
        conv_tail = seq[:, seq.shape[1] - (self.conv_kernel - 1):]
        qkv = _CausalDepthwiseConv.apply(seq, self.conv_weight.to(dtype))
        # silu and l2norm on the contiguous [B, T, 2H, d] block; q, k, v leave as [B, H, T, d] views
        qk = F.normalize(F.silu(qkv[..., :2 * H * d]).view(B, T, 2 * H, d), dim=-1)
        q, k = qk.view(B, T, 2, H, d).permute(2, 0, 3, 1, 4).unbind(0)
        v = qkv[..., 2 * H * d:].view(B, T, H, d).transpose(1, 2)
        lr = (self.max_lr * torch.sigmoid(gates[..., :H]) * real[..., None]).transpose(1, 2)  # [B, H, T]
        return q, k, v, lr, gates[..., H:], conv_tail

    # ---- the update rule ----

    def _clip_scale(self, grads: Sequence[Tensor]) -> Tensor | None:
        """The clip factor c / max(||G||, c) per row and chunk ([rows, n, 1, 1]; None without a clip)."""
        if self.max_surprise_norm is None:
            return None
        # vector_norm's backward is safe at 0 (a fully padded chunk), sqrt(sum of squares) would give NaN
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dim=(-2, -1)) for g in grads]), dim=0)
        return (self.max_surprise_norm / norm.clamp(min=self.max_surprise_norm))[..., None, None]

    @staticmethod
    def _step(weights, momentum, grads, scale, eta, keep, valid):
        """S_j = eta S_{j-1} - scale G_j, W_j = (1 - alpha) W_{j-1} + S_j; rows without real tokens keep their state."""
        if scale is None:
            new_momentum = [eta * s - g for s, g in zip(momentum, grads)]
        else:
            new_momentum = [torch.addcmul(eta * s, scale, g, value=-1) for s, g in zip(momentum, grads)]
        new_weights = [torch.addcmul(s, keep, w) for w, s in zip(weights, new_momentum)]
        return _keep_rows_without_tokens(new_weights, new_momentum, weights, momentum, valid)

    def _scan(self, q: Tensor, k: Tensor, v: Tensor, lr2: Tensor, etas: Sequence[Tensor], keeps: Sequence[Tensor],
              valids: Sequence[Tensor | None], weights: list[Tensor], momentum: list[Tensor], grad_point: list[Tensor],
              first_chunk: int) -> tuple[Tensor, list[Tensor], list[Tensor], list[Tensor]]:
        """Read and write `q`, `k`, `v` [rows, N, d] and ``2 theta`` [rows, N] chunk after chunk, from fast weights,
        momentum and gradient point (lists [rows, d_in, d_out]) at update chunk `first_chunk` of the stream, with the
        per-chunk gates `etas`, `keeps` and `valids` (one [rows, 1, 1] each, a valid None: every row). Returns the reads
        [rows, N, d] and the weights, momentum and gradient point after the last full chunk."""
        C, m, (BH, N, d) = self.chunk_size, self.chunks_per_batch, q.shape
        n_full, L = N // C, len(weights)
        # groups of consecutive full chunks that share one gradient point (the rest of a memory batch)
        groups, i = [], 0
        while i < n_full:
            groups.append(min(n_full - i, m - (first_chunk + i) % m))
            i += groups[-1]
        sizes = [n * C for n in groups] + ([N - n_full * C] if N > n_full * C else [])
        # cut with `split`: one backward node, where slicing zero-fills one full-size gradient per slice
        q_parts, k_parts, v_parts, lr2_parts = (t.split(sizes, dim=1) for t in (q, k, v, lr2))
        fused = isinstance(self.model, ExplicitMemoryModel)
        qk_parts = None
        if fused and m == 1 and n_full:  # every whole chunk one fused step: its [q; k] block, all cut at once
            whole = lambda t: t[:, :n_full * C].view(BH, n_full, C, d)  # noqa: E731
            qk_parts = torch.cat([whole(q), whole(k)], dim=2).unbind(1)
        reads, chunk = [], 0
        for g, n in enumerate(groups):
            if fused and n == 1 and grad_point is weights:  # the paper's rule: reads and surprise share W_{j-1}
                inputs = (*weights, *momentum, qk_parts[g] if qk_parts else torch.cat([q_parts[g], k_parts[g]], 1),
                          v_parts[g], lr2_parts[g], etas[chunk], keeps[chunk])
                if torch.is_grad_enabled():
                    out = _ChunkStep.apply(self.model, self.max_surprise_norm, *inputs)
                    read, new_weights, new_momentum = out[0], out[1:L + 1], out[L + 1:]
                else:
                    read, new_weights, new_momentum = _ChunkStep.step(self.model, self.max_surprise_norm, *inputs)[:3]
                reads.append(read)
                weights, momentum = _keep_rows_without_tokens(new_weights, new_momentum, weights, momentum,
                                                              valids[chunk])
            else:
                split = lambda t: t.unflatten(1, (n, C))  # noqa: E731
                grads = self.model.surprise(grad_point, split(k_parts[g]), split(v_parts[g]), split(lr2_parts[g]))
                scale = self._clip_scale(grads)
                grads = list(zip(*[g_.unbind(1) for g_ in grads]))
                scales = [None] * n if scale is None else scale.unbind(1)
                read_weights = []
                for j in range(n):
                    read_weights.append(weights)
                    weights, momentum = self._step(weights, momentum, grads[j], scales[j], etas[chunk + j],
                                                   keeps[chunk + j], valids[chunk + j])
                stacked = [torch.stack(ws, dim=1) for ws in zip(*read_weights)]
                reads.append(self.model(stacked, split(q_parts[g])).flatten(1, 2))
            chunk += n
            if (first_chunk + chunk) % m == 0:
                grad_point = weights
        if N > n_full * C:  # the unfinished chunk reads the latest weights and waits in the buffer
            reads.append(self.model(weights, q_parts[-1]))
        return torch.cat(reads, dim=1) if len(reads) > 1 else reads[0], weights, momentum, grad_point

    def _scan_affine(self, q: Tensor, k: Tensor, v: Tensor, lr2: Tensor, etas: Sequence[Tensor],
                     keeps: Sequence[Tensor], valids: Sequence[Tensor | None], weights: list[Tensor],
                     momentum: list[Tensor], grad_point: list[Tensor], first_chunk: int
                     ) -> tuple[Tensor, list[Tensor], list[Tensor], list[Tensor]]:
        """:meth:`_scan` for the linear memory ``M_W(z) = z + z W``: its surprise
        ``G_j = (diag(2 theta) K_j)^T (K_j - V_j + K_j W)`` is two products at the gradient point, and its reads are
        linear in the weights, so the scan writes (two products and a few [d, d] operations per update chunk) and the
        reads of all chunks are one product after it."""
        C, m, clip, N = self.chunk_size, self.chunks_per_batch, self.max_surprise_norm, q.shape[1]
        n_full = N // C
        (W,), (S,), (point,) = weights, momentum, grad_point
        whole = lambda t: t[:, :n_full * C].unflatten(1, (n_full, C))  # noqa: E731
        keys = whole(k)
        scaled_keys = (keys * whole(lr2).unsqueeze(-1)).transpose(-1, -2).unbind(1)
        residuals = (keys - whole(v)).unbind(1)
        keys = keys.unbind(1)
        read_weights = []
        for j in range(n_full):
            read_weights.append(W)
            G = torch.bmm(scaled_keys[j], torch.baddbmm(residuals[j], keys[j], point))
            if clip is None:
                new_S = etas[j] * S - G
            else:  # S' = eta S - clip G / max(||G||, clip)
                norm = torch.linalg.vector_norm(G, dim=(-2, -1), keepdim=True)
                new_S = torch.addcdiv(etas[j] * S, G, norm.clamp(min=clip), value=-clip)
            (W,), (S,) = _keep_rows_without_tokens([torch.addcmul(new_S, keeps[j], W)], [new_S], [W], [S], valids[j])
            if (first_chunk + j + 1) % m == 0:
                point = W
        reads = _linear_reads(q, read_weights, W, C)
        weights = [W]
        return reads, weights, [S], weights if point is W else [point]

    def _scan_delta(self, q: Tensor, k: Tensor, v: Tensor, lr2: Tensor, etas: Sequence[Tensor],
                    keeps: Sequence[Tensor], valids: Sequence[Tensor | None], weights: list[Tensor],
                    momentum: list[Tensor], grad_point: list[Tensor], first_chunk: int
                    ) -> tuple[Tensor, list[Tensor], list[Tensor], list[Tensor]]:
        """:meth:`_scan` for the delta rule (``update_rule="delta"``, the linear memory): every token of update chunk
        ``j`` takes its step ``W += beta_t k_t^T (v_t - k_t - k_t W)`` (``beta = 2 theta``) at the weights the
        tokens before it left, computed chunk-parallel in the WY form: ``U_j = P_j - Q_j W_{j-1}`` with
        ``[P_j, Q_j] = (I + tril(diag(beta) K_j K_j^T, -1))^-1 diag(beta) [V_j - K_j, K_j]`` solved for all chunks
        at once before the loop, then ``W_j = (1 - alpha_j) W_{j-1} + K_j^T U_j`` rescaled to norm
        ``max_memory_norm`` where it exceeds it. The loop holds two products a chunk; the reads of all chunks are one
        product after it. Momentum is not used (it stays as it came)."""
        C, cap, (N, d) = self.chunk_size, self.max_memory_norm, q.shape[1:]
        n_full = N // C
        (W,), (S,) = weights, momentum
        whole = lambda t: t[:, :n_full * C].unflatten(1, (n_full, C))  # noqa: E731
        keys, beta = whole(k), whole(lr2).unsqueeze(-1)
        lower = torch.tril(beta * (keys @ keys.transpose(-1, -2)), diagonal=-1)
        lower = lower + torch.eye(C, dtype=lower.dtype, device=lower.device)
        targets = beta * torch.cat([whole(v) - keys, keys], dim=-1)
        P, Q = torch.linalg.solve_triangular(lower, targets, upper=False, unitriangular=True).split(d, dim=-1)
        keys_t, P, Q = keys.transpose(-1, -2).unbind(1), P.unbind(1), Q.unbind(1)
        read_weights = []
        for j in range(n_full):
            read_weights.append(W)
            new_W = torch.addcmul(torch.bmm(keys_t[j], torch.baddbmm(P[j], Q[j], W, alpha=-1)), keeps[j], W)
            norm = torch.linalg.vector_norm(new_W, dim=(-2, -1), keepdim=True)
            new_W = new_W * (cap / norm.clamp(min=cap))
            (W,), _ = _keep_rows_without_tokens([new_W], [S], [W], [S], valids[j])
        reads = _linear_reads(q, read_weights, W, C)
        weights = [W]
        return reads, weights, [S], weights

    # ---- forward ----

    def forward(self, hidden: Tensor, state: MemoryState | None = None, mask: Tensor | None = None
                ) -> tuple[Tensor, MemoryState]:
        """Read then write `hidden` [B, T, hidden_size]; returns reads [B, T, H*d] in hidden's dtype and the state."""
        if hidden.dim() != 3 or hidden.shape[-1] != self.hidden_size or hidden.shape[1] < 1:
            raise ValueError(f"NeuralMemory: hidden must be [batch, tokens >= 1, {self.hidden_size}], "
                             f"got {tuple(hidden.shape)}")
        B, T, _ = hidden.shape
        if mask is not None and tuple(mask.shape) != (B, T):
            raise ValueError(f"NeuralMemory: mask must be [batch, tokens] = {(B, T)}, got {tuple(mask.shape)}")
        state = self.init_state(B, hidden.device) if state is None else state
        if state.batch_size != B:
            raise ValueError(f"NeuralMemory: state holds {state.batch_size} rows but hidden has {B}")
        H, d, C, dtype = self.num_heads, self.head_dim, self.chunk_size, self.state_dtype
        BH = B * H

        real = torch.ones(B, T, device=hidden.device, dtype=dtype) if mask is None else mask.to(dtype)
        q, k, v, lr, chunk_gate_logits, conv_tail = self.token_inputs(hidden, state.conv_tail, mask, real)
        written = lr.sum() / self.max_lr  # each token counted once, by the call that computed its theta

        # prepend the unfinished chunk's buffered tokens: they write now, but were read in the previous call
        r, gate_logits = state.buffer_keys.shape[2], chunk_gate_logits
        if r:
            k = torch.cat([state.buffer_keys, k], dim=2)
            v = torch.cat([state.buffer_values, v], dim=2)
            lr = torch.cat([state.buffer_lr, lr], dim=2)
            gate_logits = torch.cat([state.buffer_gate_logits, gate_logits], dim=1)
            real = torch.cat([state.buffer_mask, real], dim=1)
            q = F.pad(q, (0, 0, r, 0))  # r placeholder queries: those tokens were read last call
        N = r + T
        n_full = N // C

        # per-chunk momentum and forget gates from the mean logit over each chunk's real tokens
        chunk_real = real[:, : n_full * C].view(B, n_full, C)
        count = chunk_real.sum(-1)
        mean_logits = (gate_logits[:, : n_full * C].view(B, n_full, C, 2 * H) * chunk_real[..., None]).sum(2)
        gates = torch.sigmoid(mean_logits / count.clamp(min=1)[..., None]).transpose(1, 2)  # [B, 2H, n_full]
        etas = gates[:, :H].reshape(BH, n_full, 1, 1).unbind(1)
        keeps = (1 - gates[:, H:]).reshape(BH, n_full, 1, 1).unbind(1)
        valids = [None] * n_full
        # compiled, a mask always selects per row (a graph cannot branch on the values it computes)
        if mask is not None and (torch.compiler.is_compiling() or not bool((count > 0).all())):
            valids = (count > 0).repeat_interleave(H, dim=0).view(BH, n_full, 1, 1).unbind(1)

        # the memory's own arithmetic stays in the state dtype even under autocast (bf16 inner gradients and
        # updates lose the small steps that accumulate into what it remembers)
        flat = lambda ws: [w.reshape(BH, *w.shape[2:]) for w in ws]  # noqa: E731
        weights, momentum = flat(state.weights), flat(state.momentum)
        grad_point = weights if state.batch_start_weights is state.weights else flat(state.batch_start_weights)
        scan = self._scan_delta if self.update_rule == "delta" else self._scan_affine if self.affine else self._scan
        with torch.autocast(hidden.device.type, enabled=False):
            reads, weights, momentum, grad_point = scan(
                q.reshape(BH, N, d), k.reshape(BH, N, d), v.reshape(BH, N, d), (2 * lr).reshape(BH, N), etas, keeps,
                valids, weights, momentum, grad_point, state.position // C)
        out = reads[:, r:]
        out = out.view(B, H, T, d).transpose(1, 2).reshape(B, T, H * d).to(hidden.dtype)

        unflat = lambda ws: [w.view(B, H, *w.shape[1:]) for w in ws]  # noqa: E731
        new_weights = unflat(weights)
        rest = slice(n_full * C, N)
        new_state = MemoryState(
            weights=new_weights,
            momentum=unflat(momentum),
            batch_start_weights=new_weights if grad_point is weights else unflat(grad_point),
            conv_tail=conv_tail,
            buffer_keys=k[:, :, rest],
            buffer_values=v[:, :, rest],
            buffer_lr=lr[:, :, rest],
            buffer_gate_logits=gate_logits[:, rest],
            buffer_mask=real[:, rest],
            position=state.position + T,
            written=written,
        )
        return out, new_state


def _linear_reads(q: Tensor, read_weights: list[Tensor], W: Tensor, chunk: int) -> Tensor:
    """The linear memory's reads ``q + q W_j`` of queries `q` [rows, N, d]: the whole chunks' with the weights each
    started with (`read_weights`, one [rows, d, d] a chunk) as one batched product, an unfinished chunk's with `W`."""
    rows, N, d = q.shape
    n_full = len(read_weights)
    reads = []
    if n_full:
        queries = q[:, :n_full * chunk].unflatten(1, (n_full, chunk)).flatten(0, 1)
        stacked = torch.stack(read_weights, dim=1).flatten(0, 1)
        reads.append(torch.baddbmm(queries, queries, stacked).view(rows, n_full * chunk, d))
    if N > n_full * chunk:
        rest = q[:, n_full * chunk:]
        reads.append(torch.baddbmm(rest, rest, W))
    return torch.cat(reads, dim=1) if len(reads) > 1 else reads[0]


def _keep_rows_without_tokens(new_weights, new_momentum, weights, momentum, valid: Tensor | None):
    """A chunk without a single real token (padding only) leaves that row's weights and momentum untouched."""
    if valid is None:
        return list(new_weights), list(new_momentum)
    return ([torch.where(valid, n, o) for n, o in zip(new_weights, weights)],
            [torch.where(valid, n, o) for n, o in zip(new_momentum, momentum)])


class _CausalDepthwiseConv(torch.autograd.Function):
    """y_t = sum_i w[:, i] * x_{t+i} for x = [tail; tokens] in [B, T + K - 1, channels] layout: K shifted
    multiply-adds, with a backward that accumulates every tap into one gradient buffer."""

    @staticmethod
    def forward(ctx, seq: Tensor, taps: Tensor) -> Tensor:
        taps_by_offset = taps.t().contiguous()  # [K, channels]: each tap a contiguous row to broadcast
        K = taps.shape[1]
        T = seq.shape[1] - K + 1
        ctx.save_for_backward(seq, taps_by_offset)
        out = seq[:, K - 1:] * taps_by_offset[K - 1]
        for i in range(K - 1):
            out.addcmul_(seq[:, i:i + T], taps_by_offset[i])
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:
        seq, taps_by_offset = ctx.saved_tensors
        K, T = taps_by_offset.shape[0], grad.shape[1]
        g_seq = torch.zeros_like(seq)
        g_taps = torch.empty_like(taps_by_offset)
        for i in range(K):
            g_seq[:, i:i + T].addcmul_(grad, taps_by_offset[i])
            torch.sum(grad * seq[:, i:i + T], dim=(0, 1), out=g_taps[i])
        return g_seq, g_taps.t()


def _residual_matmul(base: Tensor, a: Tensor, w: Tensor) -> Tensor:
    """base + a @ w, fused into one kernel where the shapes allow."""
    return torch.baddbmm(base, a, w) if a.dim() == 3 else base + a @ w


def _chunks(t: Tensor, chunk: int) -> Tensor:
    """[rows, n * chunk, f] as [rows * n, chunk, f]: a view where the layout allows (always for contiguous t)."""
    return t if t.shape[1] == chunk else t.reshape(-1, chunk, t.shape[-1])


def _dots(xs: Sequence[Tensor], ys: Sequence[Tensor]) -> Tensor:
    """sum_i <x_i, y_i> per row of [rows, m, n] tensors, as [rows, 1, 1] (vecdot: a batched GEMV is much slower)."""
    total = None
    for x, y in zip(xs, ys):
        dot = torch.linalg.vecdot(x.flatten(1), y.flatten(1))
        total = dot if total is None else total.add_(dot)
    return total.view(-1, 1, 1)


class _ChunkStep(torch.autograd.Function):
    """One update chunk whose reads and surprise both use the current weights W (every chunk under the default
    ``batch_size = chunk_size``), as a single autograd node: an :class:`ExplicitMemoryModel`'s inner gradient, the
    clip and the update rule, and their reverse.

    Inputs ``(model, clip, *W, *S, [q; k], v, 2 theta, eta, 1 - alpha)``, rows = batch * heads; outputs
    ``(read, *W_new, *S_new)``. Queries and keys go through the model as one [2C, d] block. Saves the inputs, the
    error and (with a clip) G; the model recomputes its activations in the backward.
    """

    @staticmethod
    def step(model: ExplicitMemoryModel, clip: float | None, *tensors: Tensor
             ) -> tuple[Tensor, list[Tensor], list[Tensor], Tensor, list[Tensor], Tensor | None, Tensor | None]:
        """The forward arithmetic: ``(read, W_new, S_new, err, G, ||G||, scale)`` (the last two None without a
        clip). Called directly where no gradient is wanted (no autograd node to build or inputs to save)."""
        L = len(model.shapes)
        W, S = tensors[:L], tensors[L:2 * L]
        qk, values, lr2, eta, keep = tensors[2 * L:]
        reads, err, grads = model.inner_gradient(W, qk, values, lr2, values.shape[1])
        norm = scale = None
        if clip is not None:
            norm = _dots(grads, grads).sqrt_()
            scale = norm.clamp(min=clip).reciprocal_().mul_(clip)  # clip / max(||G||, clip)
            new_S = [torch.addcmul(eta * s, scale, g, value=-1) for s, g in zip(S, grads)]
        else:
            new_S = [torch.sub(eta * s, g) for s, g in zip(S, grads)]
        new_W = [torch.addcmul(s, keep, w) for w, s in zip(W, new_S)]
        return reads, new_W, new_S, err, grads, norm, scale

    @staticmethod
    def forward(ctx, model: ExplicitMemoryModel, clip: float | None, *tensors: Tensor) -> tuple[Tensor, ...]:
        L = len(model.shapes)
        reads, new_W, new_S, err, grads, norm, scale = _ChunkStep.step(model, clip, *tensors)
        W, S = tensors[:L], tensors[L:2 * L]
        qk, _, lr2, eta, keep = tensors[2 * L:]
        ctx.model, ctx.clip = model, clip
        ctx.save_for_backward(*W, *S, qk, lr2, eta, keep, err,
                              *((*grads, norm, scale) if clip is not None else ()))
        return (reads, *new_W, *new_S)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_read: Tensor | None, *g_out: Tensor | None) -> tuple[Tensor | None, ...]:
        model, clip = ctx.model, ctx.clip
        L, saved = len(model.shapes), ctx.saved_tensors
        W, S = saved[:L], saved[L:2 * L]
        qk, lr2, eta, keep, err = saved[2 * L:2 * L + 5]
        gW_new = [torch.zeros_like(w) if g is None else g for g, w in zip(g_out[:L], W)]
        gS_new = [torch.zeros_like(s) if g is None else g for g, s in zip(g_out[L:], S)]

        # W' = keep W + S', S' = eta S - scale G
        gS_total = [gs + gw for gs, gw in zip(gS_new, gW_new)]
        gW = [keep * g for g in gW_new]
        g_keep = _dots(gW_new, W)
        gS = [eta * g for g in gS_total]
        g_eta = _dots(gS_total, S)
        if clip is None:
            gG = [-g for g in gS_total]
        else:
            grads, (norm, scale) = saved[2 * L + 5:3 * L + 5], saved[3 * L + 5:]
            gG = [g * -scale for g in gS_total]
            g_scale = _dots(gS_total, grads).neg_()
            # scale = clip / norm where norm > clip: d scale / d G = -clip G / norm^3
            coef = torch.where(norm > clip, g_scale * -clip / norm.clamp(min=clip) ** 3, 0.0)
            gG = [g.addcmul_(coef, G) for g, G in zip(gG, grads)]

        g_qk, g_values, g_lr2 = model.inner_gradient_backward(W, qk, err, lr2, err.shape[1], g_read, gG, gW)
        return (None, None, *gW, *gS, g_qk, g_values, g_lr2, g_eta, g_keep)


class _Surprise(torch.autograd.Function):
    """The inner gradients of the n chunks of a memory batch at one shared point P, as a single autograd node.

    Inputs ``(model, C, *P, keys, values, 2 theta)`` with keys and values [rows, n * C, d]; outputs ``G`` per weight
    [rows * n, d_in, d_out]. Saves P, the keys and the error; the model recomputes its activations in the backward.
    """

    @staticmethod
    def forward(ctx, model: ExplicitMemoryModel, chunk: int, *tensors: Tensor) -> tuple[Tensor, ...]:
        point, (keys, values, lr2) = tensors[:-3], tensors[-3:]
        _, err, grads = model.inner_gradient(point, keys, values, lr2, chunk)
        ctx.model, ctx.chunk = model, chunk
        ctx.save_for_backward(*point, keys, err, lr2)
        return tuple(grads)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *g_grads: Tensor | None) -> tuple[Tensor | None, ...]:
        *point, keys, err, lr2 = ctx.saved_tensors
        gG = [torch.zeros(p.shape[0] * keys.shape[1] // ctx.chunk, *p.shape[1:], dtype=p.dtype, device=p.device)
              if g is None else g for g, p in zip(g_grads, point)]
        gP = [torch.zeros_like(p) for p in point]
        g_keys, g_values, g_lr2 = ctx.model.inner_gradient_backward(point, keys, err, lr2, ctx.chunk, None, gG, gP)
        return (None, None, *gP, g_keys, g_values, g_lr2)
