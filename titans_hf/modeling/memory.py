"""Titans neural long-term memory (Behrouz et al. 2025, arXiv 2501.00663): an MLP whose weights learn at test time.

Exact definitions (the tests' reference loop restates them; `H` heads of size `d`, all heads batched):

* ``x_t = RMSNorm(h_t) = h_t / sqrt(mean(h_t**2) + eps) * g`` (learned ``g``).
* ``[q, k, v]_t = causal_depthwise_conv(x W_qkv)_t``: per channel ``c``,
  ``y_t[c] = sum_{i<K} w[c, i] * u_{t-K+1+i}[c]`` with ``u`` zero before the first token (and zero on padding tokens),
  ``K = conv_kernel``. Then ``q = l2norm(silu(q))``, ``k = l2norm(silu(k))`` per head, ``v`` as is, where
  ``l2norm(z) = z / max(||z||_2, 1e-12)`` (``F.normalize``).
* Memory ``M_W`` per head, depth ``L`` (hidden width ``expansion * d``): ``a_0 = z``, ``a_l = silu(a_{l-1} W_l)`` for
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
* Read: token ``t`` of chunk ``j`` returns ``M_{W_{j-1}}(q_t)``: only strictly earlier chunks wrote what it reads.

The inner gradients are written out as batched matmuls (explicit backprop through the MLP) rather than
``torch.func``, so one ordinary autograd graph carries the outer loss through every update, and all heads and all
chunks of a memory batch run as single matmuls. State is fp32 (fp64 when the module is fp64) whatever the
activation dtype, and everything needed to continue mid-chunk lives in :class:`MemoryState`, so feeding the tokens
in any pieces gives the same reads and state as one pass.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

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
        expected = {f.name for f in fields(cls)}
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


class NeuralMemory(nn.Module):
    """Multi-head Titans memory: ``forward(hidden, state) -> (reads, new_state)``; no output projection (the model
    owns it). See the module docstring for the exact math."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        depth: int = 2,
        expansion: int = 4,
        conv_kernel: int = 4,
        chunk_size: int = 64,
        batch_size: int | None = None,
        max_lr: float = 0.1,
        max_surprise_norm: float | None = 1.0,
        theta_bias_init: float = -2.0,
        momentum_bias_init: float = 0.0,
        forget_bias_init: float = -4.0,
        norm_eps: float = 1e-6,
    ):
        super().__init__()
        for name, value in dict(hidden_size=hidden_size, num_heads=num_heads, head_dim=head_dim, depth=depth,
                                expansion=expansion, conv_kernel=conv_kernel, chunk_size=chunk_size).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"NeuralMemory: {name} must be a positive integer, got {value!r}")
        batch_size = chunk_size if batch_size is None else batch_size
        if batch_size < chunk_size or batch_size % chunk_size:
            raise ValueError(f"NeuralMemory: batch_size ({batch_size}) must be a multiple of chunk_size ({chunk_size})")
        if not max_lr > 0:
            raise ValueError(f"NeuralMemory: max_lr must be > 0, got {max_lr}")
        if max_surprise_norm is not None and not max_surprise_norm > 0:
            raise ValueError(f"NeuralMemory: max_surprise_norm must be > 0 or None, got {max_surprise_norm}")
        self.hidden_size, self.num_heads, self.head_dim, self.depth = hidden_size, num_heads, head_dim, depth
        self.conv_kernel, self.chunk_size, self.batch_size = conv_kernel, chunk_size, batch_size
        self.chunks_per_batch = batch_size // chunk_size
        self.max_lr, self.max_surprise_norm = max_lr, max_surprise_norm
        self.bias_init = (theta_bias_init, momentum_bias_init, forget_bias_init)
        inner = num_heads * head_dim

        self.norm = nn.RMSNorm(hidden_size, eps=norm_eps)
        self.to_qkv = nn.Linear(hidden_size, 3 * inner, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(3 * inner, conv_kernel))
        self.to_gates = nn.Linear(hidden_size, 3 * num_heads)
        dims = [head_dim] + [head_dim * expansion] * (depth - 1) + [head_dim]
        self.initial_weights = nn.ParameterList(
            nn.Parameter(torch.empty(num_heads, d_in, d_out)) for d_in, d_out in zip(dims[:-1], dims[1:])
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise everything; models whose `_init_weights` re-initialise Linears should call this afterwards,
        since the negative gate biases are what keep the first updates stable."""
        self.norm.reset_parameters()
        self.to_qkv.reset_parameters()
        with torch.no_grad():
            # identity convolution at init: q, k, v start as the plain projections, the other taps are learned
            self.conv_weight.zero_()
            self.conv_weight[:, -1] = 1.0
            nn.init.normal_(self.to_gates.weight, std=self.hidden_size**-0.5)
            bias = self.to_gates.bias.view(3, self.num_heads)
            for row, value in zip(bias, self.bias_init):
                row.fill_(value)
            for weight in self.initial_weights:
                nn.init.normal_(weight, std=weight.shape[1] ** -0.5)

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

    # ---- the MLP, its explicit backward, and the update rule ----

    @staticmethod
    def _mlp(weights: list[Tensor], z: Tensor) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """M_W(z), plus each layer's input and each hidden layer's sigmoid (what the inner backward needs)."""
        inputs, sigmoids, a = [], [], z
        for w in weights[:-1]:
            inputs.append(a)
            pre = a @ w
            s = torch.sigmoid(pre)
            sigmoids.append((pre, s))
            a = pre * s
        inputs.append(a)
        return z + a @ weights[-1], inputs, sigmoids

    @staticmethod
    def _inner_grads(weights: list[Tensor], inputs: list[Tensor], sigmoids: list, delta: Tensor) -> list[Tensor]:
        """grad_W of sum_t <delta_t, M_W(z_t)>: backprop written out; the token axis (-2) is summed by the matmuls."""
        grads = [inputs[-1].transpose(-1, -2) @ delta]
        for layer in range(len(weights) - 2, -1, -1):
            pre, s = sigmoids[layer]
            delta = (delta @ weights[layer + 1].transpose(-1, -2)) * (s * (1 + pre * (1 - s)))  # silu'
            grads.append(inputs[layer].transpose(-1, -2) @ delta)
        return grads[::-1]

    def _clip(self, grads: list[Tensor]) -> list[Tensor]:
        if self.max_surprise_norm is None:
            return grads
        # vector_norm's backward is safe at 0 (a fully padded chunk), sqrt(sum of squares) would give NaN
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dim=(-2, -1)) for g in grads]), dim=0)
        scale = (self.max_surprise_norm / norm.clamp(min=self.max_surprise_norm))[..., None, None]
        return [g * scale for g in grads]

    @staticmethod
    def _step(weights, momentum, grads, eta, alpha, valid):
        """S_j = eta S_{j-1} - G_j, W_j = (1 - alpha) W_{j-1} + S_j; rows with no real token keep their state."""
        eta, keep = eta[..., None, None], (1 - alpha)[..., None, None]
        new_momentum = [eta * s - g for s, g in zip(momentum, grads)]
        new_weights = [keep * w + s for w, s in zip(weights, new_momentum)]
        if valid is not None:
            v = valid[:, None, None, None]
            new_momentum = [torch.where(v, n, o) for n, o in zip(new_momentum, momentum)]
            new_weights = [torch.where(v, n, o) for n, o in zip(new_weights, weights)]
        return new_weights, new_momentum

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

        x = self.norm(hidden.to(self.to_qkv.weight.dtype))
        qkv = self.to_qkv(x).to(dtype)
        gates = self.to_gates(x).to(dtype)
        real = torch.ones(B, T, device=hidden.device, dtype=dtype) if mask is None else mask.to(dtype)
        if mask is not None:
            qkv = qkv * real[..., None]

        # causal depthwise convolution, continuing from the previous call's last K-1 tokens
        seq = torch.cat([state.conv_tail, qkv], dim=1)
        conv_tail = seq[:, seq.shape[1] - (self.conv_kernel - 1):]
        qkv = F.conv1d(seq.transpose(1, 2), self.conv_weight.to(dtype).unsqueeze(1), groups=qkv.shape[-1])
        q, k, v = qkv.view(B, 3, H, d, T).permute(1, 0, 2, 4, 3)  # each [B, H, T, d]
        q, k = F.normalize(F.silu(q), dim=-1), F.normalize(F.silu(k), dim=-1)
        lr = (self.max_lr * torch.sigmoid(gates[..., :H]) * real[..., None]).transpose(1, 2)  # [B, H, T]

        # prepend the unfinished chunk's buffered tokens: they write now, but were read in the previous call
        r = state.buffer_keys.shape[2]
        k = torch.cat([state.buffer_keys, k], dim=2)
        v = torch.cat([state.buffer_values, v], dim=2)
        lr = torch.cat([state.buffer_lr, lr], dim=2)
        gate_logits = torch.cat([state.buffer_gate_logits, gates[..., H:]], dim=1)
        real = torch.cat([state.buffer_mask, real], dim=1)
        q = F.pad(q, (0, 0, r, 0))
        N = r + T
        n_full = N // C

        # per-chunk momentum and forget gates from the mean logit over each chunk's real tokens
        chunk_real = real[:, : n_full * C].view(B, n_full, C)
        count = chunk_real.sum(-1)
        mean_logits = (gate_logits[:, : n_full * C].view(B, n_full, C, 2 * H) * chunk_real[..., None]).sum(2)
        mean_logits = mean_logits / count.clamp(min=1)[..., None]
        eta, alpha = torch.sigmoid(mean_logits).transpose(1, 2).split(H, dim=1)  # each [B, H, n_full]
        valid = None if mask is None or bool((count > 0).all()) else count > 0  # [B, n_full]

        weights, momentum, grad_point = state.weights, state.momentum, state.batch_start_weights
        first_chunk, m = state.position // C, self.chunks_per_batch
        reads, i = [], 0
        while i < n_full:
            end = min(n_full, i + m - (first_chunk + i) % m)  # chunks i..end share one gradient point
            rows = slice(i * C, end * C)
            if end - i == 1 and grad_point is weights:
                # reads and the inner gradient use the same weights: one MLP pass over [q; k]
                out, inputs, sigmoids = self._mlp(weights, torch.cat([q[:, :, rows], k[:, :, rows]], dim=2))
                reads.append(out[:, :, :C])
                delta = 2 * lr[:, :, rows, None] * (out[:, :, C:] - v[:, :, rows])
                grads = self._inner_grads(weights, [a[:, :, C:] for a in inputs],
                                          [(p[:, :, C:], s[:, :, C:]) for p, s in sigmoids], delta)
                weights, momentum = self._step(weights, momentum, self._clip(grads), eta[..., i], alpha[..., i],
                                               None if valid is None else valid[:, i])
            else:
                n = end - i
                point = [w.unsqueeze(2) for w in grad_point]
                out, inputs, sigmoids = self._mlp(point, k[:, :, rows].unflatten(2, (n, C)))
                delta = 2 * lr[:, :, rows].unflatten(2, (n, C))[..., None] * (out - v[:, :, rows].unflatten(2, (n, C)))
                grads = self._clip(self._inner_grads(point, inputs, sigmoids, delta))  # each [B, H, n, d_in, d_out]
                read_weights = []
                for j in range(n):
                    read_weights.append(weights)
                    weights, momentum = self._step(weights, momentum, [g[:, :, j] for g in grads], eta[..., i + j],
                                                   alpha[..., i + j], None if valid is None else valid[:, i + j])
                stacked = [torch.stack(ws, dim=2) for ws in zip(*read_weights)]
                reads.append(self._mlp(stacked, q[:, :, rows].unflatten(2, (n, C)))[0].flatten(2, 3))
            if (first_chunk + end) % m == 0:
                grad_point = weights
            i = end
        if N > n_full * C:  # the unfinished chunk reads the latest weights and waits in the buffer
            reads.append(self._mlp(weights, q[:, :, n_full * C:])[0])
        out = torch.cat(reads, dim=2)[:, :, r:] if len(reads) > 1 else reads[0][:, :, r:]
        out = out.transpose(1, 2).reshape(B, T, H * d).to(hidden.dtype)

        rest = slice(n_full * C, N)
        new_state = MemoryState(
            weights=weights,
            momentum=momentum,
            batch_start_weights=grad_point,
            conv_tail=conv_tail,
            buffer_keys=k[:, :, rest],
            buffer_values=v[:, :, rest],
            buffer_lr=lr[:, :, rest],
            buffer_gate_logits=gate_logits[:, rest],
            buffer_mask=real[:, rest],
            position=state.position + T,
        )
        return out, new_state
