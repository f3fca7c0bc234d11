"""Pure tensor functions for every trick: unit-tested against hand-computed numbers."""
from .estimators import compute_gae
from .losses import POLICY_LOSSES, entropy_from_logits, entropy_term, value_loss
from .rewards import KLController, kl_per_token, process_scores, token_rewards
from .stats import RunningMeanStd, masked_mean, masked_var, masked_whiten, perplexity

__all__ = [
    "compute_gae", "POLICY_LOSSES", "entropy_from_logits", "entropy_term", "value_loss",
    "KLController", "kl_per_token", "process_scores", "token_rewards",
    "RunningMeanStd", "masked_mean", "masked_var", "masked_whiten", "perplexity",
]
