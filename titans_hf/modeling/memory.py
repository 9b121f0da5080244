"""Titans neural long-term memory (Behrouz et al. 2025, arXiv 2501.00663): an MLP whose weights learn at test time.

Exact definitions (the tests restate the token inputs, and :func:`.ops.naive` the update rules, token by token; `H`
heads of size `d`, all heads batched):

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
* Update chunk ``j`` = tokens ``[j*C, (j+1)*C)`` with ``C = memory_chunk_size``; memory batch ``b`` = chunks
  ``[b*m, (b+1)*m)`` with ``m = memory_batch_size // memory_chunk_size``. Surprise of chunk ``j`` (the gradient rule,
  ``update_rule="gradient"``): ``G_j = grad_W sum_{t in j} theta_t ||M_W(k_t) - v_t||^2`` at ``W = W_{b*m-1}``
  (weights before its batch; with the default ``memory_batch_size = memory_chunk_size`` this is ``W_{j-1}``), clipped
  per head:
  ``G_j *= c / max(||G_j||, c)`` with ``||G_j||`` the norm over all layers and ``c = max_surprise_norm``.
  ``S_j = eta_j S_{j-1} - G_j``; ``W_j = (1 - alpha_j) W_{j-1} + S_j``; ``S_{-1} = 0``, ``W_{-1}`` = initial weights.
  A chunk without any real token leaves ``S`` and ``W`` unchanged.
* The delta rule (``update_rule="delta"``, linear memory only, the config's default): every token takes its own step
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
* Initial gate biases: :class:`NeuralMemory`'s own defaults, for the module alone, are those of Titans' gradient rule
  (``theta_bias_init`` -2, ``momentum_bias_init`` 0, ``forget_bias_init`` -4): small steps, since a chunk's summed
  gradient multiplies the step by the chunk length; the surprise clip then bounds every update, so
  ``||W_j|| <= ||W_{-1}|| + c / ((1 - max eta) min alpha)`` per head. A model's memories take the biases
  `TitansMemoryConfig` resolves instead: ``theta_bias_init`` -6 with the delta rule and -2 with the gradient rule,
  ``forget_bias_init`` -30 (no forgetting) with both; ``momentum_bias_init`` stays 0 (no config field).

The update rules are ops of one signature in :mod:`titans_hf.modeling.ops` (``gradient``, ``gradient_linear``,
``delta``, and the reference ``naive``); a `NeuralMemory` binds its rule's op once, when it is built, from
:data:`~.ops.UPDATE_OPS`, where a device kernel of the same signature may take the place of torch's.

A memory model is a :class:`MemoryModel`: weight shapes, init and ``M_W(z)``; its inner gradients then come from
autograd. An :class:`ExplicitMemoryModel` (the MLP) writes the inner gradient and its reverse out as batched
matmuls, so each update chunk runs as one autograd node (``ops._ChunkStep``) and the surprise of a memory batch as
another (:class:`_Surprise`); all heads, and all chunks of a memory batch, run as single matmuls either way. At depth 1
(``M_W(z) = z + z W``, the config's default) the surprise is affine in ``W`` and the reads are linear in it: the stream
then runs as a scan that only writes, and every chunk's reads are one product after it (``ops.gradient_linear``; the
delta rule's ``ops.delta`` solves each chunk's triangular system for all chunks before its loop, the WY form of
DeltaNet's chunkwise algorithm).
State is fp32 (fp64 when the module is fp64) whatever the activation dtype, and everything needed to continue
mid-chunk lives in :class:`MemoryState`, so feeding the tokens in any pieces gives the same reads and state as one
pass.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .ops import UPDATE_OPS, UpdateSettings

_LIST_FIELDS = ("weights", "momentum", "batch_start_weights")
_TENSOR_FIELDS = ("conv_tail", "buffer_keys", "buffer_values", "buffer_lr", "buffer_gate_logits", "buffer_mask")


@dataclass
class MemoryState:
    """Everything the memory needs to continue a stream exactly where it stopped.

    The buffers hold the ``position % memory_chunk_size`` tokens of the update chunk that has started but not finished:
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
    # the update rule whose memory made this state (its fast weights mean something under that rule alone): a memory
    # of another rule refuses it (`NeuralMemory.state_problem`); None where unknown (read back by `from_state_dict`)
    update_rule: str | None = None

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
            update_rule=self.update_rule,
        )

    def detach(self) -> "MemoryState":
        """Cut the autograd graph (truncated BPTT): values kept, history forgotten."""
        return self._map(Tensor.detach)

    def select(self, index: Tensor | list[int]) -> "MemoryState":
        """Rows `index` of the batch, e.g. to reorder beams or expand a prompt to several samples."""
        index = torch.as_tensor(index, dtype=torch.long, device=self.conv_tail.device)
        return self._map(lambda t: t.index_select(0, index))

    def with_rows_from(self, other: "MemoryState", rows: Tensor) -> "MemoryState":
        """This state with `other`'s fast weights and momentum (what a row's memory learnt) in the rows where `rows`
        ([batch] bool) is true, State Passing's mix: the convolution tail, the buffers and the position stay this
        state's, since a row that keeps its memory still starts a new text. `other`'s rows line up with this state's
        from the first; it may hold more (the rest are not read) or fewer (rows past its count cannot be taken)."""
        count = self.batch_size
        if tuple(rows.shape) != (count,) or bool(rows[other.batch_size:].any()):
            raise ValueError(f"MemoryState.with_rows_from: rows must be a mask of this state's {count} rows, marking "
                             f"none past the other state's {other.batch_size}; got {rows.tolist()}")

        def mixed(mine: list[Tensor], theirs: list[Tensor]) -> list[Tensor]:
            out = []
            for new, old in zip(mine, theirs):
                taken = rows.to(new.device).view(-1, *[1] * (new.dim() - 1))
                old = (torch.cat([old[:count].to(new.dtype), new[old.shape[0]:].detach()]) if old.shape[0] < count
                       else old[:count])
                out.append(torch.where(taken, old.to(new.dtype), new))
            return out

        weights = mixed(self.weights, other.weights)
        shared = self.batch_start_weights is self.weights
        return replace(self, weights=weights, momentum=mixed(self.momentum, other.momentum),
                       batch_start_weights=weights if shared else mixed(self.batch_start_weights,
                                                                        other.batch_start_weights))

    @classmethod
    def concatenated(cls, states: Sequence["MemoryState"]) -> "MemoryState":
        """The rows of `states` (all at one position) one after another in one batch."""
        shared = all(state.batch_start_weights is state.weights for state in states)
        lists = {name: [torch.cat(layer) for layer in zip(*(getattr(state, name) for state in states))]
                 for name in _LIST_FIELDS if not (shared and name == "batch_start_weights")}
        return cls(**lists, batch_start_weights=lists["weights"] if shared else lists["batch_start_weights"],
                   **{name: torch.cat([getattr(state, name) for state in states]) for name in _TENSOR_FIELDS},
                   position=states[0].position, update_rule=states[0].update_rule)

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
        expected = {f.name for f in fields(cls)} - {"written", "update_rule"}
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


# ---- memory models ----
# Fast weights are lists of [rows, d_in, d_out] tensors, rows = batch * heads, so every product is one bmm; where a
# memory batch reads with several chunks' weights at once they carry a chunk axis after rows ([rows, n, d_in, d_out]
# with inputs [rows, n, tokens, d]).


class MemoryModel(ABC):
    """The function ``M_W`` each head's memory learns, of fast weights ``W``.

    A subclass sets :attr:`shapes` in ``__init__(head_dim, depth, expansion)`` (it may ignore depth and expansion)
    and defines ``__call__``; :meth:`surprise` then takes the inner gradients by autograd, and every update chunk runs
    the memory-batch path of :func:`.ops.gradient`. Add it to :data:`MEMORY_MODELS` to select it by name.
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
    reads and surprise share the current weights then runs as one autograd node (``ops._ChunkStep``), and the
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


def _registered(registry: dict[str, Any], argument: str, name: str) -> Any:
    """``registry[name]``; a name it lacks is a ValueError naming `argument` and the registered names."""
    if name not in registry:
        raise ValueError(f"NeuralMemory: {argument} must be one of {sorted(registry)}, got {name!r}")
    return registry[name]


class NeuralMemory(nn.Module):
    """Multi-head Titans memory: ``forward(hidden, state) -> (reads, new_state)``; no output projection (the model
    owns it). See the module docstring for the exact math.

    The arguments carry the names of the `TitansMemoryConfig` fields they come from and take the values the config
    resolved and checked (the variants pass them); nothing here checks them again: sizes >= 1, a `memory_batch_size`
    that is a multiple of `memory_chunk_size`, `conv_init`, ``max_lr > 0`` and each rule's limits (the delta rule: the
    linear memory, no memory batch, ``max_lr <= 0.5``, a `max_memory_norm`) are the config's. Refused here is only
    what the module cannot be built without: a `memory_model` that is no key of :data:`MEMORY_MODELS` (the function
    each head learns), an `update_rule` that is no key of :data:`~.ops.UPDATE_OPS` (the rule whose op the memory
    binds once, here: a kernel set there, else torch's), and a rule without an op for this memory (the delta rule on
    any memory but the linear one, `memory_depth` 1).

    The keyword defaults are the standalone module's, with which the tests build it: Titans' gradient rule on a
    depth-2 MLP, ``max_lr`` 0.1, the identity convolution and gate biases -2 (write), 0 (momentum), -4 (forget). A
    model's memories take the config's instead, which differ: the delta rule on the linear memory, ``max_lr`` 0.5,
    the window convolution, ``forget_bias_init`` -30 and each rule's own `theta_bias_init` and `max_memory_norm`
    (see `TitansMemoryConfig`). `max_surprise_norm` (the gradient rule's clip) and `momentum_bias_init` are no config
    fields: a model's memories take their defaults here."""

    def __init__(
        self,
        hidden_size: int,
        memory_num_heads: int,
        memory_head_dim: int,
        memory_depth: int = 2,
        memory_expansion: int = 4,
        conv_kernel: int = 4,
        conv_init: str = "identity",
        memory_chunk_size: int = 64,
        memory_batch_size: int | None = None,
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
        if max_surprise_norm is not None and not max_surprise_norm > 0:
            raise ValueError(f"NeuralMemory: max_surprise_norm must be > 0 or None, got {max_surprise_norm}")
        memory_batch_size = memory_chunk_size if memory_batch_size is None else memory_batch_size
        self.hidden_size, self.memory_num_heads, self.memory_head_dim = hidden_size, memory_num_heads, memory_head_dim
        self.memory_depth, self.conv_kernel, self.conv_init = memory_depth, conv_kernel, conv_init
        self.memory_chunk_size, self.memory_batch_size = memory_chunk_size, memory_batch_size
        self.memory_model = memory_model
        # the memory model M_W, the function each head learns (not an nn.Module: its weights are the state's)
        memory_model_class = _registered(MEMORY_MODELS, "memory_model", memory_model)
        self.memory_function = memory_model_class(memory_head_dim, memory_depth, memory_expansion)
        # M_W(z) = z + z W: the surprise is affine in W, and the gradient rule runs as ops.gradient_linear
        self.affine = isinstance(self.memory_function, MLPMemory) and len(self.memory_function.shapes) == 1
        self.max_lr, self.max_surprise_norm = max_lr, max_surprise_norm
        self.update_rule, self.max_memory_norm = update_rule, max_memory_norm
        self.update_op = _registered(UPDATE_OPS, "update_rule", update_rule).bind(linear_memory=self.affine)
        self.update_settings = UpdateSettings(
            memory_function=self.memory_function, update_rule=update_rule, memory_chunk_size=memory_chunk_size,
            chunks_per_batch=memory_batch_size // memory_chunk_size, max_surprise_norm=max_surprise_norm,
            max_memory_norm=max_memory_norm,
            explicit_gradient=isinstance(self.memory_function, ExplicitMemoryModel))
        self.bias_init = (theta_bias_init, momentum_bias_init, forget_bias_init)
        inner = memory_num_heads * memory_head_dim

        self.norm = nn.RMSNorm(hidden_size, eps=norm_eps)
        self.to_qkv = nn.Linear(hidden_size, 3 * inner, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(3 * inner, conv_kernel))
        self.to_gates = nn.Linear(hidden_size, 3 * memory_num_heads)
        self.initial_weights = nn.ParameterList(
            nn.Parameter(torch.empty(memory_num_heads, d_in, d_out))
            for d_in, d_out in self.memory_function.shapes
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
            # shifted: a key starts as the mean of the kernel - 1 tokens before its own, a query as the mean of the
            # kernel - 1 tokens up to its own, so a read returns the value (the token) that followed the same
            # context when it was written: the next token of a copied span (a passkey's digits).
            self.conv_weight.zero_()
            self.conv_weight[:, -1] = 1.0
            inner, kernel = self.memory_num_heads * self.memory_head_dim, self.conv_kernel
            if self.conv_init == "window":
                self.conv_weight[: 2 * inner] = 1.0 / kernel
            elif self.conv_init == "shifted":
                self.conv_weight[: 2 * inner] = 0.0
                self.conv_weight[:inner, 1:] = 1.0 / (kernel - 1)
                self.conv_weight[inner : 2 * inner, :-1] = 1.0 / (kernel - 1)
            nn.init.normal_(self.to_gates.weight, std=self.hidden_size**-0.5)
            bias = self.to_gates.bias.view(3, self.memory_num_heads)
            for row, value in zip(bias, self.bias_init):
                row.fill_(value)
            self.memory_function.init_weights(self.initial_weights)

    @property
    def state_dtype(self) -> torch.dtype:
        return torch.float64 if self.to_qkv.weight.dtype == torch.float64 else torch.float32

    def init_state(self, batch_size: int, device: torch.device | str | None = None) -> MemoryState:
        """Fresh state; its weights stay connected to `initial_weights`, so the outer loss trains them."""
        device = self.to_qkv.weight.device if device is None else device
        dtype, heads, d = self.state_dtype, self.memory_num_heads, self.memory_head_dim
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
            update_rule=self.update_rule,
        )

    def retrieve(self, hidden: Tensor, state: MemoryState) -> Tensor:
        """Read without writing: ``M_W(q)`` with the state's current weights for `hidden` [B or 1, M, hidden_size]
        that is not part of the stream (e.g. MAC's learned memory queries). Such tokens have no history, so only
        the convolution's current-token tap applies. Returns [B, M, H*d] in hidden's dtype."""
        rows, H, d = state.batch_size, self.memory_num_heads, self.memory_head_dim
        inner = H * d
        if hidden.dim() != 3 or hidden.shape[-1] != self.hidden_size or hidden.shape[0] not in (1, rows):
            raise ValueError(f"NeuralMemory.retrieve: hidden must be [1 or {rows}, tokens, {self.hidden_size}], "
                             f"got {tuple(hidden.shape)}")
        x = self.norm(hidden.to(self.to_qkv.weight.dtype))
        q = F.linear(x, self.to_qkv.weight[:inner]).to(self.state_dtype)
        q = q * self.conv_weight[:inner, -1].to(self.state_dtype)
        q = F.normalize(F.silu(q.view(q.shape[0], -1, H, d).transpose(1, 2)), dim=-1).expand(rows, -1, -1, -1)
        read = self.memory_function(state.weights, q)
        return read.transpose(1, 2).reshape(rows, -1, inner).to(hidden.dtype)

    def state_problem(self, state: MemoryState, batch_size: int) -> str | None:
        """What keeps `state` from continuing this memory's stream for `batch_size` rows, as "<field>: expected ...,
        got ...": the first field that is not what `init_state` makes for this memory (a list of one tensor per fast
        weight; tensors of its shapes, the buffers holding ``position % memory_chunk_size`` tokens, in the state
        dtype), a `position` that is not a count of tokens, a state another update rule's memory made (whose fast
        weights mean something under that rule alone), or a tensor holding NaN or inf; None when it can continue it.
        Shapes and dtypes are read without touching the values; finiteness is one reduction per tensor and one device
        sync for all of them."""
        position = state.position
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            return f"position: expected the number of tokens seen (an integer >= 0), got {position!r}"
        B, H, d, dtype = batch_size, self.memory_num_heads, self.memory_head_dim, self.state_dtype
        held = position % self.memory_chunk_size  # tokens of the unfinished update chunk
        expected: list[tuple[str, Any, tuple[int, ...]]] = []
        for name in _LIST_FIELDS:
            tensors = getattr(state, name)
            if not isinstance(tensors, (list, tuple)) or len(tensors) != len(self.memory_function.shapes):
                got = f"{len(tensors)} tensors" if isinstance(tensors, (list, tuple)) else f"a {type(tensors).__name__}"
                return (f"{name}: expected a list of {len(self.memory_function.shapes)} tensor(s), one per fast "
                        f"weight of this memory ({self.memory_model}, depth {self.memory_depth}), got {got}")
            expected += [(f"{name}[{i}]", tensor, (B, H, d_in, d_out))
                         for i, (tensor, (d_in, d_out)) in enumerate(zip(tensors, self.memory_function.shapes))]
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
                    f" (position {position} leaves {held} token(s) of an unfinished update chunk of "
                    f"{self.memory_chunk_size})")
                return f"{label}: expected a {dtype} tensor of shape {shape}{why}, got {got}"
        if state.update_rule is not None and state.update_rule != self.update_rule:
            return (f"update_rule: expected a state of this memory's update_rule={self.update_rule!r}, got one made by "
                    f"a memory of update_rule={state.update_rule!r}")
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
        H, d, dtype = self.memory_num_heads, self.memory_head_dim, self.state_dtype
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
        H, d, C, dtype = self.memory_num_heads, self.memory_head_dim, self.memory_chunk_size, self.state_dtype
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
        with torch.autocast(hidden.device.type, enabled=False):
            reads, weights, momentum, grad_point = self.update_op(
                q.reshape(BH, N, d), k.reshape(BH, N, d), v.reshape(BH, N, d), (2 * lr).reshape(BH, N), etas, keeps,
                valids, weights, momentum, grad_point, state.position // C, self.update_settings)
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
            update_rule=self.update_rule,
        )
        return out, new_state


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


class _Surprise(torch.autograd.Function):
    """The inner gradients of the n chunks of a memory batch at one shared point P, as a single autograd node.

    Inputs ``(memory_function, C, *P, keys, values, 2 theta)`` with keys and values [rows, n * C, d]; outputs ``G``
    per weight [rows * n, d_in, d_out]. Saves P, the keys and the error; the memory model recomputes its activations
    in the backward.
    """

    @staticmethod
    def forward(ctx, memory_function: ExplicitMemoryModel, chunk: int, *tensors: Tensor) -> tuple[Tensor, ...]:
        point, (keys, values, lr2) = tensors[:-3], tensors[-3:]
        _, err, grads = memory_function.inner_gradient(point, keys, values, lr2, chunk)
        ctx.memory_function, ctx.chunk = memory_function, chunk
        ctx.save_for_backward(*point, keys, err, lr2)
        return tuple(grads)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *g_grads: Tensor | None) -> tuple[Tensor | None, ...]:
        *point, keys, err, lr2 = ctx.saved_tensors
        gG = [torch.zeros(p.shape[0] * keys.shape[1] // ctx.chunk, *p.shape[1:], dtype=p.dtype, device=p.device)
              if g is None else g for g, p in zip(g_grads, point)]
        gP = [torch.zeros_like(p) for p in point]
        g_keys, g_values, g_lr2 = ctx.memory_function.inner_gradient_backward(point, keys, err, lr2, ctx.chunk,
                                                                              None, gG, gP)
        return (None, None, *gP, g_keys, g_values, g_lr2)
