"""``sao.algo``: advantages, losses and statistics as pure tensor functions.

No models, no I/O, no config objects in signatures; everything here can be
read and tested without loading a model (ARCHITECTURE.md). It imports only
torch: no other ``sao`` folder.
"""

from sao.algo.advantages import (
    adaptive_lambda,
    count_turns,
    gae,
    length_adaptive_lambda,
    step_level_gae,
)
from sao.algo.aggregate import aggregate, aggregate_denom
from sao.algo.baselines import (
    RunningMeanBaseline,
    broadcast_to_tokens,
    dynamic_sampling_mask,
    group_advantages,
    overlong_penalty,
    reinforce_pp_advantages,
    rloo_advantages,
)
from sao.algo.losses import (
    cispo_loss,
    dis_loss,
    gspo_loss,
    icepop_mask,
    ppo_clip_loss,
    tis_weights,
    value_loss,
)
from sao.algo.presets import PRESETS, AlgoPreset, get_preset
from sao.algo.stats import (
    binary_auc,
    effective_sample_size,
    explained_variance,
    explained_variance_n,
    kl_k1,
    kl_k3,
    masked_fractions,
    masked_mean,
    masked_sum,
    masked_var,
)

__all__ = [
    "PRESETS",
    "AlgoPreset",
    "RunningMeanBaseline",
    "adaptive_lambda",
    "aggregate",
    "aggregate_denom",
    "binary_auc",
    "broadcast_to_tokens",
    "cispo_loss",
    "count_turns",
    "dis_loss",
    "dynamic_sampling_mask",
    "effective_sample_size",
    "explained_variance",
    "explained_variance_n",
    "gae",
    "get_preset",
    "group_advantages",
    "gspo_loss",
    "icepop_mask",
    "kl_k1",
    "kl_k3",
    "length_adaptive_lambda",
    "masked_fractions",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "overlong_penalty",
    "ppo_clip_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "step_level_gae",
    "tis_weights",
    "value_loss",
]
