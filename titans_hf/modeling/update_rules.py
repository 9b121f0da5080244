"""What the memory config knows of each update rule: its defaults, its limits and the memories it runs on.

Torch-free, so that the config reads it without importing model code (as a transformers config imports no model);
each entry of :data:`~.ops.UPDATE_OPS` carries its rule's entry here beside the rule's implementations. Adding a rule
is an entry in :data:`UPDATE_RULES` and its line in ``UPDATE_OPS``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class UpdateRule:
    """One update rule's settings, as `TitansMemoryConfig` resolves and checks them.

    Args:
        name: the rule, as `update_rule` spells it (its key in :data:`UPDATE_RULES` and in ``ops.UPDATE_OPS``).
        theta_bias_init: the write gate's initial bias the rule was measured with (docs/length.md): the config's
            `theta_bias_init` when it is left None.
        write_cost: the write cost's weight the rule was measured with (docs/length.md): the config's `write_cost`
            when it is left None.
        max_lr: the largest `max_lr` the rule takes.
        max_lr_reason: why no larger `max_lr` (the refusal says it).
        memory_norm_per_sqrt_head_dim: the config's `max_memory_norm` when it is left None, in multiples of
            sqrt(`memory_head_dim`): the Frobenius norm each head's fast weights are rescaled to whenever an update
            leaves them above it. None: the rule has no such bound, and `max_memory_norm` must stay None.
        bounded_by: what keeps the state of a rule without `max_memory_norm` bounded (the refusal of one says it).
        writes_every_token: every token takes its own step at the weights the tokens before it left; such a rule
            runs on the linear memory alone (`memory_model` "mlp", `memory_depth` 1) and has no memory batch. False:
            a rule of update chunks, for any memory model.
    """

    name: str
    theta_bias_init: float
    write_cost: float
    max_lr: float
    max_lr_reason: str
    memory_norm_per_sqrt_head_dim: float | None
    bounded_by: str | None
    writes_every_token: bool


# Every update rule, by the name `update_rule` gives it (the keys of ops.UPDATE_OPS, in the same order)
UPDATE_RULES: dict[str, UpdateRule] = {rule.name: rule for rule in (
    UpdateRule(
        name="gradient",
        theta_bias_init=-2.0,
        # not measured with a write cost
        write_cost=0.0,
        # Its update is clipped: each chunk's surprise G = sum_t 2 theta_t k_t^T r_t (||k_t|| = 1, r_t = M(k_t) - v_t
        # the residual) is scaled by c / max(||G||, c), so a theta past the point where every chunk reaches the clip
        # changes nothing, but the clip needs ||G||^2 within float32: at ||G|| >= 2^64 (~1.8e19) the norm is inf, the
        # scale 0, and the chunk's write silently vanishes (NaN follows from max_lr ~ 1e38, where theta itself
        # overflows). With theta < max_lr, ||G|| < 2 max_lr C max ||r_t|| for C = memory_chunk_size tokens (the linear
        # memory; deeper ones add their layers' norms); max_lr <= 1e6 keeps it under 2^64 for update chunks of 4096
        # tokens with residual norms up to 2e9.
        max_lr=1e6,
        max_lr_reason="its step is clipped, so a larger theta changes nothing but the size of a surprise whose norm no "
                      "longer fits float32: the write would vanish",
        memory_norm_per_sqrt_head_dim=None,
        bounded_by="its surprise clip and the forget gate",
        writes_every_token=False,
    ),
    UpdateRule(
        name="delta",
        # Its haystack writes stay where the gate starts (training on short rows never asks them to shrink), and
        # every haystack write erases part of the facts along its key, so the gate starts almost closed.
        theta_bias_init=-6.0,
        # A price on every write keeps the writes between facts small, and a fact's half-life near 1,000 chunks of
        # the CPU demo instead of 300-400 (a weight of 4 loses accuracy at every length).
        write_cost=1.0,
        # its step 2 theta < 2 max_lr stays at most 1
        max_lr=0.5,
        max_lr_reason="a step 2 theta <= 1 keeps each write a contraction along its key",
        # the bound measured in docs/length.md; twice it gains nothing at 1,024 or 4,096 chunks
        memory_norm_per_sqrt_head_dim=4.0,
        bounded_by=None,
        writes_every_token=True,
    ),
)}
