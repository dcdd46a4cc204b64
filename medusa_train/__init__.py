"""medusa_train: train Medusa heads on a Hugging Face causal LM and prove the speed-up.

Public pieces that need neither Hydra nor training code:
``medusa_train.heads.MedusaHeads`` and ``medusa_train.decoding``.
"""

__version__ = "0.1.0"
